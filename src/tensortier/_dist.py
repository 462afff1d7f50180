"""torch.distributed helpers shared by every multi-rank component: who we are, and agreement.

tensortier never opens its own connections between ranks: everything here is a torch.distributed
collective on a process group. Decisions that must agree across ranks (a configuration, a plan,
a commit) are checked or made here, so a disagreement raises on **every** rank with a message
naming the rank and the value, instead of deadlocking later inside a mismatched collective.

Waits: each call is one collective on ``group``; it returns once every rank of the group has
called it, or fails after the group's timeout (``init_process_group(timeout=...)``), which is
torch's bound for every collective. The helpers never call a collective that some rank could
skip: callers invoke them unconditionally, in the same order on every rank.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence

import torch

from tensortier.errors import ConfigError


def initialized() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def active(group=None) -> bool:
    """torch.distributed is initialised and ``group`` (default: the world) has more than one rank."""
    return initialized() and torch.distributed.get_world_size(group) > 1


def rank(group=None) -> int:
    return torch.distributed.get_rank(group) if initialized() else 0


def world(group=None) -> int:
    return torch.distributed.get_world_size(group) if initialized() else 1


def owner(base: str) -> str:
    """A private directory's owner name that says which rank made it (``tt-act-rank3``), so the
    spill files of two ranks on one node sit in different, recognisable directories."""
    return f"{base}-rank{rank()}" if initialized() else base


def comm_device(group=None) -> torch.device:
    """Where tensors handed to ``group``'s collectives must live (NCCL: the current GPU)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_objects(obj: object, group=None) -> list:
    """``obj`` of every rank of ``group``, in rank order (one ``all_gather_object``)."""
    out: list = [None] * world(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def agree(values: dict, what: str, group=None, *, fix: str = "") -> list[dict]:
    """Check that every rank passed the same ``values``; ConfigError on every rank otherwise.

    ``values`` maps a setting's name to a picklable value. The message names the first setting
    that differs, the lowest rank that differs from rank 0, and both values. Returns every rank's
    values (rank order).
    """
    everyone = gather_objects(values, group)
    base = everyone[0]
    for key in base:
        for r, other in enumerate(everyone[1:], start=1):
            if other.get(key) != base[key]:
                raise ConfigError(
                    f"{what}: ranks disagree on {key}: rank 0 has {_short(base[key])}, rank {r} "
                    f"has {_short(other.get(key))}. Every rank of the process group must pass the "
                    f"same {key}" + (f"; {fix}" if fix else "")
                )
    for r, other in enumerate(everyone[1:], start=1):
        extra = set(other) - set(base)
        if extra:
            raise ConfigError(
                f"{what}: rank {r} has settings rank 0 lacks: {sorted(extra)}; every rank must "
                f"run the same tensortier configuration"
            )
    return everyone


def any_true(flags: Sequence[bool], group=None) -> list[bool]:
    """Element-wise OR of ``flags`` over the ranks of ``group`` (one all-reduce)."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=comm_device(group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def first_true(flag: bool, group=None) -> int | None:
    """The lowest rank whose ``flag`` is set, or None (one all-reduce)."""
    n = world(group)
    t = torch.tensor([float(rank(group) if flag else n)], device=comm_device(group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    r = int(t.item())
    return None if r >= n else r


def broadcast_object(obj: object, src: int = 0, group=None) -> object:
    """``obj`` of rank ``src`` (a group rank) on every rank of ``group``."""
    box = [obj]
    global_src = torch.distributed.get_global_rank(group, src) if group is not None else src
    torch.distributed.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


def new_group_like(group=None):
    """A new process group of ``group``'s ranks, backend and timeout, for a component that issues
    its own collectives (one collective on ``group``, made by its ranks only; the caller destroys
    it with ``torch.distributed.destroy_process_group``).

    Over the world, ``new_group``: torch names it by a creation counter, never reused. Over a
    subgroup only its ranks call this, and ``new_group(use_local_synchronization=True)`` names the
    group by a hash of its ranks and of this rank's number of live groups: once one is destroyed
    the next gets the same name, its gloo rendezvous (keys under that name in the job's store)
    reads the destroyed group's addresses, and one rank connects to the dead group while its peer
    waits (measured with torch 2.13: a hang); the name also differs between ranks that destroyed
    groups at different times (a garbage-collected optimizer). So a subgroup is made under a name
    of its own, drawn by the group's rank 0 and broadcast, through torch's group constructor.
    """
    dist = torch.distributed
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    backend, timeout = dist.get_backend(group), _timeout(group)
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
    name = f"tt-{broadcast_object(uuid.uuid4().hex, 0, group)}"  # never made before in this job
    return _named_group(ranks, dist.Backend(backend), name, timeout)


def _named_group(ranks: list[int], backend, name: str, timeout: datetime.timedelta | None):
    """``new_group(ranks, use_local_synchronization=True)`` under the name ``name``: torch's own
    constructor (private; its first six arguments and ``timeout`` are the same since torch 2.2),
    then the rank mapping ``new_group`` adds."""
    c10d = torch.distributed.distributed_c10d
    store = c10d._world.pg_map[c10d._get_default_group()][1]
    me = ranks.index(torch.distributed.get_rank())
    timeout = timeout or c10d._get_default_timeout(backend)
    made, _ = c10d._new_process_group_helper(
        len(ranks), me, ranks, backend, store, name, timeout=timeout
    )
    c10d._world.pg_group_ranks[made] = {g: r for r, g in enumerate(ranks)}
    return made


def _timeout(group) -> datetime.timedelta | None:
    """``group``'s collective timeout (``init_process_group(timeout=...)`` for the world), or None
    where torch does not say (then torch's default)."""
    try:
        return group._get_backend(comm_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
