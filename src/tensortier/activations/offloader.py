"""Saved-tensor offload: activations leave the device in forward and come back, prefetched, in backward.

Mechanism (vDNN, FlashNeuron, in eager PyTorch). Inside ``with offloader:`` every tensor autograd
saves for backward goes through :meth:`Offloader._pack`. Parameters, buffers and autocast's cached
weight casts are returned as-is (saved by reference, never copied), and so are leaves that
require grad (the graph's ``AccumulateGrad`` holds them anyway). Any other tensor's *storage* is
moved once to host, disk or remote memory by the :class:`TransferEngine` and the saved tensor becomes a handle
(storage record + dtype, size, stride, offset); several tensors that share a storage (the same tensor
saved twice, views of one base) share one record, so they come back as views of one storage with
their exact strides, on the device they were saved from. The device copy is released as soon as its
transfer completes: the engine holds the source only until then.

One *pass* spans a forward and the backward(s) that follow it, whatever hooks it (``with``, or the
blocks of :func:`offload_module`). Backward asks for saved tensors roughly in reverse pack order.
:meth:`_unpack` waits only if the data has not arrived; meanwhile a byte window of the next records,
in the order backward consumed them in the previous iteration (FlashNeuron's profiled order; reverse
pack order when the graph changed), is read back ahead of need. At the end of forward, records at
the head of that order whose write is still in flight keep their source, so the first tensors
backward needs are never read back. Every backward ends with a callback that empties the window.

Remote memory (``tier="remote"``): the storages go to a :class:`~tensortier.tiers.remote.RemoteStore`
(other Ray nodes' RAM) through ``TransferEngine.to_store`` and come back, prefetched the same way,
through ``from_store``; codecs do not apply to it. The planner (``tt.offload(budget=...,
remote=pool)``) sends a unit there with ``Action("remote")`` where its simulator, given the pool's
measured bandwidth, says the transfer hides.

Lifetime. Each record frees its host block, disk extent or remote object in a weakref finalizer, so a graph that
raises in forward or is never backpropagated releases everything once dropped. Records keep their
pass (and so the offloader) alive; a dropped offloader's engine, pool and files are released by a
:class:`tensortier._lifetime.Finalizer` on the reaper thread. See ``PROTOCOL.md``.

This module never decides what to offload beyond ``min_bytes`` and the tier; the planner does that
through ``decide`` (see ``Action``).
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from tensortier import _dist, _lifetime
from tensortier._device import normalize_device
from tensortier._memory import release_freed_memory
from tensortier._renamed import OFFLOAD_RENAMES, renamed
from tensortier._saved_hooks import Outer, of_streamed, outer_hooks, pack_outer
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, format_size, parse_size
from tensortier.errors import BudgetError, ClosedError, ConfigError, TierFullError
from tensortier.tiers.base import failed, gather
from tensortier.tiers.codecs import accepts, as_codec, codec_key
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import HostPool, size_class
from tensortier.tiers.placement import Placement
from tensortier.tiers.remote import RemoteHandle, RemoteStore
from tensortier.transfer import Encoded, HostTensor, TransferEngine
from tensortier.transfer.streams import HostScalar, share
from tensortier.transfer.streams import current as _current_stream

TIERS = ("host", "disk", "remote", "auto")
# the tiers each ``tier=`` may place bytes on, in spill order
_PLACEMENT = {"host": ("host",), "disk": ("disk",), "remote": ("remote",), "auto": ("host", "disk")}


class Codec(Protocol):
    """Encodes a tensor into payload tensors that travel through a tier (see ``tiers/codecs.py``)."""

    name: str
    lossless: bool

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]: ...

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor: ...


@dataclass(frozen=True)
class SavedTensorInfo:
    """What the planner's ``decide`` sees about one saved tensor at pack time."""

    index: int  # order of packing within this forward (one per storage decided, kept or moved)
    nbytes: int  # bytes of the storage that would be moved
    dtype: torch.dtype
    shape: tuple[int, ...]
    module: str  # qualified name of the innermost module running forward ("" outside modules)
    grad_fn: str  # autograd node of the op that produced it, e.g. "GeluBackward0" ("" for leaves)


@dataclass(frozen=True)
class Action:
    """Where one saved tensor goes: ``keep`` (stay on device), ``host``, ``disk`` (optionally
    encoded) or ``remote`` (an Offloader made with ``remote=``; raw)."""

    tier: str
    codec: Codec | None = None

    def __post_init__(self) -> None:
        if self.tier not in ("keep", "host", "disk", "remote"):
            raise ConfigError(
                f"Action tier must be 'keep', 'host', 'disk' or 'remote', got {self.tier!r}"
            )
        object.__setattr__(self, "codec", as_codec(self.codec, name="Action codec"))


_KEEP = Action("keep")


@dataclass
class OffloadStats:
    """One offloader's counters over all its passes (``off.stats``; ``print`` gives a summary).

    ``bytes_offloaded`` per tier; what stayed (``bytes_kept``: under ``min_bytes``, kept by the
    plan, or CPU tensors in a CUDA run); what came back ahead of need (``bytes_prefetched``) or
    only when backward asked (``bytes_on_demand``); ``pack_seconds`` forward spent saving and
    ``wait_seconds`` backward spent waiting for data.
    """

    tensors_packed: int = 0  # saved tensors seen (excluding parameters and buffers)
    tensors_offloaded: int = 0
    bytes_offloaded: dict[str, int] = field(
        default_factory=lambda: {"host": 0, "disk": 0, "remote": 0}
    )
    bytes_kept: int = 0  # below min_bytes, kept by the plan, or a CPU tensor in a CUDA run
    bytes_weight_casts: int = 0  # autocast's cached weight casts, left on the device
    bytes_deduplicated: int = 0  # saved again from a storage already moved
    bytes_prefetched: int = 0  # read back ahead of need
    bytes_on_demand: int = 0  # read back only when backward asked
    bytes_kept_at_tail: int = 0  # end-of-forward tensors that never needed a read
    bytes_prefetch_unused: int = 0  # in the window when a backward ended without using them
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
        "stream",
        "handles",
        "served",
        "in_window",
        "used",
        "owner",
        "__weakref__",
    )

    def __init__(self, owner: _Pass, index: int, nbytes: int, device: torch.device, tier: str):
        self.owner = owner  # the pass: kept alive (with its prefetch state) while this record is
        self.index, self.nbytes, self.device, self.tier = index, nbytes, device, tier
        self.codec: Codec | None = None
        self.dtype = torch.uint8
        self.meta: dict = {}
        # futures of HostTensor (host), DiskHandle (disk) or RemoteHandle (remote), one per payload
        self.location: list[Future] = []
        self.source: torch.Tensor | None = None  # the original storage while its write is in flight
        self.keep_source = False
        self.fetched: Future | None = None  # future of the payloads read back
        self.materialized: torch.Tensor | None = None  # restored uint8 storage, while in use
        self.stream = None  # CUDA: the stream that waited for ``materialized`` (made it usable)
        self.handles = 0  # saved tensors (views) pointing at this record
        self.served = 0  # unpacks since the last fetch
        self.in_window = False  # counted in its pass's prefetch window
        self.used = False  # every handle served in the current backward: do not prefetch again


