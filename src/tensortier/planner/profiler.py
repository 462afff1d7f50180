"""Profiles one real training iteration into a :class:`Profile`.

The iteration runs under the activation offloader with ``record=True`` and a ``decide`` that sends
every saved tensor to one tier (``disk`` by default, so profiling itself stays within a tight
budget) through a *probe* codec: an identity codec that, while it holds the tensor, measures its
zero fraction and the payload ratio of every codec. Module hooks time each planning unit's forward
(pre/post hooks) and backward (a hook on the gradient of the unit's output), and a peak meter
reads the memory high-water mark. Pack and unpack seconds are subtracted from the unit times, so
the profile holds compute time, and the simulator adds transfers back per plan.

Planning units are the modules one action applies to: the root's children, with ``ModuleList``/
``ModuleDict`` containers and every module that holds a stack of repeated blocks opened
(transformer blocks, embeddings, heads; the layers of a ``Sequential`` model; the layers nested
inside a Hugging Face model). Recompute works at that granularity through
``torch.utils.checkpoint``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from tensortier.planner.profile import Bandwidth, Profile, TensorProfile, UnitProfile
from tensortier.tiers.codecs import (
    LOSSLESS_CODECS,
    LOSSY_CODECS,
    CodecSpeed,
    accepts,
    estimate_ratio,
)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # hold modules but have no forward of their own
_STACKS = (nn.ModuleList, nn.Sequential)  # where repeated blocks live


def _structure(module: nn.Module, memo: dict[int, tuple]) -> tuple:
    """What makes two blocks interchangeable for planning: types, names, parameter shapes."""
    key = id(module)
    if key not in memo:
        params = tuple(
            (n, tuple(p.shape), str(p.dtype))
            for n, p in module._parameters.items()
            if p is not None
        )
        children = tuple((n, _structure(c, memo)) for n, c in module.named_children())
        memo[key] = (type(module).__qualname__, params, children)
    return memo[key]


def _is_stack(module: nn.Module, memo: dict[int, tuple]) -> bool:
    """A ModuleList/Sequential of two or more structurally identical blocks with parameters
    (``transformer.h``, ``model.layers``, ``encoder.layer``)."""
    if not isinstance(module, _STACKS):
        return False
    blocks = list(module.children())
    if len(blocks) < 2 or next(blocks[0].parameters(), None) is None:
        return False
    first = _structure(blocks[0], memo)
    return all(_structure(b, memo) == first for b in blocks[1:])


def plan_units(root: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every planning unit under ``root`` (definition order).

    The root's children are units, except that ``ModuleList``/``ModuleDict`` containers, stacks
    of repeated blocks and every module that holds a stack somewhere below it are opened: their
    children become units instead. A Hugging Face model (``GPT2LMHeadModel``: ``transformer``
    and ``lm_head``) thus plans per layer (``transformer.h.0``, ...) and keeps its embeddings,
    final norm and head as units of their own. A block of a stack is never opened.
    """
    memo: dict[int, tuple] = {}
    holds: dict[int, bool] = {}

    def holds_stack(module: nn.Module) -> bool:
        key = id(module)
        if key not in holds:
            holds[key] = _is_stack(module, memo) or any(holds_stack(c) for c in module.children())
        return holds[key]

    out: dict[str, nn.Module] = {}

    def walk(module: nn.Module, prefix: str, top: bool) -> None:
        children = list(module.named_children())
        opened = top or isinstance(module, _CONTAINERS) or holds_stack(module)
        if opened and children:
            stack = _is_stack(module, memo)
            for name, child in children:
                path = f"{prefix}.{name}" if prefix else name
                if stack:
                    out[path] = child  # one block: a unit, never opened
                else:
                    walk(child, path, False)
        elif not top:
            out[prefix] = module

    walk(root, "", True)
    return out


