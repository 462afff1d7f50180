"""OffloadedAdamW: AdamW whose state and master weights live in host RAM or on NVMe.

Flow of one step. Parameters are grouped into buckets (reverse registration order, which is
roughly the order backward produces gradients). A ``register_post_accumulate_grad_hook`` on each
parameter counts its gradients. ``step()`` runs every bucket's CPU update (``torch._fused_adamw_``,
the kernel of ``torch.optim.AdamW(fused=True)``) on one worker thread, commits, and writes the
parameters back in their dtype. Parameters are never modified before ``step()``.

Speculation (``overlap=True``). The first step learns how many backward passes feed a step and
the order in which buckets become ready. From then on, when every trainable parameter of a bucket
has its final gradient, the hook *snapshots* the gradients (CUDA: D2H on a side stream into a
reusable pinned buffer; CPU: copied on the worker) and the worker runs the update on the snapshot
into a *shadow* state while backward continues: the committed state is never written. ``step()``
then validates each speculation against what the user did between ``backward()`` and ``step()``:
it is kept only if the gradient every parameter has *now* is bit-identical to the snapshot, the
parameter was not changed, and the GradScaler scale is the one speculated with. Otherwise the
shadow is dropped (free and exact) and the bucket is updated again from the committed state with
the current gradients. The results are therefore those of the non-overlapped path whatever
happens to ``.grad`` (``clip_grad_norm_``, ``GradScaler.unscale_``, manual edits or replacement,
more backward passes). The comparison is by content, not by version counters, because measured on
torch 2.13 ``GradScaler.unscale_``, ``p.grad.data.mul_`` and writes through ``p.grad.numpy()``
change gradients without bumping ``_version``; version counters are recorded only to count edits
(``OffloadStats.compared_equal``: edited but bit-identical, e.g. a clip factor of 1.0).
Under ``torch.distributed`` with more than one rank nothing is speculated (the hooks fire before
DDP's all-reduce); the update runs in ``step()``. A bucket whose speculation keeps failing (e.g.
clipping that clips every step) stops speculating for 1, 2, 4, ... up to 64 steps.

GradScaler. ``_step_supports_amp_scaling`` is set: ``GradScaler.step`` hands ``grad_scale`` and
``found_inf`` to the optimizer as it does for ``torch.optim.AdamW(fused=True)``; the kernel
unscales, and a step with ``found_inf`` advances nothing (steps, states, parameters).

Memory. Host states: 12 B/param with fp32 masters, plus while speculating a spare copy of each
bucket's state (another 12 B/param) and a snapshot of its gradients (grad dtype size per param);
``overlap=False`` keeps 12 B/param. ``stats.host_state_bytes`` reports what is allocated.

This module must never unpickle anything nor write a parameter outside ``step()``/``load_state_dict``.
Threads and ordering are described in ``PROTOCOL.md``.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum

import torch

from tensortier._lifetime import Finalizer
from tensortier._units import SizeLike, align_up, format_size, parse_size
from tensortier.errors import ClosedError, ConfigError
from tensortier.optim._kernel import adamw_
from tensortier.optim._staging import Staged, Staging
from tensortier.optim._states import DiskStates, HostStates, slot_layout
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import PAGE

log = logging.getLogger(__name__)

# Param-group keys of torch 2.13's AdamW, with the values that describe this optimizer (the fused
# kernel). Emitted by ``state_dict()`` so ``torch.optim.AdamW(fused=True).load_state_dict`` keeps
# ``fused`` on (it replaces its groups with the loaded ones).
_TORCH_KEYS = {
    "amsgrad": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}
_MAX_PAUSE = 64  # steps a bucket stops speculating after repeated failures, at most


class StateTier(str, Enum):
    """Where optimizer state and master weights live between steps."""

    HOST = "host"
    DISK = "disk"


@dataclass
class OffloadStats:
    """Counters a user can print to see where a step's time went and how speculation fares."""

    steps: int = 0  # steps applied
    skipped_steps: int = 0  # steps GradScaler skipped (found_inf): nothing advanced
    buckets: int = 0
    launched_in_backward: int = 0  # bucket updates started by gradient hooks (speculated)
    launched_in_step: int = 0  # bucket updates run by step() (not speculated, or redone)
    speculated: int = 0  # = launched_in_backward
    validated: int = 0  # speculations kept: gradients, parameter and scale unchanged
    compared_equal: int = 0  # ...of which the gradient was edited (version bumped) to equal bits
    redone: int = 0  # speculations dropped in step() and recomputed from the committed state
    unversioned_edits: int = 0  # ...of which the gradient changed without a version bump
    discarded: int = 0  # speculations dropped without an update (zero_grad, skipped step)
    hyper_changed: int = 0  # ...redone because lr/betas/eps/weight_decay changed before step()
    paused_bucket_steps: int = 0  # bucket-steps without speculation because it kept failing
    update_seconds: float = 0.0  # worker time: state load + kernel + save
    kernel_seconds: float = 0.0  # worker time in the AdamW kernel alone
    step_wait_seconds: float = 0.0  # time step() waited for outstanding updates
    writeback_seconds: float = 0.0  # time step() spent copying parameters back
    host_state_bytes: int = 0  # host memory held for optimizer state (bound for disk states)
    host_grad_bytes: int = 0  # host buffers holding gradient snapshots

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class _Slot:
    """One parameter inside a bucket's flat state."""

    param: torch.Tensor
    index: int  # position in the bucket
    offset: int
    numel: int
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    version: int = -1  # param._version after our last write; -1: master never seeded
    count: int = 0  # gradients accumulated since the last step()
    has_state: bool = False  # like torch: state exists once a step() saw a gradient for it


