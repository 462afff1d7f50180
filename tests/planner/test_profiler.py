"""The profiler's passes: probe once, then timing passes that alternate keep and offload."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tensortier.errors import ConfigError
from tensortier.planner.profile import Bandwidth
from tensortier.planner.profiler import Profiler

BW = Bandwidth(d2h=1e9, h2d=1e9, h2disk=1e9, disk2h=1e9)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(3)))


def _step(model, x, ctx) -> None:
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).sum()
    loss.backward()


def _profiler(spill_dir, **kw) -> Profiler:
    return Profiler(spill_dir=spill_dir, bandwidth=BW, codecs={}, device=torch.device("cpu"), **kw)


def test_timing_passes_alternate_keep_and_offload_and_calibrate(spill_dir):
    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        kinds = []
        for _ in range(3):
            _step(m, x, prof.timing())
            kinds.append(prof._cur.kind)
        p = prof.finish()
    finally:
        prof.offloader.close()
    assert kinds == ["keep", "offload", "keep"]
    assert p.meta["timing"] == "keep" and p.meta["timing_passes"] == 3
    assert p.keep_peak_bytes is not None and p.offload_step_s > 0
    assert [u.name for u in p.units] == ["0", "1", "2"]
    assert all(u.fwd_s > 0 and u.bwd_s > 0 for u in p.units)
    assert len(p.tensors) == 4  # the input and each ReLU output


def test_without_room_to_keep_every_timing_pass_offloads(spill_dir, monkeypatch):
    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    monkeypatch.setattr(Profiler, "_keep_fits", lambda self: False)
    try:
        _step(m, x, prof.forward())
        for _ in range(2):
            _step(m, x, prof.timing())
        p = prof.finish()
    finally:
        prof.offloader.close()
    assert p.meta["timing"] == "offload"
    assert p.keep_peak_bytes is None and p.offload_step_s is None  # nothing to calibrate against


def test_the_backward_ends_at_the_last_gradient_not_at_finish(spill_dir):
    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        _step(m, x, prof.timing())
        time.sleep(0.5)  # an optimizer step, data loading: not the first unit's backward
        p = prof.finish()
    finally:
        prof.offloader.close()
    assert p.unit("0").bwd_s < 0.25
    assert p.measured_step_s < 0.5


def test_passes_out_of_order_and_bad_modes_are_refused(spill_dir):
    with pytest.raises(ConfigError, match="timing must be"):
        _profiler(spill_dir, timing="fast")
    m, x = _mlp(), torch.randn(16, 128)
    prof = _profiler(spill_dir)
    with pytest.raises(ConfigError, match="before a timing pass"), prof.timing():
        pass
    with pytest.raises(ConfigError, match="nothing profiled"):
        prof.finish()
    try:
        _step(m, x, prof.forward())
        with pytest.raises(ConfigError, match="runs once"), prof.forward():
            pass
        assert prof.finish().meta["timing"] == "probe"  # no timing pass: the probe's times
    finally:
        prof.offloader.close()
