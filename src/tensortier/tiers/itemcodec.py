"""Items <-> self-describing byte blobs, without pickle.

An item is a dict of fields (numpy arrays, torch tensors, ``bytes``, ``str``, Python ``int``/
``float``/``bool``) or one such value. A blob is ``u32 header length | JSON header | payload``: the header
lists, per field, its name, kind, dtype, shape and byte range in the payload. Decoding trusts
nothing but that header, so a blob read back from a file written by another process (or another
version of this module) is interpreted exactly, and an unknown kind or dtype is refused instead of
guessed. Object arrays are refused at encode time: they could only be stored by pickling.

Alignment (header version 2). ``encode(item, align=8)`` starts every field at a multiple of 8
bytes from the blob's start and pads the blob to a multiple of 8. A blob stored at an 8-aligned
address then decodes with ``copy=False`` into views of the buffer it was read into, aligned for
every dtype: the dataset catalog's zero-copy reads. Its header is ``static JSON | "\n" | u64
numbers | blanks``: the JSON (``{"v":2,"s":..,"a":8,"f":[[name, kind, dtype, ndim], ...]}``) is the
same for every item of a schema, so it is parsed once and cached, and the shapes, offsets and sizes
that vary from item to item (a bytes field of another length) are read as binary integers. A
version-1 header is JSON only; decoding handles both.

Numpy scalars. By default a numpy scalar (``np.float32(0.5)``) is stored as a 0-d array (kind
``np``) and comes back as one. ``numpy_scalars=True`` (the dataset catalog, format 2) stores it as
kind ``ns``: the same bytes, decoded to a numpy scalar of the same dtype. Decoding accepts ``ns``
in any blob; a reader older than this kind refuses it (``unknown field kind``), so a store that
writes it says so in its own format version.

Batches of blobs that share one header (the common case: fixed-shape transitions) are decoded as
one ``(batch, record_bytes)`` byte matrix, sliced per field: no per-item Python work beyond a join.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tensortier._units import is_int
from tensortier.errors import CorruptDataError
from tensortier.tiers.disk import check_storable

_LEN = struct.Struct("<I")
_SINGLE = ""  # field name used when an item is one value rather than a dict

# torch dtypes without a numpy twin travel as raw bytes and are viewed back on decode
TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def _field(name: str, value: Any, numpy_scalars: bool = False) -> tuple[list, bytes | memoryview]:
    """(header entry without offset, payload) of one field; ``numpy_scalars``: a numpy scalar is
    kind ``ns`` (decoded to a numpy scalar), else ``np`` (a 0-d array). ``np.str_`` and
    ``np.bytes_`` are ``str`` and ``bytes`` and are stored as those: a numpy string of fixed
    width would drop trailing NULs (``np.bytes_(b"a\\0")`` comes back ``b"a"``)."""
    what = "the value" if name == _SINGLE else f"field {name!r}"
    if isinstance(value, torch.Tensor):
        try:  # the stores' rule: a nested tensor failed in a reshape, a meta one in a copy
            check_storable(value)
            if value.is_meta:
                raise TypeError("a meta tensor has no values; store a real one (.to_empty())")
        except TypeError as exc:
            raise TypeError(f"{what}: {exc}") from None
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in TORCH_DTYPES:
            raise TypeError(
                f"{what}: unsupported torch dtype {value.dtype}; convert it with .to() to one "
                f"of {', '.join(TORCH_DTYPES)}"
            )
        t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        # an empty tensor's stride may be 0, and a one-element one's anything (contiguous() keeps
        # it: x[::2] of two elements has stride 2), which .view(uint8) refuses
        empty = t.numel() == 0
        flat = t.reshape(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:
            flat = flat.as_strided((1,), (1,))  # the same element
        raw = np.empty(0, np.uint8) if empty else flat.view(torch.uint8).numpy()
        return ["pt", dtype, list(t.shape)], memoryview(raw)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ["b", "u1", [len(value)]], bytes(value)
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        return ["s", "u1", [len(raw)]], raw
    elif isinstance(value, int) and not -(1 << 63) <= value < 1 << 64:
        raise TypeError(  # numpy would make it an object array, refused below as pickle-only
            f"{what}: int {value} does not fit in 64 bits; store it as a str (str(value)) or bytes"
        )
    elif isinstance(value, (bool, int, float, np.generic)) and not isinstance(value, np.ndarray):
        arr = np.asarray(value)
        kind = ("ns" if numpy_scalars else "np") if isinstance(value, np.generic) else "py"
    elif isinstance(value, np.ma.MaskedArray) and np.ma.getmaskarray(value).any():
        raise TypeError(
            f"{what}: a masked array's mask would be lost (an array with nothing masked is "
            f"stored as its data); store arr.filled(value), or its data and "
            f"np.ma.getmaskarray(arr) as two fields"
        )
    elif isinstance(value, np.ndarray):
        arr, kind = value, "np"
    else:
        raise TypeError(f"{what}: cannot store {type(value).__name__}; {_fix(value)}")
    _check_dtype(what, arr.dtype)
    shape = list(arr.shape)  # before ascontiguousarray, which turns 0-d into 1-d
    flat = np.ascontiguousarray(arr).reshape(-1)
    return [kind, arr.dtype.str, shape], memoryview(flat.view(np.uint8))


def _fix(value: Any) -> str:
    """What to do with a value of a type no field can hold."""
    if isinstance(value, Mapping):
        return "nested dicts cannot be stored: flatten them into 'outer.inner' keys"
    if isinstance(value, (list, tuple)):
        return "convert a list of numbers with np.asarray; other lists cannot be stored"
    if value is None:
        return "None cannot be stored: fill or drop it (or leave the key out)"
    return f"{ACCEPTED}; convert it to one of those (float(x), str(x), np.asarray(x), ...)"


def _check_dtype(what: str, dtype: np.dtype) -> None:
    """Refuse the dtypes that only pickle could store, saying what to store instead."""
    if dtype.fields is not None:
        raise TypeError(
            f"{what}: structured dtype {dtype} cannot be stored; store each of its fields as an "
            f"array of its own ({{name: arr[name] for name in arr.dtype.names}})"
        )
    if dtype.hasobject:
        raise TypeError(
            f"{what}: dtype object cannot be stored without pickle; use a numeric or bool dtype, "
            f"or store text as str and raw data as bytes"
        )


ACCEPTED = (
    "an item is a numpy array, a torch tensor, bytes, str, a Python number, or a dict of those "
    "keyed by str"
)


def encode(item: Any, *, align: int = 1, numpy_scalars: bool = False) -> bytes:
    """One blob for ``item``: a dict of fields or a single array/tensor/bytes/str/number.

    ``align`` (1 or a power of two up to 4096): start each field at a multiple of ``align`` bytes
    from the blob's start and pad the blob to one (see the module docstring). ``numpy_scalars``:
    store numpy scalars as themselves (kind ``ns``), not as 0-d arrays (the module docstring).

    Items shaped like an earlier one (same field names, types, dtypes and shapes: the usual
    stream of transitions) take a cached :class:`_Plan`: a few type checks and one ``join`` that
    copies the payloads into the blob, no per-field dispatch or header work. Anything the plan
    does not cover falls back to the general path, which produces the same bytes.
    """
    if align != 1 or numpy_scalars:
        return _encode_general(item, align, numpy_scalars=numpy_scalars)
    if type(item) is dict:
        names: tuple = tuple(item)
        values = list(item.values())
        single = False
    elif isinstance(item, Mapping):  # other mappings: the general path
        return _encode_general(item, 1)
    else:
        names, values, single = (type(item),), [item], True
    plan = _plans.get(names)
    if plan is not None:
        blob = plan.encode(values)
        if blob is not None:
            return blob
    blob = _encode_general(item, 1)
    plan = _Plan.build(names, values, single, blob)
    if plan is not None:
        if len(_plans) > 1024:
            _plans.clear()
        _plans[names] = plan
    return blob


_PY_FORMATS = {int: ("q", "<i8"), float: ("d", "<f8"), bool: ("?", "|b1")}


class _Plan:
    """How to encode values shaped like the ones it was built from (see :func:`encode`).

    Steps: ``("a", i, dtype, shape, how)`` a C-contiguous ndarray handed out as a view (the one copy is the
    join); ``("p", indices, types, struct)`` a run of Python ``int``/``float``/``bool`` fields
    packed by one ``struct``; ``("g", i, name, desc)`` anything else, through :func:`_field`
    with its description checked. :meth:`encode` returns None when a value does not match.
    """

    __slots__ = ("head", "steps")

    def __init__(self, head: bytes, steps: list):
        self.head = head
        self.steps = steps

    @classmethod
    def build(cls, names: tuple, values: list, single: bool, blob: bytes) -> _Plan | None:
        (hlen,) = _LEN.unpack_from(blob, 0)
        field_names = [_SINGLE] if single else list(names)
        steps: list = []
        run: list[int] = []

        def close_run() -> None:
            if run:
                fmt = "<" + "".join(_PY_FORMATS[type(values[i])][0] for i in run)
                types = tuple(type(values[i]) for i in run)
                steps.append(("p", tuple(run), types, struct.Struct(fmt)))
                run.clear()

        for i, (name, v) in enumerate(zip(field_names, values)):
            t = type(v)
            if t in _PY_FORMATS:
                if np.asarray(v).dtype.str != _PY_FORMATS[t][1]:  # e.g. an int past int64
                    return None
                run.append(i)
                continue
            close_run()
            if t is np.ndarray and v.flags.c_contiguous and not v.dtype.hasobject:
                # how parts() hands the array out as bytes: as is (1-D uint8), a byte-cast
                # memoryview, or nothing (empty)
                how = 0 if v.nbytes == 0 else 1 if (v.dtype == np.uint8 and v.ndim == 1) else 2
                if how == 2:
                    try:  # (memoryview casts only native single-character formats)
                        memoryview(v).cast("B")
                    except (TypeError, ValueError):
                        how = 3
                steps.append(("a", i, v.dtype, v.shape, how))
            else:
                desc, _ = _field(name, v)
                steps.append(("g", i, name, desc))
        close_run()
        plan = cls(blob[: 4 + hlen], steps)
        return plan if plan.encode(values) == blob else None  # same bytes as the general path

    def encode(self, values: list) -> bytes | None:
        parts = self.parts(values)
        return None if parts is None else b"".join(parts)

    def parts(self, values: list) -> list | None:
        """The blob as byte buffers (format ``B``) to concatenate; None when a value does not
        match. Arrays are handed out as views, not copied."""
        parts: list = [self.head]
        for step in self.steps:
            kind = step[0]
            if kind == "a":
                v = values[step[1]]
                if (
                    type(v) is not np.ndarray
                    or v.shape != step[3]
                    or v.dtype != step[2]
                    or not v.flags.c_contiguous
                ):
                    return None
                how = step[4]
                if how == 1:
                    parts.append(v)
                elif how == 2:
                    parts.append(memoryview(v).cast("B"))
                elif how == 3:
                    parts.append(v.reshape(-1).view(np.uint8))
            elif kind == "p":
                vs = [values[i] for i in step[1]]
                if tuple(map(type, vs)) != step[2]:
                    return None
                try:
                    parts.append(step[3].pack(*vs))
                except struct.error:  # an int outside int64
                    return None
            else:
                desc, payload = _field(step[2], values[step[1]])
                if desc != step[3]:
                    return None
                parts.append(payload)
        return parts


_plans: dict[tuple, _Plan] = {}


def encode_aligned_parts(item: Any, align: int, *, numpy_scalars: bool = False) -> list:
    """:func:`encode` ``(item, align=align)`` (``align > 1``) as the buffers whose concatenation is
    the blob: header pieces, padding and the fields' payloads, not joined. Payloads of arrays and
    tensors are views of the caller's memory (``bytes`` parts are immutable)."""
    if align <= 1:
        raise ValueError(f"encode_aligned_parts needs align > 1, got {align!r}")
    return _encode_general(item, align, as_parts=True, numpy_scalars=numpy_scalars)


