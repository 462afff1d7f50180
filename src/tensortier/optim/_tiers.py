"""Tier wiring: where the optimizer's state lives (``StateTier``) and opening that home.

``host``: :class:`HostStates` in RAM. ``disk``: a private :class:`DiskStore` under ``spill_dir``,
streamed through ``pipeline_depth`` ring buffers (:class:`DiskStates`). ``remote``: the same
streaming over a :class:`~tensortier.tiers.remote.RemoteStore`, the caller's (left open by
``close()``) or one made from a dict of its arguments (closed with the optimizer). This module
only parses the choice and opens the store; the protocol every home follows is in ``_states.py``.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from tensortier import _dist
from tensortier._units import align_up
from tensortier.errors import ConfigError
from tensortier.optim._states import DiskStates, HostStates
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import PAGE

if TYPE_CHECKING:  # Ray is imported only when a RemoteStore is made
    from tensortier.tiers.remote import RemoteStore


class StateTier(str, Enum):
    """Where optimizer state and master weights live between steps."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # other nodes' RAM (tiers.remote.RemoteStore), streamed like "disk"


def parse_tier(states: StateTier | str) -> StateTier:
    try:
        return StateTier(states)
    except ValueError:
        raise ConfigError(
            f"states={states!r} is not a state tier; pass one of {[t.value for t in StateTier]}"
        ) from None


def open_states(
    tier: StateTier,
    *,
    spill_dir: str | None,
    disk_capacity,
    remote: RemoteStore | dict | None,
    bucket_bytes: int,
    depth: int,
    io_threads: int,
    pin: bool,
) -> HostStates | DiskStates:
    """The home of the state; ``pin``: host buffers pinned for CUDA copies."""
    if tier is StateTier.HOST:
        return HostStates(pin=pin)
    if tier is StateTier.REMOTE:
        return _remote_states(remote, depth, pin, io_threads)
    store = DiskStore(
        spill_dir,
        capacity=disk_capacity,
        slab_size=align_up(3 * bucket_bytes, PAGE),
        io_threads=io_threads,
        owner=_dist.owner("tensortier-optim"),
    )
    try:
        return DiskStates(store, depth, pin=pin)
    except BaseException:
        store.close()
        raise


def _remote_states(remote, depth: int, pin: bool, io_threads: int) -> DiskStates:
    """``states="remote"``: the disk path's streaming over a RemoteStore (same protocol)."""
    from tensortier.tiers.remote import RemoteStore

    if isinstance(remote, RemoteStore):
        if remote.closed:
            raise ConfigError("remote=RemoteStore(...) is closed; pass an open store")
        return DiskStates(remote, depth, pin=pin, owns_store=False)
    if not isinstance(remote, dict) or "capacity" not in remote:
        raise ConfigError(
            f"states='remote' needs remote=RemoteStore(capacity) or a dict of its arguments "
            f"with a capacity, e.g. remote={{'capacity': '8GiB'}}; got remote={remote!r}"
        )
    store = RemoteStore(**{"io_threads": io_threads, **remote})
    try:
        return DiskStates(store, depth, pin=pin)
    except BaseException:
        store.close()
        raise
