"""OffloadedAdamW: AdamW whose state and master weights live in host RAM or on NVMe.

Flow of one step. Parameters are grouped into buckets (reverse registration order, which is
roughly the order backward produces gradients). A ``register_post_accumulate_grad_hook`` on each
parameter counts its gradients; when every trainable parameter of a bucket has its final gradient,
the bucket's gradients are handed to a single worker thread (copied off the device on a side stream
on CUDA; on CPU the gradient tensors are used as they are) and its CPU AdamW update runs there
while backward continues. ``step()`` launches what the hooks did not (buckets with parameters that
got no gradient), waits, commits, and writes the updated parameters back in the model's dtype.
Parameters are never modified before ``step()``, so backward, gradient clipping and anything the
user does between backward and step see the old values, as with ``torch.optim.AdamW``.

When is a gradient final? The first step is not overlapped: it learns how many backward passes
feed a step (gradient accumulation) and whether ``clip_grad_norm_`` is used. Later steps launch a
bucket once each parameter has received that many gradients; with clipping they only copy
gradients during backward and update in ``step()``, because the clip factor needs every gradient.

This module must never unpickle anything nor write a parameter outside ``step()``/``load_state_dict``.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum

import torch

from tensortier._units import SizeLike, align_up, format_size, parse_size
from tensortier.errors import ClosedError, ConfigError
from tensortier.optim._kernel import adamw_
from tensortier.optim._states import DiskStates, HostStates
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import PAGE


class StateTier(str, Enum):
    """Where optimizer state and master weights live between steps."""

    HOST = "host"
    DISK = "disk"


@dataclass
class OffloadStats:
    """Counters a user can print to see where a step's time went."""

    steps: int = 0
    buckets: int = 0
    launched_in_backward: int = 0  # bucket updates started by gradient hooks (overlapped)
    launched_in_step: int = 0  # bucket updates started by step()
    update_seconds: float = 0.0  # worker time: state load + kernel + save
    kernel_seconds: float = 0.0  # worker time in the AdamW kernel alone
    step_wait_seconds: float = 0.0  # time step() waited for outstanding updates
    writeback_seconds: float = 0.0  # time step() spent copying parameters back
    host_state_bytes: int = 0  # host memory held for optimizer state (bound for disk states)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class _Slot:
    """One parameter inside a bucket's flat state."""

    param: torch.Tensor
    offset: int
    numel: int
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    new_step: torch.Tensor | None = None
    version: int = -1  # param._version after our last write; -1: master never seeded
    count: int = 0  # gradients accumulated since the last step()
    done: bool = False  # updated in the current step


@dataclass(eq=False)
class _Bucket:
    id: int
    group: int
    dtype: torch.dtype
    slots: list[_Slot]
    numel: int
    trainable: int
    ready: int = 0
    futures: list[Future] = field(default_factory=list)