def single_prefix(kind: str, dtype: str, ndim: int, align: int) -> tuple[bytes, int, bytes]:
    """What :func:`encode` ``(item, align=align)`` puts before the payload of a single array
    (``kind="np"``, ``dtype`` its ``dtype.str``), tensor (``"pt"``, its dtype's name), bytes
    (``"b"``, ``"u1"``, 1) or str (``"s"``, ``"u1"``, 1: the payload is its UTF-8) item of
    ``ndim`` dimensions: (static header, count of u64 numbers, blanks); the numbers are its
    shape, 0 and its size in bytes; the payload and zeros up to ``align`` follow."""
    if kind not in ("np", "pt", "b", "s") or align <= 1:
        raise ValueError(f"single_prefix: kind {kind!r} must be 'np', 'pt', 'b' or 's', align > 1")
    head, numbers, blanks = _encode_v2(
        True, [(_SINGLE, kind, dtype, (0,) * ndim, 0)], [b""], align
    )[:3]
    return head, len(numbers) // 8, blanks


def encode_parts(item: Any) -> list:
    """:func:`encode` as a list of byte buffers (format ``B``) whose concatenation is the blob.

    Nothing is joined: an item that takes a cached plan comes back as its header and views of
    its arrays, so a store can copy it once, straight into its own memory. (Other items come
    back as ``[encode(item)]``.) The views alias the caller's arrays: copy them before returning
    to the caller.
    """
    if type(item) is dict:
        names: tuple = tuple(item)
        values = list(item.values())
    elif isinstance(item, Mapping):
        return [_encode_general(item, 1)]
    else:
        names, values = (type(item),), [item]
    plan = _plans.get(names)
    if plan is not None:
        parts = plan.parts(values)
        if parts is not None:
            return parts
    return [encode(item)]


