"""Parameters across machines: one object-store copy per node, copy-on-write views for readers.

How a version travels (``tt.rl.serve(ParamStore())``). The publisher encodes the state dict as a
list of flat ``uint8`` NumPy arrays (a JSON header, then each tensor's bytes) and ``ray.put``\\ s it
once; the store's actor keeps the newest ``keep`` versions' ObjectRefs and hands the newest to
readers. Ray pulls an object to a node's object store once, the first time a reader there asks,
and every reader on that node maps that one copy (measured: ``tests/rl/test_param_store_nodes.py``,
``benchmarks/params_nodes.py``). Ray carries the arrays as out-of-band buffers: the only
pickle a reader loads is Ray's own for plain ``uint8`` arrays; names, dtypes and shapes come from
the JSON header, dtypes from a fixed table.

Views. Ray maps its object store into each process shared and writable, and hands out arrays
flagged read-only; PyTorch has no read-only tensors, so a view of that memory would let one reader
silently change the parameters every other reader on its node sees. Instead each ``get()`` maps
the same pages again *privately* (``MAP_PRIVATE`` of the store's file at the object's offset, found
in ``/proc/self/maps``): no byte is copied, and a reader that writes into its tensors changes only
its own pages (copy-on-write), as with the shared-memory ``ParamStore``. Where that mapping cannot
be made (not Linux, ``/proc/self/map_files`` not readable without CAP_SYS_ADMIN, a small object Ray
inlined), the tensors are a private copy instead; ``Params.shared`` says which.

Lifetime rule. Version ``v`` stays in the object stores while the actor keeps it (the newest
``keep``) or any reader still holds a ``Params`` of it: its mapping holds the ObjectRef and Ray's
buffer (pinned in the node's store, so the pages under a copy-on-write view are never reused). Ray
frees it once neither holds it. Objects are owned by the process that published them (Ray 2.56
removed ``ray.put(_owner=)``, and an owner on the actor's side would cost a copy per version): if
that process dies, its versions go with it. A reader on a node that has no copy of the newest
version then gets :class:`ClosedError` from ``get()`` (on a node that still has one, Ray may keep
serving it); the ``Params`` readers hold stay valid, and a live process can publish through the
same store again.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import time
from collections.abc import Mapping

import numpy as np
import torch

from tensortier.errors import ClosedError, CorruptDataError
from tensortier.rl.param_store import checked_tensors, tied_key
from tensortier.tiers.disk import as_bytes
from tensortier.tiers.itemcodec import TORCH_DTYPES

_MAGIC = "tt-params-1"


class _Pinned(mmap.mmap):
    """A private mapping that keeps the Ray buffer and ObjectRef it maps alive (``_pin``)."""


def encode(state_dict: Mapping[str, torch.Tensor]) -> list[np.ndarray]:
    """``[header, tensor bytes...]`` as flat ``uint8`` arrays: views of CPU tensors, no copy."""
    entries, arrays = [], []
    # tied weights repeat one array object in the list, which Ray's pickle sends once (memo)
    placed: dict[tuple, np.ndarray] = {}
    for name, dtype, t in checked_tensors(state_dict):
        key = tied_key(t)
        raw = placed.get(key) if key is not None else None
        if raw is None:  # as ParamStore.publish: any strides, conj/neg views
            raw = as_bytes(t.detach().cpu()).numpy()
            if key is not None:
                placed[key] = raw
        entries.append([name, dtype, list(t.shape), raw.size])
        arrays.append(raw)
    header = json.dumps({"magic": _MAGIC, "tensors": entries}).encode()
    return [np.frombuffer(header, dtype=np.uint8), *arrays]


def _check(payload: object, version: int) -> list:
    """The header's entries, once the payload is known to be ours (never trusts its shapes)."""
    what = f"ParamStore version {version}"
    if not (
        isinstance(payload, list)
        and payload
        and all(isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.ndim == 1 for a in payload)
    ):
        raise CorruptDataError(f"{what} is not a list of uint8 arrays (not published by tt)")
    try:
        header = json.loads(payload[0].tobytes())
        entries = header["tensors"]
        ok = header["magic"] == _MAGIC and len(entries) == len(payload) - 1
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(f"{what}: unreadable header") from exc
    if not ok:
        raise CorruptDataError(f"{what}: header does not match its {len(payload) - 1} arrays")
    for entry, a in zip(entries, payload[1:]):
        try:
            name, dtype, shape, nbytes = entry
            ok = (
                dtype in TORCH_DTYPES
                and all(isinstance(s, int) and s >= 0 for s in shape)
                and nbytes == a.size
                and math.prod(shape) * TORCH_DTYPES[dtype].itemsize == nbytes
            )
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise CorruptDataError(f"{what}: bad entry {str(entry)[:200]}")
    return entries


