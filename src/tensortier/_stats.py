"""``tt.stats()``: every live client's counters in one shape.

This module owns the registry of live clients (offloaders, optimizers, stores, buffers, ...) and
the one conversion of their stats to a flat dict. It holds weak references only: it never keeps a
client alive, and a client that is closed or collected drops out of :func:`stats`. It never
changes a client, and imports nothing of tensortier (every client imports it).

Shape of :func:`stats`: ``{"<kind>:<n>": {"kind": kind, **fields}}``, ``n`` counting the clients
of that kind in creation order (never reused, so a key names one client for its whole life). The
fields are the client's own stats (``as_dict()`` when it has one, else ``dataclasses.asdict`` of a
dataclass, else the dict itself), flattened to one level: a nested dict's entries become dotted
keys (``bytes_offloaded.host``); a ``str`` enum becomes its value; a sequence becomes a list when
its items are scalars and is left out otherwise (a record history such as the checkpointer's
``history`` stays in that client's own ``.stats``). Every value is a JSON scalar or a list of them.
A client that owns others (an offloader's host pool, disk store and transfer engine; a planned
offload's offloader) is listed beside them: do not add bytes across kinds.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

_lock = threading.Lock()
_live: dict[str, weakref.ref] = {}  # "<kind>:<n>" -> the client, in creation order
_counters: dict[str, itertools.count] = {}
_SCALARS = (bool, int, float, str, type(None))


def _after_fork() -> None:
    """A forked child (a DataLoader worker, a rank) gets a fresh lock: another thread of the
    parent may have held it at the fork, and would never release the child's copy."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def register(kind: str, obj: object) -> str:
    """List ``obj`` in :func:`stats` as ``"<kind>:<n>"`` while it is alive and open (a weak
    reference); returns that key. Call it last in the constructor, once construction succeeded."""
    ref = weakref.ref(obj)
    with _lock:
        for key in [k for k, r in _live.items() if r() is None]:  # collected since: forget them
            del _live[key]
        n = next(_counters.setdefault(kind, itertools.count()))
        key = f"{kind}:{n}"
        _live[key] = ref
    return key


def stats() -> dict[str, dict[str, Any]]:
    """One flat, JSON-serialisable dict per live client of this process, keyed ``"<kind>:<n>"``.

    >>> tt.stats()["offloader:0"]["bytes_offloaded.host"]

    ``kind`` is ``offloader``, ``optimizer``, ``host_pool``, ``transfer_engine``, ``disk_store``,
    ``checkpointer``, ``replay_buffer``, ...; ``n`` counts that kind in creation order. Each value
    is ``{"kind": kind, **fields}``, nested fields as dotted keys. A client that owns others (an
    offloader's pool, engine and disk store) is listed beside them: do not add bytes across
    kinds. Closed clients, and clients whose stats raise, are left out. Thread-safe."""
    with _lock:
        entries = list(_live.items())
    out: dict[str, dict[str, Any]] = {}
    for key, ref in entries:  # outside the lock: a client's stats may take its own locks
        obj = ref()
        if obj is None or _closed(obj):
            continue
        try:
            fields = _fields(obj)
        except Exception:  # closed between the check and the read, or cannot report now
            continue
        del obj
        out[key] = {"kind": key.rpartition(":")[0], **fields}
    return out


def _closed(obj: object) -> bool:
    """Whether a client is closed, by the flag it keeps: ``closed`` (public), else ``_closed``,
    else its finalizer (``_lifetime.Finalizer``: not alive once closed)."""
    for name in ("closed", "_closed"):
        flag = getattr(obj, name, None)
        if isinstance(flag, bool):
            return flag
    finalizer = getattr(obj, "_finalizer", None)
    return finalizer is not None and not getattr(finalizer, "alive", True)


def _fields(obj: object) -> dict[str, Any]:
    """The client's stats as a flat dict: ``.stats`` called when it is a method, read when it is
    an attribute or a property."""
    raw = obj.stats  # type: ignore[attr-defined]
    if callable(raw):
        raw = raw()
    if raw is None:  # a planned offload still profiling (no plan runs yet): "kind" alone
        return {}
    if hasattr(raw, "as_dict"):
        raw = raw.as_dict()
    elif dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        raw = dataclasses.asdict(raw)
    if not isinstance(raw, Mapping):
        raise TypeError(f"{type(obj).__name__}.stats is a {type(raw).__name__}, not a dict")
    out: dict[str, Any] = {}
    _flatten(raw, "", out)
    return out


def _flatten(d: Mapping, prefix: str, out: dict[str, Any]) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            _flatten(v, key + ".", out)
            continue
        v = _scalar(v)
        if isinstance(v, _SCALARS):
            out[key] = v
        elif isinstance(v, (list, tuple, collections.deque)):
            items = [_scalar(x) for x in v]
            if all(isinstance(x, _SCALARS) for x in items):
                out[key] = items


def _scalar(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # a numpy / torch scalar
        return v.item()
    return v
