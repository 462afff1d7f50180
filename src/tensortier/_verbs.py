"""The top-level verbs: ``tt.offload`` picks the mechanism (a fixed offloader) or the planner
(a memory budget). It sits above both, so ``activations/`` stays a mechanism that never imports
``planner/`` (the planner drives the offloader through its ``decide`` hook)."""

from __future__ import annotations

from typing import Any


def offload(to: str = "disk", *, budget: Any = None, **kwargs: Any):
    """Offload saved activations inside a ``with`` block.

    Without ``budget``: a :class:`tensortier.Offloader` with these settings (cached per settings,
    see :func:`tensortier.activations.offload`). With ``budget="6GiB"``: the planner profiles,
    chooses keep / swap / recompute under that budget and runs the plan
    (:func:`tensortier.planner.runtime.planned_offload`; ``plan_cache=DIR`` reuses plans).
    """
    if budget is not None:
        from tensortier.planner.runtime import planned_offload

        return planned_offload(budget, to=to, **kwargs)
    from tensortier.activations.offloader import offload as offload_mechanism

    return offload_mechanism(to, **kwargs)