def _version_tracker(t: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor sharing ``t``'s version counter but not its storage. Why: PyTorch skips
    its in-place check for tensors saved through hooks, and hands a pack hook a fresh
    ``detach()`` of a saved input, which dies at once (a weakref to it, or to a view's base, saw
    nothing: backward used the changed values silently). Every alias of the storage (the
    caller's name, a view, a ``detach()``) writes this counter; the moved bytes stay free.
    ``_make_subclass`` is ``detach()`` with metadata changes allowed (as ``nn.Parameter``); the
    ``set_`` runs below ADInplaceOrView, so the shared counter is not bumped by it."""
    if t.is_inference():  # no version counter
        return None
    tracker = torch.Tensor._make_subclass(torch.Tensor, t)
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        tracker.set_(torch.empty(0, dtype=t.dtype, device=t.device))
    return tracker


class _Handle:
    """What autograd holds instead of a saved tensor: a view description over a record (with the
    lazy conjugate/negative bits of a math view: the storage holds the unconjugated values), and
    the version of the tensor that was saved with a tracker of its counter (PyTorch skips its
    own check when hooks are set)."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "conj", "neg", "version", "tracker")

    def __init__(self, record: _Record, t: torch.Tensor):
        self.record, self.dtype = record, t.dtype
        self.size, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()
        self.conj, self.neg = t.is_conj(), t.is_neg()
        self.version, self.tracker = t._version, _version_tracker(t)


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
    out = out.set_(storage_u8.untyped_storage(), base // itemsize + h.offset, h.size, h.stride)
    if h.conj:  # the same lazy math views as the saved tensor (no copy)
        out = out.conj()
    if h.neg:
        out = torch._neg_view(out)
    return out


class _Leaf:
    """A tensor saved by reference (a leaf that requires grad, ``_held_by_graph``, or one the
    offloader keeps), with its version: the user may still change it in place before backward
    (a manual SGD step, ``h.mul_()`` on a layer's input), which PyTorch's own check, skipped when
    hooks are set, would refuse."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.version = t, t._version


def _amos_enabled() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is active."""
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


_AMOS_HINT = (
    " torch.autograd.graph.allow_mutation_on_saved_tensors() does not cover tensors saved inside "
    "tt.offload (tensortier's saved-tensor hooks replace its own there): enter tt.offload "
    "outside it, or do not modify saved tensors."
)


def _check_version(h: _Handle | _Leaf, under_amos: bool = False) -> None:
    """Raise PyTorch's own error if the saved tensor was modified in place after it was packed
    (saved inside ``allow_mutation_on_saved_tensors()``: with the reason it did not help)."""
    t = h.tensor if isinstance(h, _Leaf) else h.tracker
    if t is None or t._version == h.version:
        return
    size = ", ".join(str(s) for s in (h.tensor.shape if isinstance(h, _Leaf) else h.size))
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t.type()} [{size}]] is at version {t._version}; expected version "
        f"{h.version} instead. Hint: enable anomaly detection to find the operation that failed "
        "to compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False). "
        "(Detected by tensortier's offload hooks: the tensor was changed after it was saved.)"
        + (_AMOS_HINT if under_amos else "")
    )


def _close_resources(resources: list) -> None:
    """Close an offloader's engine (which waits for its transfers), then its pool and disk."""
    errors = []
    for r in resources:
        try:
            r.close()
        except BaseException as exc:  # close the others anyway
            errors.append(exc)
    if errors:
        raise errors[0]


