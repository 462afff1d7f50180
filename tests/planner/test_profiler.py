"""The profiler's passes: probe once, then timing passes that keep chosen groups of units."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tensortier._memory import status_bytes
from tensortier.errors import ConfigError
from tensortier.planner.profile import Bandwidth
from tensortier.planner.profiler import Profiler
from tests._helpers import run_fresh

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


def test_timing_passes_keep_the_groups_asked_and_calibrate(spill_dir):
    from tensortier.planner.profiler import calibrate

    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        kinds, kept = [], []
        for group in (["0"], ["1", "2"], None):
            _step(m, x, prof.timing(keep=group))
            kinds.append(prof._cur.kind)
            kept.append(sorted(prof._cur.kept))
        off = prof.offloader
        p = calibrate(prof.finish())
    finally:
        prof.offloader.close()
    assert kinds == ["offload", "offload", "offload"]  # some unit always offloads
    assert kept == [["0"], ["1", "2"], []]
    assert off.stats.bytes_kept > 0  # the kept groups' tensors stayed
    assert [r["kind"] for r in p.passes] == ["probe", "offload", "offload", "offload"]
    assert [r["kept"] for r in p.passes[1:]] == [["0"], ["1", "2"], []]
    # (RSS: in a long test process freed heap memory can absorb a small pass: only >= 0)
    assert all(r["peak_bytes"] >= 0 and r["timed_step"] for r in p.passes[1:])
    assert p.meta["timing"] == "kept" and p.meta["timing_passes"] == 3
    assert [u.name for u in p.units] == ["0", "1", "2"]
    assert all(u.fwd_s > 0 and u.bwd_s > 0 for u in p.units)
    assert len(p.tensors) == 4  # the input and each ReLU output
    assert p.transient_factor >= 0 and p.move_s_per_byte >= 0


class _HalvesItsInput(nn.Module):
    """Writes its input in place (valid in plain PyTorch: nothing saved that input)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(128, 128)

    def forward(self, x):
        x.mul_(0.5)
        return x + self.lin(x).tanh()


def test_a_unit_that_writes_its_input_in_place_is_not_recomputable(spill_dir):
    """A recompute reruns the unit on its input as the forward left it: the in-place write ran
    twice, and a ``recompute_all`` plan trained with silently wrong gradients. Such a unit is
    profiled as not recomputable (kept or swapped), the others stay recomputable."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 128), _HalvesItsInput(), nn.Linear(128, 1))
    x = torch.randn(64, 128)
    # the recompute halves the input again
    assert _recomputed_wrong_then_profiled(m, x, "1", spill_dir) == {
        "0": True,
        "1": False,
        "2": True,
    }


class _WritesAnInputLater(nn.Module):
    """Code after unit ``a`` writes ``a``'s input in place (nothing saved it)."""

    def __init__(self):
        super().__init__()
        self.pre, self.b = nn.Linear(128, 128), nn.Linear(128, 1)
        self.a = nn.Sequential(nn.Tanh(), nn.Linear(128, 128))  # saves tanh(h), not h

    def forward(self, x):
        h = self.pre(x)
        y = self.a(h)
        h.mul_(3)
        return self.b(y + h)


def test_a_unit_whose_input_is_written_after_it_ran_is_not_recomputable(spill_dir):
    """The recompute of ``a`` ran on the input as the forward left it: autograd's in-place
    error at the first planned backward (or wrong gradients where no version is checked)."""
    torch.manual_seed(0)
    m, x = _WritesAnInputLater(), torch.randn(64, 128)
    assert _recomputed_wrong_then_profiled(m, x, "a", spill_dir) == {
        "pre": True,
        "a": False,
        "b": True,
    }


class _WritesAViewedInputLater(nn.Module):
    """``a``'s input is a view that dies with the call; code after ``a`` writes the same memory
    through another view of its base (nothing saved ``a``'s input)."""

    def __init__(self):
        super().__init__()
        self.pre, self.b = nn.Linear(128, 128), nn.Linear(128, 1)
        self.a = nn.Sequential(nn.Tanh(), nn.Linear(128, 128))

    def forward(self, x):
        h = self.pre(x)
        y = self.a(h.view(-1, 128))
        h[:, :8].mul_(3)
        return self.b(y + h)


def test_a_unit_whose_viewed_input_is_written_after_it_ran_is_not_recomputable(spill_dir):
    """The probe followed the input view itself, dead at the write: a ``recompute_all`` plan
    recomputed ``a`` on the written memory and trained with silently wrong gradients."""
    torch.manual_seed(0)
    m, x = _WritesAViewedInputLater(), torch.randn(64, 128)
    assert _recomputed_wrong_then_profiled(m, x, "a", spill_dir) == {
        "pre": True,
        "a": False,
        "b": True,
    }