def fetch(ray, ref, version: int, deadline: float | None) -> list:
    """``ray.get`` one version's payload, with Ray's failures as tensortier's errors."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return ray.get(ref, timeout=left)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(
            f"ParamStore version {version} did not arrive within the timeout (its bytes are "
            f"still being pulled to this node)"
        ) from exc
    except ray.exceptions.ObjectLostError as exc:  # OwnerDiedError is one
        raise ClosedError(
            f"ParamStore version {version} is gone: the process that published it died (Ray "
            f"objects live as long as the process that put them) or its node was lost. Params "
            f"already returned stay valid; publish again from a live process through this store"
        ) from exc


def _mapping_of(lo: int, hi: int) -> tuple[int, int, str] | None:
    """(start, file offset, range) of this process's shared file mapping holding [lo, hi)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= lo < end:
                if hi > end or len(parts) < 6 or parts[1][3] != "s" or parts[4] == "0":
                    return None  # not one shared file mapping (heap: Ray inlined a small object)
                return start, int(parts[2], 16), parts[0]
    return None


def _private_map(arrays: list[np.ndarray]) -> tuple[_Pinned, int] | None:
    """A copy-on-write mapping of the pages under ``arrays`` and the address it starts at."""
    spans = [(a.ctypes.data, a.ctypes.data + a.size) for a in arrays if a.size]
    if not spans:
        return None
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    try:
        found = _mapping_of(lo, hi)
        if found is None:
            return None
        start, offset, rng = found
        file_off = offset + (lo - start)
        page_off = file_off - file_off % mmap.PAGESIZE
        fd = os.open(f"/proc/self/map_files/{rng}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            mm = _Pinned(
                fd,
                hi - lo + (file_off - page_off),
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=page_off,
            )
        finally:
            os.close(fd)  # the mapping keeps the file
    except (OSError, ValueError):  # no /proc, or map_files needs CAP_SYS_ADMIN here
        return None
    base = lo - (file_off - page_off)
    try:  # map every page readable now, in one call: a new mapping would otherwise fault per page
        mm.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))  # Linux >= 5.14; pages stay shared
    except OSError:
        pass  # older kernels: the pages fault in as they are read
    for a in arrays:  # same bytes at the same places, or we found the wrong mapping
        n = min(a.size, 64)
        if n and mm[a.ctypes.data - base : a.ctypes.data - base + n] != a[:n].tobytes():
            mm.close()
            return None
    return mm, base


def views(payload: object, ref, version: int) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors of a fetched payload: copy-on-write views of the node's copy (``True``), or a
    private copy (``False``) where no such mapping can be made."""
    entries = _check(payload, version)
    arrays = payload[1:]
    mapped = _private_map(arrays)
    if mapped is not None:
        mm, base = mapped
        mm._pin = (payload, ref)  # the buffer stays pinned in the store while any view lives
    tensors = {}
    copies: dict[int, torch.Tensor] = {}  # tied weights arrive as one array: one copy of it
    for (name, dtype, shape, nbytes), a in zip(entries, arrays):
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
            continue
        if mapped is not None:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=a.ctypes.data - base)
        else:
            raw = copies.get(id(a))
            if raw is None:
                raw = copies[id(a)] = torch.from_numpy(a.copy())
        tensors[name] = raw.view(TORCH_DTYPES[dtype]).reshape(shape)
    return tensors, mapped is not None
