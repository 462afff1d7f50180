"""Non-tensor state as JSON, tensors as named references: the only way state is serialised.

A state tree (a model/optimizer/scheduler ``state_dict``, RNG states, the user's ``extra``) is
turned into plain JSON in which every tensor is replaced by ``{"$tt": "tensor", "name": ...}`` and
stored separately (in safetensors files). Values JSON cannot hold exactly get a tag from a short
allow-list (tuples, non-string dict keys, non-finite floats, numpy arrays and scalars as raw
little-endian bytes, dtypes, bytes); only dense tensors with data are stored. Decoding resolves
only those tags: nothing is imported, evaluated or unpickled, so a crafted manifest can at worst
be rejected (:class:`CorruptDataError`, never a raw ``TypeError`` or ``RecursionError``: nesting
is bounded by ``MAX_DEPTH`` both ways). Anything else is refused at save time with the path to
the offending value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

from tensortier._units import is_int
from tensortier.errors import ConfigError, CorruptDataError
from tensortier.tiers.itemcodec import TORCH_DTYPES  # the item codec's dtypes: the same set

TAG = "$tt"

_NP_DTYPES = {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise ConfigError(f"tensors of dtype {dtype} cannot be checkpointed; convert them first")
    return name


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in TORCH_DTYPES:
        raise CorruptDataError(f"unknown dtype {name!r} in manifest")
    return TORCH_DTYPES[name]


MAX_DEPTH = 100  # nesting levels of a state tree; deeper is refused at save and at restore


def encode(
    obj: object,
    path: str,
    add_tensor: Callable[[str, torch.Tensor], str],
    depth: int = 0,
) -> object:
    """JSON-ready copy of ``obj``; tensors are handed to ``add_tensor(path, t)`` which names them."""
    if depth > MAX_DEPTH:
        raise ConfigError(
            f"{path}: nested more than {MAX_DEPTH} levels deep; flatten it before saving "
            f"(a checkpoint must be readable without deep recursion)"
        )
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {TAG: "float", "value": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_nested or obj.is_meta:
            raise ConfigError(
                f"{path}: a {'meta' if obj.is_meta else obj.layout} tensor cannot be "
                f"checkpointed; only dense tensors with data are (call .to_dense() first)"
            )
        return {TAG: "tensor", "name": add_tensor(path, obj)}
    if isinstance(obj, np.generic) and obj.dtype.name in _NP_DTYPES:
        # kept a numpy scalar: np.float32 arithmetic after a resume must stay float32
        return {**encode(np.asarray(obj), path, add_tensor, depth), "scalar": True}
    if isinstance(obj, np.generic):
        return encode(obj.item(), path, add_tensor, depth)
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _NP_DTYPES:
            raise ConfigError(f"{path}: numpy arrays of dtype {obj.dtype} cannot be checkpointed")
        # raw little-endian bytes: exact for NaN/inf/-0.0, which JSON numbers cannot carry
        little = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<"))
        return {
            TAG: "ndarray",
            "dtype": obj.dtype.name,
            "shape": list(obj.shape),
            "hex": little.tobytes().hex(),
        }
    if isinstance(obj, torch.dtype):
        return {TAG: "dtype", "name": dtype_name(obj)}
    if isinstance(obj, bytes):
        return {TAG: "bytes", "hex": obj.hex()}
    d = depth + 1
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{path}[{i}]", add_tensor, d) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {TAG: "tuple", "items": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: encode(v, f"{path}/{k}", add_tensor, d) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not _valid_key(k):
                raise ConfigError(
                    f"{path}: dict key {k!r} of type {type(k).__name__} cannot be checkpointed; "
                    f"use str, int, float, bool or None keys (or tuples of them)"
                )
            items.append(
                [encode(k, f"{path}<key>", add_tensor, d), encode(v, f"{path}/{k}", add_tensor, d)]
            )
        return {TAG: "dict", "items": items}
    raise ConfigError(
        f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be checkpointed; only "
        f"tensors, numpy arrays and JSON-like data (dict, list, tuple, str, int, float, bool, "
        f"None) are stored, never pickled. Convert it (e.g. to a dict) before saving"
    )


def _valid_key(key: object) -> bool:
    if key is None or isinstance(key, (str, int, float, bool)):
        return True
    return isinstance(key, tuple) and all(_valid_key(k) for k in key)


def decode(obj: object, tensors: Mapping[str, torch.Tensor], depth: int = 0) -> object:
    """Inverse of :func:`encode`; ``tensors`` maps names to the loaded tensors.

    Anything :func:`encode` cannot have written (unknown tags, wrong types, references to missing
    tensors, unhashable keys, nesting deeper than ``MAX_DEPTH``) raises :class:`CorruptDataError`.
    """
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if depth > MAX_DEPTH:
        raise CorruptDataError(f"manifest state nested more than {MAX_DEPTH} levels deep")
    d = depth + 1
    if isinstance(obj, list):
        return [decode(v, tensors, d) for v in obj]
    if not isinstance(obj, dict):
        raise CorruptDataError(f"unexpected {type(obj).__name__} in manifest")
    if TAG not in obj:
        return {k: decode(v, tensors, d) for k, v in obj.items()}
    tag = obj[TAG]
    if tag == "tensor":
        name = obj.get("name")
        if not isinstance(name, str) or name not in tensors:
            raise CorruptDataError(f"manifest refers to tensor {name!r} that is not in the files")
        return tensors[name]
    if tag == "tuple":
        return tuple(decode(v, tensors, d) for v in _list(obj, "items"))
    if tag == "dict":
        out = {}
        for pair in _list(obj, "items"):
            if not isinstance(pair, list) or len(pair) != 2:
                raise CorruptDataError("malformed dict entry in manifest")
            key = decode(pair[0], tensors, d)
            if not _valid_key(key):
                raise CorruptDataError(f"dict key of type {type(key).__name__} in manifest")
            out[key] = decode(pair[1], tensors, d)
        return out
    if tag == "float":
        value = obj.get("value")
        if value not in ("nan", "inf", "-inf"):
            raise CorruptDataError(f"bad float {value!r} in manifest")
        return float(value)
    if tag == "ndarray":
        dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
        if (
            dtype not in _NP_DTYPES
            or not isinstance(shape, list)
            or not all(is_int(n) and n >= 0 for n in shape)
        ):
            raise CorruptDataError(f"bad ndarray (dtype {dtype!r}) in manifest")
        try:
            if "hex" in obj:  # written by this version: raw little-endian bytes
                little = np.dtype(dtype).newbyteorder("<")
                flat = np.frombuffer(bytes.fromhex(obj["hex"]), dtype=little)
                array = flat.astype(np.dtype(dtype)).reshape(shape)
                return array[()] if obj.get("scalar") is True and not shape else array
            return np.asarray(data, dtype=np.dtype(dtype)).reshape(shape)  # nested lists (older)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise CorruptDataError(f"bad ndarray in manifest: {exc}") from exc
    if tag == "dtype":
        return dtype_from_name(obj.get("name"))
    if tag == "bytes":
        value = obj.get("hex")
        try:
            return bytes.fromhex(value)
        except (TypeError, ValueError) as exc:
            raise CorruptDataError("bad bytes value in manifest") from exc
    raise CorruptDataError(f"unknown tag {tag!r} in manifest; refusing to interpret it")


def _list(obj: dict, key: str) -> list:
    value = obj.get(key)
    if not isinstance(value, list):
        raise CorruptDataError(f"manifest entry tagged {obj[TAG]!r} lacks a list {key!r}")
    return value