def _encode_general(
    item: Any, align: int = 1, as_parts: bool = False, numpy_scalars: bool = False
) -> Any:
    """:func:`encode` without plans: dispatch on every field's type, header from the cache.
    ``as_parts`` (``align > 1`` only): the blob's pieces, not joined."""
    if align < 1 or align > 4096 or align & (align - 1):
        raise ValueError(f"align must be a power of two from 1 to 4096, got {align!r}")
    if isinstance(item, Mapping):
        if not item:
            raise ValueError("an item needs at least one field; got an empty dict")
        pairs = []
        for name, value in item.items():
            if not isinstance(name, str) or name == _SINGLE:
                raise TypeError(
                    f"field names must be non-empty strings, got {name!r}; make every key a "
                    f"non-empty str (str(key))"
                )
            pairs.append((name, value))
        single = False
    else:
        pairs, single = [(_SINGLE, item)], True
    descs, payloads = [], []
    for name, value in pairs:
        desc, payload = _field(name, value, numpy_scalars)
        n = len(payload) if isinstance(payload, bytes) else payload.nbytes
        descs.append((name, desc[0], desc[1], tuple(desc[2]), n))
        payloads.append(payload)
    if align > 1:
        parts = _encode_v2(single, descs, payloads, align)
        return parts if as_parts else b"".join(parts)
    key = (single, tuple(descs), align)
    cached = _encode_cache.get(key)
    if cached is None:
        fields, offset, gaps = [], 0, []
        for name, kind, dtype, shape, n in descs:
            fields.append([name, kind, dtype, list(shape), offset, n])
            end = offset + n
            offset = -(-end // align) * align
            gaps.append(bytes(offset - end))
        meta = {"v": 1, "s": single, "f": fields}
        if align > 1:
            meta["a"] = align
        header = json.dumps(meta, separators=(",", ":")).encode()
        header += b" " * (-(_LEN.size + len(header)) % align)  # JSON allows trailing blanks
        cached = (_LEN.pack(len(header)) + header, gaps if align > 1 else None)
        if len(_encode_cache) > 4096:
            _encode_cache.clear()
        _encode_cache[key] = cached
    head, gaps = cached
    if gaps is None:
        return b"".join([head, *payloads])
    return b"".join([head, *(x for pair in zip(payloads, gaps) for x in pair)])


def _encode_v2(single: bool, descs: list, payloads: list, align: int) -> list:
    schema = (
        single,
        tuple((name, kind, dtype, len(shape)) for name, kind, dtype, shape, _ in descs),
    )
    cached = _static_cache.get((schema, align))
    if cached is None:
        fields = [[name, kind, dtype, ndim] for name, kind, dtype, ndim in schema[1]]
        static = json.dumps({"v": 2, "s": single, "a": align, "f": fields}, separators=(",", ":"))
        count = sum(ndim + 2 for *_, ndim in schema[1])
        size = len(static) + 1 + 8 * count
        pad = -(_LEN.size + size) % align
        cached = (
            _LEN.pack(size + pad) + static.encode() + b"\n",
            struct.Struct(f"<{count}Q"),
            b" " * pad,
        )
        if len(_static_cache) > 4096:
            _static_cache.clear()
        _static_cache[(schema, align)] = cached
    head, numbers, pad = cached
    parts, values, offset = [head, None, pad], [], 0
    for (_, _, _, shape, n), payload in zip(descs, payloads):
        values += shape
        values += (offset, n)
        parts.append(payload)
        end = offset + n
        offset = -(-end // align) * align
        if offset > end:
            parts.append(bytes(offset - end))
    parts[1] = numbers.pack(*values)
    return parts


_encode_cache: dict[tuple, tuple[bytes, list[bytes] | None]] = {}
_static_cache: dict[tuple, tuple[bytes, struct.Struct, bytes]] = {}
_header_cache: dict[bytes, dict] = {}
_schema_cache: dict[bytes, tuple[dict, struct.Struct]] = {}


def _check_fields(fields: list, single: Any) -> None:
    if not isinstance(single, bool) or (single and [f[0] for f in fields] != [_SINGLE]):
        raise ValueError(f"bad single-value flag {single!r}")
    for f in fields:
        kind, dtype = f[1], f[2]
        if not isinstance(f[0], str) or kind not in ("np", "ns", "py", "pt", "b", "s"):
            raise ValueError(f"unknown field kind {kind!r}")
        if kind == "pt" and dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown torch dtype {dtype!r}")
        if kind in ("np", "ns", "py") and np.dtype(dtype).hasobject:
            raise ValueError("object dtype")


def _schema_entry(static: bytes) -> tuple[dict, struct.Struct]:
    """The parsed static JSON of a version-2 header and the struct of its numbers (cached)."""
    entry = _schema_cache.get(static)
    if entry is None:
        schema = json.loads(static)
        align = schema["a"]
        if not is_int(align) or not 1 <= align <= 4096:
            raise ValueError(f"bad alignment {align!r}")
        fields = schema["f"]
        if not isinstance(fields, list) or not fields:
            raise ValueError("no fields")
        for f in fields:
            if not isinstance(f, list) or len(f) != 4 or not is_int(f[3]) or f[3] < 0:
                raise ValueError(f"bad field {f!r}")
        _check_fields(fields, schema.get("s"))
        count = sum(f[3] + 2 for f in fields)
        entry = (schema, struct.Struct(f"<{count}Q"))
        if len(_schema_cache) > 4096:
            _schema_cache.clear()
        _schema_cache[static] = entry
    return entry


def _parse_v2(raw: bytes) -> dict:
    """Header version 2: the cached static JSON plus this item's binary shapes and offsets."""
    cut = raw.find(b"\n")
    if cut < 0:
        raise ValueError("no end of the static header")
    schema, numbers = _schema_entry(raw[:cut])
    if len(raw) < cut + 1 + numbers.size or raw[cut + 1 + numbers.size :].strip(b" "):
        raise ValueError("the binary part of the header has the wrong size")
    values = numbers.unpack_from(raw, cut + 1)
    out, i, last = [], 0, 0
    for name, kind, dtype, ndim in schema["f"]:
        shape = list(values[i : i + ndim])
        off, n = values[i + ndim], values[i + ndim + 1]
        i += ndim + 2
        if off < last:
            raise ValueError("fields overlap")
        last = off + n
        out.append([name, kind, dtype, shape, off, n])
    return {"v": 2, "s": schema["s"], "a": schema["a"], "f": out}


def _header(blob: bytes | memoryview) -> tuple[bytes, dict, int]:
    """(raw header bytes, parsed header, payload start); parsed headers are cached by their bytes."""
    if len(blob) < 4:
        raise CorruptDataError(f"item blob of {len(blob)} bytes is too short for a header")
    (hlen,) = _LEN.unpack_from(blob, 0)
    raw = bytes(blob[4 : 4 + hlen])
    meta = _header_cache.get(raw)
    if meta is None:
        try:
            if raw.startswith(b'{"v":2'):
                # not cached: its binary part differs per item (a cache of them churns, and its
                # long-lived garbage makes the cyclic GC scan everything); the JSON part is cached
                meta = _parse_v2(raw)
                _end_check(blob, hlen, meta)
                return raw, meta, 4 + hlen
            else:
                meta = json.loads(raw)
                fields = meta["f"]
                if meta.get("a", 1) != 1:
                    raise ValueError("alignment needs header version 2")
                for f in fields:
                    if len(f) != 6:
                        raise ValueError(f"bad field {f!r}")
                _check_fields(fields, meta.get("s"))
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise CorruptDataError(f"item header is not valid ({exc})") from exc
        if len(_header_cache) > 4096:
            _header_cache.clear()
        _header_cache[raw] = meta
    _end_check(blob, hlen, meta)
    return raw, meta, 4 + hlen


def _end_check(blob, hlen: int, meta: dict) -> None:
    end = 4 + hlen + (meta["f"][-1][4] + meta["f"][-1][5] if meta["f"] else 0)
    if not end <= len(blob) < end + meta.get("a", 1):  # an aligned blob may end in padding
        raise CorruptDataError(f"item blob has {len(blob)} bytes, its header describes {end}")


def _value(kind: str, dtype: str, shape: Sequence[int], raw: np.ndarray) -> Any:
    """Field value from its payload bytes ``raw`` (uint8, owned by the caller, writable)."""
    if kind == "b":
        return raw.tobytes()
    if kind == "s":
        try:
            return raw.tobytes().decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CorruptDataError(f"a str field is not valid UTF-8 ({exc})") from exc
    if kind == "pt":
        if raw.size == 0:
            if any(int(x) < 0 for x in shape) or np.prod(shape, dtype=object) != 0:
                # no bytes for a shape with elements: torch.empty would hand out junk memory
                raise ValueError(f"an empty payload for shape {list(shape)}")
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        t = torch.from_numpy(raw)
        return t.view(TORCH_DTYPES[dtype]).reshape(shape)
    arr = raw.view(np.dtype(dtype)).reshape(shape)
    if kind == "ns":
        return _scalar(arr)
    return arr.item() if kind == "py" else arr


def _scalar(arr: np.ndarray) -> np.generic:
    """The numpy scalar a 0-d array holds, its bytes copied as they are (nan payloads, -0.0)."""
    if arr.shape != ():
        raise ValueError(f"a numpy scalar field has shape {arr.shape}, not ()")
    return arr[()]


def _alignment(kind: str, dtype: str) -> int:
    if kind == "pt":
        return min(8, TORCH_DTYPES[dtype].itemsize)
    return 1 if kind in ("b", "s") else np.dtype(dtype).alignment


def decode(blob: bytes | memoryview | np.ndarray, *, copy: bool = True) -> Any:
    """The item ``blob`` was encoded from, bit-identical.

    ``copy=True``: fresh writable arrays/tensors. ``copy=False``: arrays and tensors are views of
    ``blob``'s memory where it is writable and the field is aligned for its dtype (copies
    elsewhere), so they keep that buffer alive and share its writes; bytes, str and numbers are
    always new objects.
    """
    _, meta, start = _header(blob)
    if isinstance(blob, np.ndarray) and blob.dtype == np.uint8 and blob.ndim == 1:
        base = blob
    else:
        base = np.frombuffer(blob, np.uint8)
    view = not copy and base.flags.writeable
    addr = -1
    out = {}
    for name, kind, dtype, shape, off, n in meta["f"]:
        raw = base[start + off : start + off + n]
        if kind not in ("b", "s"):  # bytes and str are new objects anyway
            if view and addr < 0:
                addr = base.__array_interface__["data"][0] + start
            if not view or (addr + off) % _alignment(kind, dtype):
                raw = raw.copy()
        try:
            out[name] = _value(kind, dtype, shape, raw)
        except (ValueError, TypeError, RuntimeError) as exc:  # a shape that does not fit the bytes
            raise CorruptDataError(f"field {name!r} does not match its header ({exc})") from exc
    return out[_SINGLE] if meta["s"] else out


_scratch = threading.local()
_SCRATCH_MAX = 64 << 20
_SMALL = 256 << 10


def gather(blobs: Sequence, size: int) -> np.ndarray:
    """Blobs (any buffers) of equal length ``size`` as rows of a matrix, in a reused per-thread
    buffer when small enough (fresh memory costs a page fault per 4 KiB, which dominates a 2.5 MB
    batch copy here). The matrix is valid until this thread's next ``gather``; pass it to
    :func:`decode_batch` (which copies every field out of it)."""
    total = size * len(blobs)
    if total <= _SMALL:  # small batches come from the heap: one C-level join
        return np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), size)
    if total > _SCRATCH_MAX:
        return np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), size)
    buf = getattr(_scratch, "buf", None)  # (another thread's gather never touches it)
    if buf is None or len(buf) < total:
        buf = _scratch.buf = np.empty(max(total, 1 << 20), np.uint8)
    np.concatenate([np.frombuffer(b, np.uint8) for b in blobs], out=buf[:total])
    return buf[:total].reshape(len(blobs), size)