@dataclass(frozen=True)
class _Hyper:
    """A param group's AdamW hyper-parameters, read on the caller's thread (never the worker's:
    loops set ``lr`` between backward and step, and the worker must not race that)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool

    @staticmethod
    def of(group: dict) -> _Hyper:
        beta1, beta2 = group["betas"]
        return _Hyper(
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group.get("maximize", False)),
        )


@dataclass(eq=False)
class _Spec:
    """A speculative update of one bucket: what it assumed, and its pending result."""

    slots: list[_Slot]
    grads: list[weakref.ref]  # identity, data_ptr and _version of each gradient at launch
    ptrs: list[int]
    versions: list[int]
    param_versions: list[int]
    scale: float | None
    hyper: _Hyper  # the group's hyper-parameters at launch: a change before step() means redo
    staged: Staged
    future: Future
    stale: bool = False  # a further backward pass reached the bucket


@dataclass(eq=False)
class _Bucket:
    id: int
    group: int
    dtype: torch.dtype
    device: torch.device
    slots: list[_Slot]
    numel: int
    trainable: int
    ready: int = 0
    spec: _Spec | None = None
    pause: int = 0  # steps left without speculation
    backoff: int = 1  # the next pause after a failed speculation


def _grad_hook(ref: weakref.ref, param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad(param)


def _shutdown(worker: ThreadPoolExecutor, states, hooks: list) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()
    worker.shutdown(wait=True, cancel_futures=True)  # jobs are finite CPU work (see PROTOCOL.md)
    states.close()


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with fp32 master weights and moments off the device.

    >>> opt = OffloadedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, states="disk",
    ...                      spill_dir="/mnt/nvme/tt")
    >>> loss.backward(); opt.step(); opt.zero_grad()

    Bit-identical to ``torch.optim.AdamW(fused=True)`` (same kernel, per parameter), including
    under ``GradScaler`` and whatever the loop does to ``.grad`` between backward and step.
    ``states``: ``"host"`` keeps state in RAM (12 bytes per parameter; while ``overlap``
    speculates, a second copy of the state and a gradient snapshot are added, see the module
    docstring); ``"disk"`` keeps it in a :class:`DiskStore` under ``spill_dir`` and streams it
    through ``pipeline_depth`` host buffers of one bucket each, so host memory stays
    ``pipeline_depth * 3 * bucket_size``.
    ``master_weights``: keep fp32 masters for bf16/fp16 parameters (else state is in their dtype).
    ``overlap``: speculate bucket updates during backward (see module docstring); ``False``
    updates in ``step()`` only; ``"auto"`` (default) speculates when parameters live on a GPU,
    whose backward the CPU update then hides behind. On a CPU-only run backward already uses
    every core, so speculating measured slower (41.9 vs 33.9 ms per iteration, 5.2M parameters,
    ``notes/issue-12-optim.md``) and costs the spare state. ``amsgrad`` is not offered.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        states: StateTier | str = StateTier.HOST,
        spill_dir: str | None = None,
        disk_capacity: SizeLike | None = None,
        master_weights: bool = True,
        bucket_size: SizeLike = "16MiB",
        overlap: bool | str = "auto",
        pipeline_depth: int = 4,
        io_threads: int = 4,
    ):
        if not float(lr) >= 0.0:
            raise ConfigError(f"invalid learning rate {lr}: must be >= 0")
        if not eps >= 0.0:
            raise ConfigError(f"invalid eps {eps}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ConfigError(f"invalid betas {betas}: each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ConfigError(f"invalid weight_decay {weight_decay}: must be >= 0")
        try:
            self.tier = StateTier(states)
        except ValueError:
            raise ConfigError(
                f"states={states!r} is not a state tier; pass one of {[t.value for t in StateTier]}"
            ) from None
        self._bucket_bytes = parse_size(bucket_size, name="bucket_size", allow_zero=False)
        self.master_weights = master_weights
        if overlap not in (True, False, "auto"):
            raise ConfigError(f"overlap={overlap!r}: pass True, False or 'auto'")
        self.overlap = overlap
        self._ready = False
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            **_TORCH_KEYS,
        )
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True  # GradScaler: grad_scale / found_inf, as fused AdamW
        devices = {p.device for g in self.param_groups for p in g["params"]}
        pin = any(d.type == "cuda" for d in devices)
        if self.overlap == "auto":
            self.overlap = pin
        if self.tier is StateTier.HOST:
            self._states: HostStates | DiskStates = HostStates(pin=pin)
        else:
            slab = align_up(3 * self._bucket_bytes, PAGE)
            store = DiskStore(
                spill_dir,
                capacity=disk_capacity,
                slab_size=slab,
                io_threads=io_threads,
                owner="tensortier-optim",
            )
            try:
                self._states = DiskStates(store, pipeline_depth, pin=pin)
            except BaseException:
                store.close()
                raise
        self._staging = Staging(devices)  # CUDA: one side stream per device, made here
        self.stats = OffloadStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tt-adamw")
        self._scratch = torch.empty(0, dtype=torch.uint8)  # worker only: unscaled gradient copies
        self._hooks: list = []
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Slot, _Bucket]] = {}
        self._calibrated = False
        self._accum = 1
        self._last_scale: float | None = None
        self._dist = _distributed()
        self._seen_order: list[int] = []
        self._order: list[int] = []
        self._prepared: list[Future] = []  # spare copies made on the worker after a step
        self._finalizer = Finalizer(self, _shutdown, self._worker, self._states, self._hooks)
        self._ready = True
        for gi in range(len(self.param_groups)):
            self._build_group(gi)

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            self._discard_speculation()
            group = self.param_groups[-1]
            self._staging.add_devices({p.device for p in group["params"]})
            self._build_group(len(self.param_groups) - 1)

    def _master_dtype(self, p: torch.Tensor) -> torch.dtype:
        if p.dtype in (torch.float32, torch.float64) or not self.master_weights:
            return p.dtype
        return torch.float32

    def _check_group(self, group: dict, where: str = "param group") -> None:
        """Refuse what the fused CPU AdamW cannot do; then state what it is (``_TORCH_KEYS``)."""
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                raise ConfigError(
                    f"{where} has {key}=True; OffloadedAdamW does not offer {key} (it runs the "
                    f"fused AdamW kernel on CPU state): use torch.optim.AdamW for that run"
                )
        if group.get("decoupled_weight_decay") is False and group.get("weight_decay", 0) != 0:
            raise ConfigError(
                f"{where} has decoupled_weight_decay=False (torch.optim.Adam's L2 penalty); "
                "OffloadedAdamW is AdamW: use torch.optim.Adam, or weight_decay=0"
            )
        group.update(_TORCH_KEYS)

    def _build_group(self, gi: int) -> None:
        group = self.param_groups[gi]
        self._check_group(group)
        params = group["params"]
        for p in params:
            if not p.is_floating_point():
                raise ConfigError(f"OffloadedAdamW optimizes floating-point tensors, got {p.dtype}")
            if p.is_sparse:
                raise ConfigError("OffloadedAdamW does not support sparse parameters")
        current: list[torch.Tensor] = []

        def close_bucket() -> None:
            if not current:
                return
            dtype = self._master_dtype(current[0])
            es = torch.empty((), dtype=dtype).element_size()
            offsets, total = slot_layout([q.numel() for q in current], es)
            slots = [
                _Slot(q, i, off, q.numel()) for i, (q, off) in enumerate(zip(current, offsets))
            ]
            b = _Bucket(
                id=len(self._buckets),
                group=gi,
                dtype=dtype,
                device=current[0].device,
                slots=slots,
                numel=total,
                trainable=sum(q.requires_grad for q in current),
            )
            self._buckets.append(b)
            self._states.add(b.id, b.numel, dtype)
            for s in slots:
                self._where[id(s.param)] = (s, b)
            current.clear()

        used = 0
        for p in reversed(params):  # backward produces gradients roughly in reverse order
            es = torch.empty((), dtype=self._master_dtype(p)).element_size()
            nbytes = p.numel() * es
            if current and (
                used + nbytes > self._bucket_bytes
                or self._master_dtype(p) != self._master_dtype(current[0])
                or p.device != current[0].device
            ):
                close_bucket()
                used = 0
            current.append(p)
            used += nbytes
        close_bucket()
        for p in params:
            if p.requires_grad:
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(
                        functools.partial(_grad_hook, weakref.ref(self))
                    )
                )
        self._order = [b.id for b in self._buckets]
        self.stats.buckets = len(self._buckets)
        self._update_memory_stats()

    def _update_memory_stats(self) -> None:
        self.stats.host_state_bytes = self._states.host_bytes
        self.stats.host_grad_bytes = self._staging.host_bytes

    # ------------------------------------------------------------------ backward side
    def _speculating(self, bucket: _Bucket) -> bool:
        return self.overlap and self._calibrated and not self._dist and bucket.pause == 0

    def _on_grad(self, p: torch.Tensor) -> None:
        entry = self._where.get(id(p))
        if entry is None or not self._finalizer.alive:
            return
        slot, bucket = entry
        slot.count += 1
        if not self._calibrated:
            if slot.count == 1:
                bucket.ready += 1
                if bucket.ready == bucket.trainable:
                    self._seen_order.append(bucket.id)
            return
        if slot.count > self._accum:  # a further backward pass: the snapshot is out of date
            if bucket.spec is not None:
                bucket.spec.stale = True
            return
        if slot.count == self._accum:
            bucket.ready += 1
            ready = bucket.ready == bucket.trainable and bucket.spec is None
            if ready and self._speculating(bucket):
                self._speculate(bucket)

    def _speculate(self, bucket: _Bucket) -> None:
        slots = [s for s in bucket.slots if s.param.grad is not None]
        if not slots or any(
            s.param.grad.is_sparse or s.version == -1 or s.param._version != s.version
            for s in slots
        ):
            return  # sparse, or the master needs seeding from the parameter: step() does it
        grads = [s.param.grad for s in slots]
        params = [s.param for s in bucket.slots]
        staged = self._staging.snapshot(bucket.id, params, [s.index for s in slots], grads)
        scale = self._last_scale
        hyper = _Hyper.of(self.param_groups[bucket.group])
        future = self._worker.submit(
            self._update, bucket, slots, staged, scale, hyper, True, None, None
        )
        bucket.spec = _Spec(
            slots=slots,
            grads=[weakref.ref(g) for g in grads],
            ptrs=[g.data_ptr() for g in grads],
            versions=[g._version for g in grads],
            param_versions=[s.param._version for s in slots],
            scale=scale,
            hyper=hyper,
            staged=staged,
            future=future,
        )
        self.stats.speculated += 1
        self.stats.launched_in_backward += 1

    # ------------------------------------------------------------------ worker side
    def _update(
        self,
        bucket: _Bucket,
        slots: list[_Slot],
        staged: Staged,
        scale: float | None,
        hyper: _Hyper,
        shadow: bool,
        seeds: list | None,
        direct: list[bool] | None,
    ) -> list[torch.Tensor]:
        """Run one bucket's AdamW update; returns the slots' new step counters.

        ``shadow``: update a copy of the committed state (speculation). ``seeds``: per slot, the
        parameter's current value (CPU) when the master must be checked against it.
        ``direct``: per slot, the kernel may unscale the gradient tensor itself (CPU, in step()).
        """
        t0 = time.perf_counter()
        grads = staged.wait()
        flat = self._kernel_grads(bucket, grads, scale, keep=shadow, direct=direct)
        token, (master, m, v), _ = self._states.load(bucket.id, shadow=shadow)
        saved = False
        try:
            pos = self._order.index(bucket.id) if bucket.id in self._order else -1
            if pos >= 0:
                self._states.prefetch(self._order[pos + 1 : pos + self._prefetch_depth()])
            ps, ms, vs, steps = [], [], [], []
            for i, s in enumerate(slots):
                sl = slice(s.offset, s.offset + s.numel)
                mp = master[sl]
                seed = seeds[i] if seeds is not None else None
                if seed is not None and (
                    s.version == -1 or not torch.equal(seed, mp.to(seed.dtype))
                ):  # first step, or the user changed the parameter: the parameter wins
                    mp.copy_(seed)
                ps.append(mp)
                ms.append(m[sl])
                vs.append(v[sl])
                steps.append(s.step.clone())
            tk = time.perf_counter()
            adamw_(
                ps,
                flat,
                ms,
                vs,
                steps,
                lr=hyper.lr,
                beta1=hyper.beta1,
                beta2=hyper.beta2,
                eps=hyper.eps,
                weight_decay=hyper.weight_decay,
                maximize=hyper.maximize,
                grad_scale=None if scale is None else torch.tensor(scale, dtype=torch.float32),
            )
            self.stats.kernel_seconds += time.perf_counter() - tk
            saved = True  # save() owns the token from here on, also when it raises
            self._states.save(bucket.id, token, (master, m, v))
        finally:
            if not saved:
                self._states.discard(token)
            self.stats.update_seconds += time.perf_counter() - t0
        return steps

    def _kernel_grads(self, bucket, grads, scale, *, keep: bool, direct) -> list[torch.Tensor]:
        """Flat gradients in the master dtype for the kernel (worker thread).

        With ``scale`` the kernel writes the unscaled gradient back into its input: a snapshot that
        ``step()`` still compares (``keep``) is copied to a scratch buffer first.
        """
        flat = []
        need = 0
        for i, g in enumerate(grads):
            if g.dtype != bucket.dtype:
                flat.append(g.reshape(-1).to(bucket.dtype))
            elif direct is not None and direct[i]:
                flat.append(g.view(-1))
            elif scale is not None and keep:
                flat.append(None)
                need = align_up(need + g.numel() * g.element_size(), 64)
            else:
                flat.append(g.reshape(-1))
        if need:
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.uint8)
            off = 0
            for i, g in enumerate(grads):
                if flat[i] is None:
                    nb = g.numel() * g.element_size()
                    flat[i] = self._scratch[off : off + nb].view(g.dtype)
                    flat[i].copy_(g.reshape(-1))
                    off = align_up(off + nb, 64)
        return flat

    def _prefetch_depth(self) -> int:
        return getattr(self._states, "depth", 2)

    # ------------------------------------------------------------------ step
    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError("OffloadedAdamW is closed; create a new optimizer")

    def _discard_speculation(self) -> None:
        """Drop every pending speculation (zero_grad without step, a skipped step, a reload)."""
        for b in self._buckets:
            spec, b.spec = b.spec, None
            if spec is None:
                continue
            spec.future.exception()  # finite CPU work (and a CUDA event): see PROTOCOL.md
            self._states.drop(b.id)
            self.stats.discarded += 1

    def _reset_cycle(self) -> None:
        for b in self._buckets:
            b.ready = 0
            b.spec = None
            for s in b.slots:
                s.count = 0

    def _end_cycle(self) -> None:
        counts = [s.count for b in self._buckets for s in b.slots]
        if not self._calibrated:
            seen = list(dict.fromkeys(self._seen_order))
            self._order = seen + [b.id for b in self._buckets if b.id not in seen]
            self._calibrated = True
        if max(counts, default=0) > 0:  # relearn: accumulation may change during training
            self._accum = max(counts)
        self._dist = _distributed()
        self._reset_cycle()
        self._update_memory_stats()

    def _scaler_inputs(self) -> tuple[torch.Tensor | None, float | None, bool]:
        """``grad_scale`` / ``found_inf`` as ``torch.optim.AdamW(fused=True)`` reads them."""
        scale_t = getattr(self, "grad_scale", None)
        found_t = getattr(self, "found_inf", None)
        scale = None if scale_t is None else float(scale_t)  # float32 -> float: exact
        skip = found_t is not None and float(found_t) != 0.0
        return scale_t, scale, skip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Validate speculations, run the remaining bucket updates, commit, write parameters back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        if any(s.param.grad is not None and s.param.grad.is_sparse for s in self._all_slots()):
            self._discard_speculation()
            self._reset_cycle()
            raise RuntimeError("OffloadedAdamW does not support sparse gradients")
        scale_t, scale, skip = self._scaler_inputs()
        if skip:  # GradScaler found inf/NaN: like fused AdamW, nothing advances
            self._discard_speculation()
            self._states.abort()
            for b in self._buckets:
                for s in b.slots:
                    s.has_state |= s.param.grad is not None
            self.stats.skipped_steps += 1
            self._end_cycle()
            return loss
        try:
            self._run_step(scale_t, scale)
        finally:  # the compute streams wait for whatever write-back was issued
            self._staging.finish_write_back()
        return loss

    def _all_slots(self) -> Iterable[_Slot]:
        return (s for b in self._buckets for s in b.slots)

    def _run_step(self, scale_t: torch.Tensor | None, scale: float | None) -> None:
        t0 = time.perf_counter()
        order = [self._buckets[i] for i in self._order]
        done: list[tuple[_Bucket, list[_Slot], list[torch.Tensor], list[bool]]] = []
        jobs: list[tuple[_Bucket, list[_Slot], Future, list[bool]]] = []
        error: BaseException | None = None
        self._wb_seconds = 0.0

        def finished(b, slots, steps, direct) -> None:
            done.append((b, slots, steps, direct))
            if self.tier is StateTier.HOST:  # host: write back now, overlapping later updates
                tw = time.perf_counter()
                self._write_back(b, slots, self._states.latest(b.id))
                self._wb_seconds += time.perf_counter() - tw

        for b in order:
            spec, b.spec, staged = b.spec, None, None
            if spec is not None:
                keep, changed, staged = self._validate(b, spec, scale)
                self._after_speculation(b, failed=changed)
                if keep:
                    finished(b, spec.slots, spec.future.result(), [False] * len(spec.slots))
                    continue
                self._states.drop(b.id)
                self.stats.redone += 1
            elif b.pause > 0:
                b.pause -= 1
                self.stats.paused_bucket_steps += 1
            try:
                job = self._submit_now(b, scale, staged)
            except BaseException as exc:  # e.g. out of memory: nothing more is launched
                error = error or exc
                self._discard_speculation()
                break
            if job is not None:
                jobs.append(job)
        for b, slots, fut, direct in jobs:
            exc = fut.exception()
            if exc is not None:
                error = error or exc
            else:
                finished(b, slots, fut.result(), direct)
        self.stats.step_wait_seconds += time.perf_counter() - t0 - self._wb_seconds
        self.stats.writeback_seconds += self._wb_seconds
        self._apply(done, error, scale_t)

    def _after_speculation(self, b: _Bucket, *, failed: bool) -> None:
        if failed:  # back off exponentially: 1, 2, 4, ... steps without speculation
            b.pause = b.backoff
            b.backoff = min(2 * b.backoff, _MAX_PAUSE)
        else:
            b.backoff = 1

    def _validate(
        self, b: _Bucket, spec: _Spec, scale: float | None
    ) -> tuple[bool, bool, Staged | None]:
        """(keep, the gradients or parameters changed, host copy of the current gradients)."""
        exc = spec.future.exception()  # finite work (see PROTOCOL.md)
        if exc is not None:  # a failed speculation is redone; the redo raises if it fails too
            log.debug("tensortier: speculative update of bucket %d failed: %r", b.id, exc)
            return False, False, None
        if spec.stale:
            return False, True, None
        current = [s for s in b.slots if s.param.grad is not None]
        if current != spec.slots or any(
            s.param._version != v for s, v in zip(spec.slots, spec.param_versions)
        ):
            return False, True, None
        if spec.scale != scale:  # GradScaler changed its scale (or unscale_ was called)
            return False, False, None
        if spec.hyper != _Hyper.of(self.param_groups[b.group]):  # e.g. lr set after backward
            self.stats.hyper_changed += 1
            return False, False, None
        grads = [s.param.grad for s in spec.slots]
        same = all(
            r() is g and g.data_ptr() == p and g._version == v
            for r, g, p, v in zip(spec.grads, grads, spec.ptrs, spec.versions)
        )
        if not self._staging.matches(spec.staged, grads):
            self.stats.unversioned_edits += same
            # CUDA: matches() left the current gradients in the snapshot buffer; reuse that copy
            return False, True, spec.staged if b.device.type == "cuda" else None
        self.stats.validated += 1
        self.stats.compared_equal += not same
        return True, False, None

    def _submit_now(self, b: _Bucket, scale: float | None, staged: Staged | None):
        """Queue a non-speculative update of ``b`` with the gradients as they are now."""
        slots = [s for s in b.slots if s.param.grad is not None]
        if not slots:
            return None
        grads = [s.param.grad for s in slots]
        if staged is None:
            params = [s.param for s in b.slots]
            staged = self._staging.stage(b.id, params, [s.index for s in slots], grads)
        direct = [
            g.device.type == "cpu" and g.dtype == b.dtype and g.is_contiguous() for g in grads
        ]
        seeds = [
            s.param.detach().reshape(-1).to("cpu")
            if s.version == -1 or s.param._version != s.version
            else None
            for s in slots
        ]
        hyper = _Hyper.of(self.param_groups[b.group])
        fut = self._worker.submit(
            self._update, b, slots, staged, scale, hyper, False, seeds, direct
        )
        self.stats.launched_in_step += 1
        return b, slots, fut, direct

    def _apply(self, done, error: BaseException | None, scale_t: torch.Tensor | None) -> None:
        """Commit, advance step counters, write parameters back; raise ``error`` if a job failed.

        Host states: the buckets whose update succeeded are applied (their parameters were
        written back as they finished) even if another failed (an update fails only on a bug or
        out of memory). Disk states: all or nothing, parameters written after the commit.
        """
        host = self.tier is StateTier.HOST
        try:
            if error is not None and not host:
                self._states.abort()
                raise error
            self._states.commit()  # disk: raises TierFullError with nothing applied
        except BaseException:
            self._reset_cycle()
            raise
        tw = time.perf_counter()
        for _, slots, steps, _ in done:
            for s, st in zip(slots, steps):
                s.step = st
                s.has_state = True
        if not host:
            by_id = {b.id: (b, slots) for b, slots, _, _ in done}
            for i, master in self._states.masters(list(by_id)):
                b, slots = by_id[i]
                self._write_back(b, slots, None, master)
        self.stats.writeback_seconds += time.perf_counter() - tw
        if scale_t is not None:  # fused AdamW leaves the unscaled gradients in .grad
            for _, slots, _, direct in done:
                for s, d in zip(slots, direct):
                    if not d:
                        s.param.grad.div_(scale_t.to(s.param.grad.device))
        self.stats.steps += 1
        self._last_scale = None if scale_t is None else float(scale_t)
        self._end_cycle()
        self._states.prefetch(self._order[: self._prefetch_depth() - 1])
        self._prepare_spares()
        if error is not None:
            raise error

    def _prepare_spares(self) -> None:
        """Host: copy each bucket's committed state into its spare on the worker now, while the
        next forward runs, so the speculative updates in backward only run the kernel."""
        self._prepared = [f for f in self._prepared if not f.done()]
        if not isinstance(self._states, HostStates) or not self.overlap or self._dist:
            return
        for i in self._order:
            if self._buckets[i].pause == 0 and self._buckets[i].trainable:
                self._prepared.append(self._worker.submit(self._states.prepare, i))

    def _write_back(self, b: _Bucket, slots: list[_Slot], holder, master=None) -> None:
        master = holder.master if master is None else master
        self._staging.write_back(
            [(s.param, master[s.offset : s.offset + s.numel]) for s in slots], holder
        )
        for s in slots:
            s.version = s.param._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop speculation that no step() consumed, then clear gradients as torch does."""
        if any(b.spec is not None for b in self._buckets) or any(
            s.count for b in self._buckets for s in b.slots
        ):
            self._discard_speculation()
            self._reset_cycle()
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip all gradients by their global norm (``torch.nn.utils.clip_grad_norm_``); call before step."""
        self._check_open()
        grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(
            grads, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ------------------------------------------------------------------ state dict
    def _index(self) -> list[_Slot]:
        return [self._where[id(p)][0] for g in self.param_groups for p in g["params"]]

    def _wait_speculation(self) -> None:
        for b in self._buckets:
            if b.spec is not None:
                b.spec.future.exception()  # finite work; the committed state is what we read

    def state_dict(self) -> dict:
        """Same layout and param-group keys as ``torch.optim.AdamW(fused=True)``: tensors and plain
        values only (no pickle needed). Between backward and step it is the state before the step.

        Per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, plus ``master_param`` when the master
        weights differ in dtype from the parameter.
        """
        self._check_open()
        self._wait_speculation()
        slots = self._index()
        pos = {id(s): i for i, s in enumerate(slots)}
        state: dict[int, dict] = {}
        for b in self._buckets:
            if not any(s.has_state for s in b.slots):
                continue
            master, m, v = self._states.read(b.id)
            for s in b.slots:
                if not s.has_state:
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                shape = s.param.shape
                entry = {
                    "step": s.step.clone(),
                    "exp_avg": m[sl].clone().view(shape),
                    "exp_avg_sq": v[sl].clone().view(shape),
                }
                if b.dtype != s.param.dtype:
                    seeded = s.version != -1
                    src = master[sl] if seeded else s.param.detach().reshape(-1).to(b.dtype)
                    entry["master_param"] = src.clone().view(shape).cpu()
                state[pos[id(s)]] = entry
        groups, start = [], 0
        for g in self.param_groups:
            packed = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"
            }
            packed.update(_TORCH_KEYS)
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.optim.AdamW.state_dict()`` (any of
        its variants: fused, foreach, for-loop). Pending speculation is dropped."""
        self._check_open()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups, the optimizer has "
                f"{len(self.param_groups)}"
            )
        for g, sg in zip(self.param_groups, groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group ({len(sg['params'])} vs {len(g['params'])} parameters)"
                )
            self._check_group(dict(sg), "the loaded state dict's param group")
        slots = self._index()
        ids = [i for sg in groups for i in sg["params"]]
        entries = {
            pos: state_dict["state"].get(i, state_dict["state"].get(str(i)))
            for pos, i in enumerate(ids)
        }
        for pos, e in entries.items():
            if e is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in e or e[key].numel() != slots[pos].numel:
                    raise ValueError(
                        f"state of parameter {pos} has no {key!r} with {slots[pos].numel} elements"
                    )
        self._discard_speculation()
        for f in self._prepared:  # they read the committed state that is about to be replaced
            f.exception()
        self._prepared = []
        if isinstance(self._states, DiskStates):
            self._states.drop_prefetch()
        new_steps: dict[int, torch.Tensor | None] = {}
        pos_of = {id(s): i for i, s in enumerate(slots)}
        try:
            for b in self._buckets:
                token, (master, m, v) = self._states.blank(b.id)
                try:
                    for s in b.slots:
                        e = entries.get(pos_of[id(s)])
                        sl = slice(s.offset, s.offset + s.numel)
                        if e is None:
                            new_steps[id(s)] = None
                            continue
                        m[sl].copy_(e["exp_avg"].reshape(-1))
                        v[sl].copy_(e["exp_avg_sq"].reshape(-1))
                        src = e.get("master_param", s.param.detach())
                        master[sl].copy_(src.reshape(-1))
                        step = e["step"]
                        new_steps[id(s)] = torch.tensor(
                            float(step.item() if torch.is_tensor(step) else step),
                            dtype=torch.float32,
                        )
                except BaseException:
                    self._states.discard(token)  # not saved: back to the ring, once
                    raise
                self._states.save(b.id, token, (master, m, v))  # owns the token from here
            self._states.commit()
        except BaseException:
            self._states.abort()
            raise
        for b in self._buckets:
            for s in b.slots:
                st = new_steps[id(s)]
                s.has_state = st is not None
                s.step = st if st is not None else torch.zeros((), dtype=torch.float32)
                s.version = s.param._version if st is not None else -1
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params" and k not in _TORCH_KEYS:
                    g[k] = tuple(v) if k == "betas" else v

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for updates, remove the gradient hooks, and delete any spill files."""
        self._finalizer()

    def __enter__(self) -> OffloadedAdamW:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"OffloadedAdamW(states={self.tier.value}, buckets={len(self._buckets)}, "
            f"host_state={format_size(self._states.host_bytes)}, groups={len(self.param_groups)})"
        )
