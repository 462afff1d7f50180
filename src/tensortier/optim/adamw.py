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
from typing import TYPE_CHECKING

import torch

from tensortier import _dist
from tensortier._lifetime import Finalizer
from tensortier._units import SizeLike, align_up, format_size, parse_size
from tensortier.errors import ClosedError, ConfigError
from tensortier.optim._kernel import adamw_
from tensortier.optim._shard import ALIGN, Gatherer, GatherPlan, partition
from tensortier.optim._staging import Staged, Staging
from tensortier.optim._states import DiskStates, HostStates, slot_layout
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import PAGE

if TYPE_CHECKING:  # Ray is imported only when a RemoteStore is made
    from tensortier.tiers.remote import RemoteStore

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
    REMOTE = "remote"  # other nodes' RAM (tiers.remote.RemoteStore), streamed like "disk"


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
    start: int = 0  # sharded: first flat element of the parameter this rank owns
    local: torch.Tensor | None = None  # what the update writes: the parameter, or its DTensor shard

    def __post_init__(self) -> None:
        if self.local is None:
            self.local = _local(self.param)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == self.local.numel()

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This slot's elements of ``t`` (a local tensor: the parameter's data, or its gradient)."""
        return t if self.whole else t.reshape(-1)[self.start : self.start + self.numel]

    def tensor(self) -> torch.Tensor:
        """The parameter data this slot updates (detached; a DTensor's local shard)."""
        return self.view(self.local.detach())

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else self.view(_local(g))


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
    plan: GatherPlan | None = None  # sharded: every rank's pieces of this bucket's parameters


def _grad_hook(ref: weakref.ref, param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad(param)


def _remote_states(remote, depth: int, pin: bool, io_threads: int) -> DiskStates:
    """``states="remote"``: the disk path's streaming over a RemoteStore (same protocol)."""
    from tensortier.tiers.remote import RemoteStore

    if isinstance(remote, RemoteStore):
        if remote.closed:
            raise ConfigError("remote=RemoteStore(...) is closed; pass an open store")
        return DiskStates(remote, depth, pin=pin, owns_store=False)
    if not isinstance(remote, dict) or "capacity" not in remote:
        raise ConfigError(
            f"states='remote' needs remote=RemoteStore(capacity) or a dict of its arguments "
            f"with a capacity, e.g. remote={{'capacity': '8GiB'}}; got remote={remote!r}"
        )
    store = RemoteStore(**{"io_threads": io_threads, **remote})
    try:
        return DiskStates(store, depth, pin=pin)
    except BaseException:
        store.close()
        raise


def _shutdown(worker: ThreadPoolExecutor, states, hooks: list) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()
    worker.shutdown(wait=True, cancel_futures=True)  # jobs are finite CPU work (see PROTOCOL.md)
    states.close()


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and gradients), else the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _peer_failed(rank: int, applied: bool) -> RuntimeError:
    what = (
        "the parts that succeeded were applied on every rank"
        if applied
        else "no rank applied it, so parameters and state are as before the step"
    )
    return RuntimeError(
        f"OffloadedAdamW: rank {rank} failed its part of this step (its log has the error); {what}"
    )


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
    ``pipeline_depth * 3 * bucket_size``; ``"remote"`` streams it the same way from other Ray
    nodes' memory: ``remote`` is a :class:`~tensortier.tiers.remote.RemoteStore` (the caller's,
    left open by :meth:`close`) or a dict of its arguments (``{"capacity": "8GiB"}``; the
    optimizer makes the store and closes it). A lost memory node makes ``step()`` raise
    ``NodeLostError`` naming it (nothing applied; the state on that node is gone: restore from a
    checkpoint).
    ``master_weights``: keep fp32 masters for bf16/fp16 parameters (else state is in their dtype).
    ``overlap``: speculate bucket updates during backward (see module docstring); ``False``
    updates in ``step()`` only; ``"auto"`` (default) speculates when parameters live on a GPU,
    whose backward the CPU update then hides behind. On a CPU-only run backward already uses
    every core, so speculating measured slower (41.9 vs 33.9 ms per iteration, 5.2M parameters,
    ``notes/issue-12-optim.md``) and costs the spare state. ``amsgrad`` is not offered.

    Data parallel (DDP): with ``torch.distributed`` initialised and more than one rank in
    ``process_group`` (default: the world), the state is *sharded* (``shard=None`` -> on; pass
    ``shard=False`` to keep a full copy per rank): each rank keeps masters and moments for its
    part of every bucket (1/N of the host bytes), updates it from the gradients DDP has reduced,
    and the updated parameters are all-gathered into every replica before ``step()`` returns.
    See ``PROTOCOL.md`` ("Sharded across ranks") for why DDP's all-reduce and not a
    reduce-scatter, and :meth:`state_dict` / :meth:`full_state_dict` for checkpoints.
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
        remote: RemoteStore | dict | None = None,
        master_weights: bool = True,
        bucket_size: SizeLike = "16MiB",
        overlap: bool | str = "auto",
        pipeline_depth: int = 4,
        io_threads: int = 4,
        process_group=None,
        shard: bool | None = None,
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
        self._init_sharding(process_group, shard)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        pin = any(d.type == "cuda" for d in devices)
        if self.overlap == "auto":
            self.overlap = pin
        if self.tier is StateTier.HOST:
            self._states: HostStates | DiskStates = HostStates(pin=pin)
        elif self.tier is StateTier.REMOTE:
            self._states = _remote_states(remote, pipeline_depth, pin, io_threads)
        else:
            slab = align_up(3 * self._bucket_bytes, PAGE)
            store = DiskStore(
                spill_dir,
                capacity=disk_capacity,
                slab_size=slab,
                io_threads=io_threads,
                owner=_dist.owner("tensortier-optim"),
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
        self._dist = self._sharded or self._fsdp or _distributed()
        self._seen_order: list[int] = []
        self._order: list[int] = []
        self._prepared: list[Future] = []  # spare copies made on the worker after a step
        self._finalizer = Finalizer(self, _shutdown, self._worker, self._states, self._hooks)
        self._ready = True
        for gi in range(len(self.param_groups)):
            self._build_group(gi)

    # ------------------------------------------------------------------ construction
    def _init_sharding(self, process_group, shard: bool | None) -> None:
        """Decide whether to shard over ``process_group`` and check that every rank agrees."""
        group_active = _dist.active(process_group)
        # FSDP2 (fully_shard): parameters are DTensors; FSDP already shards them, so each rank
        # updates its local shards and the state is DTensor-aware (PROTOCOL.md, "FSDP2")
        self._fsdp = any(_is_dtensor(p) for p in self._all_params())
        if shard is None:
            shard = group_active and not self._fsdp
        if shard and self._fsdp:
            raise ConfigError(
                "shard=True with DTensor parameters: FSDP2 (fully_shard) already shards them; "
                "leave shard=None and each rank updates its local shards"
            )
        if shard and not group_active:
            raise ConfigError(
                f"shard={shard!r} needs torch.distributed initialised with more than one rank in "
                f"process_group; call torch.distributed.init_process_group() first, or pass "
                f"shard=False"
            )
        self._sharded = bool(shard)
        self._pg = process_group
        self._world = _dist.world(process_group) if self._sharded else 1
        self._rank = _dist.rank(process_group) if self._sharded else 0
        self._load = [0] * self._world  # bytes of state per rank, to balance whole parameters
        self._gatherer = Gatherer(process_group, self._world, self._rank) if shard else None
        self._mesh = None
        self._agreeing = group_active  # every rank must build the same optimizer
        if self._agreeing:
            self._agree(self.param_groups, "OffloadedAdamW")

    def _agree(self, groups: list[dict], what: str) -> None:
        """Every rank must build the same buckets: same parameters, groups and settings."""
        _dist.agree(
            {
                "states": self.tier.value,
                "bucket_size": self._bucket_bytes,
                "master_weights": self.master_weights,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                "parameters": [
                    [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in g["params"]]
                    for g in groups
                ],
            },
            what,
            self._pg,
            fix="build the model and the optimizer the same way on every rank",
        )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            if self._agreeing:
                self._agree(self.param_groups[-1:], "OffloadedAdamW.add_param_group")
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
            plan = None
            if self._sharded:  # this rank's pieces of the bucket (PROTOCOL.md, "Sharded")
                pieces = partition(current, self._world, ALIGN // es, self._load, es)
                plan = GatherPlan(list(current), pieces)
                mine = pieces[self._rank]
                offsets, total = slot_layout([pc.numel for pc in mine], es)
                slots = [
                    _Slot(current[pc.index], k, off, pc.numel, start=pc.start)
                    for k, (pc, off) in enumerate(zip(mine, offsets))
                ]
            else:
                locals_ = [_local(q) for q in current]  # FSDP2: the local shards
                offsets, total = slot_layout([q.numel() for q in locals_], es)
                slots = [
                    _Slot(q, i, off, lq.numel(), local=lq)
                    for i, (q, lq, off) in enumerate(zip(current, locals_, offsets))
                ]
            b = _Bucket(
                id=len(self._buckets),
                group=gi,
                dtype=dtype,
                device=current[0].device,
                slots=slots,
                numel=total,
                trainable=sum(s.param.requires_grad for s in slots),
                plan=plan,
            )
            self._buckets.append(b)
            if b.numel:
                self._states.add(b.id, b.numel, dtype)
            for s in slots:
                self._where[id(s.param)] = (s, b)
            current.clear()

        used = 0
        for p in reversed(params):  # backward produces gradients roughly in reverse order
            es = torch.empty((), dtype=self._master_dtype(p)).element_size()
            nbytes = _local(p).numel() * es
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
        for p in params if not self._sharded else ():  # sharded: nothing to speculate
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
            s.param.grad.is_sparse or s.version == -1 or s.local._version != s.version
            for s in slots
        ):
            return  # sparse, or the master needs seeding from the parameter: step() does it
        grads = [s.grad() for s in slots]
        params = [s.tensor() for s in bucket.slots]
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
            param_versions=[s.local._version for s in slots],
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
        flat = self._kernel_grads(bucket, grads, scale, keep=shadow or self._sharded, direct=direct)
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
        self._dist = self._sharded or self._fsdp or _distributed()
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
        sparse = any(p.grad is not None and p.grad.is_sparse for p in self._all_params())
        scale_t, scale, skip = self._scaler_inputs()
        if self._sharded or self._fsdp:  # every rank takes the same branch (collectives follow;
            # under FSDP2 GradScaler checked only the local shards: ShardedGradScaler's reason)
            sparse, skip = _dist.any_true([sparse, skip], self._pg)
        if sparse:
            self._discard_speculation()
            self._reset_cycle()
            raise RuntimeError("OffloadedAdamW does not support sparse gradients")
        if skip:  # GradScaler found inf/NaN: like fused AdamW, nothing advances
            self._discard_speculation()
            self._states.abort()
            for b in self._buckets:
                for s in b.slots:
                    s.has_state |= s.param.grad is not None
            self.stats.skipped_steps += 1
            self._last_scale = None
            self._end_cycle()
            return loss
        try:
            if self._sharded:
                self._run_step_sharded(scale_t, scale)
            else:
                self._run_step(scale_t, scale)
        finally:  # the compute streams wait for whatever write-back was issued
            self._staging.finish_write_back()
        return loss

    def _all_slots(self) -> Iterable[_Slot]:
        return (s for b in self._buckets for s in b.slots)

    def _all_params(self) -> Iterable[torch.Tensor]:
        return (p for g in self.param_groups for p in g["params"])

    def _run_step_sharded(self, scale_t: torch.Tensor | None, scale: float | None) -> None:
        """Update this rank's pieces, agree that every rank succeeded, commit, all-gather.

        Disk states: all or nothing on every rank (a failed write on any rank aborts the step
        everywhere, parameters untouched). Host states: as without sharding, what succeeded is
        applied (a host update fails only on a bug or out of memory) and every rank raises.
        """
        t0 = time.perf_counter()
        jobs, done, error = [], [], None
        for b in (self._buckets[i] for i in self._order):
            try:
                job = self._submit_now(b, scale, None)
            except BaseException as exc:  # e.g. out of memory: nothing more is launched
                error = exc
                break
            if job is not None:
                jobs.append(job)
        for b, slots, fut, direct in jobs:
            exc = fut.exception()  # finite work (see PROTOCOL.md)
            if exc is not None:
                error = error or exc
            else:
                done.append((b, slots, fut.result(), direct))
        host = self.tier is StateTier.HOST
        if error is None and not host:
            error = self._states.write_error()  # waits for this step's state writes
        self.stats.step_wait_seconds += time.perf_counter() - t0
        failed = _dist.first_true(error is not None, self._pg)
        if failed is not None and not host:
            self._states.abort()
            self._reset_cycle()
            raise error or _peer_failed(failed, applied=False)
        tw = time.perf_counter()
        try:
            self._states.commit()
            updated: set[int] = set()
            for _, slots, steps, _ in done:
                for s, st in zip(slots, steps):
                    s.step = st
                    s.has_state = True
                    updated.add(id(s))
            self._gather_updates(done)
            for s in self._all_slots():
                if s.version != -1 or id(s) in updated:
                    s.version = s.local._version
            if scale_t is not None:  # fused AdamW leaves the unscaled gradients in .grad
                for p in self._all_params():
                    if p.grad is not None:
                        p.grad.div_(scale_t.to(p.grad.device))
        finally:
            self.stats.writeback_seconds += time.perf_counter() - tw
        self.stats.steps += 1
        self._last_scale = None if scale_t is None else float(scale_t)
        self._end_cycle()
        self._states.prefetch(self._order[: self._prefetch_depth() - 1])
        if failed is not None:
            raise error or _peer_failed(failed, applied=True)

    def _gather_updates(self, done) -> None:
        """All-gather every bucket's updated pieces into the parameters (bucket-id order)."""
        by_id = {b.id: slots for b, slots, _, _ in done}
        masters = self._states.masters(sorted(by_id))  # disk: streamed with read-ahead
        for b in self._buckets:
            values = {}
            if b.id in by_id:
                i, master = next(masters)
                assert i == b.id
                for s in by_id[b.id]:
                    values[s.index] = master[s.offset : s.offset + s.numel]
            self._gatherer.gather(b.plan, values)
        masters.close()

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
            s.local._version != v for s, v in zip(spec.slots, spec.param_versions)
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
        grads = [s.grad() for s in slots]
        if staged is None:
            params = [s.tensor() for s in b.slots]
            staged = self._staging.stage(b.id, params, [s.index for s in slots], grads)
        direct = [  # sharded: never unscale a gradient in place (other ranks own the rest of it)
            not self._sharded
            and g.device.type == "cpu"
            and g.dtype == b.dtype
            and g.is_contiguous()
            for g in grads
        ]
        seeds = [
            s.tensor().reshape(-1).to("cpu")
            if s.version == -1 or s.local._version != s.version
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
            [(s.tensor(), master[s.offset : s.offset + s.numel]) for s in slots], holder
        )
        for s in slots:
            s.version = s.local._version

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
    def _wait_speculation(self) -> None:
        for b in self._buckets:
            if b.spec is not None:
                b.spec.future.exception()  # finite work; the committed state is what we read

    def state_dict(self) -> dict:
        """Same layout and param-group keys as ``torch.optim.AdamW(fused=True)``: tensors and plain
        values only (no pickle needed). Between backward and step it is the state before the step.

        Per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, plus ``master_param`` when the master
        weights differ in dtype from the parameter.

        Sharded (``torch.distributed``): the *sharded* form, for ``torch.distributed.checkpoint``
        (DCP): each rank returns the parameters it owns a part of; a parameter cut across ranks
        has its tensors as ``DTensor`` (``Shard(0)`` over the group), one owned whole is a plain
        tensor on its owner; ``step`` is a plain tensor, the same on every owner. Parameters owned
        but not stepped yet have ``step`` 0 and zero moments (equivalent to no state, so
        ``dcp.load`` into a fresh optimizer's ``state_dict()`` works). For the full layout of
        ``torch.optim.AdamW`` on every rank use :meth:`full_state_dict` (a collective).
        """
        self._check_open()
        self._wait_speculation()
        pos = {id(p): i for i, p in enumerate(self._all_params())}
        state: dict[int, dict] = {}
        for b in self._buckets:
            if not any(s.has_state or self._local_form for s in b.slots):
                continue
            master, m, v = self._states.read(b.id)
            for s in b.slots:
                if not (s.has_state or self._local_form):
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                stepped = s.has_state
                entry = {
                    "step": s.step.clone() if stepped else torch.zeros((), dtype=torch.float32),
                    "exp_avg": self._shaped(s, m[sl].clone()),
                    "exp_avg_sq": self._shaped(s, v[sl].clone()),
                }
                if b.dtype != s.param.dtype:
                    seeded = s.version != -1
                    src = master[sl] if seeded else s.tensor().reshape(-1)
                    entry["master_param"] = self._shaped(s, src.to("cpu", b.dtype, copy=True))
                state[pos[id(s.param)]] = entry
        return {"state": state, "param_groups": self._packed_groups()}

    @property
    def _local_form(self) -> bool:
        """Sharded or FSDP2: ``state_dict()`` holds this rank's part, one entry per parameter it
        holds (``step`` 0 when never stepped, so DCP and restores find every key)."""
        return self._sharded or self._fsdp

    def _packed_groups(self) -> list[dict]:
        groups, start = [], 0
        for g in self.param_groups:
            packed = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"
            }
            packed.update(_TORCH_KEYS)
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return groups

    def _shaped(self, s: _Slot, flat: torch.Tensor) -> torch.Tensor:
        """A slot's flat state as the parameter's shape, or its ``Shard(0)`` DTensor (sharded)."""
        p = s.param
        from torch.distributed.tensor import DTensor, Shard

        if self._fsdp and _is_dtensor(p):  # the parameter's own layout
            return DTensor.from_local(
                flat.view(s.local.shape),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        if s.whole:
            return flat.view(p.shape)

        rows = s.numel // (p.numel() // p.shape[0])
        return DTensor.from_local(
            flat.view(rows, *p.shape[1:]),
            self._device_mesh(),
            [Shard(0)],
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )

    def _device_mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = self._pg if self._pg is not None else torch.distributed.group.WORLD
            self._mesh = DeviceMesh.from_group(group, "cpu")  # the states live in host memory
        return self._mesh

    def full_state_dict(self) -> dict:
        """The state in ``torch.optim.AdamW``'s full layout (parameter-shaped plain tensors).

        Without sharding this is :meth:`state_dict`. Sharded, it is a collective (call it on every
        rank): each bucket's pieces are all-gathered, so every rank returns the whole state (host
        memory for one full copy of the state). ``torch.optim.AdamW(fused=True).load_state_dict``
        and :meth:`load_state_dict` on any world size accept it.
        """
        if self._fsdp:
            return self._full_fsdp_state_dict()
        if not self._sharded:
            return self.state_dict()
        self._check_open()
        self._wait_speculation()
        pos = {id(p): i for i, p in enumerate(self._all_params())}
        mine = {pos[id(s.param)]: float(s.step) for s in self._all_slots() if s.has_state}
        steps: dict[int, float] = {}
        for other in _dist.gather_objects(mine, self._pg):
            steps.update(other)
        full: dict[int, dict] = {
            i: {"step": torch.tensor(st, dtype=torch.float32)} for i, st in steps.items()
        }
        for b in self._buckets:
            read = self._states.read(b.id) if b.slots else None
            for k, key in enumerate(("master_param", "exp_avg", "exp_avg_sq")):
                values = {}
                for s in b.slots:
                    if not s.has_state or (k == 0 and s.param.dtype == b.dtype):
                        continue
                    flat = read[k][s.offset : s.offset + s.numel]
                    if k == 0 and s.version == -1:
                        flat = s.tensor().reshape(-1).to("cpu", b.dtype)
                    values[s.index] = flat

                def dest(i, pc, key=key, plan=b.plan, dtype=b.dtype):
                    p = plan.params[i]
                    entry = full.setdefault(pos[id(p)], {})  # sent: the sender has its state
                    t = entry.setdefault(key, torch.zeros(p.shape, dtype=dtype))
                    return t.view(-1)[pc.start : pc.stop]

                self._gatherer.gather(b.plan, values, dest=dest, dtype=b.dtype)
        return {"state": full, "param_groups": self._packed_groups()}

    def _full_fsdp_state_dict(self) -> dict:
        """FSDP2: every DTensor state gathered with ``full_tensor()`` (a collective per tensor,
        in the same parameter order on every rank)."""
        self._check_open()
        self._wait_speculation()
        pos = {id(p): i for i, p in enumerate(self._all_params())}

        def full(s: _Slot, flat: torch.Tensor) -> torch.Tensor:
            t = self._shaped(s, flat.clone())
            return t.full_tensor() if _is_dtensor(t) else t

        state: dict[int, dict] = {}
        for b in self._buckets:
            if not any(s.has_state for s in b.slots):
                continue
            master, m, v = self._states.read(b.id)
            for s in b.slots:
                if not s.has_state:
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                entry = {"step": s.step.clone(), "exp_avg": full(s, m[sl])}
                entry["exp_avg_sq"] = full(s, v[sl])
                if b.dtype != s.param.dtype:
                    seeded = s.version != -1
                    src = master[sl] if seeded else s.tensor().reshape(-1).to("cpu", b.dtype)
                    entry["master_param"] = full(s, src)
                state[pos[id(s.param)]] = entry
        return {"state": state, "param_groups": self._packed_groups()}

    def _local_state(self, value, s: _Slot, what: str) -> torch.Tensor:
        """The flat elements of ``value`` this slot holds: from a full tensor of the parameter's
        shape (any world size) or a ``Shard(0)`` DTensor over the same group (DCP's sharded
        form)."""
        from torch.distributed.tensor import DTensor

        p = s.param
        if self._fsdp and _is_dtensor(p):  # FSDP2: this rank's shard of the parameter's layout
            if isinstance(value, DTensor):
                if (
                    tuple(value.placements) != tuple(p.placements)
                    or value.device_mesh.size() != p.device_mesh.size()
                    or tuple(value.shape) != tuple(p.shape)
                ):
                    raise ValueError(
                        f"{what} is a DTensor with placements {value.placements} on "
                        f"{value.device_mesh.size()} ranks; the parameter has {p.placements} on "
                        f"{p.device_mesh.size()}: pass its full_tensor() instead"
                    )
                return value.to_local().reshape(-1)
            if torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                shape, offsets = compute_local_shape_and_global_offset(
                    p.shape, p.device_mesh, p.placements
                )
                return value[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].reshape(-1)
        if isinstance(value, DTensor):
            local = value.to_local()
            same = (
                self._sharded
                and len(value.placements) == 1
                and value.placements[0].is_shard(0)
                and value.device_mesh.size() == self._world
                and tuple(value.shape) == tuple(s.param.shape)
                and local.numel() == s.numel
            )
            if not same:
                raise ValueError(
                    f"{what} is a DTensor with placements {value.placements} on a mesh of "
                    f"{value.device_mesh.size()} ranks, not this optimizer's Shard(0) over "
                    f"{self._world}; pass its full_tensor() or the full_state_dict() layout"
                )
            return local.reshape(-1)
        if not torch.is_tensor(value):
            raise ValueError(f"{what} is a {type(value).__name__}, not a tensor")
        # a plain tensor is the full state, shaped like the parameter: one with as many elements
        # as this rank's piece cannot be told from a smaller model's state (and every rank would
        # take the same tensor), so pieces come only as this optimizer's Shard(0) DTensors
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{what} has shape {tuple(value.shape)}; the parameter has {tuple(p.shape)} "
                f"(the state of another model?): pass the full state (torch.optim.AdamW's "
                f"state_dict() or full_state_dict()) or this optimizer's own state_dict()"
            )
        return s.view(value.reshape(-1)) if not s.whole else value.reshape(-1)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.optim.AdamW.state_dict()`` (any of
        its variants: fused, foreach, for-loop). Pending speculation is dropped.

        Sharded: the full layout (from ``torch.optim.AdamW``, :meth:`full_state_dict`, or an
        unsharded OffloadedAdamW, saved on any world size) or this optimizer's sharded form
        (e.g. filled by ``torch.distributed.checkpoint.load``); each rank takes its pieces, with
        no communication. Entries with ``step`` 0 are fresh state.
        """
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
        ids = [i for sg in groups for i in sg["params"]]
        pos = {id(p): k for k, p in enumerate(self._all_params())}
        loaded: dict[int, tuple] = {}  # slot -> (exp_avg, exp_avg_sq, master or None, step)
        for s in self._all_slots():
            i = ids[pos[id(s.param)]]
            e = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if e is None:
                continue
            step = e.get("step")
            step = float(step.item() if torch.is_tensor(step) else step)
            if self._local_form and step == 0:
                continue  # a never-stepped entry of the sharded form: fresh state
            what = f"state of parameter {pos[id(s.param)]}"
            parts = []
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in e:
                    raise ValueError(f"{what} has no {key!r}")
                parts.append(self._local_state(e[key], s, f"{what} {key!r}"))
            master = e.get("master_param")
            parts.append(None if master is None else self._local_state(master, s, f"{what} master"))
            loaded[id(s)] = (*parts, step)
        self._discard_speculation()
        for f in self._prepared:  # they read the committed state that is about to be replaced
            f.exception()
        self._prepared = []
        if isinstance(self._states, DiskStates):
            self._states.drop_prefetch()
        try:
            for b in self._buckets:
                if not b.slots:
                    continue
                token, (master, m, v) = self._states.blank(b.id)
                try:
                    for s in b.slots:
                        got = loaded.get(id(s))
                        if got is None:
                            continue
                        sl = slice(s.offset, s.offset + s.numel)
                        m[sl].copy_(got[0])
                        v[sl].copy_(got[1])
                        src = got[2] if got[2] is not None else s.tensor()
                        master[sl].copy_(src.reshape(-1))
                except BaseException:
                    self._states.discard(token)  # not saved: back to the ring, once
                    raise
                self._states.save(b.id, token, (master, m, v))  # owns the token from here
            self._states.commit()
        except BaseException:
            self._states.abort()
            raise
        for s in self._all_slots():
            got = loaded.get(id(s))
            s.has_state = got is not None
            s.step = torch.tensor(got[3] if got else 0.0, dtype=torch.float32)
            s.version = s.local._version if got is not None else -1
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
