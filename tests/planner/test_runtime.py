"""The plan running for real: decide callable, checkpoint wrappers, budgets met in measurement."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from torch import nn

pytest.importorskip("tensortier.activations")

from tensortier.planner.policies import Options  # noqa: E402
from tensortier.planner.profiler import plan_units, unit_of  # noqa: E402
from tensortier.planner.runtime import Recompute, planned_offload  # noqa: E402
from tests._helpers import run_fresh

FAST = Options(search_iters=60, search_seconds=5)
# The twin-GPT loops test what the runtime counts as its own memory, not the policies: without
# the "fine" policy's hill climb (tests/planner/test_fine.py tests it) they plan in half the
# time. Fewer candidate actions can only raise the lowest peak a plan reaches, so a runtime that
# charged the optimizer's or the user's memory to itself still fails to plan here.
COARSE = replace(FAST, fine=False)


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


def test_plan_units_see_through_data_parallel_and_compile_wrappers():
    """DDP/DataParallel (``module``) and torch.compile (``_orig_mod``) add no layer: planned as
    the root, the wrapper made the whole model one unit (keep, swap or recompute it whole)."""
    m = _mlp(depth=3)
    assert list(plan_units(nn.DataParallel(m))) == [f"module.{i}" for i in range(4)]
    assert list(plan_units(torch.compile(m))) == [f"_orig_mod.{i}" for i in range(4)]
    both = nn.DataParallel(torch.compile(m))
    assert list(plan_units(both)) == [f"module._orig_mod.{i}" for i in range(4)]


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
    users = m[1].forward = lambda x, _f=m[1].forward: _f(x)  # a user's own wrapper stays
    Recompute(m, ["1"]).remove()
    assert m[1].__dict__["forward"] is users


def _bn_mlp(width: int = 64, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
        for _ in range(depth)
    ]
    return nn.Sequential(*layers, nn.Linear(width, 1))


@pytest.mark.parametrize("selective", [False, True], ids=["whole", "selective"])
def test_a_recomputed_batchnorm_moves_its_running_stats_once(selective):
    """Checkpoint reruns a unit's forward in backward: BatchNorm in train mode updated its
    running mean, variance and batch count again there, so every planned step with a recomputed
    BatchNorm moved them twice (the gradients stayed equal: they use the batch's statistics)."""
    x = torch.randn(32, 64)

    def step(wrap: bool) -> list[torch.Tensor]:
        m = _bn_mlp()
        sel = {n: frozenset(range(16)) for n in ("0", "2")} if selective else None
        rc = Recompute(m, [] if selective else ["0", "2"], sel) if wrap else None
        for _ in range(2):
            m(x).square().mean().backward()
        if rc is not None:
            rc.remove()
        return [p.grad for p in m.parameters()] + list(m.buffers())

    assert all(torch.equal(a, b) for a, b in zip(step(False), step(True), strict=True))


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
    # the probe and two timing passes, each measured; the two planned steps checked too
    assert [r["kind"] for r in off.profile.passes][0] == "probe"
    profiled = [r for r in off.profile.passes if r["kind"] != "trial"]  # auto's trials: passes too
    assert len(profiled) == 3 and all(r["step_s"] > 0 for r in profiled)
    assert len(off.measured_peaks) == 2
    assert (
        len(off.profile.tensors) == 5
    )  # the input, then each ReLU output (the next Linear's input)
    relu = [t for t in off.profile.tensors if t.op.startswith("Relu")]
    assert relu and all(t.zero_frac > 0.3 for t in relu)  # ReLU outputs are sparse
    assert os.listdir(tmp_path) == [] or all(
        not os.listdir(tmp_path / d) for d in os.listdir(tmp_path)
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt:3x192x16", "llama:3x128x16"])
def test_every_step_from_the_first_is_under_the_budget(tmp_path, model):
    """A fresh subprocess, as in the benchmark: plain peak, then ``tt.offload(budget=...)`` from
    its first step (warm-up, probe, timing passes, plan), every step's RSS high-water mark above
    the RSS before it plus what its earlier steps left resident, against the budget."""
    from argparse import Namespace

    from benchmarks.planner import _spawn

    args = Namespace(
        seq=128,
        heads=4,
        vocab=512,
        steps=1,
        spill_dir=str(tmp_path),
        timing_iters=2,
        budget_fracs="0.6",
        policies="auto",
        plan_seconds=10.0,
    )
    (b,) = _spawn(args, model)["budgets"]
    assert "error" not in b, b
    (row,) = b["rows"]
    budget = row["budget_bytes"]
    assert len(b["profiling_peaks"]) >= 5  # warm-up, probe, 2 timing passes, first plan step
    assert all(0 < p <= budget for p in b["profiling_peaks"]), (b["profiling_peaks"], budget)
    assert row["meets_budget"] and row["peak_bytes"] <= budget, row
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


def test_bench_summary_finds_the_fastest_policy_that_meets_the_budget():
    from benchmarks.planner import summarize

    def row(policy, step, meets):
        return {"policy": policy, "step_s": step, "meets_budget": meets, "peak_bytes": 1,
                "pred_peak_bytes": 1, "pred_step_s": step}  # fmt: skip

    rows = [row("keep", 1.0, False), row("capuchin", 2.0, True), row("recompute_all", 2.2, True),
            row("fine", 1.5, True), row("auto", 1.52, True)]  # fmt: skip
    s = summarize(rows)
    assert s["fastest_meeting"] == "fine" and s["best_global"] == "capuchin"
    assert s["auto_within_3pct"] and s["auto_speedup_vs_best_global"] == pytest.approx(2 / 1.52)
    assert s["max_pred_err_pct"] == 0
    # each plan's slowdown over keep, predicted and measured: host drift cancels out
    rows[-1]["pred_step_s"] = 1.6  # predicted 1.6x keep, measured 1.52x
    assert summarize(rows)["max_slowdown_err_pct"] == pytest.approx(100 * (1.6 - 1.52) / 1.52)


def test_bench_summary_reports_issue_27s_five_percent_bar():
    """A cell where auto is 1.04x the fastest misses 3% but meets the issue's 5% bar; the run's
    target counts it, and a cell without an auto plan is a miss."""
    from benchmarks.planner import summarize, target

    def row(policy, step):
        return {"policy": policy, "step_s": step, "meets_budget": True, "peak_bytes": 1,
                "pred_peak_bytes": 1, "pred_step_s": step}  # fmt: skip

    near = {"model": "m", "frac": 0.5, **summarize([row("fine", 1.0), row("auto", 1.04)])}
    far = {"model": "m", "frac": 0.7, **summarize([row("fine", 1.0), row("auto", 1.06)])}
    assert near["auto_within_5pct"] and not near["auto_within_3pct"]
    assert not far["auto_within_5pct"]
    none = {"model": "m", "frac": 0.35, "error": "no auto plan fits"}
    goal = target([none, near, far])
    assert goal["cells"] == 3 and goal["auto_within_5pct"] == 1
    assert goal["misses"] == ["m@0.35", "m@0.7"]


# ---------------------------------------------------------------- RNG, tiers, cache (issue 12 #7)
def _dropout_mlp(width: int = 256, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2)) for _ in range(depth)
    ]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _train(model, x, steps, ctx=None, backward=contextlib.nullcontext) -> list[torch.Tensor]:
    """SGD steps from seed 1, each ``backward()`` inside ``backward()``; the losses, then the
    parameters."""
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
        with backward():
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


