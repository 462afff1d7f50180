"""Policies that turn a profile and a memory budget into a plan, every one judged by the simulator.

* ``keep``: nothing moves (the baseline peak).
* ``swap_all`` (vDNN): every unit's saved tensors go to the fastest tier that has room.
* ``recompute_all`` (Chen et al.): every recomputable unit is checkpointed.
* ``flashneuron``: in forward order, offload what hides behind forward compute; where raw bytes
  do not hide, compress them if that makes them hide; then offload the rest in order of least
  slowdown until the budget is met.
* ``capuchin``: from ``keep``, repeatedly take the action with the most bytes freed per second of
  added step time: a swap (free when its transfer hides) or a recompute.
* ``fine``: below block granularity. Per unit it may also swap only part of the saved tensors
  (the largest first) or recompute selectively (PyTorch's selective activation checkpointing:
  cache the outputs of the operators that are dear to rerun per byte, rerun the cheap ones such
  as norms, activation functions and elementwise ops). Greedy like ``capuchin`` over that larger
  menu until the budget is met, then hill climbing: any change that makes the plan faster and
  keeps it under the budget.
* ``search``: simulated annealing over per-unit actions (SwapAdvisor-style) and the finer menu,
  seeded with the other plans, bounded by an iteration count (deterministic for a seed) and
  a time limit.
* ``auto``: every policy above; the fastest plan that meets the budget.

Planning time is bounded: ``Options.plan_seconds`` caps the whole of ``auto`` (each policy stops
improving when it runs out and returns the best plan it has), and the search also stops after
``search_iters`` steps, so a plan is deterministic for a seed whenever the time limit does not
bind. ``Choice.plan_s`` says how long a choice took.

When no plan meets the budget, :class:`BudgetError` says the smallest budget any plan meets.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tensortier._units import SizeLike, format_size, format_size_up, parse_size
from tensortier.errors import BudgetError, ConfigError
from tensortier.planner.profile import Profile
from tensortier.planner.simulator import (
    Mode,
    Plan,
    SimResult,
    UnitAction,
    resolve_codecs,
    simulate_worst,
)

POLICIES = (
    "keep",
    "swap_all",
    "recompute_all",
    "flashneuron",
    "capuchin",
    "fine",
    "search",
    "auto",
)


@dataclass
class Options:
    """Knobs a user rarely needs: which tiers exist, lossy codecs, search effort.

    ``"remote"`` in ``tiers`` is used only when the profile measured a remote pool
    (``Bandwidth.remote``); ``tt.offload(budget=..., remote=pool)`` adds it."""

    tiers: tuple[str, ...] = ("host", "disk")
    allow_lossy: bool = False
    seed: int = 0
    search_iters: int = 600
    search_seconds: float = 20.0
    margin: float = 0.1  # plan for (1 - margin) x budget: bandwidth measured at start-up drifts
    fine: bool = True  # finer decisions: partial swaps and selective recompute
    plan_seconds: float = 30.0  # wall-clock bound on planning (every policy of auto together)

    def __post_init__(self) -> None:
        """A negative margin planned above the budget, a margin of 1 for nothing; a tier
        misspelled was silently never used."""
        if not 0 <= self.margin < 1:
            raise ConfigError(
                f"Options(margin={self.margin!r}): the share of the budget kept free must be in "
                "[0, 1), e.g. margin=0.1"
            )
        unknown = [t for t in self.tiers if t not in ("host", "disk", "remote")]
        if unknown:
            raise ConfigError(
                f"Options(tiers={self.tiers!r}): unknown tier(s) {unknown}; use 'host', 'disk' "
                "or 'remote'"
            )


@dataclass
class Choice:
    plan: Plan
    result: SimResult
    plan_s: float = 0.0  # seconds spent choosing it
    # what ``choose`` compared to pick it, by policy (the very objects: one source for reports)
    considered: dict[str, Choice] = field(default_factory=dict, repr=False, compare=False)

    def meets(self, budget: int) -> bool:
        return self.result.peak_bytes <= budget


class _Clock:
    """A deadline shared by the policies of one ``choose``/``plan_all`` call."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.deadline = self.start + seconds

    def out(self) -> bool:
        return time.monotonic() > self.deadline

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _tiers(profile: Profile, opts: Options) -> tuple[str, ...]:
    """The tiers a plan may use: those allowed, the remote one only where its channels were
    measured (a pool was given)."""
    ok = ("host", "disk", "remote") if profile.bandwidth.remote else ("host", "disk")
    return tuple(t for t in opts.tiers if t in ok)