def _grad_hook(ref: weakref.ref, param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad(param)


def _shutdown(worker: ThreadPoolExecutor, states, hooks: list) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()
    worker.shutdown(wait=True, cancel_futures=True)
    states.close()


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with fp32 master weights and moments off the device.

    >>> opt = OffloadedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, states="disk",
    ...                      spill_dir="/mnt/nvme/tt")
    >>> loss.backward(); opt.step(); opt.zero_grad()

    ``states``: ``"host"`` keeps state in RAM (12 bytes per parameter); ``"disk"`` keeps it in a
    :class:`DiskStore` under ``spill_dir`` and streams it through ``pipeline_depth`` host buffers of
    one bucket each, so host memory stays ``pipeline_depth * 3 * bucket_size``.
    ``master_weights``: keep fp32 masters for bf16/fp16 parameters (else state is in their dtype).
    ``overlap``: run bucket updates during backward (see module docstring); ``False`` updates in
    ``step()`` only. ``amsgrad`` is not offered.
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
        overlap: bool = True,
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
        self.overlap = overlap
        self._ready = False
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize
        )
        super().__init__(params, defaults)
        if self.tier is StateTier.HOST:
            self._states: HostStates | DiskStates = HostStates()
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
                self._states = DiskStates(store, pipeline_depth)
            except BaseException:
                store.close()
                raise
        self.stats = OffloadStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tt-adamw")
        self._hooks: list = []
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Slot, _Bucket]] = {}
        self._calibrated = False
        self._accum = 1
        self._clipping = False
        self._seen_order: list[int] = []
        self._order: list[int] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._worker, self._states, self._hooks)
        self._ready = True
        for gi in range(len(self.param_groups)):
            self._build_group(gi)

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            self._wait_idle()
            self._build_group(len(self.param_groups) - 1)

    def _master_dtype(self, p: torch.Tensor) -> torch.dtype:
        if p.dtype in (torch.float32, torch.float64) or not self.master_weights:
            return p.dtype
        return torch.float32

    def _build_group(self, gi: int) -> None:
        params = self.param_groups[gi]["params"]
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
            slots, off = [], 0
            for q in current:
                slots.append(_Slot(q, off, q.numel()))
                off += q.numel()
            b = _Bucket(
                id=len(self._buckets),
                group=gi,
                dtype=dtype,
                slots=slots,
                numel=off,
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
        self.stats.host_state_bytes = self._states.host_bytes

    # ------------------------------------------------------------------ backward side
    def _overlapping(self) -> bool:
        return self.overlap and self._calibrated and not self._clipping

    def _on_grad(self, p: torch.Tensor) -> None:
        entry = self._where.get(id(p))
        if entry is None or not self._finalizer.alive:
            return
        slot, bucket = entry
        slot.count += 1
        if not self._overlapping():
            if not self._calibrated and slot.count == 1:
                bucket.ready += 1
                if bucket.ready == bucket.trainable:
                    self._seen_order.append(bucket.id)
            return
        if slot.count > self._accum:
            raise RuntimeError(
                f"OffloadedAdamW: a parameter of shape {tuple(p.shape)} received gradient "
                f"{slot.count} since the last step(), but the first step saw {self._accum} "
                f"backward pass(es) per step, so its bucket's update already started. Call step() "
                f"after every {self._accum} backward pass(es), or pass overlap=False. The model's "
                f"parameters are untouched; that bucket's optimizer state has advanced."
            )
        if slot.count == self._accum:
            bucket.ready += 1
            if bucket.ready == bucket.trainable and not bucket.futures:
                self._launch(bucket, in_backward=True)

    def _launch(self, bucket: _Bucket, *, in_backward: bool) -> bool:
        slots = [s for s in bucket.slots if s.param.grad is not None and not s.done]
        if not slots:
            return False
        for s in slots:
            if s.param.grad.is_sparse:
                raise RuntimeError("OffloadedAdamW does not support sparse gradients")
            s.done = True
        grads, event = self._grads_to_host(slots)
        bucket.futures.append(self._worker.submit(self._update, bucket, slots, grads, event))
        if in_backward:
            self.stats.launched_in_backward += 1
        else:
            self.stats.launched_in_step += 1
        return True

    def _grads_to_host(self, slots: list[_Slot]) -> tuple[list[torch.Tensor], object]:
        """Host views/copies of the gradients; device gradients are copied on a side stream."""
        grads = [s.param.grad for s in slots]
        if all(g.device.type == "cpu" for g in grads):
            return grads, None
        stream = torch.cuda.Stream(device=grads[0].device)  # CUDA path: small and explicit
        stream.wait_stream(torch.cuda.current_stream(grads[0].device))
        out = []
        with torch.cuda.stream(stream):
            for g in grads:
                h = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                h.copy_(g, non_blocking=True)
                g.record_stream(stream)  # the allocator must not reuse g before the copy ran
                out.append(h)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    # ------------------------------------------------------------------ worker side
    def _update(self, bucket: _Bucket, slots: list[_Slot], grads: list, event) -> None:
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()
        flat = [(g if g.dtype == bucket.dtype else g.to(bucket.dtype)).reshape(-1) for g in grads]
        token, (master, m, v), _ = self._states.load(bucket.id)
        saved = False
        try:
            pos = self._order.index(bucket.id) if bucket.id in self._order else -1
            if pos >= 0:
                self._states.prefetch(self._order[pos + 1 : pos + self._prefetch_depth()])
            group = self.param_groups[bucket.group]
            ps, ms, vs, steps = [], [], [], []
            with torch.no_grad():
                for s in slots:
                    sl = slice(s.offset, s.offset + s.numel)
                    mp = master[sl]
                    if s.version == -1 or (
                        s.version != s.param._version
                        and not torch.equal(
                            s.param.detach().reshape(-1).cpu(), mp.to(s.param.dtype)
                        )
                    ):  # first step, or the user changed the parameter: the parameter wins
                        mp.copy_(s.param.detach().reshape(-1))
                    ps.append(mp)
                    ms.append(m[sl])
                    vs.append(v[sl])
                    s.new_step = s.step.clone()
                    steps.append(s.new_step)
                beta1, beta2 = group["betas"]
                tk = time.perf_counter()
                adamw_(
                    ps,
                    flat,
                    ms,
                    vs,
                    steps,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    maximize=group.get("maximize", False),
                )
                self.stats.kernel_seconds += time.perf_counter() - tk
            self._states.save(bucket.id, token, (master, m, v))
            saved = True
        finally:
            if not saved:
                self._states.discard(token)
            self.stats.update_seconds += time.perf_counter() - t0

    def _prefetch_depth(self) -> int:
        return getattr(self._states, "depth", 2)

    # ------------------------------------------------------------------ step
    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError("OffloadedAdamW is closed; create a new optimizer")

    def _wait_idle(self) -> None:
        for b in self._buckets:
            for f in b.futures:
                f.exception()

    def _reset_cycle(self) -> None:
        for b in self._buckets:
            b.ready = 0
            b.futures = []
            for s in b.slots:
                s.count = 0
                s.done = False
                s.new_step = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Finish this step's bucket updates, commit them, and write parameters back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        order = [self._buckets[i] for i in self._order]
        for b in order:  # buckets the hooks did not launch
            if not b.futures:
                self._launch(b, in_backward=False)
        error: BaseException | None = None
        t0 = time.perf_counter()
        wb = 0.0
        for b in order:
            for f in b.futures:
                exc = f.exception()
                error = error or exc
            if self.tier is StateTier.HOST and error is None and b.futures:
                tw = time.perf_counter()
                self._write_back(b, self._states.read(b.id)[0])
                wb += time.perf_counter() - tw
        for b in order:  # parameters whose gradient showed up after their bucket was launched
            if error is None and self._launch(b, in_backward=False):
                exc = b.futures[-1].exception()
                error = error or exc
                if self.tier is StateTier.HOST and error is None:
                    self._write_back(b, self._states.read(b.id)[0])
        self.stats.step_wait_seconds += time.perf_counter() - t0 - wb
        updated = [b.id for b in order if b.futures]
        try:
            if error is not None:
                self._states.abort()
                raise error
            self._states.commit()  # disk: raises TierFullError with nothing applied
        except BaseException:
            self._reset_cycle()
            raise
        for b in self._buckets:
            for s in b.slots:
                if s.done and s.new_step is not None:
                    s.step = s.new_step
        if self.tier is StateTier.DISK:
            tw = time.perf_counter()
            for i, master in self._states.masters(updated):
                self._write_back(self._buckets[i], master)
            wb += time.perf_counter() - tw
        self.stats.writeback_seconds += wb
        if not self._calibrated:
            self._accum = max([s.count for b in self._buckets for s in b.slots] + [1])
            seen = list(dict.fromkeys(self._seen_order))
            self._order = seen + [b.id for b in self._buckets if b.id not in seen]
            self._calibrated = True
        self._reset_cycle()
        self._states.prefetch(self._order[: self._prefetch_depth() - 1])
        self.stats.steps += 1
        return loss

    def _write_back(self, bucket: _Bucket, master: torch.Tensor) -> None:
        for s in bucket.slots:
            if s.done:
                p = s.param
                p.copy_(master[s.offset : s.offset + s.numel].view(p.shape))
                s.version = p._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_idle()  # the worker may still read gradients of launched buckets
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip all gradients by their global norm (``torch.nn.utils.clip_grad_norm_``); call before step.

        From the first call on, bucket updates wait for ``step()``: the clip factor needs every
        gradient. Call it from the first step on (or pass ``overlap=False``).
        """
        self._check_open()
        if any(b.futures for b in self._buckets):
            raise RuntimeError(
                "clip_grad_norm_ was called after bucket updates of this step started during "
                "backward (it was not used in the first step, which is when OffloadedAdamW learns "
                "the training loop). Clip from the first step on, or pass overlap=False."
            )
        self._clipping = True
        grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(
            grads, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ------------------------------------------------------------------ state dict
    def _index(self) -> list[_Slot]:
        return [self._where[id(p)][0] for g in self.param_groups for p in g["params"]]

    def _check_between_steps(self, what: str) -> None:
        self._check_open()
        if any(b.futures for b in self._buckets):
            raise RuntimeError(
                f"{what} was called between backward and step(), while bucket updates are in "
                f"flight; call it after step()"
            )

    def state_dict(self) -> dict:
        """Same layout as ``torch.optim.AdamW``: tensors and plain values only (no pickle needed).

        Per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, plus ``master_param`` when the master
        weights differ in dtype from the parameter.
        """
        self._check_between_steps("state_dict()")
        slots = self._index()
        pos = {id(s): i for i, s in enumerate(slots)}
        state: dict[int, dict] = {}
        for b in self._buckets:
            if not any(s.step.item() > 0 for s in b.slots):
                continue
            master, m, v = self._states.read(b.id)
            for s in b.slots:
                if s.step.item() == 0:
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                shape = s.param.shape
                entry = {
                    "step": s.step.clone(),
                    "exp_avg": m[sl].clone().view(shape),
                    "exp_avg_sq": v[sl].clone().view(shape),
                }
                if b.dtype != s.param.dtype:
                    entry["master_param"] = master[sl].clone().view(shape)
                state[pos[id(s)]] = entry
        groups, start = [], 0
        for g in self.param_groups:
            packed = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"
            }
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` (or from ``torch.optim.AdamW.state_dict()``)."""
        self._check_between_steps("load_state_dict()")
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
        if isinstance(self._states, DiskStates):
            self._states.drop_prefetch()
        new_steps: dict[int, torch.Tensor] = {}
        pos_of = {id(s): i for i, s in enumerate(slots)}
        try:
            for b in self._buckets:
                token, (master, m, v) = self._states.blank(b.id)
                for s in b.slots:
                    e = entries.get(pos_of[id(s)])
                    sl = slice(s.offset, s.offset + s.numel)
                    if e is None:
                        new_steps[id(s)] = torch.zeros((), dtype=torch.float32)
                        continue
                    m[sl].copy_(e["exp_avg"].reshape(-1))
                    v[sl].copy_(e["exp_avg_sq"].reshape(-1))
                    src = e.get("master_param", s.param.detach())
                    master[sl].copy_(src.reshape(-1))
                    step = e["step"]
                    new_steps[id(s)] = torch.tensor(
                        float(step.item() if torch.is_tensor(step) else step), dtype=torch.float32
                    )
                self._states.save(b.id, token, (master, m, v))
            self._states.commit()
        except BaseException:
            self._states.abort()
            raise
        for b in self._buckets:
            for s in b.slots:
                s.step = new_steps[id(s)]
                s.version = s.param._version if s.step.item() > 0 else -1
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params":
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