_gather = gather  # (the old private name)


def decode_batch(blobs: Sequence[bytes] | np.ndarray) -> tuple[Any, bool]:
    """Decode many blobs; returns (batch, collated).

    ``blobs`` is a sequence of blobs, or a (batch, size) uint8 matrix of equal-length blobs (from
    :func:`gather`). When every blob has the same header, fields are stacked into fresh
    arrays/tensors with a leading batch dimension (bytes fields become lists) and ``collated`` is
    True; otherwise the batch is a list of items.
    """
    if len(blobs) == 0:
        return [], False
    if isinstance(blobs, np.ndarray):
        mat = blobs
        _, meta, start = _header(mat[0])
    else:
        _, meta, start = _header(blobs[0])
        size = len(blobs[0])
        if len(set(map(len, blobs))) != 1:
            return [decode(b) for b in blobs], False
        mat = gather(blobs, size)
    head = mat[:, 4:start]
    if not (head == head[0]).all():  # same length, different header: not collatable
        return [decode(row) for row in mat], False
    try:
        out = _collate(mat, meta, start)
    except (ValueError, TypeError, RuntimeError) as exc:  # shapes that do not fit the bytes
        raise CorruptDataError(f"item blobs do not match their header ({exc})") from exc
    return (out[_SINGLE] if meta["s"] else out), True