def unit_of(module_name: str, units: list[str]) -> str:
    """The unit that contains ``module_name`` ("" when none does)."""
    best = ""
    for u in units:
        if (module_name == u or module_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class ProbeCodec:
    """Identity codec that measures what the planner needs while it sees each saved tensor."""

    name = "probe"
    lossless = True

    def __init__(self, codecs: tuple[str, ...]):
        self.codecs = codecs
        self.seen: list[dict] = []  # in pack order, one per offloaded storage

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        from tensortier.tiers.codecs import zero_fraction

        t0 = time.perf_counter()
        z = zero_fraction(t)
        ratios = {
            c: estimate_ratio(c, t, zero_frac=z, sample_bytes=256 << 10)
            for c in self.codecs
            if accepts(c, t.dtype)
        }
        nbytes = t.numel() * t.element_size()
        self.seen.append(
            {
                "zero_frac": z,
                "ratios": ratios,
                "probe_s": time.perf_counter() - t0,
                "nbytes": nbytes,
            }
        )
        return [t], {}

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor:
        return payloads[0]


class PeakMeter:
    """High-water mark of device memory (CUDA allocator) or of process RSS (CPU).

    CUDA: ``peak`` is the *reserved* high-water mark (``max_memory_reserved``: segments,
    fragmentation and per-stream pools; what an out-of-memory is measured against), ``start``
    what was allocated at entry, so ``delta`` is what the pass needed beyond the live tensors it
    started with. Memory the allocator had cached at entry counts (the pass could use it): after
    a warm-up of the same shape that is the iteration's own need. ``peak_allocated`` keeps
    ``max_memory_allocated`` for reports.
    CPU: on Linux the RSS high-water mark is reset on entry (``/proc/self/clear_refs``) and read
    back (``VmHWM``) on exit, so the peak is exact and no earlier high hides it; elsewhere a
    thread samples RSS every ``interval`` seconds.
    """

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self.interval = device, interval
        self.start = self.peak = self.peak_allocated = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # bounded: kernels this process queued
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = self.peak = self.peak_allocated = torch.cuda.memory_allocated(self.device)
            return self
        from tensortier._device import rss_bytes

        self._hwm = _reset_hwm()
        self.start = self.peak = rss_bytes()
        if self._hwm:
            return self

        def sample() -> None:
            while not self._stop.wait(self.interval):
                self.peak = max(self.peak, rss_bytes())

        self._thread = threading.Thread(target=sample, daemon=True, name="tt-peak")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pass's own kernels: they finish
            self.peak_allocated = torch.cuda.max_memory_allocated(self.device)
            self.peak = max(self.peak_allocated, torch.cuda.max_memory_reserved(self.device))
            return
        if self._hwm:
            self.peak = self.peak_allocated = max(self.start, _status_bytes("VmHWM"))
            return
        self._stop.set()
        if self._thread is not None:
            # bounded: the sampler checks the stop event every ``interval`` seconds
            self._thread.join(timeout=max(1.0, 10 * self.interval))
        self.peak_allocated = self.peak

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.start)


