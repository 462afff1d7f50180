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
        for _ in range(16):
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


def test_without_trials_the_simulators_choice_runs(tmp_path):
    """A named policy: the plan chosen from the profile runs, no trials."""
    m, x = _mlp(depth=3), torch.randn(512, 512)
    off = runtime.planned_offload(32 * MiB, spill_dir=str(tmp_path), options=FAST, policy="fine")
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