class _WithUnused(nn.Module):
    """A model with a parameter no backward reaches (a head another task trains)."""

    def __init__(self):
        super().__init__()
        self.body = _dropout_mlp(depth=1)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def _under_compiled_autograd(budget: str, spill_dir: str, monkeypatch, backward, device) -> None:
    """Six steps through warm-up, profiling and trials to the plan, each ``backward()`` inside
    ``backward()``: compiled autograd, as torchtitan's option turns it on. The model has a
    parameter no backward reaches: the count learns that from the first backward."""
    from tensortier._backward_end import in_compiled_autograd

    x = torch.randn(256, 256, device=device)
    plain = _train(_WithUnused().to(device), x, 6)
    off = planned_offload(budget, spill_dir=spill_dir, options=FAST)
    ends, backward_end = [], off._backward_end
    monkeypatch.setattr(
        off, "_backward_end", lambda: (ends.append(in_compiled_autograd()), backward_end())
    )
    try:
        planned = _train(_WithUnused().to(device), x, 6, off, backward=backward)
        assert off.choice is not None  # through warm-up, profiling and trials to the plan
        passes = off._profiler._passes if off._profiler is not None else []
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
    assert len(ends) >= 4 and all(ends), ends  # read inside each backward, not at the next forward
    assert passes and all(p.end is not None and p.end.ended for p in passes[1:])  # after the probe


def test_budget_under_compiled_autograd_is_bit_identical_and_metered_in_backward(
    spill_dir, monkeypatch
):
    """Compiled autograd (``torch._dynamo.compiled_autograd``) traced the planner's gradient
    hook with dynamo, which refused its ``queue_callback``: every planned backward crashed. The
    hooks run eagerly now, and the step's peak is read when the last parameter gradient
    accumulates (a callback queued there never runs under compiled autograd), not at the next
    forward, after the optimizer's step. The budget is generous because on the CPU it counts
    the process's RSS, and dynamo compiles the backward inside the first offloaded step."""
    from torch._dynamo import compiled_autograd

    def backward():  # the eager backend: no C++ build
        return compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager"))

    _under_compiled_autograd("1GiB", spill_dir, monkeypatch, backward, "cpu")


def test_host_tier_profiles_through_host_not_disk(spill_dir):
    m, x = _mlp(width=256, depth=3), torch.randn(128, 256)
    off = planned_offload("256MiB", tier="host", spill_dir=spill_dir, options=FAST)
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


def test_switching_settings_twice_closes_the_oldest_planned_offload(spill_dir):
    from tensortier.errors import ClosedError

    m, x = _mlp(width=128, depth=2), torch.randn(32, 128)
    old = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    with old:  # the warm-up iteration: spill files in a private directory
        loss = m(x).sum()
    loss.backward()
    assert len(os.listdir(spill_dir)) == 1
    second = planned_offload("32MiB", spill_dir=spill_dir, options=FAST)
    assert second is not old and len(os.listdir(spill_dir)) == 1  # two settings are kept
    assert planned_offload("64MiB", spill_dir=spill_dir, options=FAST) is old
    third = planned_offload("16MiB", spill_dir=spill_dir, options=FAST)  # 32MiB is the oldest
    assert planned_offload("64MiB", spill_dir=spill_dir, options=FAST) is old
    with pytest.raises(ClosedError, match="tt.offload"):
        second.__enter__()
    newest = planned_offload("8MiB", spill_dir=spill_dir, options=FAST)  # now 16MiB is
    with pytest.raises(ClosedError, match="tt.offload"):
        third.__enter__()
    newest.close()
    planned_offload("4MiB", spill_dir=spill_dir, options=FAST).close()  # and then 64MiB
    assert os.listdir(spill_dir) == []  # released now, not whenever the GC gets to it
    with pytest.raises(ClosedError, match="tt.offload"):
        old.__enter__()