def release_freed_memory(threshold: int = 128 << 10) -> bool:
    """Make glibc return freed blocks of ``threshold`` bytes or more to the OS (``mallopt``).

    glibc's adaptive mmap threshold otherwise serves activations from the heap after the first
    free, and the process's RSS never falls below the plain peak: offloading would save nothing
    that a CPU memory budget can see. Same effect as ``MALLOC_MMAP_THRESHOLD_=131072``. Returns
    whether it applied (False off glibc).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(
            libc.mallopt(m_trim_threshold, threshold)
        )
    except (OSError, AttributeError):
        return False


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Profiler:
    """Records one probed forward + backward, then optional clean timing iterations.

    >>> prof = Profiler(spill_dir="/mnt/nvme/tt")
    >>> with prof.forward():          # pass 1: every saved tensor, its sparsity and codec ratios
    ...     loss = model(x)
    >>> loss.backward()
    >>> for _ in range(2):            # timing passes: compute time without the probe's overhead
    ...     with prof.timing():
    ...         loss = model(x)
    ...     loss.backward()
    >>> profile = prof.finish()

    Pass 1's compute times include the probe (zero counting and codec trials on every tensor) and
    the disk traffic of every saved tensor; on the 2-core CI machine that doubled them. When the
    whole iteration fits in free memory, timing passes alternate: one with nothing offloaded (the
    compute time a plan adds its transfers to; its peak calibrates the transient memory model),
    then one with everything on ``tier`` without the probe (its step time calibrates what a moved
    byte costs the compute, see :func:`calibrate`). Otherwise every timing pass offloads and pack
    and unpack time are subtracted. Each unit keeps its fastest time over the passes: a shared
    host's CPU steal only adds time.
    On CUDA the hooks of the passes that time units synchronize, so the times are kernel time,
    not launch time; an offload pass after a keep pass times only the whole step, with CUDA
    events (first kernel to last gradient), so its copies overlap compute as in a plan.
    """

    def __init__(
        self,
        *,
        spill_dir: str | None = None,
        tier: str = "disk",
        bandwidth: Bandwidth | None = None,
        codecs: dict[str, CodecSpeed] | None = None,
        allow_lossy: bool = False,
        prefetch: int = 256 << 20,
        host_budget: int = 8 << 30,
        device: torch.device | None = None,
        offloader=None,
        timing: str = "auto",
    ):
        from tensortier._device import default_device
        from tensortier.errors import ConfigError

        if timing not in ("auto", "keep", "offload"):
            raise ConfigError(f"timing must be 'auto', 'keep' or 'offload', got {timing!r}")
        self.device = device or default_device()
        self.spill_dir, self.tier = spill_dir, tier
        self.bandwidth = bandwidth
        self.codecs = codecs
        names = LOSSLESS_CODECS + (LOSSY_CODECS if allow_lossy else ())
        self.probe = ProbeCodec(names)
        self.prefetch, self.host_budget = prefetch, host_budget
        self.timing_mode = timing
        self.root: nn.Module | None = None
        self.units: dict[int, str] = {}  # id(module) -> unit name
        self.inputs: dict[str, int] = {}
        self.grads: dict[str, int] = {}
        self.order: list[str] = []
        self.offloader = offloader  # reuse the warm-up's: its buffers are not this iteration's
        self._hooks: list = []
        self._param_hooks: list = []
        self._passes: list[_Pass] = []  # [0] is the probe pass, then the timing passes
        self._cur: _Pass | None = None
        self.tensors: list[TensorProfile] = []

    # ------------------------------------------------------------------ hooks
    def _now(self, cur: _Pass | None = None) -> float:
        """Host time; on CUDA in a pass that times its units, after the queued kernels ran."""
        if self.device.type == "cuda" and (cur is None or cur.sync_units):
            torch.cuda.synchronize(self.device)  # bounded: kernels this pass queued so far
        return time.perf_counter()

    def _pre(self, module: nn.Module, args) -> None:
        cur = self._cur
        if cur is None:
            return
        if self.root is None:
            self.root = module
            named = plan_units(module)
            self.units = {id(m): n for n, m in named.items()}
            seen: set[int] = set()
            for name in reversed(list(named)):  # grads are allocated by the first backward
                ptrs = []
                for p in named[name].parameters():
                    if p.requires_grad and p.untyped_storage().data_ptr() not in seen:
                        seen.add(p.untyped_storage().data_ptr())
                        ptrs.append(p.numel() * p.element_size())
                self.grads[name] = sum(ptrs)
            for p in module.parameters():  # the last accumulation ends the backward
                if p.requires_grad:
                    self._param_hooks.append(p.register_post_accumulate_grad_hook(self._grad_done))
        name = self.units.get(id(module))
        if name is not None and name not in cur.fwd:  # not again while a checkpoint recomputes
            if len(self._passes) == 0:
                self.order.append(name)
                self.inputs[name] = sum(t.untyped_storage().nbytes() for t in _tensors(args))
            cur.fwd[name] = [self._now(cur), 0.0]

    def _post(self, module: nn.Module, args, output) -> None:
        cur = self._cur
        name = self.units.get(id(module))
        if cur is None or name is None or name not in cur.fwd or cur.fwd[name][1]:
            return
        cur.fwd[name][1] = self._now(cur)
        outs = [t for t in _tensors(output) if t.requires_grad]
        if outs:

            def mark(grad, name=name, cur=cur):
                cur.grad_at.setdefault(name, self._now(cur))

            outs[0].register_hook(mark)

    def _grad_done(self, param) -> None:
        cur = self._cur
        if cur is None or not cur.t_fwd_end:
            return
        if cur.end_event is not None:  # CUDA, no unit timing: mark the stream, do not drain it
            cur.end_event.record(torch.cuda.current_stream(self.device))
            cur.last_grad = time.perf_counter()
        else:
            cur.last_grad = self._now(cur)

    @contextmanager
    def _pass(self, kind: str, offloader, *, sync_units: bool = True) -> Iterator[Profiler]:
        self._close_pass()
        cur = self._cur = _Pass(kind, sync_units=sync_units)
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),
        ]
        cur.meter = PeakMeter(self.device).__enter__()  # CUDA: synchronizes first
        if self.device.type == "cuda" and not sync_units:
            stream = torch.cuda.current_stream(self.device)
            cur.start_event = torch.cuda.Event(enable_timing=True)
            cur.end_event = torch.cuda.Event(enable_timing=True)
            cur.start_event.record(stream)
        cur.t_fwd = time.perf_counter()
        try:
            if offloader is None:
                yield self
            else:
                with offloader:
                    yield self
        finally:
            cur.t_fwd_end = self._now(cur)
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def _close_pass(self) -> None:
        """The pass whose backward has run: read its peak and its offloader's records."""
        cur, self._cur = self._cur, None
        if cur is None:
            return
        cur.meter.__exit__(None, None, None)  # CUDA: synchronizes (this pass's kernels) first
        cur.t_end = cur.last_grad or time.perf_counter()
        if cur.end_event is not None and cur.last_grad:  # device time, first kernel to last grad
            cur.t_end = cur.t_fwd + cur.start_event.elapsed_time(cur.end_event) / 1e3
        if cur.kind != "keep" and self.offloader is not None:
            cur.records = sorted(self.offloader.records, key=lambda r: r["index"])
        self._passes.append(cur)

    @contextmanager
    def forward(self) -> Iterator[Profiler]:
        """Pass 1: run the forward to profile inside this block (once), then ``backward()``."""
        from tensortier.activations import Action, Offloader
        from tensortier.errors import ConfigError

        if self._passes or self._cur is not None:
            raise ConfigError("Profiler.forward() runs once; use Profiler.timing() afterwards")
        probe, tier = self.probe, self.tier

        def decide(info):
            return Action(tier, probe)

        if self.offloader is None:
            self.offloader = Offloader(
                "disk" if tier == "disk" else "host",
                spill_dir=self.spill_dir,
                decide=decide,
                record=True,
                prefetch=self.prefetch,
                host_budget=self.host_budget,
            )
        else:
            self.offloader.decide, self.offloader.record = decide, True
            self.offloader.records = []
        with self._pass("probe", self.offloader):
            yield self

    @contextmanager
    def timing(self) -> Iterator[Profiler]:
        """A timing pass (after pass 1's backward; repeatable): see the class docstring."""
        from tensortier.activations import Action
        from tensortier.errors import ConfigError

        if not self._passes and self._cur is None:
            raise ConfigError("run Profiler.forward() (and its backward) before a timing pass")
        self._close_pass()
        kind = self.timing_mode
        if kind == "auto":  # keep, offload, keep, ...: the offload passes calibrate move costs
            keep_next = len(self._passes) % 2 == 1
            kind = "keep" if keep_next and self._keep_fits() else "offload"
        if kind == "keep":
            with self._pass("keep", None):
                yield self
            return
        tier = self.tier
        self.offloader.decide = lambda info: Action(tier)
        self.offloader.record, self.offloader.records = True, []
        # Once a keep pass gave the unit times, an offload pass only times the whole step (it
        # calibrates move_s_per_byte): synchronizing at every unit boundary would drain the copy
        # streams there and charge the compute for transfers a plan overlaps.
        sync_units = not any(p.kind == "keep" for p in self._passes)
        with self._pass("offload", self.offloader, sync_units=sync_units):
            yield self

    def _keep_fits(self) -> bool:
        """Whether an iteration that keeps every saved tensor fits in free memory, with room."""
        probe = self._passes[0]
        need = 2 * sum(int(r["nbytes"]) for r in probe.records)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device
            )
            return need <= 0.8 * (free + cached)
        import psutil

        return need <= 0.5 * psutil.virtual_memory().available

    def finish(self, *, meta: dict | None = None, offload_overhead: int = 0) -> Profile:
        """After the last ``backward()``: the profile (measures bandwidth if not given)."""
        self._close_pass()
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        if not self._passes:
            from tensortier.errors import ConfigError

            raise ConfigError("nothing profiled: run Profiler.forward() and backward() first")
        probe, timed = self._passes[0], self._passes[1:]
        unit_names = list(self.order)
        tensors = self._tensors(probe, unit_names)
        # compute time of every pass, with the offloader's own work taken out
        keep = [p for p in timed if p.kind == "keep"]
        offload = [p for p in timed if p.kind == "offload"]
        runs = [_times(p, unit_names, tensors) for p in (keep or offload or [probe])]
        units = []
        for n in unit_names:
            units.append(
                UnitProfile(
                    name=n,
                    fwd_s=min(r["fwd"][n] for r in runs),
                    bwd_s=min(r["bwd"][n] for r in runs),
                    input_bytes=self.inputs.get(n, 0),
                    grad_bytes=self.grads.get(n, 0),
                    recomputable=True,
                )
            )
        if any(t.unit == "" for t in tensors):
            units.append(UnitProfile("", 0.0, 0.0, recomputable=False))
        with own_rng(self.device):
            bw = self.bandwidth or _bandwidth(self.spill_dir, self.device)
            codecs = self.codecs or _codec_speeds()
        return Profile(
            device=self.device.type,
            units=units,
            tensors=tensors,
            bandwidth=bw,
            codecs=codecs,
            unified=self.device.type != "cuda",
            other_fwd_s=min(r["other_fwd"] for r in runs),
            other_bwd_s=min(r["other_bwd"] for r in runs),
            prefetch_bytes=self.prefetch,
            offload_overhead_bytes=offload_overhead if self.device.type != "cuda" else 0,
            host_budget=self.host_budget if self.device.type == "cuda" else None,
            measured_peak_bytes=probe.meter.delta,
            measured_step_s=min(p.t_end - p.t_fwd for p in (keep or offload or [probe])),
            keep_peak_bytes=min(p.meter.delta for p in keep) if keep else None,
            offload_step_s=min(p.t_end - p.t_fwd for p in offload) if keep and offload else None,
            meta={
                "profiled_tier": self.tier,
                "timing": "keep" if keep else ("offload" if offload else "probe"),
                "timing_passes": len(timed),
                **(meta or {}),
            },
        )

    def _tensors(self, probe: _Pass, unit_names: list[str]) -> list[TensorProfile]:
        tensors = []
        probes = iter(self.probe.seen)  # one per record that went through the codec, in order
        pending = next(probes, None)
        for r in probe.records:
            seen = {"zero_frac": 0.0, "ratios": {}, "probe_s": 0.0}
            if pending is not None and pending["nbytes"] == r["nbytes"]:
                seen, pending = pending, next(probes, None)
            tensors.append(
                TensorProfile(
                    index=r["index"],
                    unit=unit_of(r["module"], unit_names),
                    nbytes=int(r["nbytes"]),
                    dtype=str(r["dtype"]).removeprefix("torch."),
                    shape=list(r["shape"]),
                    module=r["module"],
                    op=r["grad_fn"],
                    zero_frac=seen["zero_frac"],
                    ratios=seen["ratios"],
                    pack_s=max(0.0, r["pack_s"] - seen["probe_s"]),
                    unpack_s=r["unpack_s"],
                )
            )
        return tensors


