"""Saved-tensor offload: activations leave the device in forward and come back, prefetched, in backward.

Mechanism (vDNN, FlashNeuron, in eager PyTorch). Inside ``with offloader:`` every tensor autograd
saves for backward goes through :meth:`Offloader._pack`. Parameters and buffers are returned as-is
(saved by reference, never copied). Any other tensor's *storage* is moved once to host or disk by the
:class:`TransferEngine` and the saved tensor becomes a handle (storage record + dtype, size, stride,
offset); several tensors that share a storage (the same tensor saved twice, views of one base) share
one record, so they come back as views of one storage with their exact strides. The device copy is
released as soon as its transfer completes: the engine holds the source only until then.

Backward asks for saved tensors roughly in reverse pack order. :meth:`_unpack` waits only if the data
has not arrived; meanwhile a byte window of the next records, in the order backward consumed them in
the previous iteration (FlashNeuron's profiled order; reverse pack order when the graph changed), is
read back ahead of need. At the end of forward, records at the head of that order whose write is
still in flight keep their source, so the first tensors backward needs are never read from disk.

Lifetime. Each record frees its host block or disk extent in a weakref finalizer, so a graph that
raises in forward or is never backpropagated releases everything once dropped. A record can be
unpacked any number of times (``retain_graph=True``, double backward): once every handle of a record
has been served, the fetched copy is dropped and a later backward reads it again.

This module never decides what to offload beyond ``min_bytes`` and the tier; the planner does that
through ``decide`` (see ``Action``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from tensortier._units import SizeLike, format_size, parse_size
from tensortier.errors import BudgetError, ConfigError, TierFullError
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import HostPool, size_class
from tensortier.transfer import HostTensor, TransferEngine

TIERS = ("host", "disk", "auto")


class Codec(Protocol):
    """Encodes a tensor into payload tensors that travel through a tier (see ``tiers/codecs.py``)."""

    name: str
    lossless: bool

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]: ...

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor: ...


@dataclass(frozen=True)
class SavedTensorInfo:
    """What the planner's ``decide`` sees about one saved tensor at pack time."""

    index: int  # order of packing within this forward
    nbytes: int  # bytes of the storage that would be moved
    dtype: torch.dtype
    shape: tuple[int, ...]
    module: str  # qualified name of the innermost module running forward ("" outside modules)
    grad_fn: str  # autograd node of the op that produced it, e.g. "GeluBackward0" ("" for leaves)


@dataclass(frozen=True)
class Action:
    """Where one saved tensor goes: ``keep`` (stay on device), ``host`` or ``disk``, optionally encoded."""

    tier: str
    codec: Codec | None = None

    def __post_init__(self) -> None:
        if self.tier not in ("keep", "host", "disk"):
            raise ConfigError(f"Action tier must be 'keep', 'host' or 'disk', got {self.tier!r}")


@dataclass
class OffloadStats:
    tensors_packed: int = 0  # saved tensors seen (excluding parameters and buffers)
    tensors_offloaded: int = 0
    bytes_offloaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_kept: int = 0  # below min_bytes, or kept by the plan
    bytes_deduplicated: int = 0  # saved again from a storage already moved
    bytes_prefetched: int = 0  # read back ahead of need
    bytes_on_demand: int = 0  # read back only when backward asked
    bytes_kept_at_tail: int = 0  # end-of-forward tensors that never needed a read
    pack_seconds: float = 0.0  # time forward spent in pack (incl. back-pressure)
    wait_seconds: float = 0.0  # time backward waited in unpack for data to arrive
    passes: int = 0
    order_reused: int = 0  # passes whose prefetch order came from the previous backward

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        off = ", ".join(f"{k}={format_size(v)}" for k, v in self.bytes_offloaded.items())
        return (
            f"offloaded {self.tensors_offloaded}/{self.tensors_packed} saved tensors ({off}), "
            f"kept {format_size(self.bytes_kept)}, prefetched {format_size(self.bytes_prefetched)}, "
            f"on demand {format_size(self.bytes_on_demand)}, backward waited {self.wait_seconds:.3f}s"
        )


