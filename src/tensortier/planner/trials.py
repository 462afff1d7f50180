"""Measured trials: the best predicted plans run for real, and the fastest measured one stays.

The simulator ranks plans from one profile; on a CPU its step times err by 10-30% and plans it
puts within a few percent of each other come out up to 1.14x apart (``bench planner``, issue 27),
and the measured bound that keeps the budget (:func:`.profiler.measured_bound`) rules out plans
that would fit, because the timing passes it starts from are far from them. So, as Capuchin
and SwapAdvisor validate on the real thing and autotuners time their candidates, the runtime
runs a short list of plans, each for ``repeats`` real training steps, right after planning:

* every trial plan fits by the rules the first plan had to meet (the simulator's peak with its
  writes stalled under the planning budget, the measured bound under the budget less the
  resident buffers): a trial never risks the budget more than the plan itself;
* a trial's metered peak becomes a measured pass of the profile, so the bound of plans close to
  it tightens to what was measured, and plans the first bound ruled out can become trials;
* the list holds the plans predicted within ``SPREAD`` of the fastest that fits (the simulator's
  error on a CPU), the fastest predicted first, at most ``plans`` of them and ``seconds`` of
  trial steps;
* then the plan with the fastest measured step (the least of its steps) that stayed under the
  budget runs.

Every plan is lossless unless the user allowed lossy codecs, so the gradients of a trial step
are those of plain training: trials change only how fast a step runs. This module holds the
trials' state; the runtime (:class:`.runtime.PlannedOffload`) installs and meters each plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from tensortier.planner.policies import Choice
from tensortier.planner.profile import Profile
from tensortier.planner.simulator import Plan

# trials: plans predicted at most this much slower than the fastest that fits. The simulator's
# slowdown over keep erred by up to 27% on the quiet CPU sweep (swaps' costs low, recompute's
# reruns high: planner-sweep-quiet-cpu.json), so a plan predicted 25% slower may be the fastest
SPREAD = 0.30
REPEATS = 2  # steps per trial plan (the first after a switch warms the offloader's buffers)


def plan_key(plan: Plan) -> str:
    """What makes two plans the same plan, whatever policy found them."""
    d = plan.to_dict()
    return json.dumps([d["actions"], d["codecs"]], sort_keys=True)


@dataclass
class Trial:
    """One plan's trial steps: their times (seconds, forward to the end of backward) and peaks
    (the step's own, as a timing pass's: resident buffers excluded)."""

    choice: Choice
    steps: int = 0
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    over: bool = False  # a step of it went over the budget


class Trials:
    """The trial phase of one planned offload; see the module docstring.

    ``fits(choice)`` says whether a plan may run by the rules the first plan met (it is asked
    again before every trial: each measured trial tightens the bound)."""

    def __init__(
        self,
        profile: Profile,
        first: Choice,
        fits: Callable[[Choice], bool],
        plans: int,
        seconds: float,
        repeats: int = REPEATS,
    ):
        self.profile, self.fits, self.first = profile, fits, first
        self.plans, self.seconds, self.repeats = plans, seconds, max(1, repeats)
        self.pool: dict[str, Choice] = {}
        for c in [first, *first.considered.values()]:
            self.pool.setdefault(plan_key(c.plan), c)
        self.done: list[Trial] = []
        self.current: Trial | None = None
        self.spent = 0.0

    def next(self) -> Choice | None:
        """The plan the next step runs, or None: the trials are over (see :meth:`best`)."""
        cur = self.current
        if cur is not None and cur.steps < self.repeats and not cur.over:
            cur.steps += 1
            return cur.choice
        if cur is not None:
            self._finish(cur)
        if len(self.done) >= self.plans or self.spent >= self.seconds:
            return None
        choice = self._candidate()
        if choice is None:
            return None
        self.current = Trial(choice, steps=1)
        return choice

    def measured(self, peak: int | None = None, seconds: float | None = None, over=False) -> None:
        """What the running trial's step measured: its peak, its time, whether it went over."""
        cur = self.current
        if cur is None:
            return
        if peak is not None:
            cur.peaks.append(peak)
        if seconds is not None:
            cur.times.append(seconds)
            self.spent += seconds
        cur.over = cur.over or over

    def best(self) -> Choice:
        """The plan with the fastest measured step that stayed under the budget (the first
        plan when no trial step was timed: forwards without a backward)."""
        if self.current is not None:
            self._finish(self.current)
        ok = [t for t in self.done if t.times and not t.over]
        if not ok:
            return self.first
        return min(ok, key=lambda t: (min(t.times), t.choice.result.step_s)).choice

    def rows(self, kept: Choice) -> list[dict]:
        """One row per plan tried, in the order they ran: its predicted and measured steps and
        its metered peak, the plan ``kept`` marked (what a report shows of the trials)."""
        from tensortier._units import format_size

        key = plan_key(kept.plan)
        return [
            {
                "plan": t.choice.plan.policy,
                "predicted step_s": f"{t.choice.result.step_s:.4g}",
                "measured steps_s": ", ".join(f"{s:.4g}" for s in t.times) or "-",
                "fastest_s": f"{min(t.times):.4g}" if t.times else "-",
                "peak": format_size(max(t.peaks)) if t.peaks else "-",
                "over budget": "yes" if t.over else "",
                "kept": "yes" if plan_key(t.choice.plan) == key else "",
            }
            for t in self.done
        ]

    def _finish(self, trial: Trial) -> None:
        """The trial is a measured pass from now on: it bounds the plans close to it."""
        self.current = None
        self.done.append(trial)
        if trial.peaks:
            self.profile.passes.append(
                {
                    "kind": "trial",
                    "plan": trial.choice.plan.to_dict(),
                    "peak_bytes": max(trial.peaks),
                    "step_s": min(trial.times) if trial.times else None,
                    "timed_step": False,
                }
            )

    def _candidate(self) -> Choice | None:
        """The untried plan predicted fastest among those that fit now, if it is predicted
        within ``SPREAD`` of the fastest plan that fits (tried ones included)."""
        tried = {plan_key(t.choice.plan) for t in self.done}
        fitting = [(k, c) for k, c in self.pool.items() if self.fits(c)]
        if not fitting:
            return None
        fastest = min(c.result.step_s for _, c in fitting)
        untried = [c for k, c in fitting if k not in tried]
        if not untried:
            return None
        pick = min(untried, key=lambda c: (c.result.step_s, c.result.peak_bytes))
        return pick if pick.result.step_s <= (1 + SPREAD) * fastest else None
