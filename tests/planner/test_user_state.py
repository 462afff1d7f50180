"""Model state a unit's forward changes (buffers, Python attributes) under a recompute plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensortier.planner.policies import Options
from tensortier.planner.profile import Bandwidth
from tensortier.planner.profiler import Profiler
from tensortier.planner.runtime import Recompute, planned_offload

FAST = Options(search_iters=60, search_seconds=5)
BW = Bandwidth(d2h=1e9, h2d=1e9, h2disk=1e9, disk2h=1e9)


class _Centred(nn.Module):
    """Centres its input on a running mean it updates in train mode (user code, not a norm)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.lin(x - self.mean).tanh()


class _Counted(nn.Module):
    """Counts its calls in a buffer it rebinds (``self.calls = self.calls + 1``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.lin(x).tanh()


def _model(unit: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32))  # restored by the recompute
    return nn.Sequential(norm, unit(), nn.Linear(32, 1))


def _train(model: nn.Module, x: torch.Tensor, ctx=None, steps: int = 6) -> list[torch.Tensor]:
    """SGD steps from seed 1: each step's gradients, then the parameters and buffers."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = model(x).square().mean()
        else:
            with ctx:
                loss = model(x).square().mean()
        loss.backward()
        out += [p.grad.clone() for p in model.parameters()]
        opt.step()
    return out + [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _buffer_after_a_step(unit: type[nn.Module], x: torch.Tensor, recompute: bool) -> torch.Tensor:
    m = _model(unit)
    rc = Recompute(m, ["1"]) if recompute else None
    m(x).square().mean().backward()
    if rc is not None:
        rc.remove()
    return next(m[1].buffers())


@pytest.mark.parametrize("unit", [_Centred, _Counted], ids=["written", "rebound"])
def test_a_unit_that_changes_a_buffer_is_not_recomputable(spill_dir, unit):
    """Checkpoint reruns the forward in backward: the buffer moved twice per step (and the
    rerun read the moved mean: wrong gradients). Only norms' statistics were put back."""
    x = torch.randn(16, 32)
    plain = _buffer_after_a_step(unit, x, recompute=False)
    assert not torch.equal(plain, _buffer_after_a_step(unit, x, recompute=True))
    m = _model(unit)
    prof = Profiler(spill_dir=spill_dir, bandwidth=BW, codecs={}, device=torch.device("cpu"))
    try:
        with prof.forward():
            loss = m(x).square().mean()
        loss.backward()
        p = prof.finish()
    finally:
        prof.offloader.close()
    recomputable = {u.name: u.recomputable for u in p.units if u.name}  # "": the loss
    assert recomputable == {"0": True, "1": False, "2": True}


def test_recompute_all_with_a_running_mean_trains_bit_for_bit(spill_dir):
    """Through warm-up, profiling and two planned steps: gradients, parameters and buffers (the
    BatchNorm's and the unit's own) equal plain training's."""
    x = torch.randn(16, 32)
    plain = _train(_model(_Centred), x)
    off = planned_offload("64MiB", spill_dir=spill_dir, policy="recompute_all", options=FAST)
    try:
        planned = _train(_model(_Centred), x, off)
        assert off.choice is not None and off.choice.plan.recomputed() == ["0", "2"]
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