def test_a_gan_with_a_budget_per_model_plans_both_bit_for_bit(spill_dir):
    """A generator and a discriminator trained in turn, each under its own budget: the second
    ``tt.offload(budget=...)`` closed the first every step, so neither ever reached a plan and
    every step offloaded everything, with no warning."""
    import tensortier as tt

    g_model, d_model = _mlp(width=128, depth=3), _mlp(width=96, depth=2)
    g_ref, d_ref = _mlp(width=128, depth=3), _mlp(width=96, depth=2)
    gen = torch.Generator().manual_seed(0)
    offs = []
    for _ in range(7):
        x, y = torch.randn(64, 128, generator=gen), torch.randn(64, 96, generator=gen)
        for model, ref, inp, budget in ((g_model, g_ref, x, "48MiB"), (d_model, d_ref, y, "40MiB")):
            off = tt.offload(budget=budget, spill_dir=spill_dir, options=FAST)
            offs.append(off)
            with off:
                loss = model(inp).square().mean()
            loss.backward()
            ref(inp).square().mean().backward()
    for model, ref in ((g_model, g_ref), (d_model, d_ref)):
        assert all(
            torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())
        )
    g_off, d_off = offs[-2], offs[-1]
    assert len({id(o) for o in offs}) == 2  # the same two objects every step
    assert g_off.choice is not None and d_off.choice is not None  # each reached its plan
    g_off.close()
    d_off.close()


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


def test_a_model_on_a_gpu_that_is_not_current_is_refused_naming_set_device():
    """The planner meters, times and budgets the current CUDA device: a model on cuda:1 with
    cuda:0 current was measured on an idle GPU (peaks ~0, every plan fits, nothing enforced)."""
    from tensortier.errors import ConfigError
    from tensortier.planner.runtime import _check_metered_device

    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    _check_metered_device([cuda0, cpu, cuda0], current=cuda0)  # its own device, CPU weights
    with pytest.raises(ConfigError, match=r"on cuda:1 .*set_device\(1\)"):
        _check_metered_device([cuda1], current=cuda0)
    with pytest.raises(ConfigError, match="several GPUs"):
        _check_metered_device([cuda0, cuda1], current=cuda0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_cuda_budget_for_a_model_on_another_gpu_is_refused_then_plans_after_set_device(tmp_path):
    from tensortier.errors import ConfigError

    dev = torch.device("cuda", 1)
    x = torch.randn(256, 256, device=dev)
    torch.cuda.set_device(0)
    off = planned_offload("64MiB", spill_dir=str(tmp_path), options=FAST)
    try:
        with pytest.raises(ConfigError, match=r"set_device\(1\)"):
            _train(_dropout_mlp().to(dev), x, 1, off)
    finally:
        off.close()
    plain = _train(_dropout_mlp().to(dev), x, 6)
    torch.cuda.set_device(1)
    try:
        off = planned_offload("64MiB", spill_dir=str(tmp_path), options=FAST)
        try:
            planned = _train(_dropout_mlp().to(dev), x, 6, off)
            assert off.choice is not None
        finally:
            off.close()
    finally:
        torch.cuda.set_device(0)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
def test_a_budget_without_a_tier_plans_with_the_disk_on_a_cpu_only_machine(spill_dir):
    """Issue 26 #4: the offloader's default tier is host, but host copies of CPU tensors free
    nothing; ``tt.offload(budget=...)`` without ``tier=`` plans over host then disk ("auto"),
    which on a CPU-only machine is the disk tier alone, profiled through disk."""
    import tensortier as tt

    m, x = _mlp(width=256, depth=3), torch.randn(128, 256)
    off = tt.offload(budget="256MiB", spill_dir=spill_dir, options=FAST)
    try:
        assert off.config.tier == "auto" and off.config.options.tiers == ("disk",)
        with off:
            loss = m(x).sum()
        loss.backward()
        warm = off._warm
        assert warm.tier == "disk" and warm.stats.bytes_offloaded["disk"] > 0
        assert warm.stats.bytes_offloaded["host"] == 0
    finally:
        off.close()


def _twin_gpts():
    """A batch and two identical GPTs (seed 0): one trained plainly, one under the offload."""
    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(n_layer=8, n_embd=128, n_head=4, block_size=256, vocab_size=512)
    x, y = random_batch(cfg, 4, 256)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg))
    return x, y, *models


def test_budget_holds_a_training_loop_that_steps_adamw(tmp_path):
    """What users run: ``tt.offload(budget=...)`` around the forward of a GPT, then backward and
    ``torch.optim.AdamW.step()`` (whose states appear at the first step, after the warm-up). The
    optimizer's memory is not the offloader's: the planner must still find a plan at half the
    plain peak, and train bit-identically to the same loop without offload. (A planner that
    counted all memory gained since the warm-up as its own buffers raised BudgetError here.)"""
    import tensortier as tt

    x, y, ref, m = _twin_gpts()
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-3) for mod in (ref, m)]
    off = tt.offload(budget="52MiB", spill_dir=str(tmp_path), options=COARSE)
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


def test_a_planned_step_over_the_budget_plans_again_with_a_wider_margin(spill_dir):
    """The first planned steps are measured (forward to the end of backward); one over the
    budget re-plans at once with the margin widened by the excess: a budget is a promise."""
    m, x = _mlp(width=512, depth=4), torch.randn(512, 512)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        for _ in range(5):  # warm-up, probe, 2 timing passes, first planned step
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
        assert off.measured_peaks and off.replans == 0
        before = off.margin
        off.measured_peaks.append(2 * (64 << 20))  # as if the step had peaked at twice it
        off._over = True
        m.zero_grad(set_to_none=True)
        warned = pytest.warns(UserWarning, match=r"peaked at 128MiB, over the 64MiB budget")
        with warned, off:
            loss = m(x).sum()
        loss.backward()
    finally:
        off.close()
    assert off.replans == 1 and off.margin >= 1 - (1 - before) / 2
    assert off.choice.result.peak_bytes <= (1 - off.margin) * (64 << 20)
    assert len(off._buckets) == 1  # the same inputs: no second plan for a "new" bucket


