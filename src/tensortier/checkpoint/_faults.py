"""Deterministic kill points for crash-consistency tests (a "failpoint", as etcd and TiKV have).

When the environment variable ``TENSORTIER_CHECKPOINT_FAULT`` is ``"<point>@<save>[:<hit>]"``, the
process sends itself SIGKILL the ``hit``-th time (default 1) it reaches ``point`` during its
``save``-th persist. The variable is read at the start of each persist; unset (always, outside
tests), :func:`point` is one comparison. Points are named in PROTOCOL.md.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "TENSORTIER_CHECKPOINT_FAULT"


def _parse(spec: str | None) -> tuple[str, int, int] | None:
    if not spec:
        return None
    name, _, rest = spec.partition("@")
    save, _, hit = rest.partition(":")
    return name, int(save or 1), int(hit or 1)


_TARGET: tuple[str, int, int] | None = None
_lock = threading.Lock()
_save = 0
_hits: dict[str, int] = {}


def begin_save() -> None:
    """Called once at the start of each persist."""
    global _save, _TARGET
    _TARGET = _parse(os.environ.get(ENV))
    if _TARGET is None:
        return
    with _lock:
        _save += 1
        _hits.clear()


def point(name: str) -> None:
    if _TARGET is None:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        fire = (name, _save, _hits[name]) == _TARGET
    if fire:
        os.kill(os.getpid(), signal.SIGKILL)
