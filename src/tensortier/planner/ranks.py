"""Rank agreement for a planned offload on many ranks: every rank runs rank 0's plan.

With ``torch.distributed`` initialised and a world above one, ranks that ran different plans
would run different collectives (FSDP's all-gathers in a recomputed forward) and deadlock. So
the ranks agree on the settings at the first step (:func:`agree_settings`) and on the profiled
structure before planning (:func:`agree_structure`), planning with the profile of the rank whose
saved tensors are largest (:func:`largest_profile`); inputs are planned for their largest shape
on any rank (:func:`agreed_shapes`), peaks and resident overheads for the highest of any rank
(:func:`highest`, :func:`over_anywhere`); and rank 0 alone makes each decision and broadcasts it
(:func:`on_rank0`). Every helper is one collective that every rank calls in the same order; a
disagreement raises ConfigError on every rank, naming the rank. Without ``torch.distributed``
(or in a world of one) each is the single-rank answer and runs no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tensortier import _dist
from tensortier.planner.config import PlanConfig
from tensortier.planner.profile import Profile

if TYPE_CHECKING:
    import torch


def on_rank0(make: Callable[[], object], what: str = "planning") -> object:
    """``make()`` run on rank 0 alone, its result on every rank (without ``torch.distributed``,
    or in a world of one: ``make()`` here).

    Ranks that recompute different blocks run different collectives (FSDP's all-gathers in the
    recomputed forward) and can deadlock, so, as torchtitan does, one rank decides and the
    others receive its decision. Rank 0's error is sent as a value, so every rank raises (a
    ``BudgetError`` with its ``.minimum``) instead of waiting for a broadcast that never comes.
    Callers call it on every rank, in the same order (one broadcast each).
    """
    if not _dist.active():
        return make()
    from tensortier.errors import BudgetError

    sent: tuple = ("none",)
    error: Exception | None = None
    if _dist.rank() == 0:
        try:
            sent = ("ok", make())
        except BudgetError as exc:
            error, sent = exc, ("BudgetError", str(exc), exc.budget, exc.minimum)
        except Exception as exc:  # every rank must leave the broadcast
            error, sent = exc, ("error", f"{type(exc).__name__}: {exc}")
    got = _dist.broadcast_object(sent, 0)
    if got[0] == "ok":
        return got[1]
    if got[0] == "BudgetError":
        _, message, budget, minimum = got
        raise BudgetError(f"rank 0 planned: {message}", budget=budget, minimum=minimum) from error
    if error is not None:
        raise error
    raise RuntimeError(f"tensortier {what} failed on rank 0 ({got[1]}); see rank 0's traceback")


def agreed_shapes(shapes: list) -> list:
    """The inputs' shapes every rank plans for: each dimension's largest size over the ranks (a
    plan made for larger inputs errs high in memory). Ranks whose inputs differ in number, rank
    or dtype are a ConfigError on every rank."""
    if not _dist.active():
        return shapes
    from tensortier.errors import ConfigError

    everyone = _dist.gather_objects(shapes)
    base = everyone[0]
    for r, other in enumerate(everyone[1:], start=1):
        same = len(other) == len(base) and all(
            len(a) == len(b) and da == db for (a, da), (b, db) in zip(base, other)
        )
        if not same:
            raise ConfigError(
                f"tt.offload(budget=...): rank {r}'s inputs {other} differ from rank 0's {base} "
                f"in number, dimensions or dtype; every rank must call the model with tensors "
                f"of the same structure (sizes may differ: the plan is made for the largest)"
            )
    return [
        [[max(o[i][0][d] for o in everyone) for d in range(len(base[i][0]))], base[i][1]]
        for i in range(len(base))
    ]


def highest(value: int) -> int:
    """The largest ``value`` of any rank (one all-gather)."""
    if not _dist.active():
        return value
    return max(_dist.gather_objects(value))


def over_anywhere(over: bool, peak: int) -> tuple[bool, int]:
    """Whether any rank went over the budget, and the highest peak of any rank."""
    if not _dist.active():
        return over, peak
    everyone = _dist.gather_objects((over, peak))
    return any(o for o, _ in everyone), max(p for _, p in everyone)


def agree_settings(cfg: PlanConfig) -> None:
    """The same settings on every rank, checked at the first step (before any rank profiles or
    reads the plan cache); a mismatch is ConfigError on every rank. The spill directory may
    differ (a node's own disk): it does not change the plan."""
    if not _dist.active():
        return
    _dist.agree(
        {
            "budget": cfg.budget,
            "tier": cfg.tier,
            "policy": cfg.policy,
            "host_budget": cfg.host_budget,
            "plan_cache": cfg.plan_cache is not None,
            "warmup": cfg.warmup,
            "timing_iters": cfg.timing_iters,
            "check_steps": cfg.check_steps,
            "options": repr(cfg.options),
        },
        "tt.offload(budget=...)",
        fix="run the same offload settings on every rank",
    )


def agree_structure(profile: Profile, root: torch.nn.Module | None) -> None:
    """Every rank has the same parameters and profiled the same units and saved tensors (else
    one plan cannot fit all): ConfigError on every rank otherwise, naming the rank. Sizes of
    saved tensors may differ (a rank's batch or sequence is shorter: :func:`largest_profile`
    picks the profile planned for); parameters are compared by name, shape (a DTensor's global
    one) and dtype, since without DDP nothing else would notice a rank with another model."""
    params = [] if root is None else root.named_parameters()
    _dist.agree(
        {
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in params],
            "planning units": [u.name for u in profile.units],
            "saved tensors": [(t.unit, t.dtype, len(t.shape)) for t in profile.tensors],
        },
        "tt.offload(budget=...)",
        fix="run the same model and offload settings on every rank",
    )


def largest_profile(profile: Profile, shapes: list | None) -> tuple[Profile, list | None]:
    """The profile (and the input shapes it was profiled with) of the rank whose saved tensors
    are largest, on every rank: rank 0 plans with it, so a rank whose inputs are larger than
    rank 0's is not planned for smaller ones (one all-gather, and a broadcast when that rank is
    not rank 0; the lowest such rank on a tie)."""
    totals = _dist.gather_objects(sum(t.nbytes for t in profile.tensors))
    src = max(range(len(totals)), key=lambda r: (totals[r], -r))
    if src == 0:
        return profile, shapes
    return _dist.broadcast_object((profile, shapes), src)
