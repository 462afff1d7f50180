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