def _collate(mat: np.ndarray, meta: dict, start: int) -> dict:
    """The fields of equal-header blobs ``mat`` (one per row), stacked (see decode_batch)."""
    out: dict = {}
    for name, kind, dtype, shape, off, n in meta["f"]:
        cols = mat[:, start + off : start + off + n]
        if kind == "b":
            out[name] = [bytes(row) for row in cols]
            continue
        if kind == "s":
            out[name] = [_value("s", dtype, shape, row) for row in cols]
            continue
        # always a copy: one row's columns are contiguous, and a view would alias the reused
        # gather buffer (the next batch would overwrite this one)
        cols = cols.copy(order="C")
        if kind == "pt" and n == 0:
            if np.prod(shape, dtype=object) != 0:  # torch.empty would hand out junk memory
                raise CorruptDataError(f"field {name!r}: an empty payload for shape {shape}")
            out[name] = torch.empty(len(mat), *shape, dtype=TORCH_DTYPES[dtype])
        elif kind == "pt":
            out[name] = torch.from_numpy(cols).view(TORCH_DTYPES[dtype]).reshape(len(mat), *shape)
        else:
            out[name] = cols.view(np.dtype(dtype)).reshape(len(mat), *shape)
    return out


_SCHEMAS_PER_CALL = 8  # distinct headers decode_spans batches; past that, one decode() each


