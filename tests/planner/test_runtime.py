"""The plan running for real: decide callable, checkpoint wrappers, budgets met in measurement."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("tensortier.activations")

from tensortier.planner.policies import Options  # noqa: E402
from tensortier.planner.profiler import plan_units, unit_of  # noqa: E402
from tensortier.planner.runtime import Recompute, planned_offload  # noqa: E402

FAST = Options(search_iters=60, search_seconds=5)


def _mlp(width: int = 256, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def test_plan_units_and_unit_of():
    m = _mlp(depth=3)
    assert list(plan_units(m)) == ["0", "1", "2", "3"]
    assert unit_of("1.0", ["0", "1", "10"]) == "1"
    assert unit_of("10.1", ["0", "1", "10"]) == "10"
    assert unit_of("", ["0"]) == ""


def test_plan_units_open_nested_stacks_but_never_a_block():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # stays inside

    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(Block() for _ in range(3))
            self.norm = nn.LayerNorm(8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = Backbone()
            self.head = nn.Linear(8, 2)

    assert list(plan_units(Model())) == [
        "backbone.emb",
        "backbone.layers.0",
        "backbone.layers.1",
        "backbone.layers.2",
        "backbone.norm",
        "head",
    ]
    stack = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)))
    assert list(plan_units(stack)) == ["0", "1", "2"]  # the root's blocks, not their layers


def test_recompute_wrapper_is_exact_and_removable():
    m = _mlp()
    x = torch.randn(64, 256)
    m(x).sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    rc = Recompute(m, ["0", "2"])
    assert "forward" in m[0].__dict__
    m(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, m.parameters()))
    rc.remove()
    assert "forward" not in m[0].__dict__


@pytest.mark.parametrize("budget", ["1MiB", "64MiB"])
def test_planned_offload_matches_plain_gradients(tmp_path, budget):
    m = _mlp(width=512, depth=4)
    x = torch.randn(512, 512)
    m(x).sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    off = planned_offload(budget, spill_dir=str(tmp_path), options=FAST)
    try:
        for _ in range(6):  # warm-up, probe, 2 timing passes, plan, plan
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
            assert all(torch.equal(a, p.grad) for a, p in zip(ref, m.parameters()))
    except Exception as e:  # a budget below what any plan reaches is a typed error
        from tensortier.errors import BudgetError

        assert isinstance(e, BudgetError) and budget == "1MiB"
        assert e.minimum > 1 << 20
        return
    finally:
        off.close()
    assert off.choice is not None and off.choice.result.peak_bytes <= 64 << 20
    # (the keep peak is RSS on CPU: other tests' freed heap can hide it, so only its presence)
    assert off.profile.meta["timing"] == "keep" and off.profile.keep_peak_bytes is not None
    assert off.profile.offload_step_s > 0  # the second timing pass offloaded everything
    assert (
        len(off.profile.tensors) == 5
    )  # the input, then each ReLU output (the next Linear's input)
    relu = [t for t in off.profile.tensors if t.op.startswith("Relu")]
    assert relu and all(t.zero_frac > 0.3 for t in relu)  # ReLU outputs are sparse
    assert os.listdir(tmp_path) == [] or all(
        not os.listdir(tmp_path / d) for d in os.listdir(tmp_path)
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["2x128x32", "3x96x24"])
def test_measured_peak_under_the_plan_is_within_budget(tmp_path, shape):
    """A fresh subprocess, as in the benchmark: plain peak, profile, then the auto plan measured
    step by step (the highest step's RSS high-water mark above the RSS before it)."""
    pytest.importorskip("tensortier.models.gpt")
    from argparse import Namespace

    from tensortier.bench.planner import _spawn

    args = Namespace(
        seq=128,
        heads=4,
        vocab=512,
        steps=1,
        spill_dir=str(tmp_path),
        threads=0,
        timing_iters=2,
        budget_frac=0.6,
        policies="auto",
        save_profiles=None,
    )
    (row,) = _spawn(args, shape)["rows"]
    assert "error" not in row, row
    assert row["pred_peak_bytes"] <= row["budget_bytes"]
    assert 0 < row["peak_bytes"] <= row["budget_bytes"], row
    assert row["grads_match"] is True  # lossless plan: bit-identical gradients


@pytest.mark.parametrize("codec", ["sparse", "zstd", "lz4"])
def test_codecs_through_the_offloader_keep_gradients_bit_identical(tmp_path, codec):
    from tensortier.activations import Offloader
    from tensortier.tiers.codecs import get_codec

    m = _mlp(width=128, depth=3)
    x = torch.randn(64, 128)
    m(x).sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    off = Offloader("disk", spill_dir=str(tmp_path), min_bytes=0, codec=get_codec(codec))
    try:
        with off:
            loss = m(x).sum()
        loss.backward()
    finally:
        off.close()
    assert off.stats.tensors_offloaded > 0
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, m.parameters()))


