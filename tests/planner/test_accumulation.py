"""Gradient accumulation under ``tt.offload(budget=...)``: micro-batches before one optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensortier.errors import ConfigError
from tensortier.planner.policies import Options
from tensortier.planner.runtime import planned_offload

FAST = Options(search_iters=60, search_seconds=5)
MICRO = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(64, 1))


def _train(ctx=None, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``MICRO`` micro-batches, each forward followed by its backward:
    each step's gradients, then the parameters."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    xs = torch.randn(MICRO, 32, 64, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for x in xs:
            if ctx is None:
                loss = m(x).square().mean() / MICRO
            else:
                with ctx:
                    loss = m(x).square().mean() / MICRO
            loss.backward()
        out += [p.grad.clone() for p in m.parameters()]
        opt.step()
    return out + [p.detach().clone() for p in m.parameters()]


def test_micro_batches_each_with_its_backward_train_bit_for_bit_under_the_budget(spill_dir):
    """Each micro-batch is one planned iteration (warm-up, probe, timing passes, then the plan
    within the first steps); the gradients add up in ``.grad`` as in plain training, dropout
    masks and recomputed blocks included."""
    plain = _train()
    off = planned_offload("64MiB", spill_dir=spill_dir, policy="recompute_all", options=FAST)
    try:
        planned = _train(off)
        assert off.choice is not None and off.measured_peaks
        assert all(p <= 64 << 20 for p in off.measured_peaks), off.measured_peaks
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))


def test_a_forward_before_the_previous_ones_backward_is_refused_naming_the_fix(spill_dir):
    """Losses summed over micro-batches, then one backward: the planner profiled the forwards
    without backward time and metered each alone while the others' activations stayed, so the
    whole step ran over the budget without a word. Refused at the second forward of the first
    step, before any backward or optimizer step."""
    m, x = _model(), torch.randn(32, 64)
    off = planned_offload("64MiB", spill_dir=spill_dir, options=FAST)
    try:
        with off:
            first = m(x).square().mean()
        fix = r"waits for its backward.*\(loss / k\)\.backward"
        with pytest.raises(ConfigError, match=fix), off:
            m(x).square().mean()
        assert all(p.grad is None for p in m.parameters())
        del first  # a skipped backward, its loss dropped: the next forward is an iteration
        for _ in range(2):
            with off:
                loss = m(x).square().mean()
            loss.backward()
    finally:
        off.close()