def evaluate(profile: Profile, plan: Plan, opts: Options) -> Choice:
    """``plan`` made canonical and simulated, with the peak it reaches when its writes stall
    (:func:`simulate_worst`): a budget holds whatever the timing of the copies."""
    resolve_codecs(profile, plan, allow_lossy=opts.allow_lossy)
    _canonical(profile, plan)
    return Choice(plan, simulate_worst(profile, plan))


def _canonical(profile: Profile, plan: Plan) -> None:
    """Drop choices with no effect: "+codec" where no codec pays; unified host without a codec;
    selective recompute of a unit that has no recorded operators."""
    with_codec = {t.unit for t in profile.tensors if plan.codecs.get(t.index)}
    selective = {u.name for u in profile.units if u.selective and u.recomputable}
    for unit, a in list(plan.actions.items()):
        if a.compress and unit not in with_codec:
            a = UnitAction(a.mode, part=a.part)
        if a.mode == Mode.HOST and not a.compress and profile.unified:
            a = UnitAction(Mode.KEEP)
        if a.mode == Mode.SELECTIVE and unit not in selective:
            a = UnitAction(Mode.KEEP)
        plan.actions[unit] = a


def _plan(name: str, actions: dict[str, UnitAction]) -> Plan:
    return Plan(name, dict(actions))


def _swap_tier(profile: Profile, opts: Options) -> str:
    """The one tier of the whole-model baselines (swap_all, capuchin, flashneuron): a local one;
    remote only where it is the only tier allowed (the finer policies weigh it per unit)."""
    tiers = _tiers(profile, opts)
    if not tiers:
        raise ConfigError(
            "no offload tier allowed: pass tiers=('host', 'disk') or a subset "
            "('remote' needs a measured remote pool: tt.offload(budget=..., remote=pool))"
        )
    local = tuple(t for t in tiers if t != "remote") or tiers
    if profile.unified:
        return "disk" if "disk" in local else local[0]
    return "host" if "host" in local and profile.host_budget is None else local[-1]


def _candidates(profile: Profile, opts: Options, unit) -> list[UnitAction]:
    out = [UnitAction(Mode.KEEP)]
    for tier in _tiers(profile, opts):
        mode = Mode(tier)
        if not (profile.unified and tier == "host"):
            out.append(UnitAction(mode))
        if tier != "remote":  # no codec on the remote tier
            out.append(UnitAction(mode, compress=True))
    if unit.recomputable:
        out.append(UnitAction(Mode.RECOMPUTE))
    if opts.fine:
        out += _finer(profile, opts, unit)
    return out


_MATMULS = (
    "mm.",
    "addmm.",
    "bmm.",
    "baddbmm.",
    "matmul.",
    "linear.",
    "convolution.",
    "_scaled_dot",
)


def selective_menu(profile: Profile, unit, levels: int = 4) -> list[frozenset[int]]:
    """Operator sets to recompute in ``unit``, each a Pareto choice of cache bytes vs rerun time.

    Operators that are dear to rerun per byte of output are cached first (matmuls usually), the
    cheap ones recomputed (norms, activation functions, elementwise ops): the cached bytes grow
    along that order while the rerun time falls. A prefix of that order is kept for each of
    ``levels`` cache sizes between nothing and what keeping the unit's saved tensors costs (more
    cached than that is never better than keeping); PyTorch's usual policy (cache the matmuls,
    recompute the rest) is added beside them.
    """
    if not (unit.selective and unit.recomputable and unit.ops):
        return []
    keep_bytes = sum(t.nbytes for t in profile.tensors_of(unit.name))
    ops = [o for o in unit.ops if not o.view and not o.pinned]  # what may be cached
    order = sorted(ops, key=lambda o: (-(o.seconds / max(o.out_bytes, 1)), o.index))
    every = frozenset(o.index for o in unit.ops)
    menu: list[frozenset[int]] = []
    cached: list[int] = []
    size = 0
    targets = [keep_bytes * (k + 1) / (levels + 1) for k in range(levels)]
    for o in order:
        if size + o.out_bytes > keep_bytes:
            break
        cached.append(o.index)
        size += o.out_bytes
        while targets and size >= targets[0]:
            targets.pop(0)
            menu.append(every - frozenset(cached))
    menu.append(every - frozenset(cached))  # the largest cache still below keeping
    mm = frozenset(o.index for o in ops if any(k in o.name for k in _MATMULS))
    if sum(o.out_bytes for o in ops if o.index in mm) < keep_bytes:
        menu.append(every - mm)
    out: list[frozenset[int]] = []
    for m in menu:
        if m not in out and m != every:
            out.append(m)
    return out


