"""Measured trials: auto runs its short list of plans for real and keeps the fastest measured."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("tensortier.activations")

from tensortier.planner import runtime  # noqa: E402
from tensortier.planner.policies import Options  # noqa: E402
from tensortier.planner.profiler import measured_bound  # noqa: E402
from tensortier.planner.simulator import Mode, Plan, UnitAction  # noqa: E402

FAST = Options(search_iters=60, search_seconds=5)
MiB = 1 << 20


def _key(plan: Plan) -> str:
    d = plan.to_dict()
    return json.dumps([d["actions"], d["codecs"]], sort_keys=True)


def _mlp(width: int = 512, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def slow_first_plan(monkeypatch, off) -> list[str]:
    """The clock the trials read: a step of the first plan run (the simulator's choice) takes
    1 s, of any other 0.1 s. Returns the list that gets that first plan's key."""
    first: list[str] = []
    clock = SimpleNamespace(t=0.0)

    def perf_counter() -> float:
        if not first:  # the first trial runs the simulator's choice
            first.append(_key(off.choice.plan))
        clock.t += 1.0 if _key(off.choice.plan) in first else 0.1
        return clock.t

    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=perf_counter), raising=False)
    return first


def test_measured_trials_overturn_the_simulators_order(tmp_path, monkeypatch):
    """The clock the trials read says the simulator's choice is the slowest plan: the plan that
    runs once the trials are over is another one that was measured, every step's gradients are
    plain training's bit for bit and every step stayed under the budget."""
    import tensortier.planner.trials as trials

    monkeypatch.setattr(trials, "SPREAD", 10.0)  # every plan that fits is on the short list
    m, x = _mlp(), torch.randn(1024, 512)
    m(x).sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    budget = 28 * MiB
    off = runtime.planned_offload(budget, spill_dir=str(tmp_path), options=FAST)
    first = slow_first_plan(monkeypatch, off)
    try:
        for _ in range(20):  # warm-up, probe, timing passes, up to 4 plans x 3 trial steps
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
            if off.choice is not None and not first:
                first.append(_key(off.choice.plan))  # the simulator's choice (no trials ran)
            assert all(torch.equal(a, p.grad) for a, p in zip(ref, m.parameters()))
    finally:
        off.close()
    tried = [r for r in off.profile.passes if r["kind"] == "trial"]
    assert len(tried) >= 2, tried  # the first plan and at least one other ran for real
    assert _key(off.choice.plan) != first[0]
    assert _key(off.choice.plan) in {_key(Plan.from_dict(r["plan"])) for r in tried}
    assert off.choice.plan.policy.startswith("auto:")
    assert max(off.measured_peaks) <= budget and off.replans == 0


@pytest.mark.parametrize("settings", [{"policy": "fine"}, {"trial_plans": 0}])
def test_without_trials_the_simulators_choice_runs(tmp_path, settings):
    """A named policy, or ``tt.offload(budget=..., trial_plans=0)`` (the README's way to turn the
    trials off, which tt.offload refused as an unexpected keyword): the plan chosen from the
    profile runs, no trials."""
    import tensortier as tt

    m, x = _mlp(depth=3), torch.randn(512, 512)
    off = tt.offload(budget=32 * MiB, spill_dir=str(tmp_path), options=FAST, **settings)
    try:
        for _ in range(8):
            with off:
                loss = m(x).sum()
            loss.backward()
    finally:
        off.close()
    assert not [r for r in off.profile.passes if r["kind"] == "trial"]
    assert off.settled


