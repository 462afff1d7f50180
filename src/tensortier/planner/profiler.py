"""Profiles one real training iteration into a :class:`Profile`.

The probe iteration runs under the activation offloader with ``record=True`` and a ``decide``
that sends every saved tensor to one tier (``disk`` by default, so profiling itself stays within
a tight budget), and a *probe* measures each storage moved, in its pack hook on the forward
thread (the storage is alive there anyway): its zero fraction and the payload ratio of every
codec. An operator recorder
(:mod:`tensortier.planner.ops`) lists each unit's operators for selective recompute. Timing
iterations follow; each keeps the saved tensors of a group of units that fits the budget (the
runtime chooses the groups with the simulator) and offloads the rest, so no profiling iteration
needs more memory than the budget. Module hooks time each planning unit's forward (pre/post
hooks) and backward (a hook on the gradient of the unit's output), and a peak meter reads the
memory high-water mark of every iteration. Pack and unpack seconds are subtracted from the unit
times and so is the time the copy threads took from compute (:func:`unit_costs`), so the
profile holds compute time, and the simulator adds transfers back per plan.

Planning units are the modules one action applies to: the root's children, with ``ModuleList``/
``ModuleDict`` containers and every module that holds a stack of repeated blocks opened
(transformer blocks, embeddings, heads; the layers of a ``Sequential`` model; the layers nested
inside a Hugging Face model). Recompute works at that granularity through
``torch.utils.checkpoint``.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from tensortier._backward_end import BackwardEnd, eager
from tensortier._memory import HighWater
from tensortier.planner.ops import OpRecorder, measure_sac_overhead, preload
from tensortier.planner.profile import (
    Bandwidth,
    OpProfile,
    Profile,
    TensorProfile,
    UnitProfile,
)
from tensortier.tiers.codecs import (
    LOSSLESS_CODECS,
    LOSSY_CODECS,
    CodecSpeed,
    accepts,
    cast_overflows,
    estimate_ratio,
)
from tensortier.transfer.streams import timing_event

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


def _wrapped(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The model inside a wrapper that adds no layer of its own (``DistributedDataParallel`` and
    ``DataParallel``: ``module``; ``torch.compile``'s ``OptimizedModule``: ``_orig_mod``), else
    None. Planned as the root, the wrapper made the whole model one unit (a plain ``Sequential``
    under DDP could only be kept, swapped or recomputed whole)."""
    wrappers: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # loaded by torch.compile, never here
    if dynamo is not None and hasattr(dynamo, "OptimizedModule"):
        wrappers += (dynamo.OptimizedModule,)
    children = list(module.named_children())
    return children[0] if isinstance(module, wrappers) and len(children) == 1 else None


def _local(p: torch.Tensor) -> torch.Tensor:
    """FSDP2's sharded parameter (a DTensor, as forward pre-hooks see it before FSDP2 gathers
    it; it has no storage of its own): its local shard, the size of the gradient it keeps;
    any other parameter: itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported by whoever made one
    if dtensor is not None and isinstance(p, dtensor.DTensor):
        return p.to_local()
    return p


def plan_units(root: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every planning unit under ``root`` (definition order).

    A wrapper root (DDP, ``torch.compile``) is planned as the model it wraps, with its prefix
    (``module.0``, ...). The root's children are units, except that ``ModuleList``/``ModuleDict`` containers, stacks
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

    prefix = ""
    while (inner := _wrapped(root)) is not None:  # DDP(torch.compile(model)): both
        name, root = inner
        prefix = f"{prefix}.{name}" if prefix else name
    walk(root, prefix, True)
    return out


def unit_of(module_name: str, units: list[str]) -> str:
    """The unit that contains ``module_name`` ("" when none does)."""
    best = ""
    for u in units:
        if (module_name == u or module_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def tensors_in(x) -> list[torch.Tensor]:
    """The tensors in ``x`` (a tensor, or lists, tuples and dicts of them), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors_in(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_in(v)]
    return []


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose life bounds every write to ``t``'s version counter: its view base.
    Why: a unit's input is often a view that dies with the unit (``base.view(...)``); a write
    through another view of ``base`` later bumps the version they share."""
    return t if t._base is None else t._base


def norm_statistics(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics of ``module``'s norms in train mode (BatchNorm's mean, variance
    and batch count): the forward moves them, and a recompute puts them back itself."""
    return [
        b
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
        for b in m.buffers(recurse=False)
    ]