@dataclass
class _Pass:
    """Timestamps of one profiled iteration."""

    kind: str  # "probe", "keep" or "offload"
    sync_units: bool = True  # CUDA: synchronize at unit boundaries (unit times are used)
    fwd: dict[str, list[float]] = field(default_factory=dict)  # unit -> [start, end]
    grad_at: dict[str, float] = field(default_factory=dict)  # unit -> its output's gradient
    t_fwd: float = 0.0
    t_fwd_end: float = 0.0
    last_grad: float = 0.0  # the last parameter gradient accumulated: the backward's end
    t_end: float = 0.0
    records: list[dict] = field(default_factory=list)  # the offloader's, when it ran
    meter: PeakMeter | None = None
    start_event: torch.cuda.Event | None = None  # CUDA passes that do not time units
    end_event: torch.cuda.Event | None = None


def _times(p: _Pass, unit_names: list[str], tensors: list[TensorProfile]) -> dict:
    """Per-unit forward/backward compute seconds of one pass, pack/unpack (and probe) removed."""
    unit_of_index = {t.index: t.unit for t in tensors}
    pack: dict[str, float] = {}
    unpack: dict[str, float] = {}
    for r in p.records:  # a keep pass has none
        u = unit_of_index.get(r["index"], "")
        pack[u] = pack.get(u, 0.0) + r["pack_s"]  # the probe's work happened inside pack
        unpack[u] = unpack.get(u, 0.0) + r["unpack_s"]
    # backward: a unit runs from the gradient of its output to the next gradient event
    events = sorted((t, n) for n, t in p.grad_at.items())
    bwd_raw: dict[str, float] = {}
    for i, (t, n) in enumerate(events):
        nxt = events[i + 1][0] if i + 1 < len(events) else p.t_end
        bwd_raw[n] = max(0.0, nxt - t)
    first_grad = events[0][0] if events else p.t_end
    fwd, bwd = {}, {}
    for n in unit_names:
        f0, f1 = p.fwd.get(n, (0.0, 0.0))
        fwd[n] = max(0.0, f1 - f0 - pack.get(n, 0.0))
        bwd[n] = max(0.0, bwd_raw.get(n, 0.0) - unpack.get(n, 0.0))
    unit_fwd = sum(f1 - f0 for f0, f1 in p.fwd.values())
    return {
        "fwd": fwd,
        "bwd": bwd,
        "other_fwd": max(0.0, p.t_fwd_end - p.t_fwd - unit_fwd - pack.get("", 0.0)),
        "other_bwd": max(0.0, first_grad - p.t_fwd_end - unpack.get("", 0.0)),
    }