def partial_menu(profile: Profile, unit, levels: tuple[float, ...] = (1 / 3, 2 / 3)) -> list:
    """Tensor ordinals to swap in ``unit``: its largest tensors first, up to each share of its
    saved bytes (the rest stay; the simulator says whether the saved transfer time pays)."""
    ts = profile.tensors_of(unit.name)
    if len(ts) < 2:
        return []
    total = sum(t.nbytes for t in ts)
    order = sorted(range(len(ts)), key=lambda k: (-ts[k].nbytes, k))
    menu, chosen, size = [], [], 0
    for share in levels:
        while size < share * total and len(chosen) < len(ts) - 1:
            k = order[len(chosen)]
            chosen.append(k)
            size += ts[k].nbytes
        part = frozenset(chosen)
        if part and part not in menu:
            menu.append(part)
    return menu


def _finer(profile: Profile, opts: Options, unit) -> list[UnitAction]:
    out = [UnitAction(Mode.SELECTIVE, part=m) for m in selective_menu(profile, unit)]
    tier = None
    tiers = _tiers(profile, opts)
    local = tuple(t for t in tiers if t != "remote")
    if local:
        tier = "disk" if profile.unified and "disk" in local else local[0]
    parts = partial_menu(profile, unit)
    if tier and not (profile.unified and tier == "host"):
        out += [UnitAction(Mode(tier), part=p) for p in parts]
    if "remote" in tiers:
        out += [UnitAction(Mode.REMOTE, part=p) for p in parts]
    return out


# ------------------------------------------------------------------ heuristics
def keep(profile: Profile, budget: int, opts: Options) -> Choice:
    return evaluate(profile, _plan("keep", {u.name: UnitAction() for u in profile.units}), opts)


def swap_all(profile: Profile, budget: int, opts: Options) -> Choice:
    mode = Mode(_swap_tier(profile, opts))
    actions = {u.name: UnitAction(mode) for u in profile.units}
    return evaluate(profile, _plan("swap_all", actions), opts)


def recompute_all(profile: Profile, budget: int, opts: Options) -> Choice:
    actions = {
        u.name: UnitAction(Mode.RECOMPUTE if u.recomputable else Mode.KEEP) for u in profile.units
    }
    return evaluate(profile, _plan("recompute_all", actions), opts)


def _greedy(
    profile: Profile,
    budget: int,
    opts: Options,
    name: str,
    start: dict[str, UnitAction],
    options: Callable[[str], list[UnitAction]],
) -> Choice:
    """From ``start``, take the change with most bytes saved per second added until under budget."""
    actions = dict(start)
    best = evaluate(profile, _plan(name, actions), opts)
    while best.result.peak_bytes > budget:
        pick, pick_score, pick_choice = None, -math.inf, None
        for u in profile.units:
            if actions[u.name].mode != Mode.KEEP:
                continue
            for a in options(u.name):
                trial = evaluate(profile, _plan(name, {**actions, u.name: a}), opts)
                saved = best.result.peak_bytes - trial.result.peak_bytes
                cost = max(trial.result.step_s - best.result.step_s, 1e-6)
                # a change that frees nothing alone may enable the next one (a read-ahead
                # window shifts): take the cheapest of those when nothing frees bytes
                score = saved / cost if saved > 0 else (-1e12 * cost if saved == 0 else -math.inf)
                if score > pick_score:
                    pick, pick_score, pick_choice = (u.name, a), score, trial
        if pick is None or pick_choice is None:
            break  # nothing left that lowers the peak
        actions[pick[0]] = pick[1]
        best = pick_choice
    return best


