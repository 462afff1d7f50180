"""Plans reused: the plan cache (JSON, keyed by model, shape bucket, dtype and budget) and plans
per shape bucket chosen at run time without profiling again."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from tensortier.planner.policies import Options
from tensortier.planner.runtime import bucket, planned_offload

FAST = Options(search_iters=60, search_seconds=5, plan_seconds=20)
STEPS = 5  # warm-up, probe, 2 timing passes, one planned step


class _Seq(nn.Module):
    """Blocks over a (batch, seq, width) input, so the sequence length can vary."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _grads(model, xs, off=None) -> list[torch.Tensor]:
    out = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        if off is None:
            loss = model(x).square().mean()
        else:
            with off:
                loss = model(x).square().mean()
        loss.backward()
        out += [p.grad.clone() for p in model.parameters()]
    return out


def _run(cache, spill_dir, *, width=512, seq=128, steps=STEPS, budget="48MiB"):
    model = _Seq(width)
    x = torch.randn(8, seq, width, generator=torch.Generator().manual_seed(1))
    plain = _grads(model, [x] * steps)
    off = planned_offload(budget, spill_dir=spill_dir, options=FAST, plan_cache=cache)
    try:
        got = _grads(model, [x] * steps, off)
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))  # bit-identical throughout
    return off


def test_a_restarted_job_runs_the_cached_plan_from_its_first_step(tmp_path, spill_dir):
    cache = tmp_path / "plans"
    first = _run(cache, spill_dir)
    assert not first.cached and first._profiler is not None
    (path,) = list(cache.iterdir())
    data = json.loads(path.read_text())  # JSON, never pickle
    assert data["key"]["budget"] == 48 << 20 and data["key"]["inputs"][0][0] == [8, 128, 512]
    second = _run(cache, spill_dir, steps=2)
    assert second.cached and second._profiler is None  # no warm-up, no profiling
    assert second.choice.plan.to_dict() == first.choice.plan.to_dict()
    assert second.profile.to_dict() == first.profile.to_dict()
    # the cached plan is the plan a fresh choice makes from the same profile
    assert second._overhead == first._overhead  # the budget is accounted the same way
    fresh = second._choose(second.profile)
    assert fresh.plan.to_dict()["actions"] == second.choice.plan.to_dict()["actions"]


@pytest.mark.parametrize("change", ["model", "shape", "budget"])
def test_a_cached_plan_is_refused_when_the_model_shapes_or_budget_change(
    tmp_path, spill_dir, change
):
    cache = tmp_path / "plans"
    _run(cache, spill_dir)
    kw = {"model": {"width": 256}, "shape": {"seq": 32}, "budget": {"budget": "56MiB"}}[change]
    again = _run(cache, spill_dir, **kw)
    assert not again.cached and again._profiler is not None  # profiled again
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_cache_file_means_profiling_again(tmp_path, spill_dir):
    cache = tmp_path / "plans"
    _run(cache, spill_dir)
    (path,) = list(cache.iterdir())
    path.write_text('{"key": ')  # torn
    again = _run(cache, spill_dir)
    assert not again.cached
    assert json.loads(path.read_text())["key"]["budget"] == 48 << 20  # rewritten whole
    assert not [p for p in os.listdir(cache) if p.startswith(".plan-")]  # no temporaries left


def test_other_sequence_lengths_get_their_bucket_plan_without_profiling(spill_dir):
    model = _Seq()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, 256, generator=gen) for _ in range(STEPS)]
    xs += [torch.randn(8, 100, 256, generator=gen), torch.randn(8, 120, 256, generator=gen)]
    xs += [torch.randn(8, 64, 256, generator=gen)]
    plain = _grads(model, xs)
    off = planned_offload("48MiB", spill_dir=spill_dir, options=FAST)
    try:
        got = _grads(model, xs, off)
        passes = len(off.profile.passes)
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert bucket(100) == bucket(120) == 128 and bucket(64) == 64
    assert len(off._buckets) == 2  # seq 64 (profiled) and seq 128 (scaled), one plan each
    scaled = [b for b in off._buckets.values() if b.sizes][0]
    assert scaled.sizes[64] == 128 and scaled.sizes[8 * 64] == 8 * 128  # rows of the matmuls
    assert scaled.profile.saved_bytes == pytest.approx(
        2 * off._buckets[next(iter(off._buckets))].profile.saved_bytes, rel=0.01
    )
    assert passes == 3 and off._profiled == 3  # the probe and two timing passes, never again