class _Record:
    """One moved storage: its location in a tier, and (while backward needs it) the fetched copy."""

    __slots__ = (
        "index",
        "nbytes",
        "device",
        "dtype",
        "tier",
        "codec",
        "meta",
        "location",
        "source",
        "keep_source",
        "fetched",
        "materialized",
        "handles",
        "served",
        "prefetched",
        "__weakref__",
    )

    def __init__(self, index: int, nbytes: int, device: torch.device, tier: str, codec):
        self.index, self.nbytes, self.device, self.tier, self.codec = (
            index,
            nbytes,
            device,
            tier,
            codec,
        )
        self.dtype = torch.uint8
        self.meta: dict = {}
        self.location: list[
            Future
        ] = []  # futures of HostTensor (host) or DiskHandle (disk), per payload
        self.source: torch.Tensor | None = None  # the original storage while its write is in flight
        self.keep_source = False
        self.fetched: Future | None = None  # future of the payloads read back
        self.materialized: torch.Tensor | None = None  # restored uint8 storage, while in use
        self.handles = 0  # saved tensors (views) pointing at this record
        self.served = 0  # unpacks since the last fetch
        self.prefetched = False


class _Handle:
    """What autograd holds instead of a saved tensor: a view description over a record."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "__weakref__")

    def __init__(self, record: _Record, t: torch.Tensor):
        self.record, self.dtype = record, t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor (no copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _view(storage_u8: torch.Tensor, h: _Handle) -> torch.Tensor:
    """Rebuild the saved tensor as a view of the restored storage, with its original strides."""
    itemsize = h.dtype.itemsize
    base = storage_u8.storage_offset()
    if base % itemsize:  # cannot express as an element offset: copy into a fresh storage
        storage_u8 = storage_u8.clone()
        base = storage_u8.storage_offset()
    out = torch.empty(0, dtype=h.dtype, device=storage_u8.device)
    return out.set_(storage_u8.untyped_storage(), base // itemsize + h.offset, h.size, h.stride)


class Offloader:
    """Offloads saved activations while active. Reusable: enter it once per forward pass.

    ``to``: ``"host"`` (pinned RAM; the mode for GPUs), ``"disk"`` (NVMe; the mode that saves memory
    on a CPU-only machine, where device memory *is* RAM) or ``"auto"`` (host up to ``host_budget``,
    then disk). Tensors smaller than ``min_bytes`` stay put. ``prefetch`` bounds the bytes read back
    ahead of backward. ``decide`` (the planner's hook) overrides ``min_bytes``/``to`` per tensor.
    ``record=True`` keeps per-tensor timings in ``records`` for profiling.
    """

    def __init__(
        self,
        to: str = "disk",
        *,
        spill_dir: str | None = None,
        min_bytes: SizeLike = "1MiB",
        host_budget: SizeLike = "8GiB",
        prefetch: SizeLike = "256MiB",
        max_inflight: SizeLike = "256MiB",
        disk_capacity: SizeLike | None = None,
        decide: Callable[[SavedTensorInfo], Action | str] | None = None,
        codec: Codec | None = None,
        record: bool = False,
    ):
        if to not in TIERS:
            raise ConfigError(f"to must be one of {TIERS}, got {to!r}")
        self.to = to
        self.min_bytes = parse_size(min_bytes, name="min_bytes")
        self.host_budget = parse_size(host_budget, name="host_budget", allow_zero=False)
        self.prefetch = parse_size(prefetch, name="prefetch")
        self.decide, self.codec, self.record = decide, codec, record
        self.spill_dir = spill_dir
        self._disk_args = {"capacity": disk_capacity}
        self._max_inflight = max_inflight
        self._host = HostPool(self.host_budget)
        self._disk: DiskStore | None = None
        self._engine = TransferEngine(host=self._host, disk=None, max_inflight=max_inflight)
        if to in ("disk", "auto"):
            self._attach_disk()
        self.stats = OffloadStats()
        self.records: list[dict] = []
        self._lock = threading.RLock()
        self._hooks: Any = None
        self._module_hooks: list = []
        self._pass: _Pass | None = None
        # (signature of the pass, order in which backward consumed its records)
        self._learned: tuple[tuple[int, ...], list[int]] | None = None
        global _last_stats
        _last_stats = self.stats

    def _attach_disk(self) -> None:
        if self._disk is None:
            self._disk = DiskStore(self.spill_dir, owner="tt-act", **self._disk_args)
            self._engine.disk = self._disk

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Offloader:
        if self._hooks is not None:
            raise RuntimeError(
                "this Offloader is already active; nest a different one or exit first"
            )
        global _last_stats
        _last_stats = self.stats
        self._learn_from_previous_pass()
        self._pass = _Pass(self)
        self.stats.passes += 1
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._module_hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pass.enter_module),
            nn.modules.module.register_module_forward_hook(
                self._pass.exit_module, always_call=True
            ),
        ]
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        hooks, self._hooks = self._hooks, None
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        hooks.__exit__(exc_type, exc, tb)
        if exc_type is None and self._pass is not None:
            self._pass.end_forward()

    def close(self) -> None:
        """Release the host pool and delete the spill files now (otherwise done at garbage collection)."""
        self._engine.close()
        self._host.close()
        if self._disk is not None:
            self._disk.close()

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> Any:
        p = self._pass
        if p is None or not _movable(t) or p.is_parameter(t):
            return t
        t0 = time.perf_counter()
        try:
            return p.pack(t)
        finally:
            self.stats.pack_seconds += time.perf_counter() - t0

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        record = packed.record
        t0 = time.perf_counter()
        with self._lock:
            storage = record.materialized
        if storage is None:
            storage = self._materialize(record)
        waited = time.perf_counter() - t0
        with self._lock:
            self.stats.wait_seconds += waited
            record.served += 1
            if record.served >= record.handles:  # every view of it has been handed out: let it go
                record.fetched = record.materialized = None
                record.served = 0
            owner = _pass_of(record)
        if owner is not None:
            owner.consumed(record)
        if self.record and owner is not None:
            owner.timings[record.index]["unpack_s"] += waited
        return _view(storage, packed)

    def _materialize(self, record: _Record) -> torch.Tensor:
        """Finish the record's read on this (the consumer's) thread: on CUDA, ``Transfer.result()``
        makes the current stream wait for the host->device copy; then decode. One storage per
        record, shared by all of its views."""
        parts = self._fetch(record).result()
        values = [p.result() if isinstance(p, Future) else p for p in parts]
        value = values[0]
        if record.codec is not None and not isinstance(parts, _Source):
            value = record.codec.decode(values, record.meta).reshape(-1).view(torch.uint8)
        with self._lock:
            if record.materialized is None:
                record.materialized = value
            return record.materialized

    # ------------------------------------------------------------------ data movement
    def _store(self, record: _Record, data: torch.Tensor) -> None:
        """Start moving ``data`` (the storage bytes, or codec payloads) to ``record.tier``."""
        payloads = [data]
        if record.codec is not None:  # codecs see the typed values of the whole storage
            payloads, record.meta = record.codec.encode(data.view(record.dtype))
        for payload in payloads:
            if record.tier == "host":
                record.location.append(self._engine.to_host(payload))
            else:
                record.location.append(self._engine.to_disk(payload))
        with self._lock:
            self.stats.bytes_offloaded[record.tier] += record.nbytes
            self.stats.tensors_offloaded += 1

    def _fetch(self, record: _Record, *, prefetch: bool = False) -> Future:
        """Future of the record's payloads on the device (transfers still to be finished by the
        consumer, see ``_materialize``); starts the reads if needed."""
        with self._lock:
            if record.fetched is not None:
                return record.fetched
            if record.source is not None:  # write still in flight (or kept at the tail): no read
                done: Future = Future()
                done.set_result(_Source([record.source]))  # raw bytes: nothing to decode
                record.fetched = done
                return done
            record.prefetched = prefetch
            counter = "bytes_prefetched" if prefetch else "bytes_on_demand"
            setattr(self.stats, counter, getattr(self.stats, counter) + record.nbytes)
            record.fetched = fut = Future()
        parts = [self._read(loc) for loc in record.location]
        lock = threading.Lock()

        # Completed futures keep their callbacks, so every closure below lets go of what it holds
        # once it has fired: read buffers are then freed by refcount the moment backward is done
        # with them, not whenever the cyclic garbage collector happens to run.
        def assemble(_: Future) -> None:  # never capture the record: its finalizer must run
            with lock:
                if not parts or not all(p.done() for p in parts):
                    return
                finished = parts[:]
                parts.clear()
            errors = [p.exception() for p in finished if p.exception() is not None]
            if errors:
                fut.set_exception(errors[0])
            else:
                fut.set_result([p.result() for p in finished])

        for p in list(parts):
            p.add_done_callback(assemble)
        return fut

    def _read(self, location: Future) -> Future:
        """Start reading one payload back to the device once its write is done; the result is the
        engine's transfer future (already done), finished later on the consumer's thread."""
        out: Future = Future()
        box = [out]  # taken by the first callback to fire (see _fetch)

        def written(f: Future) -> None:
            target = box.pop()
            try:
                where = f.result()
                if isinstance(where, HostTensor):
                    inner = self._engine.to_device(where)
                else:
                    inner = self._engine.from_disk(where, to="device")
                inner.add_done_callback(_relay_to(target))
            except BaseException as exc:
                target.set_exception(exc)

        location.add_done_callback(written)
        return out

    # ------------------------------------------------------------------ prefetch order
    def _learn_from_previous_pass(self) -> None:
        prev = self._pass
        if prev is None or not prev.order:
            return
        seen = dict.fromkeys(prev.consumed_order)
        order = list(seen) + [i for i in reversed(range(len(prev.order))) if i not in seen]
        self._learned = (prev.signature(), order)


_last_stats: OffloadStats | None = None  # for offload_stats(); never keeps an Offloader alive
_PASS_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Source(list):
    """A record's own source storage, handed back before its write finished (not payloads)."""


