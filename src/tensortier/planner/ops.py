"""Operators inside a unit: recorded once in the probe pass, recomputed selectively in a plan.

Selective recompute is PyTorch's own (``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``): a unit's forward runs under non-reentrant checkpoint
and a policy that, per operator, either caches its output (``MUST_SAVE``) or lets backward
recompute it (``MUST_RECOMPUTE``). Every operator not cached is re-run in backward, whether
autograd needs its output or not, and every cached output stays whole until then: so what a
choice costs and frees depends on each operator's time and output bytes, which
:class:`OpRecorder` measures in the probe pass (a ``TorchDispatchMode`` that sees the operators
exactly as the policy will, ``SAC_IGNORED_OPS`` skipped). A plan names operators by their index
in that order (:class:`SelectivePolicy`).

This module never moves bytes and never decides: the simulator prices a choice, the policies
choose.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from tensortier.transfer.streams import timing_event


def _is_inplace(func) -> bool:
    try:
        return func.overloadpacket.__name__.endswith("_") or bool(func._schema.is_mutable)
    except AttributeError:
        return False


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operator writes in place (its schema's ``Tensor(a!)`` arguments)."""
    out = []
    try:
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [t for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
    except (AttributeError, IndexError):
        pass
    return out


def _is_random(func) -> bool:
    try:
        return torch.Tag.nondeterministic_seeded in func.tags
    except AttributeError:
        return False


class OpRecorder(TorchDispatchMode):
    """Records every operator run while ``unit()`` names a unit: name, output bytes, seconds.

    Some operators must rerun whenever their unit does (``pinned``): random ones (checkpoint
    restores the RNG state at the unit's start, so every random op must draw again, in order)
    and those whose output a later op of the unit writes in place (dropout's mask).

    ``muted`` (a counter) hides the offloader's own work inside its pack hook. ``producer`` maps
    the storage of each output to (unit, operator index), so a saved tensor can be traced to the
    operator that made it. On CUDA each operator is timed with a pair of events.
    """

    def __init__(self, unit: Callable[[], str | None], device: torch.device):
        super().__init__()
        self.unit, self.device = unit, device
        self.muted = 0
        self.ops: dict[str, list[dict]] = {}
        self.producer: dict[int, tuple[str, int]] = {}
        self.inplace: set[str] = set()  # units with an in-place operator
        self._events: list[tuple[dict, object, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unit = None if self.muted else self.unit()
        if unit is None or func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        cuda = self.device.type == "cuda"
        if cuda:  # on the profiled device's stream, where ``func`` runs (not the current device's)
            stream = torch.cuda.current_stream(self.device)
            start = timing_event()
            end = timing_event()
            start.record(stream)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        inputs = {
            a.untyped_storage().data_ptr()
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        new: dict[int, int] = {}
        aliased = False
        for o in tree_leaves(out):
            if not isinstance(o, torch.Tensor):
                continue
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or o._base is not None:
                aliased = True
            elif ptr:
                new[ptr] = storage.nbytes()
        ops = self.ops.setdefault(unit, [])
        row = {
            "index": len(ops),
            "name": str(func),
            "out_bytes": sum(new.values()),
            "seconds": dt,
            "view": aliased and not new,
            "random": _is_random(func),
            # rerun whenever the unit is: random ops keep the RNG sequence of the forward
            "pinned": _is_random(func),
        }
        ops.append(row)
        if _is_inplace(func):
            # the op that made what this writes must rerun with it (a cached tensor written in
            # place fails checkpoint's version check); a write to a storage from outside the
            # unit would be applied twice by any recompute: no selective recompute then
            for t in _mutated(func, args, kwargs):
                made = self.producer.get(t.untyped_storage().data_ptr())
                if made is not None and made[0] == unit:
                    ops[made[1]]["pinned"] = True
                else:
                    self.inplace.add(unit)
        for ptr in new:
            self.producer[ptr] = (unit, row["index"])
        if cuda:
            end.record(stream)
            self._events.append((row, start, end))
        return out

    def resolve(self) -> None:
        """CUDA: replace launch times by kernel times (after the pass synchronized)."""
        for row, start, end in self._events:
            row["seconds"] = start.elapsed_time(end) / 1e3
        self._events = []


class SelectivePolicy:
    """``MUST_RECOMPUTE`` for the operators at ``recompute`` (indices in dispatch order),
    ``MUST_SAVE`` for the others; fresh counters for every forward of the unit, one for the
    forward and one for its recompute (PyTorch before 2.5 asks the policy again in the
    recompute: one shared counter would go on from the forward's last index there)."""

    def __init__(self, recompute: Iterable[int]):
        self.recompute = frozenset(recompute)

    def contexts(self):
        counters = {False: 0, True: 0}

        def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
            i = counters[ctx.is_recompute]
            counters[ctx.is_recompute] += 1
            return (
                CheckpointPolicy.MUST_RECOMPUTE
                if i in self.recompute
                else CheckpointPolicy.MUST_SAVE
            )

        return create_selective_checkpoint_contexts(policy)


def measure_sac_overhead(device: torch.device | None = None, n: int = 200) -> float:
    """Seconds selective checkpointing's dispatch mode adds per operator (Python per op)."""
    device = device or torch.device("cpu")
    x = torch.zeros(8, device=device)

    def ops() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = y + 1
        return y

    def timed(mode) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            if mode is None:
                ops()
            else:
                with mode:
                    ops()
            best = min(best, time.perf_counter() - t0)
        return best

    caching, _ = create_selective_checkpoint_contexts(
        functools.partial(lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    )
    return max(0.0, (timed(caching) - timed(None)) / n)


_preloaded = False


def preload() -> None:
    """Import what PyTorch imports the first time a dispatch mode runs (sympy, the FX symbolic
    shape machinery: about 800 modules and 70 MiB of RSS on CPU), so that this one-time cost is
    paid when the planner is created, not inside the first budgeted iteration."""
    global _preloaded
    if _preloaded:
        return

    class _Noop(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Noop():
        torch.zeros(1).add_(1)
    _preloaded = True
