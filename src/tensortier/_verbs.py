"""The top-level verbs: ``tt.offload`` picks the mechanism (a fixed offloader) or the planner
(a memory budget). It sits above both, so ``activations/`` stays a mechanism that never imports
``planner/`` (the planner drives the offloader through its ``decide`` hook)."""

from __future__ import annotations

from typing import Any

from tensortier._renamed import OFFLOAD_RENAMES, renamed

# settings only tt.offload(budget=...) takes (planner/runtime.py: planned_offload)
PLANNER_ONLY = frozenset(
    {"policy", "warmup", "timing_iters", "options", "report", "plan_cache", "trial_plans"}
)


@renamed(**OFFLOAD_RENAMES)
def offload(tier: str | None = None, *, budget: Any = None, **kwargs: Any):
    """Offload saved activations inside a ``with`` block.

    Without ``budget``: a :class:`tensortier.Offloader` with these settings (cached per settings,
    see :func:`tensortier.activations.offload`); ``tier`` defaults to ``"host"``. With
    ``budget="6GiB"``: the planner profiles, chooses keep / swap / recompute under that budget and
    runs the plan (:func:`tensortier.planner.runtime.planned_offload`; ``plan_cache=DIR`` reuses
    plans); ``tier`` defaults to ``"auto"``: host then disk on a GPU, and the disk tier alone on a
    CPU-only machine, where host RAM is the device memory (a host copy frees nothing), so the
    plan still keeps the budget. Its settings: ``spill_dir``, ``policy``, ``warmup``,
    ``timing_iters``, ``prefetch_budget``, ``inflight_budget``, ``host_budget``, ``options``,
    ``report``, ``plan_cache``, ``remote``, ``trial_plans``
    (``help(tensortier.planner.runtime.planned_offload)``).
    """
    if budget is not None:
        from tensortier.planner.runtime import planned_offload

        _check_planner_settings(kwargs, planned_offload)
        return planned_offload(budget, tier=tier or "auto", **kwargs)
    planner_only = sorted(set(kwargs) & PLANNER_ONLY)
    if planner_only:  # else Offloader's "unexpected keyword argument", with no word of budget=
        from tensortier.errors import ConfigError

        raise ConfigError(
            f"tt.offload({', '.join(f'{k}=' for k in planner_only)}...) without budget=: "
            f"{'these are settings' if len(planner_only) > 1 else 'this is a setting'} of the "
            "planner; pass budget= too, e.g. tt.offload(budget='6GiB', plan_cache='plans/')"
        )
    from tensortier.activations.offloader import offload as offload_mechanism

    return offload_mechanism(tier or "host", **kwargs)


def _check_planner_settings(kwargs: dict, planned_offload: Any) -> None:
    """An unknown setting with ``budget=`` named ``planned_offload()``, a function the user never
    called; name ``tt.offload(budget=...)``, its settings, and why a mechanism setting is not one."""
    import inspect

    known = [
        n for n in inspect.signature(planned_offload).parameters if n not in ("budget", "tier")
    ]
    unknown = sorted(set(kwargs) - set(known))
    if not unknown:
        return
    name = unknown[0]
    why = (
        f"; {name}= is a setting of tt.offload without budget= (with one, the planner chooses "
        f"tiers and codecs per tensor itself)"
        if name in MECHANISM_ONLY
        else ""
    )
    raise TypeError(
        f"tt.offload(budget=...) got an unexpected keyword argument {name!r}{why}; its settings "
        f"are {', '.join(known)}"
    )


# settings only tt.offload() without a budget takes (activations/offloader.py: Offloader)
MECHANISM_ONLY = frozenset(
    {"codec", "decide", "record", "offload_weight_casts", "disk_budget", "io_threads"}
)
