"""Profiles one real training iteration into a :class:`Profile`.

The iteration runs under the activation offloader with ``record=True`` and a ``decide`` that sends
every saved tensor to one tier (``disk`` by default, so profiling itself stays within a tight
budget) through a *probe* codec: an identity codec that, while it holds the tensor, measures its
zero fraction and the payload ratio of every codec. Module hooks time each planning unit's forward
(pre/post hooks) and backward (a hook on the gradient of the unit's output), and a peak meter
reads the memory high-water mark. Pack and unpack seconds are subtracted from the unit times, so
the profile holds compute time, and the simulator adds transfers back per plan.

Planning units are the modules one action applies to: the root's children, with ``ModuleList``/
``ModuleDict`` containers opened (transformer blocks, embeddings, heads; the layers of a
``Sequential`` model). Recompute works at that granularity through ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

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


def plan_units(root: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every planning unit under ``root`` (definition order)."""
    out: dict[str, nn.Module] = {}

    def walk(module: nn.Module, prefix: str, top: bool) -> None:
        children = list(module.named_children())
        if (top or isinstance(module, _CONTAINERS)) and children:
            for name, child in children:
                walk(child, f"{prefix}.{name}" if prefix else name, False)
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

    On Linux the RSS high-water mark is reset on entry (``/proc/self/clear_refs``) and read back
    (``VmHWM``) on exit, so the peak is exact and no earlier high hides it; elsewhere a thread
    samples RSS every ``interval`` seconds.
    """

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self.interval = device, interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = self.peak = torch.cuda.memory_allocated(self.device)
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
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        if self._hwm:
            self.peak = max(self.start, _status_bytes("VmHWM"))
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

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
    """Records one forward + backward. Use :meth:`forward` around the forward pass, then
    call :meth:`finish` after ``backward()`` to get the :class:`Profile`.

    >>> prof = Profiler(spill_dir="/mnt/nvme/tt")
    >>> with prof.forward():
    ...     loss = model(x)
    >>> loss.backward()
    >>> profile = prof.finish()
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
    ):
        from tensortier._device import default_device

        self.device = device or default_device()
        self.spill_dir, self.tier = spill_dir, tier
        self.bandwidth = bandwidth
        self.codecs = codecs
        names = LOSSLESS_CODECS + (LOSSY_CODECS if allow_lossy else ())
        self.probe = ProbeCodec(names)
        self.prefetch, self.host_budget = prefetch, host_budget
        self.root: nn.Module | None = None
        self.units: dict[int, str] = {}  # id(module) -> unit name
        self.fwd: dict[str, list[float]] = {}
        self.grad_at: dict[str, float] = {}
        self.inputs: dict[str, int] = {}
        self.grads: dict[str, int] = {}
        self.order: list[str] = []
        self.offloader = offloader  # reuse the warm-up's: its buffers are not this iteration's
        self._hooks: list = []
        self._t_fwd = self._t_fwd_end = self._t_bwd_end = 0.0
        self._meter: PeakMeter | None = None

    # ------------------------------------------------------------------ hooks
    def _pre(self, module: nn.Module, args) -> None:
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
        name = self.units.get(id(module))
        if name is not None and name not in self.fwd:
            self.order.append(name)
            self.inputs[name] = sum(t.untyped_storage().nbytes() for t in _tensors(args))
            self.fwd[name] = [time.perf_counter(), 0.0]

    def _post(self, module: nn.Module, args, output) -> None:
        name = self.units.get(id(module))
        if name is None or name not in self.fwd or self.fwd[name][1]:
            return
        self.fwd[name][1] = time.perf_counter()
        outs = [t for t in _tensors(output) if t.requires_grad]
        if outs:

            def mark(grad, name=name):
                self.grad_at.setdefault(name, time.perf_counter())

            outs[0].register_hook(mark)

    @contextmanager
    def forward(self) -> Iterator[Profiler]:
        """Run the forward pass to profile inside this block (once)."""
        from tensortier.activations import Action, Offloader

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
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),
        ]
        self._meter = PeakMeter(self.device).__enter__()
        self._t_fwd = time.perf_counter()
        try:
            with self.offloader:
                yield self
        finally:
            self._t_fwd_end = time.perf_counter()
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def finish(self, *, meta: dict | None = None, offload_overhead: int = 0) -> Profile:
        """After ``backward()``: the profile of the iteration (measures bandwidth if not given)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_end = time.perf_counter()
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
        off = self.offloader
        records = sorted(off.records, key=lambda r: r["index"]) if off is not None else []
        unit_names = list(self.order)
        tensors = []
        probes = iter(self.probe.seen)  # one per record that went through the codec, in order
        pending = next(probes, None)
        seen: dict[int, float] = {}
        for r in records:
            probe = {"zero_frac": 0.0, "ratios": {}, "probe_s": 0.0}
            if pending is not None and pending["nbytes"] == r["nbytes"]:
                probe, pending = pending, next(probes, None)
            seen[r["index"]] = probe["probe_s"]
            tensors.append(
                TensorProfile(
                    index=r["index"],
                    unit=unit_of(r["module"], unit_names),
                    nbytes=int(r["nbytes"]),
                    dtype=str(r["dtype"]).removeprefix("torch."),
                    shape=list(r["shape"]),
                    module=r["module"],
                    op=r["grad_fn"],
                    zero_frac=probe["zero_frac"],
                    ratios=probe["ratios"],
                    pack_s=max(0.0, r["pack_s"] - probe["probe_s"]),
                    unpack_s=r["unpack_s"],
                )
            )
        # backward: a unit runs from the gradient of its output to the next gradient event
        events = sorted((t, n) for n, t in self.grad_at.items())
        bwd: dict[str, float] = {}
        for i, (t, n) in enumerate(events):
            nxt = events[i + 1][0] if i + 1 < len(events) else t_end
            bwd[n] = max(0.0, nxt - t)
        first_grad = events[0][0] if events else t_end
        units = []
        for n in unit_names:
            ts = [t for t in tensors if t.unit == n]
            f0, f1 = self.fwd[n]
            units.append(
                UnitProfile(
                    name=n,
                    fwd_s=max(0.0, f1 - f0 - sum(t.pack_s + _probe(seen, t) for t in ts)),
                    bwd_s=max(0.0, bwd.get(n, 0.0) - sum(t.unpack_s for t in ts)),
                    input_bytes=self.inputs.get(n, 0),
                    grad_bytes=self.grads.get(n, 0),
                    recomputable=True,
                )
            )
        loose = [t for t in tensors if t.unit == ""]
        fwd_total = self._t_fwd_end - self._t_fwd
        unit_fwd = sum(f1 - f0 for f0, f1 in self.fwd.values())
        if loose:
            units.append(UnitProfile("", 0.0, 0.0, recomputable=False))
        other_fwd = max(0.0, fwd_total - unit_fwd - sum(t.pack_s + _probe(seen, t) for t in loose))
        other_bwd = max(0.0, first_grad - self._t_fwd_end - sum(t.unpack_s for t in loose))
        bw = self.bandwidth or _bandwidth(self.spill_dir, self.device)
        codecs = self.codecs or _codec_speeds()
        step_s = t_end - self._t_fwd
        return Profile(
            device=self.device.type,
            units=units,
            tensors=tensors,
            bandwidth=bw,
            codecs=codecs,
            unified=self.device.type != "cuda",
            other_fwd_s=other_fwd,
            other_bwd_s=other_bwd,
            prefetch_bytes=self.prefetch,
            offload_overhead_bytes=offload_overhead if self.device.type != "cuda" else 0,
            host_budget=self.host_budget if self.device.type == "cuda" else None,
            measured_peak_bytes=self._meter.delta if self._meter else None,
            measured_step_s=step_s,
            meta={"profiled_tier": self.tier, **(meta or {})},
        )


def _probe(seen: dict[int, float], t: TensorProfile) -> float:
    return seen.get(t.index, 0.0)


def _bandwidth(spill_dir: str | None, device: torch.device) -> Bandwidth:
    from tensortier.planner.profile import measure_bandwidth

    return measure_bandwidth(spill_dir, device=device)


def _codec_speeds() -> dict[str, CodecSpeed]:
    from tensortier.planner.profile import measure_codec_speeds

    return measure_codec_speeds()


def calibrate(profile: Profile) -> Profile:
    """Sets ``workspace_bytes``: temporaries every plan pays beyond saved tensors and gradients.

    Model: 1.5x the largest saved tensor (in backward that tensor, its gradient and a temporary
    of about half its size coexist; on the GPT benchmark shapes this is the logits). The peak
    measured in the profiled iteration is *not* used: the probe codec and the all-to-disk plan
    of that iteration add 10-20 MiB of their own that a planned iteration does not have (seen
    on the CPU benchmark), which inflated every prediction. It stays in
    ``measured_peak_bytes`` for reference.
    """
    largest = max((t.nbytes for t in profile.tensors), default=0)
    profile.workspace_bytes = max(profile.workspace_bytes, int(1.5 * largest))
    return profile