def test_an_infeasible_replan_mid_training_warns_and_keeps_the_most_conservative_plan(spill_dir):
    """Once training runs, a step over the budget never breaks the user's loop: when no plan
    fits the widened margin, the plan with the lowest predicted peak runs and a warning names
    the measured peak and the budget (BudgetError is for the first plan only). Gradients stay
    those of plain training."""
    m, x = _mlp(width=512, depth=4), torch.randn(512, 512)
    m(x).sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        for _ in range(5):  # warm-up, probe, 2 timing passes, first planned step
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
        assert off.measured_peaks and off.replans == 0
        off.measured_peaks.append(100 * (64 << 20))  # as if it had peaked at 100x the budget
        off._over = True
        for _ in range(2):  # the loop goes on
            m.zero_grad(set_to_none=True)
            with pytest.warns(UserWarning, match=r"peaked at 6.25GiB, over the 64MiB budget"):
                with off:
                    loss = m(x).sum()
                loss.backward()
                off._over = off.replans < 2  # and once more: still no BudgetError
            assert all(torch.equal(a, p.grad) for a, p in zip(ref, m.parameters()))
    finally:
        off.close()
    assert off.replans == 2
    from tensortier.planner.policies import smallest

    floor = smallest(off.profile, replace(off.config.options, margin=0.0))  # its own tiers
    assert off.choice.result.peak_bytes == floor.result.peak_bytes


def test_memory_the_user_allocates_mid_training_is_not_the_offloaders(tmp_path):
    """A plain GPT loop at half its plain peak (~104 MiB here) that allocates 30 MiB of its own
    between two steps while the planner profiles (a data buffer, say): that memory is outside
    tt.offload's forward/backward, so it is not counted as offloader buffers. A planner that
    charged it all to itself found no plan (BudgetError). Training stays bit-identical."""
    import tensortier as tt

    x, y, ref, m = _twin_gpts()
    opts = [torch.optim.SGD(mod.parameters(), lr=1e-2) for mod in (ref, m)]
    off = tt.offload(budget="52MiB", spill_dir=str(tmp_path), options=COARSE)
    kept = []
    try:
        for step in range(7):  # warm-up, probe, timing passes, then the plan
            ref(x, y).backward()
            with off:
                loss = m(x, y)
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            if step == 1:  # the user's own 30 MiB, touched (resident), kept to the end
                kept.append(torch.ones(30 << 18))
        assert off.choice is not None and off._overhead < 30 << 20
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))
    finally:
        off.close()


# the twin-GPT loop above, alone in a fresh process: plain steps of the user's before every
# offloaded one, from the first iteration on
_COLD_TWIN_LOOP = textwrap.dedent(
    """
    import json, sys
    from dataclasses import replace
    import torch
    import tensortier as tt
    from tensortier.models.gpt import GPT, GPTConfig, random_batch
    from tensortier.planner.policies import Options

    cfg = GPTConfig(n_layer=8, n_embd=128, n_head=4, block_size=256, vocab_size=512)
    x, y = random_batch(cfg, 4, 256)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg))
    ref, m = models
    for _ in range(int(sys.argv[2])):  # plain steps before tt.offload() (their gradients dropped)
        for mod in (ref, m):
            mod(x, y).backward()
            mod.zero_grad()
    opts = [torch.optim.SGD(mod.parameters(), lr=1e-2) for mod in (ref, m)]
    options = replace(Options(search_iters=60, search_seconds=5), fine=False)
    off = tt.offload(budget="52MiB", spill_dir=sys.argv[1], options=options)
    try:
        for _ in range(7):
            ref(x, y).backward()
            with off:
                loss = m(x, y)
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        same = all(torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))
        print(json.dumps({"peaks": off.measured_peaks, "same": same}))
    finally:
        off.close()
    """
)


@pytest.mark.skipif(
    torch.cuda.is_available() or not sys.platform.startswith("linux"),
    reason="the CPU budget is RSS, glibc's heap (Linux)",
)
@pytest.mark.parametrize("trained_before", [0, 2], ids=["offload-first", "trained-first"])
def test_a_fresh_process_with_plain_steps_of_its_own_plans_at_half_the_peak(
    tmp_path, trained_before
):
    """The loop of the test above in a fresh process: the plain model's forward and backward run
    before the first ``with off`` (and, ``trained-first``, both models trained plainly before
    ``tt.offload()``). Those steps left their activations in glibc's heap, which never shrinks:
    the threshold was fixed only at the first ``with``, and a heap grown before it still served
    requests. The profiled passes faulted its free pages back in and kept them (probe 84-112
    MiB, timing passes 63-106 MiB, against 22-38 MiB in a process that had run tensortier
    before), and the budget had no plan (BudgetError, "at least 54.1MiB"). The threshold is now
    fixed at ``tt.offload()``, and the heap's free chunks are retired then."""
    out = run_fresh(_COLD_TWIN_LOOP, tmp_path, trained_before)
    assert out["same"] is True  # bit-identical to the plain loop
    assert out["peaks"] and all(p <= 52 << 20 for p in out["peaks"]), out["peaks"]


def test_an_impossible_budget_is_reported_at_the_first_step_before_any_optimizer_step(spill_dir):
    """The first step offloads every saved tensor; when even it peaks over the budget, the budget
    cannot hold from the first step, and the user hears it from that step's backward, before
    ``optimizer.step()`` can run (it came at the first plan, step 5, after four updates)."""
    from tensortier.errors import BudgetError

    m, x = _mlp(width=512, depth=4), torch.randn(512, 512)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in m.parameters()]
    off = planned_offload("1MiB", spill_dir=spill_dir, options=FAST)
    forwards = updates = 0
    try:
        with pytest.raises(BudgetError, match=r"first step peaked at .* at least") as caught:
            for _ in range(6):
                with off:
                    loss = m(x).sum()
                forwards += 1
                loss.backward()
                opt.step()
                updates += 1
    finally:
        off.close()
    assert (forwards, updates) == (1, 0)  # raised by the first backward
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))  # nothing applied
    e = caught.value
    assert e.budget == 1 << 20 and e.minimum > off.first_peak > 1 << 20
    assert off.profile is None  # no probe, no plan: nothing ran after the first step