def test_bench_compares_each_plans_slowdown_over_keep():
    from tensortier.bench.planner import _relative_to_keep

    rows = [
        {"policy": "keep", "pred_step_s": 1.0, "step_s": 2.0},
        {"policy": "swap_all", "pred_step_s": 1.5, "step_s": 2.4},
        {"policy": "auto", "error": "no plan fits"},
    ]
    _relative_to_keep(rows)
    assert rows[1]["pred_slowdown"] == 1.5 and rows[1]["slowdown"] == pytest.approx(1.2)
    assert rows[1]["slowdown_err_pct"] == pytest.approx(25.0)
    assert "slowdown" not in rows[2]


# ---------------------------------------------------------------- RNG, tiers, cache (issue 12 #7)
def _dropout_mlp(width: int = 256, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2)) for _ in range(depth)
    ]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _train(model, x, steps, ctx=None) -> list[torch.Tensor]:
    """SGD steps from seed 1; the losses, then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = model(x).square().mean()
        else:
            with ctx:
                loss = model(x).square().mean()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["auto", "recompute_all"])
def test_dropout_training_is_bit_identical_through_profiling_and_plan(spill_dir, policy):
    """The bandwidth probe used to draw from the global RNG at the first planned step, so
    dropout masks diverged from plain training from there on."""
    x = torch.randn(256, 256)
    plain = _train(_dropout_mlp(), x, 6)
    off = planned_offload("64MiB", spill_dir=spill_dir, policy=policy, options=FAST)
    try:
        planned = _train(_dropout_mlp(), x, 6, off)  # warm-up, probe, 2 timing passes, plan x2
        assert off.choice is not None  # the last two steps ran the plan
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


def test_host_tier_profiles_through_host_not_disk(spill_dir):
    m, x = _mlp(width=256, depth=3), torch.randn(128, 256)
    off = planned_offload("256MiB", to="host", spill_dir=spill_dir, options=FAST)
    try:
        for _ in range(5):
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
            if off.profile is None:  # warm-up and profiling: the tier asked for, no spill files
                assert os.listdir(spill_dir) == []
        assert off.profile.meta["profiled_tier"] == "host"
        assert off.offloader.stats.bytes_offloaded["disk"] == 0
        assert off.offloader.stats.bytes_offloaded["host"] > 0
    finally:
        off.close()


def test_switching_settings_closes_the_replaced_planned_offload(spill_dir):
    from tensortier.errors import ClosedError

    m, x = _mlp(width=128, depth=2), torch.randn(32, 128)
    old = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    with old:  # the warm-up iteration: spill files in a private directory
        loss = m(x).sum()
    loss.backward()
    assert len(os.listdir(spill_dir)) == 1
    new = planned_offload("32MiB", spill_dir=spill_dir, options=FAST)
    assert new is not old
    assert os.listdir(spill_dir) == []  # released now, not whenever the GC gets to it
    with pytest.raises(ClosedError, match="tt.offload"):
        old.__enter__()
    new.close()


@pytest.mark.gpu
def test_cuda_dropout_training_is_bit_identical_through_profiling_and_plan(tmp_path):
    x = torch.randn(256, 256, device="cuda")
    plain = _train(_dropout_mlp().cuda(), x, 6)
    off = planned_offload("64MiB", spill_dir=str(tmp_path), options=FAST)
    try:
        planned = _train(_dropout_mlp().cuda(), x, 6, off)
        assert off.choice is not None and off.profile.meta["profiled_tier"] == "host"
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


def test_budget_holds_a_training_loop_that_steps_adamw(tmp_path):
    """What users run: ``tt.offload(budget=...)`` around the forward of a GPT, then backward and
    ``torch.optim.AdamW.step()`` (whose states appear at the first step, after the warm-up). The
    optimizer's memory is not the offloader's: the planner must still find a plan at half the
    plain peak, and train bit-identically to the same loop without offload. (A planner that
    counted all memory gained since the warm-up as its own buffers raised BudgetError here.)"""
    import tensortier as tt
    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(n_layer=8, n_embd=128, n_head=4, block_size=256, vocab_size=512)
    x, y = random_batch(cfg, 4, 256)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg))
    ref, m = models
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-3) for mod in (ref, m)]
    off = tt.offload(budget="52MiB", spill_dir=str(tmp_path), options=FAST)
    try:
        for _ in range(7):  # warm-up, probe, timing passes, then the plan
            ref(x, y).backward()
            with off:
                loss = m(x, y)
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert off.choice is not None
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))
    finally:
        off.close()