class Offloader:
    """Offloads saved activations while active. Reusable: enter it once per forward pass.

    ``tier``: ``"host"`` (pinned RAM; the default, the mode for GPUs), ``"disk"`` (NVMe; the mode
    that saves memory on a CPU-only machine, where device memory *is* RAM) or ``"auto"`` (host up
    to ``host_budget``, then disk), spilling under ``spill_dir`` (``None``: the system temporary
    directory, as :class:`DiskStore`). Tensors smaller than ``min_bytes`` stay put, and so do CPU
    tensors saved in a CUDA run (they hold no device memory). ``prefetch_budget`` bounds the bytes
    read back ahead of backward (a record larger than it is read ahead alone; 0: none, every
    saved tensor is read when backward asks for it), ``inflight_budget`` the bytes being
    written (their sources still in memory); ``disk_budget`` the bytes the disk tier may
    preallocate, ``io_threads`` its I/O threads. ``decide`` (the planner's hook) overrides
    ``min_bytes``/``tier`` per tensor. ``codec`` (a name such as ``"zstd"`` or
    :func:`~tensortier.get_codec`'s codec) encodes what goes to the host and disk tiers.
    ``record=True`` keeps per-tensor timings in ``records`` for profiling. ``offload_weight_casts=True`` also moves
    autocast's low-precision weight casts, which by default stay on the device: the autocast cache
    holds them until autocast exits, so moving them frees nothing before backward and costs their
    size over the bus both ways (it only lowers memory during backward).
    ``tier="remote"``: other Ray nodes' RAM; ``remote`` is a
    :class:`~tensortier.tiers.remote.RemoteStore` (the caller's, left open) or a dict of its
    arguments (``{"budget": "8GiB"}``, made and closed by the offloader). A lost memory node
    makes backward raise ``NodeLostError`` naming it. No codec.
    """

    @renamed(**OFFLOAD_RENAMES)
    def __init__(
        self,
        tier: str = "host",
        *,
        spill_dir: str | None = None,
        min_bytes: SizeLike = "1MiB",
        host_budget: SizeLike = "8GiB",
        prefetch_budget: SizeLike = "256MiB",
        inflight_budget: SizeLike = "256MiB",
        disk_budget: SizeLike | None = None,
        io_threads: int = 4,
        decide: Callable[[SavedTensorInfo], Action | str] | None = None,
        codec: Codec | str | None = None,
        record: bool = False,
        offload_weight_casts: bool = False,
        remote: RemoteStore | dict | None = None,
    ):
        if tier not in TIERS:
            raise ConfigError(f"tier must be one of {TIERS}, got {tier!r}")
        codec = as_codec(codec)
        if tier == "remote" and codec is not None:
            raise ConfigError(
                f"tier='remote' with codec={getattr(codec, 'name', codec)!r}: codecs apply to the "
                f"host and disk tiers only; pass codec=None"
            )
        # tiers, spill directory, budgets and remote pool: checked here, once
        self.placement = Placement(
            _PLACEMENT[tier],
            directory=spill_dir,
            host_budget=host_budget,
            disk_budget=disk_budget,
            remote=remote,
            where=f"Offloader(tier={tier!r})",
        )
        self.tier = tier
        self.min_bytes = parse_size(min_bytes, name="min_bytes")
        self.host_budget = self.placement.host_budget
        self.prefetch_budget = parse_size(prefetch_budget, name="prefetch_budget")
        self.decide, self.codec, self.record = decide, codec, record
        self.offload_weight_casts = offload_weight_casts
        self.spill_dir = spill_dir
        # each disk I/O thread keeps an aligned staging buffer (up to 4 MiB): fewer, less memory
        self._io_threads = io_threads
        self._host = HostPool(self.host_budget)
        self._disk: DiskStore | None = None
        self._engine = TransferEngine(host=self._host, disk=None, inflight_budget=inflight_budget)
        # what close() (or the reaper, once this offloader is collected) releases, in this order
        self._resources: list = [self._engine, self._host]
        self._finalizer = _lifetime.Finalizer(self, _close_resources, self._resources)
        self.device = normalize_device(self._engine.device)
        try:
            if tier in ("disk", "auto"):
                self._attach_disk()
            if remote is not None:  # tier="remote" without one: refused by the Placement
                self._attach_remote()
        except BaseException:
            self._finalizer()
            raise
        self.stats = OffloadStats()
        self.records: list[dict] = []
        self._lock = threading.RLock()
        self._hooks: Any = None
        self._outer: tuple | None = None  # saved-tensor hooks around ours while active
        self._thread: int | None = None  # the thread whose saved-tensor hooks are ours
        self._module_hooks: list = []
        self._pass: _Pass | None = None
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()  # passes with live records
        # (signature of the pass, order in which backward consumed its records)
        self._learned: tuple[tuple[int, ...], list[int]] | None = None
        self._learned_blocks = 0  # offload_module: hooked blocks per forward seen last time
        self._traced = False  # set when torch.compile traced the pack hook (see _COMPILED_HOOKS)
        register_stats("offloader", self)  # tt.stats() lists it while it is open

    def _attach_disk(self) -> None:
        if self._disk is None:
            if self.device.type == "cpu":
                # RAM is the device memory: activations written to disk must leave the RSS, which
                # glibc's adaptive heap never lets them do (see tensortier._memory)
                release_freed_memory()
            owner, threads = _dist.owner("tt-act"), self._io_threads
            self._disk = self.placement.open_disk(owner=owner, io_threads=threads)
            self._engine.disk = self._disk
            self._resources.append(self._disk)

    def buffer_bytes(self) -> int:
        """Memory this offloader keeps for itself: its host pool's blocks (lent, cached for reuse
        or still being copied; between passes only cached read-back and staging blocks) and its
        disk store's per-thread staging buffers. What a memory budget charges to the machinery,
        asked of the objects that hold it (never inferred from the process's RSS, which also
        grows with the user's optimizer states and data)."""
        total = self._host.stats.reserved
        disk = self._disk
        if disk is not None:
            total += disk.stats.staging_bytes
        return total

    def _attach_remote(self) -> None:
        store, made_here = self.placement.open_remote()  # else the caller's: left open
        self._engine.remote = store
        if made_here:
            self._resources.append(store)  # closed after the engine (which waits for transfers)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Offloader:
        with self._lock:  # two threads entering one offloader: exactly one gets it
            if self._hooks is not None:
                where = "" if self._thread == threading.get_ident() else " in another thread"
                raise RuntimeError(
                    f"this Offloader is already active{where}; nest a different one or exit "
                    "first (saved-tensor hooks are per thread: give each thread its own "
                    "Offloader, as tt.offload() does)"
                )
            self._check_open()
            self._new_pass()
            self._activate()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._deactivate(exc_type, exc, tb)
        if exc_type is None and self._traced:
            self._traced = False
            raise ConfigError(_COMPILED_HOOKS)
        if exc_type is None and self._pass is not None:
            self._pass.end_forward()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Release the host pool and delete the spill files now (otherwise done once collected)."""
        self._finalizer()

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(
                "this Offloader is closed (tt.offload() closes the previous settings' offloader "
                "when the settings change); make a new one, or keep your own tt.Offloader(...) "
                "to alternate settings"
            )

    def _new_pass(self) -> _Pass:
        prev = self._pass
        if prev is not None and prev.order:
            seen = dict.fromkeys(prev.consumed_order)
            order = list(seen) + [i for i in reversed(range(len(prev.order))) if i not in seen]
            self._learned = (prev.signature(), order)
        if prev is not None and prev.backward_started:
            self._learned_blocks = prev.blocks
        self._pass = p = _Pass(self)
        self._passes.add(p)
        self.stats.passes += 1
        return p

    def _activate(self) -> None:
        global _last_stats
        _last_stats = self.stats
        p = self._pass
        self._outer = outer_hooks()  # a streamed model's, around offload_module's blocks
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()  # raises inside disable_saved_tensors_hooks: stay inactive then
        self._hooks = hooks
        # the module hooks below are global: they see every thread's modules, the pass only ours
        self._thread = p.thread = threading.get_ident()
        p.under_amos = p.under_amos or _amos_enabled()  # its hooks are shadowed by ours
        self._module_hooks = [
            nn.modules.module.register_module_forward_pre_hook(p.enter_module),
            nn.modules.module.register_module_forward_hook(p.exit_module, always_call=True),
        ]

    def _deactivate(self, exc_type=None, exc=None, tb=None) -> None:
        hooks, self._hooks = self._hooks, None
        self._outer = None
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)

    def awaiting_backward(self) -> bool:
        """Whether the last ``with`` forward ended and what it saved (and moved) is alive with
        its backward not begun: a forward entered now comes before that backward (gradient
        accumulation over summed losses), which the planner cannot budget."""
        p = self._pass
        if p is None or not p.forward_ended or p.backward_started:
            return False
        with self._lock:
            return any(r() is not None for r in p.order)

    def _idle(self) -> bool:
        """Not active and no saved tensor of any pass alive: closing now loses nothing."""
        if self._hooks is not None:
            return False
        return not any(r() is not None for p in list(self._passes) for r in p.order)

    def _release_if_idle(self) -> None:
        """Close now if nothing needs this offloader any more; else its finalizer will, once the
        graphs that hold its records (and so the offloader) are gone."""
        if self._idle():
            self.close()

    # ------------------------------------------------------------------ offload_module's blocks
    def _begin_block(self, module: nn.Module) -> bool:
        """A hooked block starts: continue this forward's pass, or open the next one."""
        if self._hooks is not None:  # inside `with offloader:` already: that pass covers it
            return False
        self._check_open()
        p = self._pass
        if p is None or p.backward_started or (p.order and p.order[-1]() is None):
            p = self._new_pass()  # first block of a new forward (the last graph ran or died)
        elif p.forward_ended:
            p.reopen()  # more blocks than the previous forward had
        self._activate()
        p.track(module)
        return True

    def _end_block(self) -> None:
        self._deactivate()
        if self._traced:
            self._traced = False
            raise ConfigError(_COMPILED_HOOKS)
        p = self._pass
        p.blocks += 1
        if p.blocks == self._learned_blocks:  # the last block the previous forward had
            p.end_forward()

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> Any:
        p = self._pass
        if self._outer is not None and of_streamed(t):  # its streamer saves it (_saved_hooks.py)
            return pack_outer(self._outer, t)
        if torch.compiler.is_dynamo_compiling():
            # dynamo is tracing this hook into a compiled graph, where it would do nothing: the
            # flag (replayed when the graph runs) makes the hooked block fail with a clear error
            self._traced = True
            return t
        if (
            p is None
            or type(t) is not torch.Tensor  # subclasses (DTensor, FakeTensor...) stay untouched
            or t.layout != torch.strided
            or t.is_nested  # strided nested tensors have no sizes or strides to rebuild them from
            or t.is_quantized
            or t.device.type == "meta"
        ):
            return t
        t0 = time.perf_counter()
        try:
            return p.pack(t)
        finally:
            self.stats.pack_seconds += time.perf_counter() - t0

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, Outer):
            return packed.unpack(packed.packed)
        if isinstance(packed, _Leaf):
            _check_version(packed, _amos_enabled())
            return packed.tensor
        if not isinstance(packed, _Handle):
            return packed
        _check_version(packed, packed.record.owner.under_amos)
        record = packed.record
        owner = record.owner
        task = torch._C._current_graph_task_id()
        if task != owner.task:
            owner.begin_backward(task)
        t0 = time.perf_counter()
        with self._lock:
            storage, made_on = record.materialized, record.stream
        if storage is None:
            storage, made_on = self._materialize(record)
        # a storage saved by ops on two streams is unpacked by backward nodes on both (autograd
        # runs a node on its forward's stream): the second waits for the first's copy and decode
        share(storage, made_on, _current_stream(storage))
        waited = time.perf_counter() - t0
        with self._lock:
            self.stats.wait_seconds += waited
            record.served += 1
            if record.served >= record.handles:  # every view of it has been handed out: let it go
                record.fetched = record.materialized = record.stream = None
                record.served = 0
                record.used = True
        owner.consumed(record)
        timing = owner.timings.get(record.index) if self.record else None
        if timing is not None:
            timing["unpack_s"] += waited
        return _view(storage, packed)

    def _materialize(self, record: _Record) -> tuple[torch.Tensor, Any]:
        """Finish the record's read on this (the consumer's) thread: on CUDA, ``Transfer.result()``
        makes the current stream wait for the host->device copy; then decode. One storage per
        record, shared by all of its views; returned with the stream that waited for it.

        No timeout: the future resolves (value or exception) once the engine resolves the futures
        it returned, and every branch of ``_read``/``_restore`` passes failures on."""
        parts = self._fetch(record).result()
        values = [p.result() if isinstance(p, Future) else p for p in parts]
        value = values[0]
        if record.codec is not None and isinstance(parts, _Source) and not record.codec.lossless:
            # served from the tensor itself (its write still in flight, or kept at the tail): a
            # lossy codec must give the same values as the round trip, whatever the timing
            typed = value.reshape(-1).view(torch.uint8).view(record.dtype)
            payloads, meta = record.codec.encode(typed)
            # the forward's encode of these values (record.meta, on a device) checked them too:
            # its fp16 overflow flag is older, so reading it does not wait for this backward
            value = record.codec.decode(payloads, {**meta, **record.meta})
            value = value.reshape(-1).view(torch.uint8)
        elif record.codec is not None and not isinstance(parts, _Source):
            if isinstance(value, _Payloads):  # an Encoded's payloads on the device: decode there
                value = value.decode()
            elif record.meta:  # payloads of a codec that encoded on the device (see _store)
                value = record.codec.decode(values, record.meta)
            value = value.reshape(-1).view(torch.uint8)  # else the engine decoded it
        with self._lock:
            if record.materialized is None:
                record.materialized, record.stream = value, _current_stream(value)
            return record.materialized, record.stream

    # ------------------------------------------------------------------ data movement
    def _store(self, record: _Record, data: torch.Tensor) -> None:
        """Start moving ``data`` (the storage bytes) to ``record.tier``, through its codec if any.

        The one place that encodes. Codecs see the typed values of the whole storage, and encode
        through the engine (``to_host/to_store(codec=)``: an async raw D2H, then a copy worker), so
        the forward thread never waits for the device; only a codec that encodes on the device
        itself without a sync (a cast) runs here, on the current stream, and its payloads travel
        raw. See ``_restore`` for the way back."""
        engine, codec = self._engine, record.codec
        if record.tier == "remote":
            if engine.remote is None:
                raise ConfigError(
                    "a saved tensor was sent to tier 'remote' (decide returned it), but this "
                    "Offloader has no remote store; pass remote=RemoteStore(...) or a dict"
                )
            record.location.append(engine.to_store(data, "remote"))  # raw: no codec on this tier
            with self._lock:
                self.stats.bytes_offloaded["remote"] += record.nbytes
                self.stats.tensors_offloaded += 1
            return
        put = _to_host if record.tier == "host" else _to_disk
        if codec is None:
            record.location.append(put(engine, data))
        elif data.device.type != "cpu" and getattr(codec, "encodes_on_device", False):
            payloads, meta = codec.encode(data.view(record.dtype))
            record.meta = {k: _host_scalar(v) for k, v in meta.items()}
            record.location.extend(put(engine, p) for p in payloads)
        else:
            loc = put(engine, data.view(record.dtype), codec=codec)
            if record.tier == "host" and self.tier == "auto":  # the payloads' size is known only
                loc = _spill_if_full(engine, loc, data.view(record.dtype), codec, self)  # later
            record.location.append(loc)
        with self._lock:
            self.stats.bytes_offloaded[record.tier] += record.nbytes
            self.stats.tensors_offloaded += 1

    def _claim(self, record: _Record, prefetch: bool) -> tuple[Future, bool]:
        """Under the lock: the record's fetch future, and whether the caller must start its reads."""
        if record.fetched is not None:
            return record.fetched, False
        done: Future = Future()
        if record.source is not None:  # write still in flight (or kept at the tail): no read
            done.set_result(_Source([record.source]))  # raw bytes: nothing to decode
            record.fetched = done
            return done, False
        if prefetch:
            self.stats.bytes_prefetched += record.nbytes
        else:
            self.stats.bytes_on_demand += record.nbytes
        record.fetched = done
        return done, True

    def _fetch(self, record: _Record) -> Future:
        """Future of the record's payloads on its device (transfers still to be finished by the
        consumer, see ``_materialize``); starts the reads if needed."""
        with self._lock:
            fut, start = self._claim(record, prefetch=False)
        if start:
            self._start_reads(record, fut)
        return fut

    def _start_reads(self, record: _Record, fut: Future) -> None:
        parts = [self._read(loc, record.device) for loc in record.location]
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

    def _read(self, location: Future, device: torch.device) -> Future:
        """Start reading one payload back to ``device`` once its write is done; the result is the
        engine's transfer future (already done), finished later on the consumer's thread."""
        out: Future = Future()
        box = [out]  # taken by the first callback to fire (see _start_reads)

        def written(f: Future) -> None:
            target = box.pop()
            try:
                _restore(self._engine, f.result(), device, _relay_to(target))
            except BaseException as exc:
                target.set_exception(exc)

        location.add_done_callback(written)
        return out