def test_a_trial_is_a_measured_pass_that_bounds_plans_close_to_it(make_profile):
    """A trial's peak bounds its own plan exactly and a plan that keeps one more unit by that
    unit's bytes; the units it recomputed held their tensors only during the rerun, so a plan
    that keeps them is charged their bytes (the bound stays a bound)."""
    p = make_profile(n_units=4, tensor_bytes=MiB, per_unit=2)
    disk = UnitAction(Mode.DISK)
    trial = Plan(
        "fine",
        {"h.0": UnitAction(Mode.KEEP), "h.1": UnitAction(Mode.RECOMPUTE), "h.2": disk, "h.3": disk},
    )
    p.passes = [
        {"kind": "probe", "kept": [], "parts": {}, "tier": "disk", "peak_bytes": 100 * MiB},
        {"kind": "trial", "plan": trial.to_dict(), "peak_bytes": 10 * MiB, "timed_step": False},
    ]
    assert measured_bound(p, trial) == 10 * MiB
    more = Plan("x", {**trial.actions, "h.2": UnitAction(Mode.KEEP)})
    assert measured_bound(p, more) == 12 * MiB
    kept = Plan("x", {**trial.actions, "h.1": UnitAction(Mode.KEEP)})
    assert measured_bound(p, kept) == 12 * MiB