def test_a_budget_the_first_step_keeps_runs_on(spill_dir):
    """The check at the first step measures; a budget that step keeps trains on to the plan."""
    m, x = _mlp(width=512, depth=4), torch.randn(512, 512)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        for _ in range(5):  # warm-up, probe, 2 timing passes, plan
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
    finally:
        off.close()
    # measured (0 when the step grew RSS into pages earlier tests left resident) and kept
    assert off.first_peak is not None and 0 <= off.first_peak <= 64 << 20
    assert off.choice is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the resident accounting is a CPU budget's")
def test_resident_memory_counts_what_freed_gradients_leave_in_the_process(spill_dir):
    """On a CPU the planner adds the memory its machinery keeps between iterations to every
    prediction (``_resident``): the growth inside its forward/backward windows, gradients taken
    out. Gradients glibc carves from heap pages that were resident already (64 KiB matrices
    here) added nothing to the window, and freeing them (``zero_grad()``) returns nothing: a
    window that took them out at full size counted ~2 MiB too little each step, so the estimate
    drifted below what the process really kept and the first planned step ran over (issue 23).
    """
    from tensortier._device import rss_bytes

    torch.manual_seed(0)
    m = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(32)))
    x = torch.randn(64, 128)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    seen = []  # per step: the process's RSS before it, the planner's estimate once it began
    try:
        for _ in range(4):  # warm-up, probe, 2 timing passes: three measured windows
            m.zero_grad(set_to_none=True)
            before = rss_bytes()
            with off:
                seen.append((before, off._resident()))
                loss = m(x).square().mean()
            loss.backward()
    finally:
        off.close()
    grown = seen[-1][0] - seen[1][0]  # what the probe and the first timing pass left
    estimated = seen[-1][1] - seen[1][1]
    assert estimated >= grown - (512 << 10), (estimated, grown)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the resident accounting is a CPU budget's")