_COMPILED_HOOKS = (
    "torch.compile traced tensortier's saved-tensor hooks into a compiled graph, where they "
    "offload nothing: they were switched on inside a compiled region (offload_module() on blocks "
    "of a torch.compile'd model, or `with tt.offload()` inside a compiled function). Call the "
    "compiled model inside `with tt.offload(...)` instead, or offload_module() an uncompiled model"
)
_last_stats: OffloadStats | None = None  # for offload_stats(); never keeps an Offloader alive
_FROM_STORE_TAKES_DEVICE = "device" in inspect.signature(TransferEngine.from_store).parameters


def _restore(
    engine: TransferEngine, where: Any, device: torch.device, then: Callable[[Future], None]
) -> None:
    """The one place that asks the engine for a payload back on ``device`` (the saved tensor's
    own, which may differ from the engine's); ``then`` gets the finished transfer future.

    An :class:`Encoded` whose codec decodes on the device without a sync (sparse, casts) comes
    back as its raw payloads, decoded by the consumer (``_Payloads``): fewer bytes cross the bus
    and the device decodes far faster than a CPU. Other codecs (zstd, lz4) decode on the
    engine's host threads, and their raw bytes are copied."""
    if (
        isinstance(where, Encoded)
        and device.type == "cuda"
        and getattr(where.codec, "decodes_on_device", False)
    ):
        _restore_payloads(engine, where, device, then)
        return
    if isinstance(where, HostTensor) or (
        isinstance(where, Encoded) and all(isinstance(p, HostTensor) for p in where.parts)
    ):
        engine.to_device(where, device=device).add_done_callback(then)
    elif isinstance(where, RemoteHandle):
        engine.from_store(where, "remote", to="device", device=device).add_done_callback(then)
    elif _FROM_STORE_TAKES_DEVICE:
        engine.from_store(where, "disk", to="device", device=device).add_done_callback(then)
    elif device == normalize_device(engine.device):
        engine.from_store(where, "disk", to="device").add_done_callback(then)
    else:  # an engine that reads to its own device only: stage in host memory, then copy

        def staged(f: Future) -> None:
            if f.exception() is not None:
                then(f)
                return
            try:
                inner = engine.to_device(Future.result(f), free=True, device=device)
            except BaseException as exc:  # e.g. closed: the unpack must raise, never wait forever
                failed: Future = Future()
                failed.set_exception(exc)
                then(failed)
                return
            inner.add_done_callback(then)

        engine.from_store(where, "disk", to="host").add_done_callback(staged)