def test_recomputed_units_add_their_inputs_and_one_units_tensors_to_the_bound(make_profile):
    """A recomputed unit's saved tensors live only while it runs (its forward, then its rerun to
    the end of its backward) and units run one at a time: over a pass that offloaded everything,
    a plan recomputing two units is bounded by their inputs and one unit's tensors, not by both
    units' tensors as if they were kept all along."""
    p = make_profile(n_units=4, tensor_bytes=MiB, per_unit=2)  # inputs: a quarter MiB each
    p.passes = [{"kind": "probe", "kept": [], "parts": {}, "tier": "disk", "peak_bytes": 9 * MiB}]
    rc = UnitAction(Mode.RECOMPUTE)
    disk = UnitAction(Mode.DISK)
    plan = Plan("x", {"h.0": UnitAction(Mode.KEEP), "h.1": rc, "h.2": rc, "h.3": disk})
    assert measured_bound(p, plan) == 9 * MiB + 2 * MiB + 2 * (MiB // 4) + 2 * MiB


def _bridged_trials(make_profile, plans: int = 4):
    """Trials as the runtime builds them on a chain whose swaps cost time: the only pass
    offloaded everything (peak 10 MiB), so the measured bound rules out ``fine`` (it keeps two
    units: 14 MiB over a 12.5 MiB limit) although the simulator puts it under the 7.5 MiB
    planning budget and faster than ``swap_all``, the plan that fits; ``keep`` is faster still
    but over the planning budget."""
    from tensortier.planner.policies import Choice, evaluate
    from tensortier.planner.trials import Trials

    p = make_profile(n_units=4, tensor_bytes=MiB, per_unit=2, bw=MiB)
    p.passes = [{"kind": "probe", "kept": [], "parts": {}, "tier": "disk", "peak_bytes": 10 * MiB}]
    opts = Options(margin=0.0)
    disk, keep = UnitAction(Mode.DISK), UnitAction(Mode.KEEP)

    def ev(plan: Plan) -> Choice:
        return evaluate(p, plan, opts)

    def predicted(c: Choice) -> bool:
        return c.result.peak_bytes <= 7.5 * MiB

    def fits(c: Choice) -> bool:
        return predicted(c) and measured_bound(p, c.plan) <= 12.5 * MiB

    units = [f"h.{i}" for i in range(4)]
    first = ev(Plan("auto:swap_all", {u: disk for u in units}))
    fine = ev(Plan("fine", {u: keep if u in ("h.0", "h.1") else disk for u in units}))
    everything = ev(Plan("keep", {u: keep for u in units}))
    first.considered = {"fine": fine, "keep": everything}
    assert fine.result.step_s < first.result.step_s and predicted(fine) and not fits(fine)
    t = Trials(p, first, fits, plans, seconds=100.0, evaluate=ev, predicted=predicted)
    return t, fits, fine


def _run_trials(t, fits, peak_of, seconds_of) -> list:
    """Step the trials to their end with fake peaks and times; the plans they ran, in order."""
    ran = []
    while (c := t.next()) is not None:
        assert fits(c), c.plan  # every plan a trial runs fits when it runs: the budget holds
        ran.append(c)
        t.measured(peak=peak_of(c), seconds=seconds_of(c))
    return ran


def test_bridges_lead_the_trials_to_a_faster_plan_the_measured_bound_ruled_out(make_profile):
    """The cause of auto keeping swap_all at 0.35x on gpt:8x128x4: every plan faster than the
    first was ruled out by a bound loose far from the measured passes, so the first plan was the
    only trial. A bridge (the first plan with one of fine's kept units) fits, and its measured
    peak bounds fine within the limit: fine runs, is measured fastest (a fake clock) and stays.
    The plan the simulator puts over the planning budget (keep) is never a bridge's target."""
    t, fits, fine = _bridged_trials(make_profile)
    times = {"auto:swap_all": 2.0, "toward fine": 1.5, "fine": 1.0}
    ran = _run_trials(t, fits, lambda c: 10 * MiB, lambda c: times[c.plan.policy])
    names = [c.plan.policy for c in ran]
    assert names[:3] == ["auto:swap_all", "toward fine", "fine"]  # then compared in rounds
    kept = {u: a.label() for u, a in ran[1].plan.actions.items()}
    assert kept == {"h.0": "keep", "h.1": "disk", "h.2": "disk", "h.3": "disk"}
    assert _key(t.best().plan) == _key(fine.plan)


def test_a_bridge_measured_high_does_not_open_the_way(make_profile):
    """The bridge's measured peak is what bounds the faster plan: measured 1 MiB higher than the
    passes before it, fine stays over the limit, the trials try no plan that does not fit, and
    the fastest plan measured of those that ran stays."""
    t, fits, _ = _bridged_trials(make_profile)
    peaks = {"auto:swap_all": 10 * MiB, "toward fine": 11 * MiB}
    times = {"auto:swap_all": 2.0, "toward fine": 1.5}
    ran = _run_trials(t, fits, lambda c: peaks[c.plan.policy], lambda c: times[c.plan.policy])
    assert {c.plan.policy for c in ran} == {"auto:swap_all", "toward fine"}
    assert t.best().plan.policy == "toward fine"


def test_plans_are_compared_in_interleaved_rounds_under_a_drifting_load(make_profile):
    """On a shared machine the load drifts: here every step takes 0.1 s longer than the one
    before. ``fine`` (predicted fastest, so run first) truly takes 1.0 s, ``swap_all`` 0.9 s.
    Timed each in its own window (the old trials: two steps of one, then two of the other, the
    least step kept) fine won by the drift alone; after one step each, interleaved rounds in
    ABBA order weigh the drift on both alike and swap_all, the faster, stays."""
    from tensortier.planner.policies import evaluate
    from tensortier.planner.trials import Trials

    p = make_profile(n_units=4, tensor_bytes=MiB, per_unit=2, bw=MiB)
    disk, keep = UnitAction(Mode.DISK), UnitAction(Mode.KEEP)
    units = [f"h.{i}" for i in range(4)]
    first = evaluate(p, Plan("auto:swap_all", {u: disk for u in units}), Options(margin=0.0))
    fine = Plan("fine", {u: keep if u in ("h.0", "h.1") else disk for u in units})
    first.considered = {"fine": evaluate(p, fine, Options(margin=0.0))}
    t = Trials(p, first, lambda c: True, plans=4, seconds=100.0)
    cost = {"auto:swap_all": 0.9, "fine": 1.0}
    step = [0]

    def seconds_of(c) -> float:
        step[0] += 1
        return cost[c.plan.policy] + 0.1 * (step[0] - 1)

    ran = _run_trials(t, lambda c: True, lambda c: MiB, seconds_of)
    assert t.best().plan.policy == "auto:swap_all"
    names = [c.plan.policy for c in ran]
    assert names[:2] == ["fine", "auto:swap_all"]  # one step each, the fastest predicted first
    assert names.count("fine") == names.count("auto:swap_all")  # as many steps each
