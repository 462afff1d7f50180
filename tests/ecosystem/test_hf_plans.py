"""Every plan the planner can pick, forced on Hugging Face GPT-2, Llama and BERT (tiny, from
configs) the way a restarted job meets it: through ``tt.offload(budget=..., plan_cache=...)``,
from the first step, trained bit for bit against plain PyTorch (losses, gradients, parameters).

A plan is forced by writing it into the plan cache under the key of the run that reads it: each
model is profiled once (``tt.offload(budget=...)``'s own warm-up, probe and timing passes), then
every policy plans from that profile at half the peak of keeping everything (so each of them moves
or recomputes something), and ``selective`` recomputes every layer per operator. The budget the
runs are measured against is large, so no forced plan is re-planned away.

Issue 23: a recomputed HF decoder layer appended its keys and values to the model's KV cache in
the forward and again in the recompute, so selective recompute crashed in backward
(``aten.slice.Tensor invocation index 4 ... not found in storage``) and full recompute with a
shape mismatch.
"""

from __future__ import annotations

import json

import pytest
import torch

import tensortier as tt
from tensortier.planner.cache import save_cached
from tensortier.planner.policies import POLICIES, Choice, Options, plan_all, selective_menu
from tensortier.planner.profile import Profile
from tensortier.planner.simulator import Mode, Plan, UnitAction, simulate
from tests.ecosystem._hf import KINDS, assert_same_params, batch, block_path, build, twin

FAST = Options(search_iters=60, search_seconds=3, plan_seconds=10)
BUDGET = "1GiB"  # measured against: every forced plan fits, none is re-planned
STEPS = 2
FORCED = (*(p for p in POLICIES if p != "auto"), "selective")


def _run(model, kind: str, ctx=None, steps: int = STEPS) -> tuple[list[float], list]:
    """AdamW steps (dropout seeded): the losses and every step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1234)
    losses, grads = [], []
    for step in range(steps):
        if ctx is None:
            loss = model(**batch(kind, step)).loss
        else:
            with ctx():
                loss = model(**batch(kind, step)).loss
        loss.backward()
        losses.append(loss.item())
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _plans(profile: Profile, layers: list[str]) -> dict[str, Plan]:
    """Each policy's plan at half the peak of keeping everything, and a selective one that
    recomputes every layer per operator (alternately the most and the fewest operators)."""
    keep = simulate(profile, Plan("keep", {}))
    out = {n: c.plan for n, c in plan_all(profile, keep.peak_bytes // 2, FAST).items()}
    units = {u.name: u for u in profile.units}
    out["selective"] = Plan(
        "fine",
        {
            name: UnitAction(Mode.SELECTIVE, part=selective_menu(profile, units[name])[-(i % 2)])
            for i, name in enumerate(layers)
        },
    )
    return out


def _profile(kind: str, base) -> tuple:
    """The plan-cache entry ``tt.offload(budget=...)`` writes after profiling ``kind`` (warm-up,
    probe, two timing passes, one planned step), its profile, and its two layers."""
    opts = dict(budget=BUDGET, spill_dir=str(base), plan_cache=str(base / "plans"), options=FAST)
    off = tt.offload(**opts)
    try:
        _run(build(kind, dropout=0.1), kind, lambda: tt.offload(**opts), steps=5)
        assert off.choice is not None and not off.cached
    finally:
        off.close()
    (path,) = (base / "plans").iterdir()
    data = json.loads(path.read_text())
    profile = Profile.from_dict(data["profile"])
    stack = block_path(build(kind))
    layers = [u.name for u in profile.units if u.name.startswith(stack + ".")]
    assert len(layers) == 2, [u.name for u in profile.units]
    return data, profile, layers


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> dict:
    """Per model: its plan-cache entry, profile, the plan each policy makes, its layers."""
    out = {}
    for kind in KINDS:
        data, profile, layers = _profile(kind, tmp_path_factory.mktemp(f"profile-{kind}"))
        out[kind] = (data, profile, _plans(profile, layers), layers)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", FORCED)
@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_trains_every_hf_model_bit_identical(kind, name, profiled, tmp_path, spill_dir):
    data, profile, plans, layers = profiled[kind]
    plan = plans[name]
    policy = "fine" if name == "selective" else name
    if name == "recompute_all":
        assert all(plan.action(n).mode == Mode.RECOMPUTE for n in layers), plan.to_dict()
    if name == "swap_all":
        assert all(plan.action(n).mode == Mode.DISK for n in layers), plan.to_dict()
    if name == "selective":
        assert all(plan.action(n).mode == Mode.SELECTIVE for n in layers), plan.to_dict()
    cache = tmp_path / "plans"
    save_cached(
        str(cache),
        {**data["key"], "policy": policy},
        profile,
        Choice(plan, simulate(profile, plan)),
        data["shapes"],
        data["overhead_bytes"],
    )
    ref = build(kind, dropout=0.1)  # dropout on: recomputed layers must draw the same masks
    got = twin(ref)
    want_losses, want_grads = _run(ref, kind)
    opts = dict(budget=BUDGET, spill_dir=spill_dir, plan_cache=str(cache), policy=policy)
    off = tt.offload(**opts, options=FAST)
    try:
        losses, grads = _run(got, kind, lambda: tt.offload(**opts, options=FAST))
        assert off.cached and off.replans == 0, "the forced plan did not run from step one"
        assert off.choice.plan.to_dict() == plan.to_dict()
    finally:
        off.close()
    assert losses == want_losses
    assert len(grads) == len(want_grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads)), "gradients differ"
    assert_same_params(got, ref)


def test_the_forced_plans_cover_every_action(profiled):
    """Across the forced plans every kind of action runs on every model: keep, swap (whole and,
    in the finer policies' menus, part), full and selective recompute."""
    for kind, (_, _, plans, _) in profiled.items():
        modes = {a.mode for p in plans.values() for a in p.actions.values()}
        assert {Mode.KEEP, Mode.DISK, Mode.RECOMPUTE, Mode.SELECTIVE} <= modes, (kind, modes)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_kv_cache_is_left_out_only_inside_a_budgeted_training_step(kind, spill_dir):
    """Inside ``with tt.offload(budget=...)`` under autograd the layers run without the KV cache
    (a recomputed layer would append to it twice); outside it, and without autograd (generation,
    evaluation), the model fills its cache as always."""
    model = build(kind)
    b = {k: v for k, v in batch(kind, 0).items() if k != "labels"}
    off = tt.offload(budget=BUDGET, spill_dir=spill_dir, options=FAST)
    try:
        with off:  # the warm-up step
            out = model(**b, use_cache=True)
        out.logits.sum().backward()
        assert out.past_key_values.get_seq_length() == 0
        with torch.no_grad(), off:
            assert (
                model(**b, use_cache=True).past_key_values.get_seq_length()
                == b["input_ids"].shape[1]
            )
        assert (
            model(**b, use_cache=True).past_key_values.get_seq_length() == b["input_ids"].shape[1]
        )
    finally:
        off.close()
    assert model(**b, use_cache=True).past_key_values.get_seq_length() == b["input_ids"].shape[1]