class _Source(list):
    """A record's own source storage, handed back before its write finished (not payloads)."""


class _Payloads(list):
    """The payload transfers of an :class:`Encoded`, restored raw to the device (see
    ``_restore``); ``decode()`` finishes them on the consumer's stream and decodes there."""

    def __init__(self, transfers: list[Future], enc: Encoded):
        super().__init__(transfers)
        self.codec, self.meta = enc.codec, enc.meta

    def decode(self) -> torch.Tensor:
        return self.codec.decode([t.result() for t in self], self.meta)


def _restore_payloads(
    engine: TransferEngine, enc: Encoded, device: torch.device, then: Callable[[Future], None]
) -> None:
    """Restore every payload of ``enc`` raw to ``device``; ``then`` gets a finished future whose
    result is the :class:`_Payloads` (failed with the first error, if any)."""
    futures: list[Future] = []
    try:
        for part in enc.parts:
            if isinstance(part, HostTensor):
                futures.append(engine.to_device(part, device=device))
            else:
                futures.append(engine.from_store(part, "disk", to="device", device=device))
    except BaseException as exc:  # e.g. closed: the unpack must raise, never wait forever
        futures.append(failed(exc))

    def finished(all_done: Future) -> None:
        done: Future = Future()
        if all_done.exception() is not None:
            done.set_exception(all_done.exception())
        else:
            done.set_result(_Payloads(futures, enc))
        then(done)

    gather(futures).add_done_callback(finished)


