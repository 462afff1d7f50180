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
  trial steps; each runs one step there (its peak, and the warm-up of its buffers);
* a plan the simulator predicts faster than the last one measured, and under the planning
  budget, that the measured bound alone rules out is approached by a bridge (:func:`bridge`): the last plan measured under the budget with as many of its units
  switched to the faster plan's actions as still fit. The passes the planner measured before
  the trials offload nearly everything, so the measured bound of a plan that keeps or reruns
  layers adds all their bytes to a pass peak reached elsewhere in the step (on gpt:8x128x4 at
  0.35x, flashneuron's bound was 36 MiB, its steps measured 22-24 MiB): no plan of the list was
  close to a measured pass, the first plan (swap_all, predicted slowest) was the only trial and
  ran. Each bridge measured is a pass close to the next, so the bound of the faster plan tightens
  step by step, and a bridge is a plan that fits by the same rules, kept if fastest;
* then the plans measured under the budget are compared fairly: ``repeats`` rounds of one step
  of each, interleaved, every other round in reverse order (ABBA: on a shared machine the load
  drifts, and a plan timed alone in its own window was judged by the load of that window: at
  0.5x the first plan's first step, 0.375 s, beat plans later measured faster over 5 rounds),
  and the plan with the least mean of its compared steps runs (the least single step when fewer
  than two plans were measured).

Every plan is lossless unless the user allowed lossy codecs, so the gradients of a trial step
are those of plain training: trials change only how fast a step runs. This module holds the
trials' state; the runtime (:class:`.runtime.PlannedOffload`) installs and meters each plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import fmean

from tensortier.planner.policies import Choice
from tensortier.planner.profile import Profile
from tensortier.planner.simulator import Plan

Evaluate = Callable[[Plan], Choice]  # a plan simulated as the planner's choices are

# trials: plans predicted at most this much slower than the fastest that fits. The simulator's
# slowdown over keep erred by up to 27% on the quiet CPU sweep (swaps' costs low, recompute's
# reruns high: planner-sweep-quiet-cpu.json), so a plan predicted 25% slower may be the fastest
SPREAD = 0.30
REPEATS = 2  # rounds of the comparison (after one step of each plan: its peak, its warm-up)


def plan_key(plan: Plan) -> str:
    """What makes two plans the same plan, whatever policy found them."""
    d = plan.to_dict()
    return json.dumps([d["actions"], d["codecs"]], sort_keys=True)


@dataclass
class Trial:
    """One plan's trial steps: their times (seconds, forward to the end of backward; ``times``
    its exploring step's, ``compared`` those of the interleaved rounds) and peaks (the step's
    own, as a timing pass's: resident buffers excluded)."""

    choice: Choice
    steps: int = 0
    times: list[float] = field(default_factory=list)
    compared: list[float] = field(default_factory=list)
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
        evaluate: Evaluate | None = None,
        predicted: Callable[[Choice], bool] | None = None,
    ):
        self.profile, self.fits, self.first = profile, fits, first
        # bridges (None: only the planner's plans are tried): ``evaluate`` simulates one,
        # ``predicted`` says whether a plan fits as the simulator predicts it (a bridge's target)
        self.evaluate, self.predicted = evaluate, predicted
        self.plans, self.seconds, self.repeats = plans, seconds, max(1, repeats)
        self.pool: dict[str, Choice] = {}
        for c in [first, *first.considered.values()]:
            self.pool.setdefault(plan_key(c.plan), c)
        self.done: list[Trial] = []
        self.current: Trial | None = None
        self.spent = 0.0
        self.queue: list[Trial] | None = None  # the comparison's steps to come (None: exploring)

    def next(self) -> Choice | None:
        """The plan the next step runs, or None: the trials are over (see :meth:`best`)."""
        if self.queue is None:
            if self.current is not None:
                self._finish(self.current)
            choice = None
            if len(self.done) < self.plans and self.spent < self.seconds:
                choice = self._candidate()
            if choice is not None:
                self.current = Trial(choice, steps=1)
                return choice
            self.queue = self._rounds()
        self.current = None
        while self.queue:
            trial = self.queue.pop(0)
            if not trial.over:
                trial.steps += 1
                self.current = trial
                return trial.choice
        return None

    def _rounds(self) -> list[Trial]:
        """The comparison's steps: ``repeats`` rounds of the plans measured under the budget,
        every other round reversed (ABBA: a load drifting linearly weighs on each alike)."""
        ok = [t for t in self.done if t.times and not t.over]
        if len(ok) < 2:
            return []
        return [t for r in range(self.repeats) for t in (ok if r % 2 == 0 else ok[::-1])]

    def measured(self, peak: int | None = None, seconds: float | None = None, over=False) -> None:
        """What the running trial's step measured: its peak, its time, whether it went over."""
        cur = self.current
        if cur is None:
            return
        if peak is not None:
            cur.peaks.append(peak)
        if seconds is not None:
            (cur.times if self.queue is None else cur.compared).append(seconds)
            self.spent += seconds
        cur.over = cur.over or over

    def best(self) -> Choice:
        """The plan with the least mean compared step that stayed under the budget (the least
        step when none was compared; the first plan when no trial step was timed: forwards
        without a backward)."""
        if self.current is not None and self.queue is None:
            self._finish(self.current)
        self.current = None
        ok = [t for t in self.done if t.times and not t.over]
        if not ok:
            return self.first
        if any(t.compared for t in ok):
            ok = [t for t in ok if t.compared]
            return min(ok, key=lambda t: (fmean(t.compared), t.choice.result.step_s)).choice
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
                "measured steps_s": ", ".join(f"{s:.4g}" for s in t.times + t.compared) or "-",
                "compared_s": f"{fmean(t.compared):.4g}" if t.compared else "-",
                "fastest_s": f"{min(t.times + t.compared):.4g}" if t.times else "-",
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
        """The untried plan predicted fastest among those that fit now and the bridge toward a
        faster plan that does not (:meth:`_bridge`), if it is predicted within ``SPREAD`` of the
        fastest plan that fits (tried ones included)."""
        tried = {plan_key(t.choice.plan) for t in self.done}
        fitting = [(k, c) for k, c in self.pool.items() if self.fits(c)]
        if not fitting:
            return None
        fastest = min(c.result.step_s for _, c in fitting)
        untried = [c for k, c in fitting if k not in tried]
        bridged = self._bridge(tried)
        if bridged is not None:
            untried.append(bridged)
        if not untried:
            return None
        pick = min(untried, key=lambda c: (c.result.step_s, c.result.peak_bytes))
        return pick if pick.result.step_s <= (1 + SPREAD) * fastest else None

    def _bridge(self, tried: set[str]) -> Choice | None:
        """The bridge from the last plan measured under the budget toward the fastest untried
        plan predicted faster than it and under the planning budget, that does not fit as the
        measured passes bound it (see the module docstring), or None."""
        ok = [t for t in self.done if not t.over]
        if self.evaluate is None or self.predicted is None or not ok:
            return None
        base = ok[-1].choice
        targets = [
            c
            for k, c in self.pool.items()
            if k not in tried
            and c.result.step_s < base.result.step_s
            and self.predicted(c)
            and not self.fits(c)
        ]
        for target in sorted(targets, key=lambda c: c.result.step_s):
            b = bridge(self.profile, base, target, self.fits, self.evaluate)
            if b is not None and plan_key(b.plan) not in tried:
                return b
        return None


def bridge(
    profile: Profile, base: Choice, target: Choice, fits: Callable[[Choice], bool], ev: Evaluate
) -> Choice | None:
    """``base`` with the units of ``target`` switched to its actions, one at a time in forward
    order, each switch kept while the plan still ``fits``; None when no switch fits or the
    result is not predicted faster than ``base``."""
    name = f"toward {target.plan.policy.removeprefix('auto:')}"
    actions, out = dict(base.plan.actions), None
    for unit in (u.name for u in profile.units):
        a = target.plan.action(unit)
        if a == actions.get(unit, base.plan.action(unit)):
            continue
        c = ev(Plan(name, {**actions, unit: a}))
        if fits(c):
            actions, out = dict(c.plan.actions), c
    if out is None or out.result.step_s >= base.result.step_s:
        return None
    return out