@contextmanager
def own_rng(device: torch.device) -> Iterator[None]:
    """Run the planner's own work under a forked RNG (CPU and ``device``'s CUDA generator).

    Training must draw the same dropout masks with the planner as without it: whatever the
    planner draws (bandwidth probe data, codec samples) is undone when the block ends.
    """
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def _bandwidth(spill_dir: str | None, device: torch.device) -> Bandwidth:
    from tensortier.planner.profile import measure_bandwidth

    return measure_bandwidth(spill_dir, device=device)


def _codec_speeds() -> dict[str, CodecSpeed]:
    from tensortier.planner.profile import measure_codec_speeds

    return measure_codec_speeds()


def calibrate(profile: Profile) -> Profile:
    """Fits the two constants the simulator cannot know from first principles to measurement.

    * ``transient_factor``: so that the simulated ``keep`` plan peaks where the measured keep
      iteration did (``keep_peak_bytes``). Without it the default (1.5: in backward a saved
      tensor, its gradient and a temporary of about half its size coexist) stays, as it does
      when the measured peak is below the saved bytes (an allocator reused freed heap memory,
      so RSS did not see the iteration).
    * ``move_s_per_byte``: compute time lost per byte moved, so that the simulated all-offload
      plan takes as long as the measured offload iteration (``offload_step_s``). On a CPU the
      copy threads share the cores with compute; on a GPU this comes out near zero.

    The probe pass's own peak and time are never used: the probe adds work a plan does not have.
    """
    from tensortier.planner.simulator import Mode, Plan, UnitAction, simulate

    # a peak below the saved bytes did not see live memory (freed heap reused): not a measurement
    if profile.tensors and (profile.keep_peak_bytes or 0) >= profile.saved_bytes:
        target = profile.keep_peak_bytes
        keep = Plan("keep", {})

        def peak(f: float) -> int:
            profile.transient_factor = f
            return simulate(profile, keep).peak_bytes

        lo, hi = 0.0, 8.0
        if peak(lo) >= target:
            hi = lo
        elif peak(hi) <= target:
            lo = hi
        for _ in range(30):  # the peak grows monotonically with the factor
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if peak(mid) < target else (lo, mid)
        profile.transient_factor = hi
    if profile.offload_step_s and profile.tensors:
        tier = Mode(profile.meta.get("profiled_tier", "disk"))
        every = Plan("offload", {u.name: UnitAction(tier) for u in profile.units})
        profile.move_s_per_byte = 0.0
        predicted = simulate(profile, every).step_s
        moved = 2 * profile.saved_bytes  # out in forward, back in backward
        profile.move_s_per_byte = max(0.0, (profile.offload_step_s - predicted) / moved)
    return profile