def _pass_of(record: _Record) -> _Pass | None:
    ref = _PASS_OF.get(record)
    return ref() if ref is not None else None


def _relay_to(dst: Future) -> Callable[[Future], None]:
    """A callback that resolves ``dst`` with the finished future, then forgets ``dst``."""
    box = [dst]

    def relay(src: Future) -> None:
        box.pop().set_result(src)

    return relay


def _movable(t: torch.Tensor) -> bool:
    """Plain dense tensors with real storage; subclasses (DTensor, FakeTensor...) stay untouched."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type != "meta"
        and not t.is_quantized
    )


def _free_location(engine: TransferEngine, locations: list[Future]) -> None:
    """Finalizer of a record: give back its host blocks / disk extents once written."""
    for loc in locations:
        loc.add_done_callback(lambda f: _free_one(engine, f))


def _free_one(engine: TransferEngine, f: Future) -> None:
    if f.exception() is not None:
        return
    where = Future.result(f)
    if isinstance(where, HostTensor):
        if not where.block.freed:
            where.free()
    elif engine.disk is not None and where in engine.disk:
        engine.disk.free(where)


class _Pass:
    """State of one forward (and the backward that follows it)."""

    def __init__(self, off: Offloader):
        self.off = off
        self.order: list[weakref.ref] = []  # records in pack order
        self.sizes: list[int] = []
        self.by_storage: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # ptr -> (storage, record)
        self.param_ptrs: set[int] = set()
        self.modules: list[nn.Module] = []
        self.names: dict[int, str] = {}
        self.seen_modules: set[int] = set()
        self.consumed_order: list[int] = []
        self.expected: list[int] = []
        self.cursor = 0
        self.window = 0  # bytes fetched ahead and not yet consumed
        self.timings: dict[int, dict] = {}
        self.index = 0

    def signature(self) -> tuple[int, ...]:
        return tuple(self.sizes)

    # module tracking: parameters/buffers are never moved; names feed the planner
    def enter_module(self, module: nn.Module, args) -> None:
        if not self.modules and not self.names:
            self.names = {id(m): name for name, m in module.named_modules()}
        self.modules.append(module)
        if id(module) not in self.seen_modules:
            self.seen_modules.add(id(module))
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                self.param_ptrs.add(t.untyped_storage().data_ptr())

    def exit_module(self, module: nn.Module, args, output) -> None:
        if self.modules and self.modules[-1] is module:
            self.modules.pop()

    def is_parameter(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        return t.untyped_storage().data_ptr() in self.param_ptrs

    def pack(self, t: torch.Tensor) -> Any:
        off = self.off
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
        off.stats.tensors_packed += 1
        known = self.by_storage.get(ptr)
        if known is not None:
            storage_ref, record_ref = known
            record = record_ref()
            if storage_ref() is storage and record is not None:  # same live storage: move it once
                off.stats.bytes_deduplicated += nbytes
                handle = _Handle(record, t)
                record.handles += 1
                return handle
        action = self._action(t, nbytes)
        if action.tier == "keep":
            off.stats.bytes_kept += nbytes
            return t
        tier = action.tier
        if tier == "host" and size_class(nbytes) > off.host_budget:
            if off.to == "auto":
                tier = "disk"
            else:
                raise BudgetError(
                    f"host_budget={format_size(off.host_budget)} cannot hold even one saved tensor "
                    f"of {format_size(nbytes)} (shape {tuple(t.shape)}); raise host_budget or use "
                    f"to='auto' or to='disk'",
                    budget=off.host_budget,
                    minimum=size_class(nbytes),
                )
        codec = action.codec
        if codec is not None and nbytes % t.dtype.itemsize:
            codec = None  # a storage that is not whole elements of this dtype travels raw
        record = _Record(self.index, nbytes, t.device, tier, codec)
        record.dtype = t.dtype
        _PASS_OF[record] = weakref.ref(self)
        data = _storage_bytes(t)
        try:
            self._start(record, data)
        except TierFullError:
            if off.to != "auto" or record.tier != "host":
                raise
            record.tier = "disk"  # host budget used up: spill the rest to disk
            record.location.clear()
            off._attach_disk()
            self._start(record, data)
        record.handles = 1
        self.by_storage[ptr] = (weakref.ref(storage), weakref.ref(record))
        self.order.append(weakref.ref(record))
        self.sizes.append(nbytes)
        if off.record:
            self.timings[record.index] = {
                "index": record.index,
                "nbytes": nbytes,
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "module": self._module_name(),
                "grad_fn": t.grad_fn.name() if t.grad_fn is not None else "",
                "tier": record.tier,
                "pack_s": 0.0,
                "unpack_s": 0.0,
            }
            off.records.append(self.timings[record.index])
        self.index += 1
        return _Handle(record, t)

    def _start(self, record: _Record, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        record.source = data
        self.off._store(record, data)
        weakref.finalize(record, _free_location, self.off._engine, record.location)
        # drop the source once every payload is written, unless the tail keeps it
        remaining = [len(record.location)]
        rec_ref = weakref.ref(record)

        def written(_: Future) -> None:
            remaining[0] -= 1
            r = rec_ref()
            if remaining[0] == 0 and r is not None and not r.keep_source:
                r.source = None

        for loc in record.location:
            loc.add_done_callback(written)
        if self.off.record:
            self.timings.setdefault(record.index, {})["pack_s"] = time.perf_counter() - t0

    def _action(self, t: torch.Tensor, nbytes: int) -> Action:
        off = self.off
        if off.decide is None:
            if nbytes < off.min_bytes:
                return Action("keep")
            tier = "host" if off.to in ("host", "auto") else "disk"
            return Action(tier, off.codec)
        node = t.grad_fn.name() if t.grad_fn is not None else ""
        info = SavedTensorInfo(
            self.index, nbytes, t.dtype, tuple(t.shape), self._module_name(), node
        )
        action = off.decide(info)
        return Action(action) if isinstance(action, str) else action

    def _module_name(self) -> str:
        return self.names.get(id(self.modules[-1]), "") if self.modules else ""

    # prefetch
    def end_forward(self) -> None:
        """Forward is over: choose the consumption order, keep the tail's sources, start reading."""
        off = self.off
        n = len(self.order)
        learned = off._learned
        if learned is not None and learned[0] == self.signature():
            self.expected = list(learned[1])
            off.stats.order_reused += 1
        else:
            self.expected = list(reversed(range(n)))
        budget = off.prefetch
        for i in self.expected:  # the first records backward needs: keep them if still in flight
            record = self.order[i]()
            if record is None or record.nbytes > budget:
                break
            budget -= record.nbytes
            if record.source is not None:
                record.keep_source = True
                off.stats.bytes_kept_at_tail += record.nbytes
        self.pump()

    def consumed(self, record: _Record) -> None:
        with self.off._lock:
            self.consumed_order.append(record.index)
            if record.prefetched:
                record.prefetched = False
                self.window -= record.nbytes
            record.keep_source = False
            if record.fetched is None:
                record.source = None
        self.pump()

    def pump(self) -> None:
        """Start reading the next records in the expected order while the window has room."""
        while True:
            with self.off._lock:
                if self.cursor >= len(self.expected):
                    return
                record = self.order[self.expected[self.cursor]]()
                if (
                    record is not None
                    and record.fetched is None
                    and self.window > 0
                    and self.window + record.nbytes > self.off.prefetch
                ):
                    return
                self.cursor += 1
                if record is None or record.fetched is not None:
                    continue
                self.window += record.nbytes
            self.off._fetch(record, prefetch=True)