def test_memory_the_user_allocates_after_zero_grad_is_not_the_machinerys(spill_dir):
    """What freeing the gradients left in the process is read when they are freed: read at the
    next forward, it also held what the user's code allocated after ``zero_grad()`` (in the
    planner bench, the other policies' offloaders), charged to the machinery up to the
    gradients' size (6.7 MB of gpt:8x128x4's 37.8 MB budget: its checked steps ran 5 MB over
    the budget and re-planned three times)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 1024))  # 16 MiB grads
    x = torch.randn(32, 1024)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    held, charged = [], []
    try:
        for step in range(4):  # warm-up, probe, 2 timing passes: three measured windows
            m.zero_grad(set_to_none=True)
            if step >= 2:  # the user's memory, allocated between steps and kept
                held.append(torch.ones(8 << 20))
            before = off._uncounted
            with off:
                if step >= 2:
                    charged.append(off._uncounted - before)
                loss = m(x).square().mean()
            loss.backward()
    finally:
        off.close()
    assert all(c < 4 << 20 for c in charged), charged


def _at_least(message: str) -> int:
    import re

    from tensortier._units import parse_size

    return parse_size(re.search(r"at least ([0-9.]+[KMGT]?i?B)", message).group(1))


def test_a_keep_budget_error_names_the_budget_keep_itself_needs(spill_dir, make_profile):
    """The minimum is the model's floor over every plan; "raise the budget to at least
    <minimum>, or use policy='auto'" was false for ``policy='keep'``: that budget was refused
    again. The message names the budget keep needs, and keep fits it."""
    from tensortier.errors import BudgetError

    profile = make_profile(n_units=2, tensor_bytes=10_000_000, per_unit=1)

    def planned(budget: str):
        off = planned_offload(budget, spill_dir=spill_dir, policy="keep", options=FAST)
        off._overhead = 1_000_003
        return off

    off = planned("1MiB")
    try:
        with pytest.raises(BudgetError) as caught:
            off._choose(profile)
    finally:
        off.close()
    message = str(caught.value)
    assert "with policy='auto'" in message and message.count("at least") == 2
    off = planned(re.findall(r"at least ([0-9.]+[KMGT]?i?B)", message)[-1])
    try:
        assert off._choose(profile).result.peak_bytes <= off._planning_budget()
    finally:
        off.close()


def test_the_minimum_a_budget_error_names_is_enough_when_passed_back(spill_dir, make_profile):
    """ "Raise the budget to at least X": X was rounded to three digits, often down, so the
    budget the message named was refused again. Both messages round up."""
    from tensortier.errors import BudgetError

    off = planned_offload("1MiB", spill_dir=spill_dir, options=FAST)
    try:
        for k in range(40):  # the first step over the budget, at many peaks
            with pytest.raises(BudgetError) as caught:
                off._check_first((1 << 20) + 12_345 * k + 7)
            assert _at_least(str(caught.value)) >= caught.value.minimum
        profile = make_profile(n_units=2, tensor_bytes=10_000_000 + 12_345, per_unit=1)
        for k in range(20):  # no plan fits, at many resident overheads
            off._overhead = 1_000_003 * k + 777
            with pytest.raises(BudgetError) as caught:
                off._choose(profile)
            assert _at_least(str(caught.value)) >= caught.value.minimum
    finally:
        off.close()


def test_memory_planning_leaves_behind_is_planned_for(spill_dir, make_profile):
    """Planning itself leaves memory (the search's objects), measured only once it is done:
    when the resident memory grew past what the plan was made for, the plan must still fit,
    else it is chosen again."""
    mb = 1_000_000
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        off.profile = make_profile(n_units=4, tensor_bytes=10 * mb, per_unit=2, bw=100e9)
        off.choice = first = off._choose(off.profile)
        off._recheck(off._overhead)  # nothing grew: the plan stays
        assert off.choice is first
        room = off._planning_budget() - first.result.peak_bytes
        off._recheck(off._overhead + room + 5 * mb)  # grew past the room the plan left
        assert off._overhead == room + 5 * mb
        assert off.choice is not first
        assert off.choice.result.peak_bytes <= off._planning_budget()
    finally:
        off.close()


def test_the_plan_stays_under_what_the_measured_passes_bound(make_profile):
    """The simulator is fitted and put plans 0.05x the budget low on gpt:3x192x16 (issue 23):
    the plan must also be under the budget as the measured passes bound it (their peak plus
    the bytes a plan holds beyond them), else a plan that is runs instead."""
    from tensortier.errors import BudgetError
    from tensortier.planner.policies import choose
    from tensortier.planner.profiler import held, measured_bound
    from tensortier.planner.runtime import bounded_choice

    gb = 10**9
    p = make_profile(n_units=4, tensor_bytes=gb, per_unit=2, bw=100 * gb)
    p.meta["profiled_tier"] = "disk"
    opts = replace(FAST, margin=0.0, tiers=("disk",))
    first = choose(p, 6 * gb, "auto", opts)
    assert sum(held(p, first.plan).values()) >= 4 * gb  # the simulator lets it keep 4 GB
    p.passes = [{"kind": "offload", "kept": [], "tier": "disk", "peak_bytes": 3 * gb}]
    assert bounded_choice(p, first, 6 * gb, 9 * gb, "auto", opts) is first  # bound: 7 GB
    bounded = bounded_choice(p, first, 6 * gb, 5 * gb, "auto", opts)
    assert measured_bound(p, bounded.plan) <= 5 * gb  # holds at most 2 GB beyond the pass
    assert bounded.result.peak_bytes <= 6 * gb and bounded.plan.policy.startswith("auto:")
    with pytest.raises(BudgetError):  # under the pass itself: no plan is bounded there
        bounded_choice(p, first, 6 * gb, 2 * gb, "auto", opts)


# a user's loop after plain training, in a fresh process: each whole step's RSS high-water mark
# above the RSS before the first offloaded step, beside the planner's own meter of that step
_USER_METERED_LOOP = textwrap.dedent(
    """
    import json, sys
    import torch
    import tensortier as tt
    from tensortier._device import rss_bytes
    from tensortier._memory import HighWater
    from tensortier.models import GPT, GPTConfig, random_batch
    from tensortier.planner.policies import Options

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=12, n_embd=64, n_head=4, block_size=256, vocab_size=512)
    model = GPT(cfg)
    x, y = random_batch(cfg, 4, 256, seed=1)
    for _ in range(3):  # plain training first: torch's lazy initialisation is behind us
        model(x, y).backward()
        model.zero_grad(set_to_none=True)
    options = Options(seed=0, plan_seconds=5, tiers=("disk",))
    off = tt.offload(budget="36MiB", spill_dir=sys.argv[1], tier="disk", options=options)
    start = rss_bytes()
    pairs = []  # (the user's peak, the planner's) per metered step after the planning one
    try:
        for _ in range(16):
            model.zero_grad(set_to_none=True)
            metered, watch = len(off.measured_peaks), HighWater()
            watch.start()
            with off:
                loss = model(x, y)
            loss.backward()
            del loss
            user = watch.stop() - start
            if metered and len(off.measured_peaks) > metered:
                pairs.append((user, off.measured_peaks[-1]))
        print(json.dumps({"pairs": pairs}))
    finally:
        off.close()
    """
)


@pytest.mark.skipif(
    torch.cuda.is_available() or not sys.platform.startswith("linux"),
    reason="the CPU budget is RSS, glibc's heap (Linux)",
)
def test_the_planners_meter_reads_no_less_than_the_users_rss_over_a_whole_step(tmp_path):
    """What the planner measures of a planned step (``measured_peaks``, against the budget) is
    at least what the user measures: the step's RSS high-water mark above the RSS before the
    first ``with off``. The planner read 3-4 MiB less on gpt:12x64x4 at 36 MiB (the benchmark
    saw its "fine" plan at 36-37 MiB, the planner at 31-34): the warm-up's window, not counted,
    had left 2.9 MiB of heap and stacks beyond the offloader's buffers; and each window's end was
    read after a trim, its start and the step's meter before one, so free heap pages the steps
    fault back in were charged nowhere (-0.05 MiB a step). The planning step is left out: what
    planning allocates before the step's meter starts is not the step's."""
    pairs = run_fresh(_USER_METERED_LOOP, tmp_path)["pairs"]
    assert len(pairs) >= 3, pairs
    mib = [(round(u / 2**20, 2), round(p / 2**20, 2)) for u, p in pairs]
    assert all(planner >= user for user, planner in pairs), mib


def test_a_budget_error_on_cuda_names_expandable_segments_when_the_allocator_held_much_more(
    spill_dir, make_profile, monkeypatch
):
    """Issue 25 (H100 run 2): budgets count reserved memory, and full checkpointing reserved
    6.8 GB for 2.3 GB of tensors, so the error must name the allocator setting that returns it,
    not only a larger budget; and say nothing of it where it would not help."""
    from tensortier.errors import BudgetError

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    off = planned_offload("1MiB", spill_dir=spill_dir, options=FAST)
    gb = 10**9
    try:
        profile = make_profile(n_units=2, tensor_bytes=10_000_000, per_unit=1)

        def message(device: str, allocated: int) -> str:
            profile.device = device
            profile.passes = [
                {"kind": "probe", "peak_bytes": 9 * gb, "allocated_bytes": 8 * gb},
                {"kind": "recompute", "peak_bytes": 7 * gb, "allocated_bytes": allocated},
            ]
            with pytest.raises(BudgetError) as caught:
                off._choose(profile)
            return str(caught.value)

        hint = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        text = message("cuda", int(2.3 * gb))
        assert hint in text and "held 4.38GiB" in text, text  # 7 - 2.3 GB, at the smallest peak
        assert hint not in message("cuda", int(6.5 * gb))  # the allocator held little
        assert hint not in message("cpu", int(2.3 * gb))
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        assert hint not in message("cuda", int(2.3 * gb))  # already on
    finally:
        off.close()


@pytest.mark.gpu
def test_cuda_budget_under_compiled_autograd_is_bit_identical_and_metered_in_backward(
    tmp_path, monkeypatch
):
    from torch._dynamo import compiled_autograd

    def backward():  # torch.compile in the test's source: the kit runs it last (_pytest_rows.py)
        return compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager"))

    _under_compiled_autograd("64MiB", str(tmp_path), monkeypatch, backward, "cuda")


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"policy": "capucin"}, "policy='capucin'"),
        ({"policy": None}, "policy=None"),
        ({"warmup": -1}, "warmup=-1"),
        ({"warmup": "1"}, "warmup='1'"),
        ({"timing_iters": -2}, "timing_iters=-2"),
        ({"timing_iters": True}, "timing_iters=True"),
        ({"trial_plans": -1}, "trial_plans=-1 must be an int >= 0 (the number of plans)"),
        ({"report": 123}, "report=123"),
        ({"plan_cache": ["plans"]}, "plan_cache=['plans']"),
        ({"options": {"margin": 0.2}}, "options={'margin': 0.2} (dict) is not an Options"),
    ],
)
def test_a_bad_setting_fails_at_the_call_and_names_itself(kw, named):
    """An unknown policy was accepted and raised only at the first plan, after four profiled
    steps; a negative or non-int count was accepted (a str failed inside a step); a report path
    that is not a path raised TypeError at the first plan, a plan_cache one (or options= a dict)
    a raw TypeError."""
    import tensortier as tt
    from tensortier.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(named)):
        tt.offload(budget="64MiB", **kw)
    off = tt.offload(budget="64MiB", warmup=0, timing_iters=0)  # 0 is valid
    off.close()


@pytest.mark.parametrize(
    "kw", [{"plan_cache": "plans/"}, {"report": "plan.html", "policy": "fine"}]
)
def test_a_planner_setting_without_a_budget_names_budget(kw):
    """tt.offload(plan_cache=...) without budget= raised Offloader's TypeError "unexpected
    keyword argument", with no word that budget= is missing."""
    import tensortier as tt
    from tensortier.errors import ConfigError

    with pytest.raises(ConfigError, match="pass budget= too") as e:
        tt.offload(**kw)
    assert all(f"{k}=" in str(e.value) for k in kw)