class _PassesByKeyword(nn.Module):
    """Calls ``_HalvesItsInput`` with its input by keyword."""

    def __init__(self):
        super().__init__()
        self.pre, self.halve, self.b = nn.Linear(128, 128), _HalvesItsInput(), nn.Linear(128, 1)

    def forward(self, x):
        return self.b(self.halve(x=self.pre(x)))


def test_a_unit_that_writes_an_input_passed_by_keyword_is_not_recomputable(spill_dir):
    """PyTorch's global pre-hook sees positional arguments only: ``layer(x=h)`` escaped the
    check, and recompute_all trained with silently wrong gradients."""
    torch.manual_seed(0)
    m, x = _PassesByKeyword(), torch.randn(64, 128)
    assert _recomputed_wrong_then_profiled(m, x, "halve", spill_dir) == {
        "pre": True,
        "halve": False,
        "b": True,
    }


def test_every_unit_kept_is_a_keep_pass(spill_dir):
    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        _step(m, x, prof.timing(keep=prof.unit_names))
        assert prof._cur.kind == "keep"
        p = prof.finish()
    finally:
        prof.offloader.close()
    assert p.passes[-1]["kind"] == "keep" and p.passes[-1]["kept"] == ["0", "1", "2"]


def test_timing_groups_are_predicted_under_the_budget(make_profile):
    from tensortier.planner.profiler import pass_plan, timing_groups
    from tensortier.planner.simulator import simulate

    GB = 10**9
    p = make_profile(n_units=4, tensor_bytes=GB, per_unit=2, bw=100 * GB)
    p.meta["profiled_tier"] = "disk"
    budget = 4 * GB + GB // 2  # two units' tensors fit, with the others on disk
    groups = timing_groups(p, budget, 3)
    assert len(groups) == 3
    for g in groups:
        run = {"kind": "t", "kept": g, "tier": "disk"}
        assert g and simulate(p, pass_plan(p, run)).peak_bytes <= budget
    assert {u for g in groups for u in g} == {u.name for u in p.units}  # every unit timed kept
    assert timing_groups(p, GB // 2, 2) == [[], []]  # nothing fits: every pass offloads all


def test_a_timing_pass_keeps_only_what_the_measured_passes_bound_under_the_budget(make_profile):
    """The simulator's peaks are fitted and can err low (issue 23: a fit on passes that kept small
    units put a pass that kept a layer 16% low, and it peaked at 1.03x the budget). A timing
    pass also stays under the bound the measured passes give: their peak plus the saved bytes
    of every unit kept now that they offloaded."""
    from tensortier.planner.profiler import measured_bound, pass_plan, timing_group
    from tensortier.planner.simulator import simulate

    GB = 10**9
    p = make_profile(n_units=4, tensor_bytes=GB, per_unit=2, bw=100 * GB)
    p.meta["profiled_tier"] = "disk"

    def keeping(kept: list[str]):
        return pass_plan(p, {"kept": kept, "tier": "disk"})

    assert [simulate(p, keeping(k)).peak_bytes for k in ([], ["h.0"])] == [GB, 3 * GB]
    p.passes = [{"kind": "probe", "kept": [], "peak_bytes": 2 * GB}]  # 1 GB the model misses
    assert measured_bound(p, keeping(["h.0"])) == 4 * GB  # the probe's peak and h.0's tensors
    assert timing_group(p, 3 * GB + GB // 2) == []  # the simulator fits h.0, measurement not
    assert timing_group(p, 4 * GB) == ["h.0"]
    p.passes.append({"kind": "offload", "kept": ["h.0"], "peak_bytes": 3 * GB + GB // 5})
    assert measured_bound(p, keeping([])) == 2 * GB  # the tightest measured pass bounds a group
    # h.0's pass and h.1's tensors
    assert measured_bound(p, keeping(["h.0", "h.1"])) == 5 * GB + GB // 5
    p.passes = []  # nothing measured (a profile planned offline): the simulator alone
    assert measured_bound(p, keeping(["h.0"])) is None
    assert timing_group(p, 3 * GB + GB // 2) == ["h.0"]


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


_CALIBRATION_HELD = """
import json, sys
import torch
from torch import nn
from tensortier._memory import HighWater, release_freed_memory, status_bytes
from tensortier.planner.profiler import Profiler

torch.manual_seed(0)
m = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(3)))
x = torch.randn(256, 128)
prof = Profiler(spill_dir=sys.argv[1], device=torch.device("cpu"), probe_bytes=2 << 20)
try:
    with prof.forward():
        loss = m(x).sum()
    loss.backward()
    release_freed_memory()
    start, watch = status_bytes("VmRSS"), HighWater()
    watch.start()
    p = prof.provisional()
    held = watch.stop() - start
finally:
    prof.offloader.close()
print(json.dumps({"codecs": sorted(p.codecs), "held": held}))
"""


@pytest.mark.skipif(not status_bytes("VmHWM"), reason="needs /proc/self/status")
def test_bandwidth_and_codec_calibration_are_sized_to_the_probe(spill_dir):
    """They run inside the first timing pass, so on a CPU inside its budget: the codec sample
    was a fixed 4 MiB of every codec, lossy ones too, which held ~27 MiB (a 36 MiB budget's
    first timing pass went to 66 MiB); with a 2 MiB probe it now holds a few MiB. In a fresh
    process: after the whole suite the same call held 15.7 MiB once (the heap other tests left),
    which is not what the calibration holds."""
    out = run_fresh(_CALIBRATION_HELD, spill_dir, timeout=300)
    assert out["codecs"] == ["lz4", "sparse", "zstd"]  # lossy codecs only when allowed
    assert out["held"] < 12 << 20, out


def test_the_probe_measures_every_moved_storage_in_pack_order(spill_dir):
    """The probe measured as an identity codec, which the offloader now encodes on the engine's
    copy workers: the measurements came back out of pack order (matched to the wrong tensors)
    and the probe iteration held its sources until then (30 MiB over a 36 MiB budget)."""
    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        prof._close_pass()
        records = prof._passes[0].records
    finally:
        prof.offloader.close()
    assert records and len(prof.probe.seen) == len(records)
    assert [s["nbytes"] for s in prof.probe.seen] == [r["nbytes"] for r in records]
    relu_outputs = [s for s, r in zip(prof.probe.seen, records) if r["grad_fn"] == "ReluBackward0"]
    assert relu_outputs and all(s["zero_frac"] > 0.3 for s in relu_outputs)


def test_passes_out_of_order_and_unknown_units_are_refused(spill_dir):
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
        with pytest.raises(ConfigError, match=r"keep=\['9'\]"), prof.timing(keep=["9"]):
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
        self.calls: list[str] = []  # the memory calls, in order

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

        def called(name):
            return lambda device=None: fake.calls.append(name)

        for name, fn in {
            "synchronize": sync,
            "empty_cache": called("empty_cache"),
            "reset_peak_memory_stats": called("reset_peak_memory_stats"),
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
    """A pass that keeps no unit not yet timed only calibrates move costs: it must not drain the
    copy streams at every unit boundary, its step time comes from events around the whole step."""
    fake = _FakeCuda().install(monkeypatch)
    m, x = _mlp(), torch.randn(256, 128)
    prof = Profiler(
        spill_dir=spill_dir,
        bandwidth=BW,
        codecs={},
        device=torch.device("cuda", 0),
        record_ops=False,
    )
    try:
        _step(m, x, prof.forward())
        syncs = {}
        for keep in (prof.unit_names, None):
            before = fake.syncs
            ctx = prof.timing(keep=keep)
            _step(m, x, ctx)
            syncs[prof._cur.kind] = fake.syncs - before
        p = prof.finish()
    finally:
        prof.offloader.close()
    units = len(p.units)
    assert syncs["keep"] >= 2 * units  # the keep pass times every unit: kernel time
    assert syncs["offload"] <= 2  # closing the keep pass, starting this one: never per unit
    last = p.passes[-1]
    assert last["step_s"] == pytest.approx(1.234)  # events: first kernel to last gradient
    # reserved (what the budget counts) and allocated (live tensors) beyond the 1 GiB at entry
    assert (last["peak_bytes"], last["allocated_bytes"]) == (4 * fake.GiB, 2 * fake.GiB)
    assert last["timed_step"] and not p.passes[1]["timed_step"]  # only it calibrates moves


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


def test_cuda_peak_meter_empties_the_cache_before_it_resets_the_peak(monkeypatch):
    """The reserved high-water mark starts at what is reserved at reset, cache included, and
    the delta is read against what is allocated: without emptying the cache first, every pass
    measured at least what earlier iterations left cached (issue 25)."""
    from tensortier.planner.profiler import PeakMeter

    fake = _FakeCuda().install(monkeypatch)
    with PeakMeter(torch.device("cuda", 0)):
        pass
    assert fake.calls == ["empty_cache", "reset_peak_memory_stats"]


@pytest.mark.gpu
def test_cuda_peak_meter_measures_the_pass_not_the_cache_before_it():
    """A pass that allocates 16 MiB after 256 MiB were freed into the cache: its delta was
    the 256 MiB cached before it (the reserved mark starts there), now its own footprint."""
    from tensortier.planner.profiler import PeakMeter

    dev = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    del big  # cached, not released
    with PeakMeter(dev) as meter:
        small = torch.empty(16 << 20, dtype=torch.uint8, device=dev)
    del small
    assert meter.delta < 64 << 20, meter.delta
    assert meter.peak_allocated - meter.start >= 16 << 20


@pytest.mark.gpu
def test_cuda_peak_meter_reads_reserved_memory():
    from tensortier.planner.profiler import PeakMeter

    dev = torch.device("cuda", torch.cuda.current_device())
    with PeakMeter(dev) as meter:
        keep = [torch.empty(3 << 20, dtype=torch.uint8, device=dev) for _ in range(8)]
        del keep[::2]  # holes: reserved stays above allocated
    assert meter.peak == torch.cuda.max_memory_reserved(dev)
    assert meter.peak >= meter.peak_allocated


def test_cuda_operator_events_are_recorded_on_the_profiled_devices_stream(monkeypatch):
    """The per-operator timing events were recorded on the *current* device's stream: a model
    profiled on cuda:1 while cuda:0 is current timed an idle stream (every operator ~0 s, so
    recomputing looked free). They go on the profiled device's current stream, where the
    operator runs."""
    from tensortier.planner.ops import OpRecorder

    recorded = []

    class Event:
        def __init__(self, **kw):
            pass

        def record(self, stream=None):
            recorded.append(stream)

        def elapsed_time(self, end):
            return 2.0

    def current_stream(device=None):
        return ("stream", None if device is None else torch.device(device))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    rec = OpRecorder(lambda: "0", torch.device("cuda", 1))
    with rec:
        torch.ones(4).mul(2)
    rec.resolve()
    assert recorded and set(recorded) == {("stream", torch.device("cuda", 1))}, recorded
    assert [r["seconds"] for r in rec.ops["0"]] == [2e-3] * len(rec.ops["0"])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_cuda_operator_times_on_a_device_that_is_not_current():
    """Profiling a model on cuda:1 with cuda:0 current: the recorded matmul time is the
    kernel's (events on cuda:1's stream), not the gap between two events on idle cuda:0."""
    from tensortier.planner.ops import OpRecorder

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    a = torch.randn(4096, 4096, device=dev)
    a @ a  # warm-up: cuBLAS handle and workspace of cuda:1
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(dev))
    a @ a
    end.record(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    kernel_s = start.elapsed_time(end) / 1e3
    rec = OpRecorder(lambda: "0", dev)
    with rec:
        a @ a
    torch.cuda.synchronize(dev)
    rec.resolve()
    (mm,) = [r for r in rec.ops["0"] if "mm" in r["name"]]
    assert 0.5 * kernel_s < mm["seconds"] < 2 * kernel_s, (mm["seconds"], kernel_s)


def test_a_timing_pass_keeps_part_of_the_units_it_does_not_keep_whole(spill_dir):
    """A unit too large to keep whole was never kept in a timing pass, so the fit only knew
    passes that offloaded nearly everything (issue 23): a pass can keep the tensors ``parts``
    names (unit -> ordinals, as a partial swap names them), and its plan says so."""
    from tensortier.planner.profiler import pass_plan, unit_of
    from tensortier.planner.simulator import ordinals

    p_units = ["0", "1", "2"]
    m, x = _mlp(), torch.randn(256, 128)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        _step(m, x, prof.timing(keep=["0"], parts={"2": [0]}))
        moved = [r["module"] for r in prof.offloader.records]
        p = prof.finish()
    finally:
        prof.offloader.close()
    ordinal = ordinals(p)
    run = p.passes[-1]
    assert run["kept"] == ["0"] and run["parts"] == {"2": [0]}
    plan = pass_plan(p, run)
    stayed = {t.index for t in p.tensors if plan.tier_of(t, ordinal[t.index]) == "keep"}
    assert stayed == {t.index for t in p.tensors if t.unit in ("0", "2")}
    went = [t for t in p.tensors if t.index not in stayed]  # unit 1's: what the offloader moved
    assert [unit_of(m, p_units) for m in moved] == [t.unit for t in went] == ["1"] * len(went)
    with pytest.raises(ConfigError, match="not planning units"):
        prof.timing(parts={"9": [0]}).__enter__()


def test_timing_parts_fill_the_room_with_the_smallest_tensors_of_every_unit(make_profile):
    from tensortier.planner.profiler import measured_bound, pass_plan, timing_parts
    from tensortier.planner.simulator import simulate

    GB = 10**9
    p = make_profile(n_units=3, tensor_bytes=GB, per_unit=2, bw=100 * GB)
    p.tensors[1].nbytes = p.tensors[3].nbytes = p.tensors[5].nbytes = GB // 4  # each unit's 2nd
    p.meta["profiled_tier"] = "disk"
    p.passes = [{"kind": "probe", "kept": [], "peak_bytes": 2 * GB}]
    # room for two quarters over the probe's measured 2 GB: h.0's and h.1's, alike, in turn
    assert timing_parts(p, 2 * GB + GB // 2, []) == {"h.0": [1], "h.1": [1]}
    assert timing_parts(p, 4 * GB, ["h.0"]) == {"h.1": [1], "h.2": [1]}  # beside h.0 whole
    parts = timing_parts(p, 5 * GB, ["h.0"])  # the quarters first, then a whole tensor
    assert parts == {"h.1": [0, 1], "h.2": [1]}
    plan = pass_plan(p, {"kept": ["h.0"], "parts": parts})
    assert measured_bound(p, plan) == 2 * GB + 2 * (GB + GB // 4) + GB // 4
    assert simulate(p, plan).peak_bytes <= 5 * GB
    assert timing_parts(p, GB, []) == {}  # no room: the pass offloads every tensor


def test_the_bandwidth_probe_moves_through_as_many_io_threads_as_the_offloader(
    spill_dir, monkeypatch
):
    """The disk bandwidth prices the offloader's moves: four I/O threads measured 4 MiB chunks
    faster than the one thread a small CPU budget runs with (issue 27)."""
    from tensortier.planner.runtime import planned_offload
    from tensortier.tiers import disk as disk_module

    made: dict[str, list[int]] = {}
    init = disk_module.DiskStore.__init__

    def spy(self, *args, io_threads: int = 4, owner: str = "tensortier", **kw):
        made.setdefault(owner, []).append(io_threads)
        init(self, *args, io_threads=io_threads, owner=owner, **kw)

    monkeypatch.setattr(disk_module.DiskStore, "__init__", spy)
    m, x = _mlp(), torch.randn(256, 128)
    off = planned_offload("32MiB", spill_dir=spill_dir, policy="swap_all")
    try:
        for _ in range(5):
            _step(m, x, off)
        threads = off._io_threads()
    finally:
        off.close()
    assert threads == 1  # a budget under 256 MiB on a CPU
    assert made["tt-plan"] == [threads]


def test_the_probe_offers_no_cast_that_would_turn_a_tensor_into_inf():
    """With allow_lossy the planner chose fp16 wherever it was fastest: an activation beyond
    +-65504 came back inf (NaN gradients). The probe now offers only the casts that fit it."""
    from tensortier.planner.profiler import ProbeCodec

    probe = ProbeCodec(("sparse", "fp16", "bf16"))
    probe.see(torch.tensor([1.0, 0.0, 7e4, -2.0]))
    probe.see(torch.tensor([1.0, 0.0, 6e4, -2.0]))
    assert set(probe.seen[0]["ratios"]) == {"sparse", "bf16"}
    assert set(probe.seen[1]["ratios"]) == {"sparse", "fp16", "bf16"}


def _recomputed_wrong_then_profiled(m: nn.Module, x: torch.Tensor, unit: str, spill_dir) -> dict:
    """Shows that recomputing ``unit`` changes the gradients (or raises autograd's in-place
    error), then returns each unit's ``recomputable`` from a profiled step."""
    from tensortier.planner.runtime import Recompute

    m(x).sum().backward()
    plain = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    rc = Recompute(m, [unit])
    try:
        m(x).sum().backward()
        assert not all(torch.equal(a, p.grad) for a, p in zip(plain, m.parameters()))
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    rc.remove()
    m.zero_grad(set_to_none=True)
    prof = _profiler(spill_dir)
    try:
        _step(m, x, prof.forward())
        p = prof.finish()
    finally:
        prof.offloader.close()
    return {u.name: u.recomputable for u in p.units}