def decode_spans(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> list:
    """``[decode(buf[s : s + n], copy=False) for s, n in zip(starts, lengths)]``, the same items
    and errors, with the header of each schema parsed once for all its blobs.

    Blobs with a version-2 header equal to the first one's static part (the usual case: one
    schema per dataset) have their shapes, offsets and sizes read as one integer matrix and
    checked with array operations; what remains per blob is making its values. Anything else
    (version 1, a damaged header, a field that does not fit) goes through :func:`decode`.
    """
    out: list = [None] * len(starts)
    rest = np.arange(len(starts))
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    for _ in range(_SCHEMAS_PER_CALL):
        if not len(rest):
            return out
        rest = _decode_group(buf, starts, lengths, rest, out)
    for i in rest.tolist():
        out[i] = decode(buf[starts[i] : starts[i] + lengths[i]], copy=False)
    return out


def _decode_group(buf, starts, lengths, rest: np.ndarray, out: list) -> np.ndarray:
    """Decode the blobs of ``rest`` sharing the first one's header layout into ``out``; the
    others (indices into ``starts``) are returned."""
    first = int(rest[0])
    s0 = int(starts[first])
    blob0 = buf[s0 : s0 + lengths[first]]
    try:
        raw, meta, start = _header(blob0)
    except CorruptDataError:
        out[first] = decode(blob0, copy=False)  # raises the same error
        return rest[1:]
    if not raw.startswith(b'{"v":2') or not buf.flags.writeable:
        out[first] = decode(blob0, copy=False)
        return rest[1:]
    cut = raw.find(b"\n") + 1
    schema, numbers = _schema_entry(raw[: cut - 1])
    fixed = np.frombuffer(_LEN.pack(len(raw)) + raw, np.uint8)
    cols = np.arange(len(fixed))
    mine = rest[lengths[rest] >= start]
    same = buf[starts[mine, None] + cols] == fixed  # (blobs, header bytes)
    varying = slice(4 + cut, 4 + cut + numbers.size)  # the binary numbers differ per blob
    same[:, varying] = True
    mine = mine[same.all(axis=1)]
    mat = buf[starts[mine, None] + np.arange(4 + cut, 4 + cut + numbers.size)]
    values = mat.view("<u8").astype(np.int64)  # (blobs, numbers): shapes, offset, size per field
    fine = (mat.view("<u8") < 2**62).all(axis=1)
    fields, i, last = [], 0, np.zeros(len(mine), np.int64)
    addr = buf.__array_interface__["data"][0]
    for name, kind, dtype, ndim in schema["f"]:
        shape, off, n = values[:, i : i + ndim], values[:, i + ndim], values[:, i + ndim + 1]
        i += ndim + 2
        fine &= off >= last
        last = off + n
        if kind not in ("b", "s"):
            item = TORCH_DTYPES[dtype].itemsize if kind == "pt" else np.dtype(dtype).itemsize
            fine &= (np.prod(shape, axis=1) * item == n) & (n > 0)
            fine &= (addr + starts[mine] + start + off) % _alignment(kind, dtype) == 0
        fields.append((name, kind, dtype, shape, off, n))
    end = start + last
    fine &= (end <= lengths[mine]) & (lengths[mine] < end + schema["a"])
    ok = mine[fine]
    try:
        columns = [_column(buf, starts[ok] + start, f, fine) for f in fields]
    except (ValueError, TypeError, RuntimeError, CorruptDataError):  # decode() says which blob
        columns = None
    if columns is None:
        items = [decode(buf[starts[j] : starts[j] + lengths[j]], copy=False) for j in ok.tolist()]
    elif schema["s"]:
        items = columns[0]
    else:
        names = [f[0] for f in schema["f"]]
        items = [dict(zip(names, v)) for v in zip(*columns)]
    for j, item in zip(ok.tolist(), items):
        out[j] = item
    left = np.setdiff1d(rest, ok, assume_unique=True)
    if len(left) and left[0] == first:  # the first blob itself did not fit: decode() says why
        out[first] = decode(blob0, copy=False)
        left = left[1:]
    return left


def _column(buf, bases: np.ndarray, field: tuple, fine: np.ndarray) -> list:
    """The values of one field for blobs whose payload starts at ``bases``."""
    name, kind, dtype, shape, off, n = field
    a = (bases + off[fine]).tolist()
    b = (bases + off[fine] + n[fine]).tolist()
    if kind == "b":
        return [buf[x:y].tobytes() for x, y in zip(a, b)]
    if kind == "s":
        try:
            return [buf[x:y].tobytes().decode("utf-8", "surrogatepass") for x, y in zip(a, b)]
        except UnicodeDecodeError as exc:
            raise CorruptDataError(f"a str field is not valid UTF-8 ({exc})") from exc
    shapes = [tuple(s) for s in shape[fine].tolist()]
    if kind == "pt":
        t = TORCH_DTYPES[dtype]
        return [torch.from_numpy(buf[x:y]).view(t).reshape(s) for x, y, s in zip(a, b, shapes)]
    dt = np.dtype(dtype)
    arrs = [buf[x:y].view(dt).reshape(s) for x, y, s in zip(a, b, shapes)]
    if kind == "ns":
        return [_scalar(v) for v in arrs]
    return [v.item() for v in arrs] if kind == "py" else arrs