@pytest.mark.parametrize("kw, why", [({"codec": "zstd"}, True), ({"plan_cach": "p/"}, False)])
def test_a_setting_the_planner_does_not_take_names_tt_offload_and_its_settings(kw, why):
    """With budget= an unknown setting said "planned_offload() got an unexpected keyword
    argument", a function the user never called, and nothing about what it does take."""
    import tensortier as tt

    with pytest.raises(TypeError, match=r"tt\.offload\(budget=\.\.\.\) got an") as e:
        tt.offload(budget="64MiB", **kw)
    assert "plan_cache, " in str(e.value) and "planned_offload" not in str(e.value)
    assert ("a setting of tt.offload without budget=" in str(e.value)) is why


@pytest.mark.parametrize("where", ["model", "layer"])
def test_a_compiled_model_under_a_budget_is_refused_at_the_first_step(tmp_path, where):
    """The plan's hooks ran inside dynamo's tracing: dynamo failed its own mutation tracking
    (AssertionError "already tracked for mutation"), or the saved-tensor hooks were traced into
    the graph (an error blaming offload_module)."""
    import tensortier as tt
    from tensortier.errors import ConfigError

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])
    if where == "layer":
        m[1].compile(backend="eager")
    model = torch.compile(m, backend="eager") if where == "model" else m
    off = tt.offload(budget="64MiB", spill_dir=str(tmp_path))
    name = "the model" if where == "model" else "its layer '1'"
    match = rf"{name} is torch.compile'd.*tt.offload\(tier="
    with pytest.raises(ConfigError, match=match), off:
        model(torch.randn(4, 16)).sum().backward()
    off.close()