def capuchin(profile: Profile, budget: int, opts: Options) -> Choice:
    tier = Mode(_swap_tier(profile, opts))
    units = {u.name: u for u in profile.units}

    def options(name: str) -> list[UnitAction]:
        out = [UnitAction(tier)] if not (profile.unified and tier == Mode.HOST) else []
        if units[name].recomputable:
            out.append(UnitAction(Mode.RECOMPUTE))
        return out

    start = {u.name: UnitAction() for u in profile.units}
    if not (profile.unified and tier == Mode.HOST):  # first: every swap whose transfer hides
        start = _hidden_swaps(profile, budget, opts, "capuchin", start, [UnitAction(tier)])
    return _greedy(profile, budget, opts, "capuchin", start, options)


def _hidden_swaps(
    profile: Profile,
    budget: int,
    opts: Options,
    name: str,
    actions: dict[str, UnitAction],
    tries: list[UnitAction],
) -> dict[str, UnitAction]:
    """In forward order (longest reuse distance first), the first of ``tries`` that costs no time."""
    actions = dict(actions)
    current = evaluate(profile, _plan(name, actions), opts)
    slack = 1e-3 * max(current.result.step_s, 1e-9)
    for u in profile.units:
        if current.result.peak_bytes <= budget:
            break
        if not profile.tensors_of(u.name):
            continue
        for a in tries:
            trial = evaluate(profile, _plan(name, {**actions, u.name: a}), opts)
            if trial.result.step_s <= current.result.step_s + slack:
                actions[u.name], current = a, trial
                break
    return actions


def flashneuron(profile: Profile, budget: int, opts: Options) -> Choice:
    tier = Mode(_swap_tier(profile, opts))
    raw_ok = not (profile.unified and tier == Mode.HOST)
    tries = ([UnitAction(tier)] if raw_ok else []) + [UnitAction(tier, compress=True)]
    start = {u.name: UnitAction() for u in profile.units}
    actions = _hidden_swaps(profile, budget, opts, "flashneuron", start, tries)

    def options(name: str) -> list[UnitAction]:
        return ([UnitAction(tier)] if raw_ok else []) + [UnitAction(tier, compress=True)]

    return _greedy(profile, budget, opts, "flashneuron", actions, options)


def fine(profile: Profile, budget: int, opts: Options, clock: _Clock | None = None) -> Choice:
    """Greedy over every unit's full menu (swap in part, selective and full recompute, ...)
    until the budget is met, then hill climbing under it; see the module docstring."""
    clock = clock or _Clock(opts.plan_seconds)
    cands = {u.name: _candidates(profile, opts, u) for u in profile.units}
    actions = {u.name: UnitAction() for u in profile.units}
    best = evaluate(profile, _plan("fine", actions), opts)
    while best.result.peak_bytes > budget and not clock.out():
        pick, pick_score = None, -math.inf
        for name, menu in cands.items():
            for a in menu:
                if a == actions[name]:
                    continue
                trial = evaluate(profile, _plan("fine", {**actions, name: a}), opts)
                saved = best.result.peak_bytes - trial.result.peak_bytes
                if saved <= 0:
                    continue
                score = saved / max(trial.result.step_s - best.result.step_s, 1e-6)
                if score > pick_score:
                    pick, pick_score = (name, a, trial), score
        if pick is None:
            break  # nothing left that lowers the peak
        actions[pick[0]], best = pick[1], pick[2]
    return _climb(profile, budget, opts, "fine", actions, best, cands, clock)


def _climb(profile, budget, opts, name, actions, best, cands, clock) -> Choice:
    """Take the single change that makes the plan fastest while it stays under the budget,
    until no change helps (or the clock runs out)."""
    if not best.meets(budget):
        return best
    actions = dict(actions)
    while not clock.out():
        pick, target = None, best.result.step_s * (1 - 1e-4)
        for unit, menu in cands.items():
            for a in menu:
                if a == actions[unit]:
                    continue
                trial = evaluate(profile, _plan(name, {**actions, unit: a}), opts)
                if trial.meets(budget) and trial.result.step_s < target:
                    pick, target = (unit, a, trial), trial.result.step_s
        if pick is None:
            break
        actions[pick[0]], best = pick[1], pick[2]
    return best


# ------------------------------------------------------------------ search
def _fitness(result: SimResult, budget: int) -> float:
    over = max(0, result.peak_bytes - budget) / max(budget, 1)
    return result.step_s * (1.0 + 10.0 * over) + (1e3 * result.step_s if over > 0 else 0.0)