def _host_scalar(value: Any) -> Any:
    """A codec's metadata value, a 0-dim CUDA tensor (fp16's overflow flag) as a
    :class:`HostScalar`: its decode reads it once the payloads moved, without a host sync."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cuda":
        return HostScalar(value)
    return value


def _to_host(engine: TransferEngine, t: torch.Tensor, **codec) -> Future:
    return engine.to_host(t, **codec)


def _to_disk(engine: TransferEngine, t: torch.Tensor, **codec) -> Future:
    """``engine.to_store(t, "disk")``; a device tensor that the host pool cannot stage
    (``tier="auto"`` with the pool full of host records) is copied to pageable memory first, on the
    current stream: slower (the forward waits for it), never a failed forward."""
    try:
        return engine.to_store(t, "disk", **codec)
    except TierFullError as exc:
        if exc.tier != "host" or t.device.type == "cpu":
            raise
        return engine.to_store(t.cpu(), "disk", **codec)


def _spill_if_full(engine: TransferEngine, first: Future, src, codec, off: Offloader) -> Future:
    """``tier="auto"``: encoded payloads that do not fit the host pool (their size is known only
    once encoded, on a copy worker) go to disk instead; the future of wherever they end up."""
    out: Future = Future()
    box = [src]  # the source, until the payloads are stored somewhere

    def stored(f: Future) -> None:
        t = box.pop()
        exc = f.exception()
        if not isinstance(exc, TierFullError):
            _copy_result(f, out)
            return
        try:
            retry = _to_disk(engine, t, codec=codec)
        except BaseException as err:
            out.set_exception(err)
            return
        with off._lock:
            n = t.numel() * t.element_size()
            off.stats.bytes_offloaded["host"] -= n
            off.stats.bytes_offloaded["disk"] += n
        retry.add_done_callback(lambda g: _copy_result(g, out))

    first.add_done_callback(stored)
    return out


def _copy_result(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(Future.result(src))


def _pass_of(record: _Record) -> _Pass:
    return record.owner


def _relay_to(dst: Future) -> Callable[[Future], None]:
    """A callback that resolves ``dst`` with the finished future, then forgets ``dst``."""
    box = [dst]

    def relay(src: Future) -> None:
        box.pop().set_result(src)

    return relay


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
    elif isinstance(where, Encoded):
        if engine.disk is not None or all(isinstance(p, HostTensor) for p in where.parts):
            where.free(engine.disk)
    elif isinstance(where, RemoteHandle):
        if engine.remote is not None and where in engine.remote:  # free(): never blocks
            engine.remote.free(where)
    elif engine.disk is not None and where in engine.disk:
        engine.disk.free(where)


def _is_weight_cast(t: torch.Tensor, base: torch.Tensor | None) -> bool:
    """Autocast's cached cast of a weight (REVIEW #14): a copy in autocast's dtype of an fp32 leaf
    that requires grad. The autocast cache holds it on the device until autocast exits, so moving
    it frees nothing there. (Inside the op that saves it, autocast reports itself disabled, so this
    goes by the cache's own criterion; the same copy made by hand is treated alike.)"""
    if not torch.is_autocast_cache_enabled():
        return False
    cast = t if base is None else base  # linear saves the cast's transpose
    fn = cast.grad_fn
    if fn is None or cast.dtype != torch.get_autocast_dtype(t.device.type):
        return False
    if fn.name() != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    leaf = getattr(nxt[0][0], "variable", None) if nxt else None
    return leaf is not None and leaf.dtype == torch.float32


def _held_by_graph(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a weight that is not an ``nn.Parameter``: the tensors given to
    ``torch.func.functional_call``, a hand-written model's): the graph's ``AccumulateGrad`` node
    holds it until the graph dies, so moving it (or a view of it) frees nothing."""
    return t.requires_grad and t.is_leaf


def _with_storage(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold parameter or buffer ``t``: itself, or for a wrapper
    subclass, which has no storage of its own (FSDP2's sharded DTensor parameter, as its
    module's forward pre-hooks see it before FSDP2 gathers it: reading it raised), its inner
    tensors; none for a tensor with no storage at all (functorch's BatchedTensor: the weights
    vmap hands to functional_call in a model ensemble)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
        return [x for i in inner if torch.is_tensor(i) for x in _with_storage(i)]
    return [t] if torch._C._has_storage(t) else []


def _cudagraph_owned(t: torch.Tensor) -> bool:
    """A tensor recorded by a CUDA graph (torch.compile mode="reduce-overhead"): its memory is the
    graph's static pool, which offloading cannot free and the next replay rewrites."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or t.device.type != "cuda":
        return False
    try:
        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return False
        manager = trees.get_manager(t.device.index, create_if_none_exists=False)
        return manager is not None and manager._get_cuda_graph_recorded_tensor_checker()(t)
    except Exception:  # private API moved: treat it as an ordinary tensor
        return False


class _Pass:
    """State of one forward (and the backward(s) that follow it)."""

    def __init__(self, off: Offloader):
        self.off = off
        self.order: list[weakref.ref] = []  # records in pack order
        self.sizes: list[int] = []
        # ptr -> (storage, record); record None: the storage was kept
        self.by_storage: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}
        # storage address -> the parameter or buffer there when its module ran
        self.param_ptrs: dict[int, weakref.ref] = {}
        self.modules: list[nn.Module] = []
        self.names: dict[int, str] = {}
        self.seen_modules: set[int] = set()
        self.consumed_order: list[int] = []
        self.expected: list[int] = []
        self.cursor = 0
        self.window = 0  # bytes of the records with in_window set
        self.timings: dict[int, dict] = {}
        self.index = 0  # records made (moved storages)
        self.decided = 0  # storages a decision was made for: SavedTensorInfo.index
        self.forward_ended = False
        self.backward_started = False
        self.task: int | None = None  # autograd graph task now unpacking this pass
        self.blocks = 0  # offload_module: hooked blocks finished in this forward
        self.thread: int | None = None  # the thread running this forward (module tracking)
        self.under_amos = False  # saved inside allow_mutation_on_saved_tensors() (error hint)

    def signature(self) -> tuple[int, ...]:
        return tuple(self.sizes)

    # module tracking: parameters/buffers are never moved; names feed the planner
    def enter_module(self, module: nn.Module, args) -> None:
        # traced by dynamo: leave no side effect in the graph; another thread's module: not ours
        if torch.compiler.is_dynamo_compiling() or threading.get_ident() != self.thread:
            return
        if not self.modules and not self.names:
            self.names = {id(m): name for name, m in module.named_modules()}
        self.modules.append(module)
        self.track(module)

    def exit_module(self, module: nn.Module, args, output) -> None:
        if torch.compiler.is_dynamo_compiling() or threading.get_ident() != self.thread:
            return
        if self.modules and self.modules[-1] is module:
            self.modules.pop()

    def track(self, module: nn.Module) -> None:
        if id(module) not in self.seen_modules:
            self.seen_modules.add(id(module))
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                for x in _with_storage(t):
                    self.param_ptrs[x.untyped_storage().data_ptr()] = weakref.ref(x)

    def _is_param(self, ptr: int) -> bool:
        """A parameter's or buffer's storage is at ``ptr`` now. Not just was: FSDP2 frees the
        parameters it gathered for a module once its forward ends (``reshard_after_forward``),
        and an activation allocated at that address was kept on the device as a parameter (at
        random: a rank whose allocator reused it profiled another plan than its peers)."""
        ref = self.param_ptrs.get(ptr)
        held = ref() if ref is not None else None
        return held is not None and held.untyped_storage().data_ptr() == ptr

    def pack(self, t: torch.Tensor) -> Any:
        """Pack a plain ``torch.Tensor`` (not a Parameter: ``_pack`` checked its exact type)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        base = t._base
        if self._is_param(ptr) or (base is not None and isinstance(base, nn.Parameter)):
            return _Leaf(t)  # a parameter, a view of one, or a buffer: saved by reference
        if _held_by_graph(t if base is None else base):
            return _Leaf(t)  # a weight that is no Parameter (or a view of one): by reference
        stats = self.off.stats
        nbytes = storage.nbytes()
        stats.tensors_packed += 1
        again = self._saved_before(t, storage, ptr, nbytes)
        if again is not None:
            return again
        if self._stays(t, base, nbytes):
            return _Leaf(t)
        action = self._action(t, nbytes)
        if action.tier == "keep":
            stats.bytes_kept += nbytes
            # decided once per storage, as moved ones are: saving it again asks nothing
            self.by_storage[ptr] = (weakref.ref(storage), None)
            return _Leaf(t)
        tier = self._fitting_tier(t, action.tier, nbytes)
        record = _Record(self, self.index, nbytes, t.device, tier)
        record.dtype = t.dtype
        codec = action.codec
        if codec is not None and nbytes % t.dtype.itemsize == 0 and accepts(codec.name, t.dtype):
            record.codec = codec  # storages the codec cannot take (not whole elements of this
            # dtype, a dtype it does not list: fp8, uint16...) travel raw
        pack_s = self._start_or_spill(record, _storage_bytes(t))
        record.handles = 1
        self.by_storage[ptr] = (weakref.ref(storage), weakref.ref(record))
        self.order.append(weakref.ref(record))
        self.sizes.append(nbytes)
        if self.off.record:
            self._record_timing(t, record, pack_s)
        self.index += 1
        return _Handle(record, t)

    def _saved_before(
        self, t: torch.Tensor, storage: torch.UntypedStorage, ptr: int, nbytes: int
    ) -> Any:
        """What to save for a storage this pass already decided on: ``t`` when it was kept, a
        new handle of its record when it is being moved (moved once), else None (a new one)."""
        known = self.by_storage.get(ptr)
        if known is None:
            return None
        storage_ref, record_ref = known
        if record_ref is None and storage_ref() is storage:  # kept before: kept again
            self.off.stats.bytes_kept += nbytes
            return _Leaf(t)
        record = record_ref() if record_ref is not None else None
        if storage_ref() is storage and record is not None:  # same live storage: move it once
            self.off.stats.bytes_deduplicated += nbytes
            record.handles += 1
            return _Handle(record, t)
        return None  # the address was reused by a new storage

    def _stays(self, t: torch.Tensor, base: torch.Tensor | None, nbytes: int) -> bool:
        """Whether ``t`` is saved by reference whatever the decision, as moving it frees nothing."""
        off = self.off
        if t.device.type == "cpu" and off.device.type != "cpu" or _cudagraph_owned(t):
            off.stats.bytes_kept += nbytes  # no device memory to free: saved by reference
            return True
        if not off.offload_weight_casts and _is_weight_cast(t, base):
            off.stats.bytes_weight_casts += (
                nbytes  # the autocast cache holds it on the device anyway
            )
            return True
        return False

    def _fitting_tier(self, t: torch.Tensor, tier: str, nbytes: int) -> str:
        """``tier``, or disk for a tensor larger than the whole host budget under ``tier="auto"``
        (BudgetError under ``tier="host"``: it could never be held)."""
        off = self.off
        if tier != "host" or size_class(nbytes) <= off.host_budget:
            return tier
        if off.tier == "auto":
            return "disk"
        raise BudgetError(
            f"host_budget={format_size(off.host_budget)} cannot hold even one saved tensor "
            f"of {format_size(nbytes)} (shape {tuple(t.shape)}); raise host_budget or use "
            f"tier='auto' or tier='disk'",
            budget=off.host_budget,
            minimum=size_class(nbytes),
        )

    def _start_or_spill(self, record: _Record, data: torch.Tensor) -> float:
        """:meth:`_start`; under ``tier="auto"`` a host record that finds the host budget used up
        goes to disk instead. Returns the seconds the start took."""
        try:
            return self._start(record, data)
        except TierFullError:
            if self.off.tier != "auto" or record.tier != "host":
                raise
            record.tier = "disk"  # host budget used up: spill the rest to disk
            record.location.clear()
            self.off._attach_disk()
            return self._start(record, data)

    def _record_timing(self, t: torch.Tensor, record: _Record, pack_s: float) -> None:
        """``record=True``: the per-tensor row of ``Offloader.records`` (unpack fills its time)."""
        self.timings[record.index] = {
            "index": record.index,
            "nbytes": record.nbytes,
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "module": self._module_name(),
            "grad_fn": t.grad_fn.name() if t.grad_fn is not None else "",
            "tier": record.tier,
            "pack_s": pack_s,
            "unpack_s": 0.0,
        }
        self.off.records.append(self.timings[record.index])

    def _start(self, record: _Record, data: torch.Tensor) -> float:
        """Start the record's writes; returns the seconds that took."""
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
        return time.perf_counter() - t0

    def _action(self, t: torch.Tensor, nbytes: int) -> Action:
        off = self.off
        if off.decide is None:
            if nbytes < off.min_bytes:
                return _KEEP
            tier = "host" if off.tier in ("host", "auto") else off.tier
            return Action(tier, off.codec)
        node = t.grad_fn.name() if t.grad_fn is not None else ""
        info = SavedTensorInfo(
            self.decided, nbytes, t.dtype, tuple(t.shape), self._module_name(), node
        )
        self.decided += 1
        return _checked_action(off, off.decide(info))

    def _module_name(self) -> str:
        return self.names.get(id(self.modules[-1]), "") if self.modules else ""

    # ------------------------------------------------------------------ prefetch
    def end_forward(self) -> None:
        """Forward is over: choose the consumption order, keep the tail's sources, start reading."""
        off = self.off
        with off._lock:
            if self.forward_ended:
                return
            self.forward_ended = True
            n = len(self.order)
            learned = off._learned
            if learned is not None and learned[0] == self.signature():
                self.expected = list(learned[1])
                off.stats.order_reused += 1
            else:
                self.expected = list(reversed(range(n)))
            budget = off.prefetch_budget
            for i in self.expected:  # the first records backward needs: keep them if in flight
                record = self.order[i]()
                if record is None or record.nbytes > budget:
                    break
                budget -= record.nbytes
                if record.source is not None:
                    record.keep_source = True
                    off.stats.bytes_kept_at_tail += record.nbytes
        self.pump()

    def reopen(self) -> None:
        """More of the forward after end_forward (offload_module saw more blocks than last time):
        forget the prefetch started for a tail that was not the tail."""
        with self.off._lock:
            self.forward_ended = False
            self._reset_reads()
            self.expected = []

    def begin_backward(self, task: int) -> None:
        """First unpack of this pass in autograd graph task ``task`` (-1: outside a backward)."""
        with self.off._lock:
            if self.task is not None and self.task != -1:  # the last backward's callback never ran
                self._reset_reads()
            self.task = task
            self.backward_started = True
        self.end_forward()  # offload_module: the forward ends at the latest when backward starts
        if task != -1:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self.end_backward(task)
                )
            except RuntimeError:  # not inside a backward after all
                pass

    def end_backward(self, task: int) -> None:
        """Autograd's final callback of the backward that read this pass: empty the window."""
        with self.off._lock:
            if self.task == task:
                self._reset_reads()
                self.task = None

    def _reset_reads(self) -> None:
        """Drop fetched copies, kept sources and the window; a later backward reads again (caller
        holds the lock)."""
        unused = 0
        for ref in self.order:
            r = ref()
            if r is None:
                continue
            if r.in_window:
                r.in_window = False
                unused += r.nbytes
            r.fetched = r.materialized = r.source = r.stream = None
            r.keep_source = r.used = False
            r.served = 0
        self.off.stats.bytes_prefetch_unused += unused
        self.window = 0
        self.cursor = 0

    def consumed(self, record: _Record) -> None:
        with self.off._lock:
            self.consumed_order.append(record.index)
            if record.in_window:
                record.in_window = False
                self.window -= record.nbytes
            record.keep_source = False
            if record.fetched is None:
                record.source = None
        self.pump()

    def pump(self) -> None:
        """Start reading the next records in the expected order while the window has room."""
        off = self.off
        while True:
            with off._lock:
                if self.cursor >= len(self.expected):
                    return
                record = self.order[self.expected[self.cursor]]()
                wanted = record is not None and record.fetched is None and not record.used
                # a record larger than the window is read ahead alone; prefetch_budget=0 reads none
                alone = self.window == 0 and off.prefetch_budget > 0
                if wanted and not alone and self.window + record.nbytes > off.prefetch_budget:
                    return
                self.cursor += 1
                if not wanted:
                    continue
                self.window += record.nbytes
                record.in_window = True
                fut, start = off._claim(record, prefetch=True)
            if start:
                off._start_reads(record, fut)


