"""A replay buffer's saved state: ``buffer.json`` (config, sampler state) and ``state.npz`` (arrays).

Reading trusts nothing: the npz is opened with ``allow_pickle=False`` (an object array is refused,
never unpickled), and every field of both files is checked (types, shapes, ranges, keys that fit
the capacity (``max_items``) and the add count) before a buffer is built, so damage surfaces as one
:class:`~tensortier.errors.CorruptDataError` naming the file, never as a parser's exception or a
half-restored buffer. Nothing here writes to the directory it reads.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np

from tensortier import _modes
from tensortier._units import check_int
from tensortier.errors import CorruptDataError
from tensortier.rl.sampler import LEAF_MAX, Prioritized, Uniform, sampler_from_dict

STATE = "state.npz"
META = "buffer.json"
FORMAT = "tensortier-replay"
VERSION = 1
ARRAYS = ("keys", "leaves", "uses")
# per-item episode, step and policy version (int64, -1: not given); files written before these
# existed lack them, and readers that predate them ignore them
OPTIONAL = ("episode", "step", "version")
# a seeded uniform buffer's draw order: each item's position in the sampler's dense array
DRAW_POS = "draw_pos"
_U128 = 1 << 128


def write(dirname: str, arrays: dict[str, np.ndarray], meta: dict, mode: int = 0o600) -> None:
    """Replace the state files in ``dirname``, each atomically, with exactly ``mode``.

    ``buffer.json`` goes first: a crash between the two replaces leaves a newer ``seq`` with
    older arrays, which is still consistent (keys only grow), never arrays the meta cannot explain.
    """
    tmp = os.path.join(dirname, META + ".tmp")
    with open(_create(tmp, mode), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(dirname, META))
    tmp = os.path.join(dirname, STATE + ".tmp.npz")
    with open(_create(tmp, mode), "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, os.path.join(dirname, STATE))


def _create(path: str, mode: int) -> int:
    """A fresh temporary file (a crash's leftover is replaced), mode as every file here."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return _modes.create(path, mode)


def read(dirname: str, *, fix: str) -> tuple[dict, Uniform | Prioritized, dict[str, np.ndarray]]:
    """(meta, sampler config, arrays) saved in ``dirname``, all validated.

    ``fix`` ends the CorruptDataError message (what the user can do about damage).
    """
    meta_path, state_path = os.path.join(dirname, META), os.path.join(dirname, STATE)
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read())
        with np.load(state_path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ARRAYS}
            arrays.update({k: z[k] for k in (*OPTIONAL, DRAW_POS) if k in z.files})
    except FileNotFoundError as exc:
        raise CorruptDataError(
            f"{dirname!r} holds no saved ReplayBuffer ({exc.filename} is missing)", path=dirname
        ) from exc
    except PermissionError as exc:
        raise _modes.denied(exc.filename or dirname, exc, "ReplayBuffer.load") from exc
    except Exception as exc:  # a damaged file makes json/zipfile/numpy raise almost anything
        raise CorruptDataError(
            f"the saved state in {dirname!r} is damaged ({type(exc).__name__}: {exc}); {fix}",
            path=dirname,
        ) from exc
    try:
        sampler = _check_meta(meta)
        _check_arrays(arrays, meta)
    except (ValueError, TypeError, KeyError) as exc:  # ConfigError is a ValueError
        raise CorruptDataError(
            f"the saved state in {dirname!r} is not valid ({exc}); {fix}", path=dirname
        ) from exc
    return meta, sampler, arrays


def _int(d: dict, name: str, low: int, *, none: bool = False) -> None:
    v = d.get(name)
    if none and v is None:
        return
    check_int(v, f"{name} must be an int >= {low}, got {v!r}", minimum=low, error=ValueError)