def search(
    profile: Profile,
    budget: int,
    opts: Options,
    seeds: list[Choice] | None = None,
    clock: _Clock | None = None,
) -> Choice:
    """Simulated annealing over per-unit actions, seeded with the heuristics' plans."""
    rng = random.Random(opts.seed)
    if seeds is None:
        seeds = [f(profile, budget, opts) for f in (swap_all, recompute_all, capuchin, flashneuron)]
    names = [u.name for u in profile.units]
    cands = {u.name: _candidates(profile, opts, u) for u in profile.units}
    current = min(seeds, key=lambda c: _fitness(c.result, budget))
    cur_f = _fitness(current.result, budget)
    best, best_f = current, cur_f
    temp0 = 0.05 * max(cur_f, 1e-9)
    deadline = time.monotonic() + opts.search_seconds
    if clock is not None:
        deadline = min(deadline, clock.deadline)
    for i in range(opts.search_iters):
        if time.monotonic() > deadline:
            break
        actions = dict(current.plan.actions)
        for _ in range(1 + (rng.random() < 0.3)):  # one or two units change
            name = rng.choice(names)
            actions[name] = rng.choice(cands[name])
        trial = evaluate(profile, _plan("search", actions), opts)
        f = _fitness(trial.result, budget)
        temp = temp0 * (1.0 - i / opts.search_iters) + 1e-12
        if f < cur_f or rng.random() < math.exp(-(f - cur_f) / temp):
            current, cur_f = trial, f
            if f < best_f:
                best, best_f = trial, f
    best = Choice(Plan("search", dict(best.plan.actions), dict(best.plan.codecs)), best.result)
    return best


HEURISTICS: dict[str, Callable[[Profile, int, Options], Choice]] = {
    "keep": keep,
    "swap_all": swap_all,
    "recompute_all": recompute_all,
    "flashneuron": flashneuron,
    "capuchin": capuchin,
    "fine": fine,
}
GLOBAL = ("keep", "swap_all", "recompute_all", "flashneuron", "capuchin")  # the baselines


def plan_all(profile: Profile, budget: SizeLike, opts: Options | None = None) -> dict[str, Choice]:
    """Every policy's plan for ``budget`` (the search seeded with the others), keyed by name.
    The whole call is bounded by ``opts.plan_seconds``; each choice records its own time."""
    opts = opts or Options()
    b = parse_size(budget, name="budget", allow_zero=False)
    clock = _Clock(opts.plan_seconds)
    out: dict[str, Choice] = {}
    for name, f in HEURISTICS.items():
        if name == "fine" and not opts.fine:
            continue
        t0 = time.monotonic()
        out[name] = fine(profile, b, opts, clock) if name == "fine" else f(profile, b, opts)
        out[name].plan_s = time.monotonic() - t0
    t0 = time.monotonic()
    out["search"] = search(
        profile,
        b,
        opts,
        seeds=[c for k, c in out.items() if k != "keep"],
        clock=clock,
    )
    out["search"].plan_s = time.monotonic() - t0
    return out


def smallest(profile: Profile, opts: Options, choices: list[Choice] = ()) -> Choice:
    """The plan with the lowest predicted peak: among ``choices``, the plans that give every
    unit one action (:func:`_uniform`) and the plan that gives every unit the action with the
    lowest peak it reaches alone.

    Why the uniform plans too: the actions that are lowest alone need not be lowest together.
    Recomputing one layer lowers a peak the other, kept, layers set; recomputing all of them
    can peak above offloading all of them (each rerun brings a whole layer back with its
    temporaries). Without them the fallback of an infeasible re-plan, and the floor a
    ``BudgetError`` names for a single policy, were above a plan the planner had (issue 25)."""
    t0 = time.monotonic()
    uniform = [evaluate(profile, plan, opts) for plan in _uniform(profile, opts)]
    floor = min([_most_conservative(profile, opts), *uniform], key=_lowest)
    floor.plan_s = time.monotonic() - t0
    return min([*choices, floor], key=_lowest)


def _lowest(c: Choice) -> tuple[int, float]:
    return (c.result.peak_bytes, c.result.step_s)


def _uniform(profile: Profile, opts: Options) -> list[Plan]:
    """Every unit on one tier (raw, and with codecs where they pay), and every recomputable
    unit recomputed with the others on the whole-model swap tier (kept when no tier is
    allowed)."""
    plans = []
    for tier in _tiers(profile, opts):
        for compress in (False, True) if tier != "remote" else (False,):
            action = UnitAction(Mode(tier), compress=compress)
            plans.append(_plan(f"all {action.label()}", {u.name: action for u in profile.units}))
    try:
        rest = UnitAction(Mode(_swap_tier(profile, opts)))
    except ConfigError:
        rest = UnitAction()
    rerun = {u.name: UnitAction(Mode.RECOMPUTE) if u.recomputable else rest for u in profile.units}
    return [*plans, _plan("all recompute", rerun)]