@renamed(**OFFLOAD_RENAMES)
def offload(tier: str = "host", **kwargs) -> Offloader:
    """Offload saved activations inside a ``with`` block; see :class:`Offloader` for the options.

    Calls with the same settings from one thread reuse one offloader (its spill files, host pool
    and learned prefetch order), so a training loop can write ``with tt.offload(...):`` every
    step; each thread has its own (saved-tensor hooks are per thread). Changing
    the settings closes the previous one (at once if nothing it saved is still alive, else once
    its graphs are gone).
    """
    budget = kwargs.pop("budget", None)
    if budget is not None:  # the planner's verb, one layer up: this mechanism never imports it
        raise ConfigError(
            f"budget={budget!r}: a memory budget is planned by tensortier.offload "
            "(tt.offload(budget=..., spill_dir=...)); tensortier.activations.offload takes the "
            "offloader's own settings (tier=, min_bytes=, prefetch_budget=, ...)"
        )
    key = (tier, tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())))
    cache = _thread_cache()
    same = [o for o in cache.get(key, []) if not o.closed]
    for o in same:
        if o._hooks is None:
            return o
    made = Offloader(tier, **kwargs)
    old = [o for k, offs in cache.items() if k != key for o in offs]
    cache.clear()  # one cached configuration: switching settings releases the old one
    cache[key] = [*same, made]  # `with tt.offload()` nested in one of the same settings: one
    for o in old:  # offloader per depth, each reused (and its prefetch order learned) every step
        o._release_if_idle()
    return made