def _sgd_steps(model: nn.Module, xs: list[torch.Tensor], ctx=None, step_done=None) -> list:
    """Plain SGD steps over ``xs`` (each forward inside ``ctx()`` when given): the losses, then
    the parameters, for a bit-for-bit comparison."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        with ctx() if ctx is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        out.append(loss.detach())
        if step_done is not None:
            step_done()
    return out + [p.detach().clone() for p in model.parameters()]


def test_two_threads_with_their_own_budgets_each_reach_a_plan(tmp_path):
    """tt.offload(budget=...) kept one planned offload per process: a thread's call with its own
    budget closed the other thread's between its steps (so neither ever planned, each warming
    up again every step) or while it entered (ClosedError), and the global module hooks caught
    the other thread's model as the root and its modules as units."""
    import copy
    import threading

    import tensortier as tt

    gen = torch.Generator().manual_seed(0)
    setups = {"a": (_mlp(width=128, depth=4), "64MiB"), "b": (_mlp(width=96, depth=2), "48MiB")}
    widths = {"a": 128, "b": 96}
    data = {k: [torch.randn(32, w, generator=gen) for _ in range(7)] for k, w in widths.items()}
    plain = {k: _sgd_steps(copy.deepcopy(m), data[k]) for k, (m, _) in setups.items()}
    together = threading.Barrier(2, timeout=120)  # the threads' steps interleave
    got, offs, errors = {}, {}, []

    def train(k: str) -> None:
        model, budget = setups[k]
        kw = dict(budget=budget, spill_dir=str(tmp_path), options=FAST)
        try:
            got[k] = _sgd_steps(model, data[k], lambda: tt.offload(**kw), together.wait)
            offs[k] = tt.offload(**kw)
        except BaseException as e:  # noqa: BLE001 - reported below, with the thread's name
            errors.append((k, repr(e)))
            together.abort()

    threads = [threading.Thread(target=train, args=(k,)) for k in setups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not errors, errors
        for k, (model, _) in setups.items():
            assert all(torch.equal(a, b) for a, b in zip(plain[k], got[k])), k
            assert offs[k].choice is not None, k  # planned: not closed by the other thread
            assert [u.name for u in offs[k].profile.units if u.name] == list(plan_units(model))
    finally:
        for off in offs.values():
            off.close()


def test_an_evaluation_under_no_grad_inside_the_block_is_not_an_iteration(spill_dir):
    """A validation forward under ``torch.no_grad()`` inside ``with tt.offload(budget=...)``
    counted as an iteration: right after the warm-up it was the probe, which profiled no saved
    tensor at all (the plan then kept every activation), later a timing pass or a checked step
    without activations or backward."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 256, generator=gen) for _ in range(7)]
    plain = _sgd_steps(_mlp(), xs)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    evals = []

    def evaluate_after_the_warm_up() -> None:
        if off.iteration == 1:
            with torch.no_grad(), off:
                evals.append(model(xs[0]).sum())
            with torch.inference_mode(), off:
                evals.append(model(xs[0]).sum())

    model = _mlp()
    try:
        planned = _sgd_steps(model, xs, lambda: off, evaluate_after_the_warm_up)
        assert off.iteration == len(xs) and len(evals) == 2
        assert off.choice is not None
        # the probe saw a training step: each block's input (the last Linear's is block 3's
        # ReLU output) and the output the loss squares
        assert {t.unit for t in off.profile.tensors} == {"0", "1", "2", "3", ""}
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


class _Interrupted(Exception):
    pass


class _RaisesWhenArmed(nn.Module):
    """A layer whose forward raises while ``armed`` (a bad batch, a data-dependent assert)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise _Interrupted("this batch is skipped")
        return x


@pytest.mark.parametrize("raise_at", [1, 2], ids=["probe", "timing-pass"])
def test_a_forward_that_raises_while_profiling_is_profiled_again(spill_dir, raise_at):
    """A forward that raised midway inside the probe left a profile of the units before the
    raise only (the plan counted the others as saving nothing); inside a timing pass, the
    partial pass's peak and times stayed among the measured passes that bound every plan."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 256, generator=gen) for _ in range(8)]

    def model() -> nn.Module:
        m = _mlp()
        return nn.Sequential(*m[:2], _RaisesWhenArmed(), *m[2:])

    def train(ctx) -> list:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        out = []
        for i, x in enumerate(xs):
            opt.zero_grad(set_to_none=True)
            m[2].armed = i == raise_at
            try:
                with ctx():
                    loss = m(x).square().mean()
            except _Interrupted:
                continue  # the user skips the batch and trains on
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out + [p.detach().clone() for p in m.parameters()]

    plain = train(contextlib.nullcontext)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        planned = train(lambda: off)
        assert off.choice is not None
        assert {t.unit for t in off.profile.tensors} >= {"0", "1", "3", "4"}  # after the raise too
        profiled = [p for p in off.profile.passes if p["kind"] != "trial"]
        assert len(profiled) == 3  # the probe and two timing passes, none of them partial
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


def test_a_warm_up_batch_of_another_shape_does_not_mislabel_the_profile(spill_dir):
    """The profile's shape bucket was taken from the first forward, the warm-up's, not from the
    probe the profile measures: a first batch of 512 rows then batches of 64 filed the 64-row
    profile as the 512-row bucket's (a later 512-row batch ran a plan that counted each
    activation at an eighth of its size), and the 64-row steps ran a plan made from a scaled
    copy, which has no measured passes to bound it."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(512 if i == 0 else 64, 256, generator=gen) for i in range(7)]
    plain = _sgd_steps(_mlp(), xs)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        planned = _sgd_steps(_mlp(), xs, lambda: off)
        assert off.choice is not None
        inputs = {
            str(b.shapes): b.profile.tensors[0].nbytes for b in off._buckets.values()
        }  # the first saved tensor: the model's input, as the plan of that bucket counts it
    finally:
        off.close()
    assert inputs == {str([([64, 256], "float32")]): 64 * 256 * 4}
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


def test_a_planned_step_that_raises_is_not_one_of_the_checked_steps(spill_dir):
    """The meter of a forward that raised stayed open to the next step's start and its reading,
    a part of a step, became one of the few checked steps a plan is held to the budget by."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*_mlp()[:2], _RaisesWhenArmed(), *_mlp()[2:])
    off = planned_offload("64MiB", spill_dir=spill_dir, policy="capuchin", options=FAST)
    try:
        for step in range(7):  # warm-up, probe, two timing passes, the plan, a raise, the plan
            model.zero_grad(set_to_none=True)
            model[2].armed = step == 5
            with contextlib.suppress(_Interrupted):
                with off:
                    loss = model(torch.randn(64, 256, generator=gen)).square().mean()
                loss.backward()
        assert off.choice is not None
        assert len(off.measured_peaks) == 2  # the steps that ran whole: 4 and 6
    finally:
        off.close()


def test_larger_inputs_of_the_profiled_bucket_get_a_plan_for_their_size(spill_dir):
    """Inputs share a plan per bucket (dimensions rounded up to powers of two), and the profiled
    bucket's plan counts the profiled sizes: profiled at 40 rows, batches of 64 ran it with 1.6x
    the activations it planned for, after the checked steps, so unchecked."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(40 if i < 6 else 64, 256, generator=gen) for i in range(9)]
    plain = _sgd_steps(_mlp(), xs)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    running = []
    try:
        planned = _sgd_steps(
            _mlp(),
            xs,
            lambda: off,
            lambda: running.append(off.profile and off.profile.tensors[0].nbytes),
        )
    finally:
        off.close()
    # the model's input as the running plan counts it: 40 rows, then 64 (not 40 again)
    assert running[5:] == [40 * 256 * 4] + [64 * 256 * 4] * 3
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