def _most_conservative(profile: Profile, opts: Options) -> Choice:
    """Every unit with the action of the lowest peak it reaches alone."""
    most = {}
    for u in profile.units:
        best = None
        for a in _candidates(profile, opts, u):
            if a.mode == Mode.KEEP:
                continue
            single = evaluate(profile, _plan("min", {u.name: a}), opts).result.peak_bytes
            if best is None or single < best[0]:
                best = (single, a)
        most[u.name] = best[1] if best else UnitAction()
    return evaluate(profile, _plan("smallest", most), opts)


def _smallest(profile: Profile, opts: Options, choices: list[Choice]) -> int:
    """The lowest peak any plan reaches: the tried ones and every unit offloaded or recomputed."""
    return smallest(profile, opts, choices).result.peak_bytes


def _remote(choice: Choice) -> bool:
    return any(a.mode == Mode.REMOTE for a in choice.plan.actions.values())


def planning_budget(budget: int, opts: Options) -> int:
    """The budget plans are made for: ``budget`` less ``opts.margin`` (measured bandwidths drift)."""
    if not 0 <= opts.margin < 1:
        raise ConfigError(f"margin must be in [0, 1), got {opts.margin}")
    return int(budget * (1 - opts.margin))


def choose(
    profile: Profile,
    budget: SizeLike,
    policy: str = "auto",
    opts: Options | None = None,
) -> Choice:
    """The plan of ``policy`` for ``budget``; raises :class:`BudgetError` if it does not fit."""
    opts = opts or Options()
    given = parse_size(budget, name="budget", allow_zero=False)
    b = max(1, planning_budget(given, opts))  # a few bytes less the margin: no plan, not 0
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    t0 = time.monotonic()
    if policy == "auto":
        everything = plan_all(profile, b, opts)
        fitting = [c for c in everything.values() if c.meets(b)]
        if fitting:
            # on a tie in time the plan that needs no other machine wins: remote memory is
            # chosen only where it makes the step faster (where its transfers hide and the
            # local tiers' do not)
            best = min(fitting, key=lambda c: (c.result.step_s, _remote(c), c.result.peak_bytes))
            plan = Plan(f"auto:{best.plan.policy}", dict(best.plan.actions), dict(best.plan.codecs))
            return Choice(plan, best.result, time.monotonic() - t0, considered=everything)
        tried = list(everything.values())
    else:
        one = (
            search(profile, b, opts) if policy == "search" else HEURISTICS[policy](profile, b, opts)
        )
        one.plan_s = time.monotonic() - t0
        one.considered = {policy: one}
        if one.meets(b):
            return one
        tried = [one]
    reached = _smallest(profile, opts, tried)
    minimum = int(math.ceil(reached / (1 - opts.margin)))
    own = tried[0].result.peak_bytes if policy != "auto" else reached
    err = BudgetError(
        f"no {policy} plan fits a budget of {format_size(given)}: the smallest peak this model "
        f"reaches is {format_size(reached)} (policy {policy!r}, {opts.margin:.0%} margin). Raise "
        f"the budget to at least {format_size_up(minimum)}"
        + policy_tail(policy, own, reached, int(math.ceil(own / (1 - opts.margin)))),
        budget=given,
        minimum=minimum,
    )
    err.policy_peak = own  # what ``policy`` itself reached (the runtime words the error again)
    raise err


def policy_tail(policy: str, own: int, reached: int, needs: int) -> str:
    """The end of a ``BudgetError`` whose minimum is the model's floor ``reached`` over every
    plan. Why: where ``policy``'s own peak ``own`` is above it (``keep`` always), "raise the
    budget to the minimum, or use auto" was false: that budget alone was refused again with
    ``policy``; it needs ``needs``."""
    if policy == "auto":
        return "."
    if own <= reached:
        return ", or use policy='auto'."
    return (
        f" with policy='auto': policy {policy!r} peaked at {format_size(own)} here, so with it "
        f"the budget must be at least {format_size_up(needs)}."
    )