def _thread_cache() -> dict[tuple, list[Offloader]]:
    """This thread's cached offloaders (by settings). Saved-tensor hooks are per thread, and so is
    the cache: threads training at once each get their own offloader, and a thread's call never
    closes or enters another thread's. A finished thread's offloader is closed once collected."""
    cache = getattr(_CACHE, "offloaders", None)
    if cache is None:
        cache = _CACHE.offloaders = {}
    return cache


def _hashable(v: Any) -> Any:
    if isinstance(v, dict):  # e.g. remote={"budget": ...}: same settings, same offloader
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    v = codec_key(v)  # codec=tt.get_codec("sparse") each step: one offloader, not one a step
    try:
        hash(v)
        return v
    except TypeError:
        return id(v)


_CACHE = threading.local()


def _checked_action(off: Offloader, action: Any) -> Action:
    """What ``decide`` returned, as an Action this offloader can carry out: a value that is none
    failed inside the pack hook with an AttributeError, and ``"disk"`` on an offloader without a
    disk tier with the transfer engine's advice to pass it a DiskStore, which users never make."""
    if isinstance(action, str):
        action = Action(action)
    elif not isinstance(action, Action):
        raise ConfigError(
            f"decide returned {action!r}; return an Action or one of 'keep', 'host', 'disk', "
            f"'remote'"
        )
    if action.tier == "disk" and off._disk is None:
        raise ConfigError(
            f"a saved tensor was sent to tier 'disk' (decide returned it), but this "
            f"Offloader(tier={off.tier!r}) has no disk tier; make it with tier='auto' (host, "
            f"then disk) or tier='disk', and spill_dir="
        )
    return action


class _Blocks:
    """offload_module's hooks: the saved-tensor hooks are on inside the hooked blocks only, while
    one pass spans every block of a forward (its end is learned: the number of blocks the last
    forward ran, else the first unpack)."""

    def __init__(self, off: Offloader):
        self.off = off
        self.depth = 0
        self.active = False
        self.frame: Any = None  # the outermost running block's Module._call_impl frame
        self.thread: int | None = None  # and the thread running it
        # set by remove(): copy.deepcopy(model) copies the hooks (which call this object), and
        # a copy's forward must run plainly once the original's hooks are removed
        self.removed = False

    def enter(self, module: nn.Module, args) -> None:
        if self.removed:
            return
        self.abandon_if_left()
        self.depth += 1
        if self.depth == 1:
            # a block re-run by checkpoint's recomputation inside backward is left alone
            in_backward = torch._C._current_graph_task_id() != -1
            self.active = not in_backward and self.off._begin_block(module)
            self.frame, self.thread = _call_frame(), threading.get_ident()

    def leave(self, module: nn.Module, args, output) -> None:
        if self.removed and self.depth == 0:  # a copy's block entered after remove()
            return
        self.depth -= 1
        if self.depth == 0:
            self.frame = None
            if self.active:
                self.active = False
                self.off._end_block()

    def abandon_if_left(self) -> None:
        """A block still open whose call is no longer running was left by a BaseException
        (KeyboardInterrupt): PyTorch runs ``always_call`` forward hooks for an ``Exception``
        only, so its ``leave`` never ran. Turn its hooks off now, as ``leave`` would have."""
        if self.depth == 0 or self.frame is None or self.thread != threading.get_ident():
            return  # (one model's blocks run by two threads at once are not supported)
        if _running(self.frame):
            return
        self.depth, self.frame = 0, None
        if self.active:
            self.active = False
            self.off._end_block()


_CALL_IMPL = nn.Module._call_impl.__code__


def _call_frame() -> Any:
    """The frame of the ``Module._call_impl`` running the forward pre-hook that calls this."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return frame


def _running(frame: Any) -> bool:
    """Whether ``frame`` is on this thread's call stack."""
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class OffloadHandle:
    """Returned by :func:`offload_module`; ``remove()`` detaches the hooks and closes the offloader
    that :func:`offload_module` made (at once if idle, else once its graphs are gone)."""

    def __init__(self, offloader: Offloader, hooks: list, *, owned: bool, blocks: _Blocks):
        self._offloader: Offloader | None = offloader
        self._ref = weakref.ref(offloader)
        self._hooks, self._owned = hooks, owned
        self._blocks: _Blocks | None = blocks

    @property
    def offloader(self) -> Offloader | None:
        return self._offloader if self._offloader is not None else self._ref()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        blocks, self._blocks = self._blocks, None  # (it holds the offloader)
        if blocks is not None:
            blocks.removed = True  # the hooks deep copies of the model still hold
            blocks.abandon_if_left()  # a block interrupted by a BaseException: hooks off
        off, self._offloader = self._offloader, None
        if off is not None and self._owned:
            off._release_if_idle()


@renamed(**OFFLOAD_RENAMES)
def offload_module(module: nn.Module, tier: str = "host", **kwargs) -> OffloadHandle:
    """Offload the activations saved inside ``module``'s forward only (each child of a ModuleList).

    >>> handle = tt.offload_module(model.transformer.h, tier="host")   # handle.remove() undoes it

    ``tier`` and ``kwargs``: the settings of the :class:`Offloader` it makes (closed by
    ``remove()``); ``offloader=`` uses one of yours instead (left open; then no other setting).

    Not for ``torch.compile``: dynamo compiles the hooks away (ConfigError when tensortier sees
    it), and does not guard on hooks added after compiling (they never fire). Call a compiled
    model inside ``with tt.offload(...)`` instead.
    """
    given = kwargs.pop("offloader", None)
    if given is not None and (kwargs or tier != "host"):  # they would be silently ignored
        raise ConfigError(
            f"offload_module(offloader=...) also got {sorted(kwargs) or ['tier']}: the offloader "
            "given has its own settings; pass either offloader= or the settings"
        )
    targets = list(module) if isinstance(module, nn.ModuleList | nn.ModuleDict) else [module]
    if isinstance(module, nn.ModuleDict):
        targets = list(module.values())
    for m in [module, *targets]:
        if getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod"):
            raise ConfigError(
                f"offload_module() got a torch.compile'd module ({type(m).__name__}): hooks inside "
                "compiled graphs are compiled away; call the compiled model inside "
                "`with tt.offload(...)` instead"
            )
    off = given or Offloader(tier, **kwargs)
    blocks = _Blocks(off)
    # a compiled model runs these eagerly, at a graph break around each hooked block
    enter, leave = torch.compiler.disable(blocks.enter), torch.compiler.disable(blocks.leave)
    hooks = []
    for m in targets:
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave, always_call=True))
    return OffloadHandle(off, hooks, owned=given is None, blocks=blocks)


def offload_stats() -> dict:
    """Stats of the offloader that ran the latest forward (cumulative over its passes), as
    :meth:`OffloadStats.as_dict`; all zeros before any has. ``off.stats`` is one offloader's,
    :func:`tensortier.stats` every live one's."""
    return (_last_stats or OffloadStats()).as_dict()
