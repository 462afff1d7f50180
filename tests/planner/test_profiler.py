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


# ---------------------------------------------------------------- CUDA paths, on a fake device
class _FakeCuda:
    """Stands in for ``torch.cuda`` on a CPU-only machine: counts synchronizations, reports
    chosen memory figures, and gives events a fixed elapsed time."""

    GiB = 1 << 30

    def __init__(self):
        self.syncs = 0

    def install(self, monkeypatch):
        fake = self

        class Event:
            def __init__(self, enable_timing=False, **kw):
                self.recorded = 0

            def record(self, stream=None):
                self.recorded += 1

            def elapsed_time(self, end):
                assert self.recorded and end.recorded
                return 1234.0  # ms

        def sync(device=None):
            fake.syncs += 1

        for name, fn in {
            "synchronize": sync,
            "reset_peak_memory_stats": lambda device=None: None,
            "memory_allocated": lambda device=None: 1 * self.GiB,
            "max_memory_allocated": lambda device=None: 3 * self.GiB,
            "memory_reserved": lambda device=None: 2 * self.GiB,
            "max_memory_reserved": lambda device=None: 5 * self.GiB,
            "mem_get_info": lambda device=None: (64 * self.GiB, 80 * self.GiB),
            "current_stream": lambda device=None: None,
            "get_rng_state": lambda device=None: torch.zeros(8, dtype=torch.uint8),
            "set_rng_state": lambda state, device=None: None,
            "Event": Event,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        return self


def test_cuda_peak_is_reserved_memory_not_allocated(monkeypatch):
    from tensortier.planner.profiler import PeakMeter

    _FakeCuda().install(monkeypatch)
    with PeakMeter(torch.device("cuda", 0)) as meter:
        pass
    assert meter.peak == 5 * _FakeCuda.GiB  # max_memory_reserved: what an OOM is measured on
    assert meter.delta == 4 * _FakeCuda.GiB  # beyond the 1 GiB allocated at entry
    assert meter.peak_allocated == 3 * _FakeCuda.GiB


def test_cuda_offload_timing_pass_does_not_sync_at_unit_boundaries(spill_dir, monkeypatch):
    """An offload pass that only calibrates move costs must not drain the copy streams at every
    unit boundary: its step time comes from events around the whole step."""
    fake = _FakeCuda().install(monkeypatch)
    m, x = _mlp(), torch.randn(256, 128)
    prof = Profiler(spill_dir=spill_dir, bandwidth=BW, codecs={}, device=torch.device("cuda", 0))
    try:
        _step(m, x, prof.forward())
        syncs = {}
        for _ in range(2):
            before = fake.syncs
            ctx = prof.timing()
            _step(m, x, ctx)
            syncs[prof._cur.kind] = fake.syncs - before
        p = prof.finish()
    finally:
        prof.offloader.close()
    units = len(p.units)
    assert syncs["keep"] >= 2 * units  # the keep pass times every unit: kernel time
    assert syncs["offload"] <= 2  # closing the keep pass, starting this one: never per unit
    assert p.offload_step_s == pytest.approx(1.234)  # events: first kernel to last gradient


@pytest.mark.gpu
def test_cuda_h2d_bandwidth_is_timed_after_the_copies(tmp_path):
    """Review #7: the H2D clock stopped before the copies ran (issue time, not bandwidth)."""
    from tensortier.planner.profile import measure_bandwidth

    bw = measure_bandwidth(str(tmp_path), device="cuda")
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    measured = n / (start.elapsed_time(end) / 1e3)
    assert 0.5 < bw.h2d / measured < 1.5, (bw.h2d, measured)
    assert bw.h2d < 100e9  # no PCIe or NVLink-C2C host link copies faster


@pytest.mark.gpu
def test_cuda_peak_meter_reads_reserved_memory():
    from tensortier.planner.profiler import PeakMeter

    dev = torch.device("cuda", torch.cuda.current_device())
    with PeakMeter(dev) as meter:
        keep = [torch.empty(3 << 20, dtype=torch.uint8, device=dev) for _ in range(8)]
        del keep[::2]  # holes: reserved stays above allocated
    assert meter.peak == torch.cuda.max_memory_reserved(dev)
    assert meter.peak >= meter.peak_allocated