def buffer_versions(module: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """``module``'s buffers (by name, with their versions) but :func:`norm_statistics`.
    Why: a unit whose forward writes or rebinds one (an EMA, a step count) changes the model
    again when recomputed, and its rerun reads the changed value."""
    restored = {id(b) for b in norm_statistics(module)}
    return {n: (b, b._version) for n, b in module.named_buffers() if id(b) not in restored}


def _changed(before: dict[str, tuple[torch.Tensor, int]], module: nn.Module) -> bool:
    """Whether a buffer of :func:`buffer_versions` was written, rebound, added or removed."""
    now = buffer_versions(module)
    return now.keys() != before.keys() or any(
        b is not now[n][0] or v != now[n][1] for n, (b, v) in before.items()
    )


class ProbeCodec:
    """Measures what the planner needs of each storage the probe moves (:meth:`see`, called in
    the pack hook on the forward thread, in pack order). Not passed to the offloader as a codec:
    a codec encodes on the engine's copy workers, which reordered ``seen`` and kept every
    source alive until its encode ran (the probe iteration went 30 MiB over a 36 MiB budget)."""

    name = "probe"
    lossless = True

    def __init__(self, codecs: tuple[str, ...], producer: dict | None = None):
        self.codecs = codecs
        self.producer = producer if producer is not None else {}  # storage -> (unit, op index)
        self.seen: list[dict] = []  # in pack order, one per offloaded storage

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        """As an identity codec (measuring on whatever thread encodes)."""
        self.see(t)
        return [t], {}

    def see(self, t: torch.Tensor) -> None:
        """Measure ``t``: the typed values of one whole storage."""
        from tensortier.tiers.codecs import zero_fraction

        t0 = time.perf_counter()
        z = zero_fraction(t)
        ratios = {
            c: estimate_ratio(c, t, zero_frac=z, sample_bytes=256 << 10)
            for c in self.codecs
            if accepts(c, t.dtype) and not cast_overflows(c, t)  # fp16 would make it inf
        }
        nbytes = t.numel() * t.element_size()
        self.seen.append(
            {
                "zero_frac": z,
                "ratios": ratios,
                "probe_s": time.perf_counter() - t0,
                "nbytes": nbytes,
                # the op that made this storage, looked up now: once freed, its address is reused
                "made": self.producer.get(t.untyped_storage().data_ptr()),
            }
        )

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor:
        return payloads[0]


class PeakMeter:
    """High-water mark of device memory (CUDA allocator) or of process RSS (CPU).

    CUDA: ``peak`` is the *reserved* high-water mark (``max_memory_reserved``: segments,
    fragmentation and per-stream pools; what an out-of-memory is measured against), ``start``
    what was allocated at entry, so ``delta`` is what the pass needed beyond the live tensors it
    started with. The allocator's cache is emptied at entry (:func:`_empty_cuda_cache`): what
    the pass reserves is then its own footprint, not whatever an earlier, larger iteration, the
    optimizer's step or the gradients freed before this forward left cached, which the
    reserved high-water mark started at and which every later pass measured as its own peak
    (issue 25). ``peak_allocated`` keeps ``max_memory_allocated`` for reports.
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
        self._watch: HighWater | None = None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # bounded: kernels this process queued
            _empty_cuda_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = self.peak = self.peak_allocated = torch.cuda.memory_allocated(self.device)
            return self
        from tensortier._device import rss_bytes

        self._watch = HighWater()
        self._hwm = self._watch.start()
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
            self.peak = self.peak_allocated = max(self.start, self._watch.stop())
            return
        self._stop.set()
        if self._thread is not None:
            # bounded: the sampler checks the stop event every ``interval`` seconds
            self._thread.join(timeout=max(1.0, 10 * self.interval))
        self.peak_allocated = self.peak

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.start)


def _empty_cuda_cache() -> None:
    """Return the caching allocator's unused blocks to the driver, so that its reserved memory
    is what live tensors hold (and the segments they share).

    Why: ``reset_peak_memory_stats`` starts the reserved high-water mark at what is reserved
    now, cache included, and a pass's peak is read against what is *allocated* at its start.
    Without this every pass measured at least the cache that earlier iterations left: the
    warm-up's and the probe's footprints, the timing pass that kept the most, the freed
    gradients, an optimizer's temporaries. The transient factor is fitted to the highest of
    those peaks, and the floor of GPT-2 12 x 2048 on an H100 came out at 8.73 GiB while the
    warm-up step, offloading everything from a cold cache, had measured under 5.74 GiB
    (issue 25). Only metered iterations pay it (the cached segments are freed and allocated
    again); the steps after them grow the cache back to their own footprint, which is what
    was measured."""
    torch.cuda.empty_cache()


class Profiler:
    """Records one probed forward + backward, then timing iterations that fit a budget.

    >>> prof = Profiler(spill_dir="/mnt/nvme/tt")
    >>> with prof.forward():          # pass 1: every saved tensor, its sparsity and codec ratios
    ...     loss = model(x)
    >>> loss.backward()
    >>> for group in groups:          # timing passes: these units keep, the others offload
    ...     with prof.timing(keep=group):
    ...         loss = model(x)
    ...     loss.backward()
    >>> profile = calibrate(prof.finish())

    Pass 1's compute times include the probe (zero counting, codec trials, operator recording)
    and the traffic of every saved tensor, so unit times come from the timing passes: a unit's
    time is its fastest over the passes that moved none of its tensors, or none of a unit of
    its structure (steal on a shared host only adds time), else over the passes that moved
    them, pack and unpack time and the copies' measured share of the cores taken out
    (:func:`unit_costs`). Every pass's peak
    and step time are kept in ``Profile.passes`` for :func:`calibrate`. :func:`timing_groups`
    picks groups whose pass the simulator predicts under a budget; ``keep=None`` offloads all.
    On CUDA the hooks of a pass that keeps a unit not yet timed synchronize (kernel time, not
    launch time); other passes time only the whole step, with CUDA events, so their copies
    overlap compute as in a plan (those passes calibrate the cost of moving bytes).
    """

    def __init__(
        self,
        *,
        spill_dir: str | None = None,
        tier: str = "disk",
        bandwidth: Bandwidth | None = None,
        codecs: dict[str, CodecSpeed] | None = None,
        allow_lossy: bool = False,
        prefetch_budget: int = 256 << 20,
        host_budget: int = 8 << 30,
        device: torch.device | None = None,
        offloader=None,
        probe_bytes: int = 64 << 20,
        record_ops: bool = True,
        remote=None,
        io_threads: int = 4,
    ):
        from tensortier._device import default_device

        self.device = device or default_device()
        self.spill_dir, self.tier = spill_dir, tier
        self.bandwidth = bandwidth
        self.remote = remote  # a RemoteStore: its channels are measured too
        self.io_threads = io_threads  # the offloader's disk I/O threads: the probe uses as many
        self.codecs = codecs
        self.probe_bytes = probe_bytes
        names = LOSSLESS_CODECS + (LOSSY_CODECS if allow_lossy else ())
        self.prefetch_budget, self.host_budget = prefetch_budget, host_budget
        self.root: nn.Module | None = None
        self.units: dict[int, str] = {}  # id(module) -> unit name
        self.kinds: dict[str, str] = {}  # unit name -> its structure (see _structure)
        self.inputs: dict[str, int] = {}
        # the probe's unit inputs and versions (see _note_input_writes)
        self._versions: dict[str, list[tuple[torch.Tensor | weakref.ref, int]]] = {}
        self.writes_input: set[str] = set()  # see _note_input_writes
        self._buffers: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}  # see _pre, _post
        self.writes_buffer: set[str] = set()  # units whose forward changes a buffer (see _post)
        self._keyword_unit: str | None = None  # the unit _pre just noted (see _keywords)
        self.grads: dict[str, int] = {}
        self.order: list[str] = []
        self.offloader = offloader  # reuse the warm-up's: its buffers are not this iteration's
        self._hooks: list = []
        self._param_hooks: list = []
        self._n_params = 0  # the root's parameters that get gradients (BackwardEnd counts them)
        self._last_end: BackwardEnd | None = None
        self._passes: list[_Pass] = []  # [0] is the probe pass, then the timing passes
        self._cur: _Pass | None = None
        self._unit_now: str | None = None
        self._sac_op_s: float | None = None
        self.recorder = OpRecorder(lambda: self._unit_now, self.device) if record_ops else None
        self.probe = ProbeCodec(names, self.recorder.producer if self.recorder else None)
        if record_ops:
            preload()
        self.tensors: list[TensorProfile] = []

    # ------------------------------------------------------------------ hooks
    def _now(self, cur: _Pass | None = None) -> float:
        """Host time; on CUDA in a pass that times its units, after the queued kernels ran."""
        if self.device.type == "cuda" and (cur is None or cur.sync_units):
            torch.cuda.synchronize(self.device)  # bounded: kernels this pass queued so far
        return time.perf_counter()

    def _pre(self, module: nn.Module, args) -> None:
        cur = self._cur
        if cur is None or threading.get_ident() != cur.thread:  # global hook: not our thread's
            return
        if self.root is None:
            self.root = module
            named = plan_units(module)
            self.units = {id(m): n for n, m in named.items()}
            memo: dict[int, tuple] = {}
            self.kinds = {n: repr(_structure(m, memo)) for n, m in named.items()}
            seen: set[int] = set()
            for name in reversed(list(named)):  # grads are allocated by the first backward
                ptrs = []
                for p in map(_local, named[name].parameters()):
                    if p.requires_grad and p.untyped_storage().data_ptr() not in seen:
                        seen.add(p.untyped_storage().data_ptr())
                        ptrs.append(p.numel() * p.element_size())
                self.grads[name] = sum(ptrs)
            params = [p for p in module.parameters() if p.requires_grad]
            self._n_params = len(params)
            hook = eager(self._grad_done)  # the last accumulation ends the backward
            self._param_hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]
            self._hooks += [  # removed with the probe's global hooks
                m.register_forward_pre_hook(eager(self._keywords), with_kwargs=True)
                for m in named.values()
            ]
        name = self.units.get(id(module))
        if name is not None and name not in cur.fwd:  # not again while a checkpoint recomputes
            if len(self._passes) == 0:
                self._note_input_writes()
                self.order.append(name)
                self.inputs[name] = sum(t.untyped_storage().nbytes() for t in tensors_in(args))
                self._versions[name] = [
                    (_root(t), t._version) for t in tensors_in(args) if not t.is_inference()
                ]
                self._buffers[name] = buffer_versions(module)
                self._keyword_unit = name
            cur.fwd[name] = [self._now(cur), 0.0]
            self._unit_now = name

    def _keywords(self, module: nn.Module, args, kwargs) -> None:
        """The probe's unit inputs passed by keyword (``layer(x=h)``) join those :meth:`_pre`
        noted: the global pre-hook sees positional arguments only."""
        name, self._keyword_unit = self._keyword_unit, None
        if name is not None and self.units.get(id(module)) == name:
            self._versions[name] += [
                (_root(t), t._version) for t in tensors_in(kwargs) if not t.is_inference()
            ]

    def _post(self, module: nn.Module, args, output) -> None:
        cur = self._cur
        name = self.units.get(id(module))
        if cur is None or name is None or name not in cur.fwd or cur.fwd[name][1]:
            return
        if threading.get_ident() != cur.thread:
            return
        cur.fwd[name][1] = self._now(cur)
        self._unit_now = None
        self._note_input_writes(name)
        before = self._buffers.pop(name, None)
        if before is not None and _changed(before, module):
            # a recompute would move it again (and rerun on the moved value)
            self.writes_buffer.add(name)
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if outs:

            def mark(grad, name=name, cur=cur):
                cur.grad_at.setdefault(name, self._now(cur))

            outs[0].register_hook(eager(mark))

    def _grad_done(self, param) -> None:
        cur = self._cur
        if cur is None or not cur.t_fwd_end:
            return
        # read the meter when this backward ends, not at the next pass (the user's code in
        # between, an optimizer's first step or another model's iteration, is not this pass's
        # peak); a backward that does not end here is read when the pass closes
        if cur.end is None:
            n = self._last_end.learned() if self._last_end else self._n_params
            cur.end = self._last_end = BackwardEnd(n, lambda c=cur: _read_pass_meter(c))
        cur.end.accumulated()
        if cur.end_event is not None:  # CUDA, no unit timing: mark the stream, do not drain it
            cur.end_event.record(torch.cuda.current_stream(self.device))
            cur.last_grad = time.perf_counter()
        else:
            cur.last_grad = self._now(cur)

    @contextmanager
    def _pass(
        self,
        kind: str,
        offloader,
        *,
        kept: frozenset = frozenset(),
        parts: dict[str, frozenset[int]] | None = None,
        sync_units: bool = True,
    ) -> Iterator[Profiler]:
        self._close_pass()
        cur = self._cur = _Pass(kind, kept=kept, parts=parts or {}, sync_units=sync_units)
        self._hooks = [
            # eager inside a torch.compile'd model: dynamo cannot trace the timing bookkeeping
            nn.modules.module.register_module_forward_pre_hook(eager(self._pre)),
            nn.modules.module.register_module_forward_hook(eager(self._post)),
        ]
        cur.meter = PeakMeter(self.device).__enter__()  # CUDA: synchronizes first
        if self.device.type == "cuda" and not sync_units:
            stream = torch.cuda.current_stream(self.device)
            cur.start_event = timing_event()
            cur.end_event = timing_event()
            cur.start_event.record(stream)
        cur.t_fwd = time.perf_counter()
        recorder = self.recorder if kind == "probe" else None
        try:
            if offloader is None:
                yield self
            else:
                probe = self.probe if kind == "probe" else None
                with _probe_pack(offloader, recorder, probe), offloader:
                    if recorder is None:
                        yield self
                    else:
                        with recorder:
                            yield self
        finally:
            self._unit_now = None
            cur.t_fwd_end = self._now(cur)
            self._note_input_writes()
            self._versions, self._buffers = {}, {}
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def _note_input_writes(self, unit: str | None = None) -> None:
        """Units whose input was written in place after the unit began (by the unit or by code
        after it): a recompute reruns the unit on the input as the forward left it (silently
        wrong gradients, or autograd's in-place error), so they are not recomputable. Checked
        at the ``unit``'s end, then for every unit (``None``) at each unit's start and at the
        forward's end, while the inputs live: held after their unit, offloaded inputs stayed
        in memory and raised the probe's peak."""
        for name in [unit] if unit is not None else list(self._versions):
            inputs = self._versions.pop(name, [])
            alive = [(r() if isinstance(r, weakref.ref) else r, v) for r, v in inputs]
            alive = [(t, v) for t, v in alive if t is not None]
            if any(t._version != v for t, v in alive):
                self.writes_input.add(name)
            elif alive:
                self._versions[name] = [(weakref.ref(t), v) for t, v in alive]

    def _close_pass(self) -> None:
        """The pass whose backward has run: read its peak and its offloader's records."""
        cur, self._cur = self._cur, None
        if cur is None:
            return
        _read_pass_meter(cur)  # no backward ended it (or the callback could not be queued)
        cur.t_end = cur.last_grad or time.perf_counter()
        if cur.end_event is not None and cur.last_grad:  # device time, first kernel to last grad
            cur.t_end = cur.t_fwd + cur.start_event.elapsed_time(cur.end_event) / 1e3
        if cur.kind != "keep" and self.offloader is not None:
            cur.records = sorted(self.offloader.records, key=lambda r: r["index"])
        if cur.kind == "probe" and self.recorder is not None:
            self.recorder.resolve()
        self._passes.append(cur)

    @contextmanager
    def forward(self) -> Iterator[Profiler]:
        """Pass 1: run the forward to profile inside this block (once), then ``backward()``."""
        from tensortier.activations import Action, Offloader
        from tensortier.errors import ConfigError

        if self._passes or self._cur is not None:
            raise ConfigError("Profiler.forward() runs once; use Profiler.timing() afterwards")
        tier = self.tier

        def decide(info):
            return Action(tier)  # measured by the probe in the pack hook (see _probe_pack)

        if self.offloader is None:
            self.offloader = Offloader(
                "disk" if tier == "disk" else "host",
                spill_dir=self.spill_dir,
                decide=decide,
                record=True,
                prefetch_budget=self.prefetch_budget,
                host_budget=self.host_budget,
            )
        else:
            self.offloader.decide, self.offloader.record = decide, True
            self.offloader.records = []
        with self._pass("probe", self.offloader):
            yield self

    @contextmanager
    def timing(
        self, keep: Iterable[str] | None = None, parts: dict[str, Iterable[int]] | None = None
    ) -> Iterator[Profiler]:
        """A timing pass (after pass 1's backward; repeatable): the units in ``keep`` keep their
        saved tensors, and so do the tensors ``parts`` names (unit -> ordinals within it, as a
        plan's partial swap names them) of other units; every other tensor goes to the profiled
        tier (all of them: ``keep=None``)."""
        from tensortier.activations import Action
        from tensortier.errors import ConfigError

        if not self._passes and self._cur is None:
            raise ConfigError("run Profiler.forward() (and its backward) before a timing pass")
        self._close_pass()
        kept = frozenset(keep or ())
        some = {u: frozenset(o) for u, o in (parts or {}).items() if o and u not in kept}
        unknown = (kept | set(some)) - set(self.order)
        if unknown:
            raise ConfigError(
                f"keep={sorted(unknown)}: not planning units of the profiled model; pass names "
                f"from {self.order}"
            )
        timed = {n for p in self._passes[1:] if p.sync_units for n in p.kept}
        # CUDA: synchronize at unit boundaries only to time a kept unit not yet timed; else
        # time the whole step with events so copies overlap compute as in a plan
        sync_units = self.device.type != "cuda" or bool(kept - timed)
        if len(kept) == len(self.order):
            with self._pass("keep", None, kept=kept, sync_units=sync_units):
                yield self
            return
        tier, names = self.tier, list(self.order)
        seen: dict[str, int] = {}  # per unit: its tensors decided so far in this forward

        def decide(info):
            if info.index == 0:
                seen.clear()  # a new forward
            unit = unit_of(info.module, names)
            k = seen[unit] = seen.get(unit, -1) + 1
            return Action("keep" if unit in kept or k in some.get(unit, ()) else tier)

        self.offloader.decide = decide
        self.offloader.record, self.offloader.records = True, []
        with self._pass("offload", self.offloader, kept=kept, parts=some, sync_units=sync_units):
            yield self

    def abort(self) -> bool:
        """The pass running now raised in its forward: drop it (its peak, times and records are
        a part of an iteration). True when that was the probe, which leaves nothing to time
        against: the caller profiles again with a new :class:`Profiler` (the parameter hooks
        are removed here)."""
        cur, self._cur = self._cur, None
        if cur is not None:
            _read_pass_meter(cur)
        if self._passes:
            return False
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        return True

    @property
    def unit_names(self) -> list[str]:
        return list(self.order)

    def provisional(self) -> Profile:
        """The profile so far (after the probe's backward), to choose timing groups with."""
        self._close_pass()
        return self._build()

    def finish(self, *, meta: dict | None = None, offload_overhead: int = 0) -> Profile:
        """After the last ``backward()``: the profile (measures bandwidth if not given)."""
        self._close_pass()
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        return self._build(meta=meta, offload_overhead=offload_overhead)

    def _measure_machine(self) -> None:
        """The channels' bandwidth, the codecs' speeds and the selective policy's dispatch cost,
        each measured once (under a forked RNG: the training's dropout masks stay its own)."""
        with own_rng(self.device):
            if self.bandwidth is None:
                self.bandwidth = _bandwidth(
                    self.spill_dir, self.device, self.probe_bytes, self.io_threads
                )
            if self.remote is not None and not self.bandwidth.remote:
                self.bandwidth = _remote_bandwidth(self.bandwidth, self.remote, self.probe_bytes)
            if self.codecs is None:
                # only the codecs the probe tried (lossy ones only when allowed)
                self.codecs = _codec_speeds(self.probe.codecs, codec_sample_bytes(self.probe_bytes))
            if self._sac_op_s is None:
                self._sac_op_s = (
                    measure_sac_overhead(self.device) if self.recorder is not None else 0.0
                )

    def _build(self, *, meta: dict | None = None, offload_overhead: int = 0) -> Profile:
        if not self._passes:
            from tensortier.errors import ConfigError

            raise ConfigError("nothing profiled: run Profiler.forward() and backward() first")
        probe, timed = self._passes[0], self._passes[1:]
        unit_names = list(self.order)
        tensors = self._tensors(probe, unit_names)
        cuda = self.device.type == "cuda"
        clean = [p for p in timed if p.sync_units or not cuda]  # unit times are kernel times
        runs = {id(p): _times(p, unit_names, tensors) for p in (clean or [probe])}
        by_pass = [(p, runs[id(p)]) for p in (clean or [probe])]
        kinds = {n: (self.kinds.get(n, n), self.inputs.get(n, 0)) for n in unit_names}
        costs = unit_costs(by_pass, unit_names, kinds)
        units = [
            UnitProfile(
                name=n,
                fwd_s=costs[n][0],
                bwd_s=costs[n][1],
                input_bytes=self.inputs.get(n, 0),
                grad_bytes=self.grads.get(n, 0),
                recomputable=n not in self.writes_input | self.writes_buffer,
            )
            for n in unit_names
        ]
        self._attach_ops(units, tensors)
        if any(t.unit == "" for t in tensors):
            units.append(UnitProfile("", 0.0, 0.0, recomputable=False, selective=False))
        self._measure_machine()
        passes = [
            {
                "kind": p.kind,
                "kept": sorted(p.kept) if p.kind != "probe" else [],
                "parts": {u: sorted(o) for u, o in sorted(p.parts.items())},
                "tier": self.tier,
                "peak_bytes": p.meter.delta,
                # live tensors alone (CUDA: allocated, not reserved; CPU: the same as peak_bytes)
                "allocated_bytes": max(0, p.meter.peak_allocated - p.meter.start),
                "step_s": p.t_end - p.t_fwd,
                "timed_step": p.kind != "probe" and (not cuda or not p.sync_units),
            }
            for p in self._passes
        ]
        steps = [p.t_end - p.t_fwd for p in (timed or [probe])]
        return Profile(
            device=self.device.type,
            units=units,
            tensors=tensors,
            bandwidth=self.bandwidth,
            codecs=self.codecs,
            unified=self.device.type != "cuda",
            other_fwd_s=min(r["other_fwd"] for _, r in by_pass),
            other_bwd_s=min(r["other_bwd"] for _, r in by_pass),
            prefetch_bytes=self.prefetch_budget,
            inflight_bytes=_inflight_limit(self.offloader),
            offload_overhead_bytes=offload_overhead if self.device.type != "cuda" else 0,
            host_budget=self.host_budget if self.device.type == "cuda" else None,
            measured_peak_bytes=probe.meter.delta,
            measured_step_s=min(steps),
            passes=passes,
            sac_op_s=self._sac_op_s,
            meta={
                "profiled_tier": self.tier,
                "timing": "kept"
                if any(p.kept for p in timed)
                else ("offload" if timed else "probe"),
                "timing_passes": len(timed),
                **(meta or {}),
            },
        )

    def _attach_ops(self, units: list[UnitProfile], tensors: list[TensorProfile]) -> None:
        """Each unit's operators, their times scaled to the unit's clean forward time."""
        rec = self.recorder
        if rec is None:
            for u in units:
                u.selective = False
            return
        saved: dict[tuple[str, int], int] = {}
        for t in tensors:
            if t.op_index >= 0:
                saved[(t.unit, t.op_index)] = saved.get((t.unit, t.op_index), 0) + t.nbytes
        for u in units:
            rows = rec.ops.get(u.name, [])
            total = sum(r["seconds"] for r in rows)
            scale = u.fwd_s / total if total > 0 else 0.0
            u.ops = [
                OpProfile(
                    index=r["index"],
                    name=r["name"],
                    out_bytes=r["out_bytes"],
                    seconds=r["seconds"] * scale,
                    saved_bytes=saved.get((u.name, r["index"]), 0),
                    view=r["view"],
                    random=r["random"],
                    pinned=r.get("pinned", False),
                )
                for r in rows
            ]
            u.selective = bool(u.ops) and u.name not in rec.inplace

    def _tensors(self, probe: _Pass, unit_names: list[str]) -> list[TensorProfile]:
        tensors = []
        probes = iter(self.probe.seen)  # one per record that went through the codec, in order
        pending = next(probes, None)
        for r in probe.records:
            seen = {"zero_frac": 0.0, "ratios": {}, "probe_s": 0.0, "made": None}
            if pending is not None and pending["nbytes"] == r["nbytes"]:
                seen, pending = pending, next(probes, None)
            unit = unit_of(r["module"], unit_names)
            made = seen["made"]
            tensors.append(
                TensorProfile(
                    index=r["index"],
                    unit=unit,
                    nbytes=int(r["nbytes"]),
                    dtype=str(r["dtype"]).removeprefix("torch."),
                    shape=list(r["shape"]),
                    module=r["module"],
                    op=r["grad_fn"],
                    zero_frac=seen["zero_frac"],
                    ratios=seen["ratios"],
                    pack_s=max(0.0, r["pack_s"] - seen["probe_s"]),
                    unpack_s=r["unpack_s"],
                    op_index=made[1] if made is not None and made[0] == unit else -1,
                )
            )
        return tensors


def _inflight_limit(offloader) -> int | None:
    """The bytes the offloader's engine lets be in flight (its throttle), if known."""
    throttle = getattr(getattr(offloader, "_engine", None), "_throttle", None)
    return getattr(throttle, "limit", None)


@contextmanager
def _probe_pack(offloader, recorder: OpRecorder | None, probe: ProbeCodec | None) -> Iterator[None]:
    """Wraps the (inactive) offloader's pack hook, which it looks up when it activates: the
    offloader's own operators inside it are not the model's (hidden from the recorder), and
    each storage it starts moving is measured by ``probe`` right there, in pack order (its time
    added to the record's pack time, which the unit times leave out)."""
    if recorder is None and probe is None:
        yield
        return
    pack = offloader._pack

    def probed(t):
        if recorder is not None:
            recorder.muted += 1
        try:
            n = len(offloader.records)
            handle = pack(t)
            if probe is not None and len(offloader.records) > n:
                t0 = time.perf_counter()
                probe.see(_storage_values(t))
                offloader.records[-1]["pack_s"] += time.perf_counter() - t0
            return handle
        finally:
            if recorder is not None:
                recorder.muted -= 1

    offloader._pack = probed
    try:
        yield
    finally:
        del offloader._pack


def _storage_values(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, typed as ``t`` where its bytes are whole elements."""
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    size = t.element_size()
    return u8.view(t.dtype) if u8.numel() % size == 0 else u8


@dataclass
class _Pass:
    """Timestamps of one profiled iteration."""

    kind: str  # "probe", "keep" or "offload"
    kept: frozenset = frozenset()  # units whose saved tensors stayed on the device
    parts: dict[str, frozenset[int]] = field(default_factory=dict)  # and tensors of other units
    sync_units: bool = True  # CUDA: synchronize at unit boundaries (unit times are used)
    fwd: dict[str, list[float]] = field(default_factory=dict)  # unit -> [start, end]
    grad_at: dict[str, float] = field(default_factory=dict)  # unit -> its output's gradient
    t_fwd: float = 0.0
    t_fwd_end: float = 0.0
    last_grad: float = 0.0  # the last parameter gradient accumulated: the backward's end
    t_end: float = 0.0
    records: list[dict] = field(default_factory=list)  # the offloader's, when it ran
    meter: PeakMeter | None = None
    metered: bool = False  # the meter was read (at the backward's end, or when the pass closed)
    end: BackwardEnd | None = None  # its backward's end, once a gradient accumulated
    start_event: torch.cuda.Event | None = None  # CUDA passes that do not time units
    end_event: torch.cuda.Event | None = None
    thread: int = field(default_factory=threading.get_ident)  # whose forward the pass records


def _read_pass_meter(p: _Pass) -> None:
    if p.meter is not None and not p.metered:
        p.metered = True
        p.meter.__exit__(None, None, None)  # CUDA: synchronizes (this pass's kernels) first


def _times(p: _Pass, unit_names: list[str], tensors: list[TensorProfile]) -> dict:
    """Per-unit forward/backward compute seconds of one pass, pack/unpack (and probe) removed."""
    pack: dict[str, float] = {}
    unpack: dict[str, float] = {}
    for r in p.records:  # a keep pass has none; a partial pass numbers only what it moved
        u = unit_of(r["module"], unit_names)
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


def _moved(p: _Pass, unit_names: list[str]) -> dict[str, int]:
    """Per unit, the bytes of its saved tensors pass ``p`` moved to a tier (its records)."""
    out: dict[str, int] = {}
    for r in p.records:
        u = unit_of(r["module"], unit_names)
        out[u] = out.get(u, 0) + int(r["nbytes"])
    return out


def unit_costs(
    by_pass: list[tuple[_Pass, dict]], unit_names: list[str], kinds: dict[str, object]
) -> dict[str, tuple[float, float]]:
    """Per unit, its compute seconds ``(forward, backward)`` from the passes' unit times
    (:func:`_times`), with the time the copies took from compute taken out.

    Why: on a CPU the offloader's copy and I/O threads share the cores with compute, so a unit
    whose tensors a pass moved runs slower than its compute alone, by more than the pack and
    unpack time :func:`_times` removes. Unit times taken from such passes put the whole step
    ~1.25-1.5x high on the quiet CPU sweep for plans that move little (keep, recompute) while
    the fitted per-byte cost of moving (:func:`calibrate`) came out near zero, having been
    absorbed into those times: swaps were costed too cheap, recompute too dear, and the two
    cancelled only on swap plans (issue 27). So, from measurement only:

    * a unit's compute is its fastest time over the passes that moved none of its tensors, or
      none of those of a unit of the same ``kinds`` (same module structure and input bytes:
      the blocks of a stack, whose compute is the same), whichever is faster;
    * the copies' cost per byte moved is the least-squares slope of (a unit's time in a pass
      that moved its tensors minus its compute above) against the bytes moved (both ways);
    * a unit of which no pass moved nothing, nor one of its kind, takes its fastest time over
      the passes less that slope times the bytes each pass moved of it.
    """
    moved = [(r, _moved(p, unit_names)) for p, r in by_pass]
    clean: dict[object, list[float]] = {}  # kind -> fastest [forward, backward] moving nothing
    for r, mv in moved:
        for n in unit_names:
            if not mv.get(n):
                c = clean.setdefault(kinds[n], [float("inf"), float("inf")])
                c[0], c[1] = min(c[0], r["fwd"][n]), min(c[1], r["bwd"][n])
    num = den = 0.0
    for r, mv in moved:
        for n in unit_names:
            c, b = clean.get(kinds[n]), 2 * mv.get(n, 0)
            if b and c is not None:
                num += (r["fwd"][n] + r["bwd"][n] - c[0] - c[1]) * b
                den += b * b
    rate = max(0.0, num / den) if den else 0.0
    out = {}
    for n in unit_names:
        c = clean.get(kinds[n])
        if c is not None:
            out[n] = (c[0], c[1])
            continue
        out[n] = (
            min(max(0.0, r["fwd"][n] - rate * mv.get(n, 0)) for r, mv in moved),
            min(max(0.0, r["bwd"][n] - rate * mv.get(n, 0)) for r, mv in moved),
        )
    return out


@contextmanager
def own_rng(device: torch.device) -> Iterator[None]:
    """Run the planner's own work under a forked RNG (CPU and ``device``'s CUDA generator).

    Training must draw the same dropout masks with the planner as without it: whatever the
    planner draws (bandwidth probe data, codec samples) is undone when the block ends.
    """
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def _bandwidth(
    spill_dir: str | None, device: torch.device, resident: int = 64 << 20, io_threads: int = 4
) -> Bandwidth:
    """64 MiB through every channel, with at most ``resident`` bytes of chunks alive at once,
    through a disk store with the offloader's ``io_threads``."""
    from tensortier.planner.profile import measure_bandwidth

    resident = max(1 << 20, int(resident) >> 20 << 20)  # whole MiB: whole pages for O_DIRECT
    chunk = min(16 << 20, max(1 << 20, resident // 2 >> 20 << 20))
    return measure_bandwidth(
        spill_dir,
        device=device,
        nbytes=64 << 20,
        chunk=chunk,
        resident=resident,
        io_threads=io_threads,
    )


def _remote_bandwidth(bw: Bandwidth, store, resident: int = 64 << 20) -> Bandwidth:
    """``bw`` with the remote channels of ``store`` measured as the disk's are (64 MiB, at most
    ``resident`` bytes of chunks alive at once)."""
    import dataclasses

    from tensortier.planner.profile import measure_remote_bandwidth

    resident = max(1 << 20, int(resident) >> 20 << 20)
    chunk = min(16 << 20, max(1 << 20, resident // 2 >> 20 << 20))
    up, down = measure_remote_bandwidth(store, nbytes=64 << 20, chunk=chunk, resident=resident)
    return dataclasses.replace(bw, h2remote=up, remote2h=down)


def codec_sample_bytes(probe_bytes: int) -> int:
    """The codec calibration sample for a bandwidth probe of ``probe_bytes`` (sized to the
    budget): an eighth of it, between 256 KiB and 4 MiB. Encoding a sample briefly holds about
    seven times its size (payloads, masks, decoded copies): 30 MiB for 4 MiB, which on a CPU
    is in the budget of the timing pass that measures it."""
    return int(min(4 << 20, max(256 << 10, probe_bytes // 8)))


_PRELOADED_CODECS: set[str] = set()
PRELOAD_CODEC_BYTES = 64 << 10


def preload_codecs(names: Iterable[str]) -> None:
    """Run every codec in ``names`` once on a small sample, under a forked RNG, once per process.

    Why: their first use loads code and lazily initialised kernels (~3 MiB of RSS on the CPU
    sweep's models, the same for a 64 KiB sample as for the calibration's 4 MiB one) that stay
    in the process. Inside the first profiling passes that counted as the offload machinery's
    resident memory, charged to a CPU budget on top of its buffers: the first budget of a
    process paid ~13.6 MiB against 7-10 MiB for later ones (issue 27). Paid when the planner is
    created instead, as :func:`.ops.preload` pays PyTorch's dispatch-mode imports."""
    todo = tuple(n for n in names if n not in _PRELOADED_CODECS)
    if not todo:
        return
    with own_rng(torch.device("cpu")):
        _codec_speeds(todo, PRELOAD_CODEC_BYTES)
    _PRELOADED_CODECS.update(todo)


def _codec_speeds(names: tuple[str, ...], nbytes: int) -> dict[str, CodecSpeed]:
    from tensortier.planner.profile import measure_codec_speeds

    return measure_codec_speeds(names, nbytes)


def pass_plan(profile: Profile, run: dict):
    """The plan a measured pass ran: a trial's own plan (:mod:`.trials`); else its kept units
    keep, the tensors ``parts`` names (unit -> ordinals) stay in their units, every other
    tensor goes to the pass's tier."""
    from tensortier.planner.simulator import Mode, Plan, UnitAction

    if run.get("plan") is not None:
        return Plan.from_dict(run["plan"])
    tier = Mode(run.get("tier") or profile.meta.get("profiled_tier", "disk"))
    kept = set(run.get("kept", ()))
    parts = {u: set(o) for u, o in (run.get("parts") or {}).items()}
    counts: dict[str, int] = {}
    for t in profile.tensors:
        counts[t.unit] = counts.get(t.unit, 0) + 1
    actions = {}
    for u in profile.units:
        if u.name in kept:
            actions[u.name] = UnitAction(Mode.KEEP)
        elif parts.get(u.name):
            moved = frozenset(range(counts.get(u.name, 0))) - parts[u.name]
            actions[u.name] = UnitAction(tier, part=moved)
        else:
            actions[u.name] = UnitAction(tier)
    return Plan(run.get("kind", "pass"), actions)


def calibrate(profile: Profile, *, with_probe: bool = False) -> Profile:
    """Fits the two constants the simulator cannot know from first principles to measurement.

    * ``transient_factor`` (an op's temporaries / the saved tensor it makes or uses): for each
      timing pass, the factor at which the simulated plan of that pass peaks where the pass did;
      the largest of them is kept, so every measured pass is predicted at or above its peak (a
      budget is a promise). A pass whose peak is below what its saved bytes alone need did not
      see live memory (an allocator reused freed heap memory) and is skipped. The probe pass is
      used only when there is no other (or ``with_probe``, which the choice of timing passes
      asks for: the probe adds temporaries a plan does not have, so a fit on it errs high).
    * ``move_s_per_byte`` (compute seconds lost per byte moved: on a CPU the copy threads share
      the cores with compute; on a GPU it comes out near zero): least squares over the passes
      whose step time was taken without unit synchronization, of measured step minus the
      simulated step without move costs against the bytes each pass moved.
    """
    from tensortier.planner.simulator import ordinals, simulate

    runs = _calibrating(profile, with_probe)
    factors = [f for f in (_factor(profile, run) for run in runs) if f is not None]
    profile.transient_factor = max(factors) if factors else 1.5
    timed = [r for r in runs if r.get("timed_step") and r.get("step_s")]
    if timed and profile.tensors:
        num = den = 0.0
        profile.move_s_per_byte = 0.0
        ordinal = ordinals(profile)
        for run in timed:
            plan = pass_plan(profile, run)
            moved = 2 * sum(
                t.nbytes for t in profile.tensors if plan.tier_of(t, ordinal[t.index]) != "keep"
            )
            resid = run["step_s"] - simulate(profile, plan).step_s
            num += moved * resid
            den += moved * moved
        profile.move_s_per_byte = max(0.0, num / den) if den else 0.0
    return profile


def _calibrating(profile: Profile, with_probe: bool = False) -> list[dict]:
    """The passes :func:`calibrate` fits: the timing passes (and the probe ``with_probe``), or
    the probe alone when there is no other."""
    runs = [r for r in profile.passes if r.get("kind") != "trial"]
    fitted = [r for r in runs if with_probe or r.get("kind") != "probe"]
    return fitted or runs


def _factor(profile: Profile, run: dict) -> float | None:
    """The transient factor at which ``run``'s simulated plan peaks where it measured (None when
    its peak is below its saved bytes alone; see :func:`calibrate`). Leaves the profile's
    factor changed."""
    from tensortier.planner.simulator import simulate

    plan = pass_plan(profile, run)
    target = int(run.get("peak_bytes") or 0)

    def peak(f: float) -> int:
        profile.transient_factor = f
        return simulate(profile, plan).peak_bytes

    if not profile.tensors or target < peak(0.0):
        return None
    lo, hi = 0.0, 8.0
    if peak(hi) <= target:
        return hi
    for _ in range(30):  # the peak grows monotonically with the factor
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if peak(mid) < target else (lo, mid)
    return hi


def held(profile: Profile, plan) -> dict[int, int]:
    """Pack index -> bytes of each saved tensor ``plan`` holds that a full offload would not: the
    tensors it keeps, the ones a recomputed unit makes again in its backward (recompute and
    selective units hold them as a kept unit does, from their rerun on) and the ones it
    encodes (source and payload exist together while the codec runs)."""
    from tensortier.planner.simulator import ordinals

    ordinal = ordinals(profile)
    return {
        t.index: t.nbytes
        for t in profile.tensors
        if plan.tier_of(t, ordinal[t.index]) == "keep" or plan.codecs.get(t.index)
    }


def kept_through(profile: Profile, plan) -> set[int]:
    """Pack indices of the saved tensors ``plan`` keeps from its forward to their backward, raw:
    what a measured pass of it held all along. Not those of recomputed or selective units
    (held from their rerun on only) nor those it encodes (source and payload coexist only
    while the codec runs): a plan that keeps them holds more than that pass measured."""
    from tensortier.planner.simulator import SWAPS, Mode, ordinals

    ordinal = ordinals(profile)
    out = set()
    for t in profile.tensors:
        mode = plan.action(t.unit).mode
        if mode != Mode.KEEP and mode not in SWAPS:
            continue
        if plan.tier_of(t, ordinal[t.index]) == "keep" and not plan.codecs.get(t.index):
            out.add(t.index)
    return out


def _alike(profile: Profile, plan, ran) -> set[int]:
    """Pack indices of the saved tensors whose unit ``plan`` treats as the measured pass ``ran``
    did (same action, same codec): they live as long in both (a recomputed unit's rerun too)."""
    return {
        t.index
        for t in profile.tensors
        if plan.action(t.unit) == ran.action(t.unit)
        and plan.codecs.get(t.index) == ran.codecs.get(t.index)
    }


def measured_bound(profile: Profile, plan) -> int | None:
    """An upper bound, from measurement alone, on the peak of ``plan``: a measured pass's peak
    plus the bytes of the tensors ``plan`` holds that the pass offloaded (:func:`held`; the
    tightest over the passes; None before any was measured).

    Why it bounds: keeping a tensor instead of offloading it adds at most its bytes at any
    moment, and offloading a tensor that pass kept only shortens its life (its read-back is
    within the prefetch window that pass had too). The simulator's peaks are fitted, and a fit
    made on passes that kept small units underestimated one that kept a layer by 16% (issue 23:
    a timing pass at 1.03x its budget); this bound is what keeps the timing passes under the
    budget, the margin covers what is left (allocator and page granularity, copies in flight).
    For a recomputed unit it assumes its rerun's temporaries are no larger than those of the
    pass's backward over the same unit, which reads the unit's tensors back, and counts its
    input and, for the largest recomputed unit only, its saved tensors (:func:`_added`). A measured trial of
    a plan (:mod:`.trials`) is a pass too: what it held is what it kept raw all along
    (:func:`kept_through`), so a plan close to one already run is bounded close to its peak.
    """
    holds = held(profile, plan)
    bounds = []
    for r in profile.passes:
        if r.get("peak_bytes"):
            ran = pass_plan(profile, r)
            had = kept_through(profile, ran) | _alike(profile, plan, ran)
            bounds.append(int(r["peak_bytes"]) + _added(profile, plan, ran, holds, had))
    return min(bounds, default=None)


def _added(profile: Profile, plan, ran, holds: dict[int, int], had: set[int]) -> int:
    """The bytes ``plan`` may hold beyond the measured pass ``ran`` at any moment: those of the
    tensors it holds that the pass did not (:func:`measured_bound`), except that the units it
    recomputes (where the pass did not) add their inputs, which their checkpoints keep, and the
    saved tensors of one of them alone: a recomputed unit's tensors are alive only while its
    forward runs and from its rerun to the end of its backward, and units run one at a time."""
    from tensortier.planner.simulator import Mode

    rerun: dict[str, int] = {}
    inputs = {u.name: u.input_bytes for u in profile.units}
    for t in profile.tensors:
        a = plan.action(t.unit)
        if a.mode == Mode.RECOMPUTE and a != ran.action(t.unit) and t.index not in had:
            rerun[t.unit] = rerun.get(t.unit, 0) + holds.get(t.index, 0)
    rest = sum(n for i, n in holds.items() if i not in had)
    rest -= sum(rerun.values())
    return rest + sum(inputs.get(u, 0) for u in rerun) + max(rerun.values(), default=0)


def timing_group(profile: Profile, budget: int, timed: Iterable[str] = ()) -> list[str]:
    """Units to keep in one timing pass, under ``budget`` with the others on the profiled tier
    both as the simulator predicts it and as the measured passes bound it
    (:func:`measured_bound`): units not yet ``timed`` first (forward order), then the others
    if room is left (each keeps its fastest time over the passes). A unit that never fits is
    timed offloaded."""
    names = [u.name for u in profile.units if u.name and profile.tensors_of(u.name)]
    timed = set(timed)
    group: list[str] = []
    for n in [n for n in names if n not in timed] + [n for n in names if n in timed]:
        if _pass_fits(profile, budget, group + [n]):
            group.append(n)
    return group


def _pass_fits(profile: Profile, budget: int, kept: list[str], parts: dict | None = None) -> bool:
    """Whether a pass keeping ``kept`` and ``parts`` is under ``budget`` both as the simulator
    predicts it (its writes stalled: :func:`simulate_worst`) and as the measured passes bound
    it."""
    from tensortier.planner.simulator import simulate_worst

    run = {"kind": "group", "kept": kept, "parts": parts or {}}
    plan = pass_plan(profile, run)
    if simulate_worst(profile, plan).peak_bytes > budget:
        return False
    bound = measured_bound(profile, plan)
    return bound is None or bound <= budget


def timing_parts(profile: Profile, budget: int, group: list[str]) -> dict[str, list[int]]:
    """Tensors of the units outside ``group`` that a timing pass keeping ``group`` keeps too, in
    the room ``budget`` leaves (both as the simulator predicts it and as the measured passes
    bound it): the smallest first, alike tensors of every unit in turn, as plans keep them (the large ones are
    those whose moves hide behind compute). Why: a layer too large to keep whole was never
    kept in a timing pass, so the fit knew only passes that offloaded nearly everything and put
    plans that keep most of each layer 0.03-0.12x the budget low; a pass that keeps part of
    every layer is measured as the plans will run, and bounds them (:func:`measured_bound`)."""
    from tensortier.planner.simulator import ordinals

    ordinal = ordinals(profile)
    whole = set(group)
    rest = sorted(
        (t for t in profile.tensors if t.unit and t.unit not in whole),
        key=lambda t: (t.nbytes, ordinal[t.index], t.index),  # alike tensors: every unit's
    )

    def parts_of(k: int) -> dict[str, list[int]]:
        parts: dict[str, list[int]] = {}
        for t in rest[:k]:
            parts.setdefault(t.unit, []).append(ordinal[t.index])
        return {u: sorted(o) for u, o in parts.items()}

    lo, hi = 0, len(rest)  # the most smallest tensors that fit: peaks grow with what is kept
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _pass_fits(profile, budget, list(group), parts_of(mid)):
            lo = mid
        else:
            hi = mid - 1
    return parts_of(lo)


def timing_groups(profile: Profile, budget: int, passes: int) -> list[list[str]]:
    """Groups for ``passes`` timing passes from one profile (see :func:`timing_group`); the
    runtime instead chooses each pass's group after calibrating on the passes before it."""
    groups: list[list[str]] = []
    timed: set[str] = set()
    for _ in range(passes):
        group = timing_group(profile, budget, timed)
        groups.append(group)
        timed |= set(group)
    return groups
