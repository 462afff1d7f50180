"""The settings of one planned offload (``tt.offload(budget=...)``), as one dataclass.

:func:`tensortier.planner.runtime.planned_offload` validates the user's keyword arguments and
builds a :class:`PlanConfig`; the runtime, the plan cache (its key) and the rank agreement read
it. It holds values only: nothing here measures, plans or moves bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensortier.planner.policies import Options
from tensortier.planner.profile import Bandwidth


@dataclass
class PlanConfig:
    budget: int
    policy: str = "auto"
    tier: str = "auto"  # the tiers the plan may use: "host", "disk", "remote" or "auto" (all)
    spill_dir: str | None = None
    warmup: int = 1
    timing_iters: int = 2  # timing passes after the probe, each under the budget
    prefetch_budget: int | None = None  # None: default_prefetch(budget)
    inflight_budget: int | None = None  # None: default_inflight(budget)
    host_budget: int = 8 << 30
    options: Options | None = None
    bandwidth: Bandwidth | None = None
    report: str | None = None  # write an HTML report of the chosen plan here
    plan_cache: str | None = None  # directory of cached profiles and plans (JSON)
    check_steps: int = 3  # planned iterations measured against the budget (re-plan if over)
    # auto: plans run for real after planning, the fastest measured kept (planner/trials.py);
    # 0: the simulator's choice runs
    trial_plans: int = 4
    # a RemoteStore the plan may use (the caller's, left open); not in repr: its repr has stats
    remote: object = field(default=None, repr=False, compare=False)