def _check_meta(meta: Any) -> Uniform | Prioritized:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{META} is not a saved ReplayBuffer's")
    version = meta.get("version")
    if version != VERSION:
        raise ValueError(
            f"format version {version!r}; this tensortier reads version {VERSION} (a newer "
            f"version needs a newer tensortier)"
        )
    cfg = meta.get("config")
    if not isinstance(cfg, dict):
        raise ValueError("config must be an object")
    _int(cfg, "capacity", 1)
    _int(cfg, "ram_budget", 0)
    _int(cfg, "segment_size", 1)
    _int(cfg, "max_uses", 1, none=True)
    _int(meta, "seq", 0)
    if "policy_version" in meta:
        _int(meta, "policy_version", -1)
    if not isinstance(meta.get("sampler_state"), dict):
        raise ValueError("sampler_state must be an object")
    if "rng" in meta:
        _check_rng(meta["rng"])
    return sampler_from_dict(cfg.get("sampler"))


def _check_rng(rng: Any) -> None:
    """``rng``: ``{"seed": int, "state": numpy's PCG64 state}``, every field in range (numpy's
    own setter raises OverflowError or TypeError on some bad values, misses others)."""

    def uint(v: Any, end: int) -> bool:
        return type(v) is int and 0 <= v < end

    state = rng.get("state") if isinstance(rng, dict) else None
    inner = state.get("state") if isinstance(state, dict) else None
    if not (
        isinstance(inner, dict)
        and type(rng.get("seed")) is int
        and rng["seed"] >= 0  # any seed numpy takes
        and state.get("bit_generator") == "PCG64"
        and uint(inner.get("state"), _U128)
        and uint(inner.get("inc"), _U128)
        and inner["inc"] % 2 == 1
        and state.get("has_uint32") in (0, 1)
        and uint(state.get("uinteger"), 1 << 32)
    ):
        raise ValueError(f"rng must be a seed and numpy's PCG64 state, got {rng!r:.200}")


def _check_arrays(arrays: dict[str, np.ndarray], meta: dict) -> None:
    keys, leaves, uses = (arrays[k] for k in ARRAYS)
    cap, seq = meta["config"]["capacity"], meta["seq"]
    for name, arr, kind in (("keys", keys, "i"), ("leaves", leaves, "f"), ("uses", uses, "i")):
        if arr.ndim != 1 or arr.dtype.kind != kind or len(arr) != len(keys):
            raise ValueError(
                f"{name}: expected {len(keys)} values of kind {kind!r}, got {arr.dtype} {arr.shape}"
            )
    for name in OPTIONAL:
        arr = arrays.get(name)
        if arr is not None and (
            arr.ndim != 1 or arr.dtype.kind != "i" or len(arr) != len(keys) or (arr < -1).any()
        ):
            raise ValueError(
                f"{name}: expected {len(keys)} ints >= -1, got {arr.dtype} {arr.shape}"
            )
    pos = arrays.get(DRAW_POS)
    if pos is not None and not (
        pos.ndim == 1
        and pos.dtype.kind == "i"
        and np.array_equal(np.sort(pos), np.arange(len(keys)))
    ):
        raise ValueError(f"{DRAW_POS}: expected a permutation of {len(keys)} positions")
    if len(keys) > cap:
        raise ValueError(f"{len(keys)} items saved in a buffer of max_items={cap}")
    if len(keys):
        if keys[0] < 0 or (np.diff(keys) <= 0).any() or keys[-1] // cap >= seq:
            raise ValueError("keys must be increasing, >= 0 and issued before the save")
        if len(np.unique(keys % cap)) != len(keys):
            raise ValueError("two keys map to one slot")
        if not (np.isfinite(leaves).all() and (leaves >= 0).all() and (uses >= 0).all()):
            raise ValueError("priorities must be finite and >= 0, use counts >= 0")
        if leaves.max() > LEAF_MAX:  # add/update refuse these: the sum could overflow to inf
            raise ValueError(
                f"priority weights p**alpha must be at most {LEAF_MAX:g} (so their sum stays "
                f"finite), got {leaves.max():.3g}"
            )