def offload(to: str = "disk", **kwargs) -> Offloader:
    """Offload saved activations inside a ``with`` block; see :class:`Offloader` for the options.

    Calls with the same settings reuse one offloader (its spill files, host pool and learned
    prefetch order), so a training loop can write ``with tt.offload(...):`` every step.
    """
    if kwargs.get("budget") is not None:  # a budget: the planner chooses (tensortier.planner)
        from tensortier.planner.runtime import planned_offload

        return planned_offload(to=to, **kwargs)
    key = (to, tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())))
    cached = _CACHE.get(key)
    if cached is None or cached._hooks is not None:
        cached = Offloader(to, **kwargs)
        _CACHE.clear()  # one cached configuration: switching settings releases the old one
        _CACHE[key] = cached
    return cached


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return id(v)


_CACHE: dict = {}


class OffloadHandle:
    """Returned by :func:`offload_module`; ``remove()`` detaches the hooks."""

    def __init__(self, offloader: Offloader, hooks: list):
        self.offloader, self._hooks = offloader, hooks

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def offload_module(module: nn.Module, to: str = "host", **kwargs) -> OffloadHandle:
    """Offload the activations saved inside ``module``'s forward only (each child of a ModuleList).

    >>> tt.offload_module(model.transformer.h, to="host")
    """
    off = kwargs.pop("offloader", None) or Offloader(to, **kwargs)
    targets = list(module) if isinstance(module, nn.ModuleList | nn.ModuleDict) else [module]
    if isinstance(module, nn.ModuleDict):
        targets = list(module.values())
    depth = [0]

    def enter(mod, args):
        if depth[0] == 0:
            off.__enter__()
        depth[0] += 1

    def leave(mod, args, output):
        depth[0] -= 1
        if depth[0] == 0:
            off.__exit__(None, None, None)

    hooks = []
    for m in targets:
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave, always_call=True))
    return OffloadHandle(off, hooks)


def offload_stats() -> dict:
    """Stats of the most recently used offloader (cumulative over its passes)."""
    return (_last_stats or OffloadStats()).as_dict()
