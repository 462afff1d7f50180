"""Tier wiring: where the optimizer's state lives (``StateTier``) and opening that home.

``host``: :class:`HostStates` in RAM. ``disk``: a private :class:`DiskStore` under ``spill_dir``,
streamed through ``pipeline_depth`` ring buffers (:class:`DiskStates`). ``remote``: the same
streaming over a :class:`~tensortier.tiers.remote.RemoteStore`, the caller's (left open by
``close()``) or one made from a dict of its arguments (closed with the optimizer). This module
only maps the choice to a :class:`~tensortier.tiers.placement.Placement` (which checks it) and
opens the store; the protocol every home follows is in ``_states.py``.
"""

from __future__ import annotations

from enum import Enum

from tensortier import _dist
from tensortier._units import align_up
from tensortier.errors import ConfigError
from tensortier.optim._states import DiskStates, HostStates
from tensortier.tiers.host import PAGE
from tensortier.tiers.placement import Placement


class StateTier(str, Enum):
    """Where optimizer state and master weights live between steps."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # other nodes' RAM (tiers.remote.RemoteStore), streamed like "disk"


def parse_tier(tier: StateTier | str) -> StateTier:
    try:
        return StateTier(tier)
    except ValueError:
        raise ConfigError(
            f"tier={tier!r} is not a state tier; pass one of {[t.value for t in StateTier]}"
        ) from None


def states_placement(tier: StateTier, spill_dir, disk_budget, remote) -> Placement:
    """The state's placement, checked before anything is built (``remote=`` by the one rule of
    ``tiers/placement.py``)."""
    return Placement(
        (tier.value,),
        directory=spill_dir,
        disk_budget=disk_budget,
        remote=remote,
        where=f"OffloadedAdamW(tier={tier.value!r})",
    )


def open_states(
    placement: Placement, *, bucket_bytes: int, depth: int, io_threads: int, pin: bool
) -> HostStates | DiskStates:
    """The home of the state; ``pin``: host buffers pinned for CUDA copies."""
    tier = placement.tiers[0]
    if tier == "host":
        return HostStates(pin=pin)
    if tier == "remote":
        store, owned = placement.open_remote(io_threads=io_threads)
    else:
        owner = _dist.owner("tensortier-optim")
        slab = align_up(3 * bucket_bytes, PAGE)
        store, owned = placement.open_disk(owner=owner, slab_size=slab, io_threads=io_threads), True
    try:
        return DiskStates(store, depth, pin=pin, owns_store=owned)
    except BaseException:
        if owned:
            store.close()
        raise
