"""Parameter streaming: parameters live on host RAM or disk and visit the device per module.

A *unit* is a module that owns parameters directly. Parameters are kept once each (a *slot* per
unique ``nn.Parameter``): a parameter shared by several modules (tied embeddings) has one home
and is installed for every module that uses it, counted so that the inner of two users does not
take it away from the outer. Between uses each parameter holds a NaN placeholder of the right
shape (one element, expanded), so autograd, ``.grad`` and optimizers still see the parameter's
shape, and a use outside the owning module's forward computes NaN instead of stale values; when
that forward saves it for backward (a parent reading its child's weight: ``F.linear(x,
self.embed.weight)``) it is a :class:`ConfigError`, and so is replacing a child that holds
streamed parameters (HF ``resize_token_embeddings``) or re-assigning a streamed parameter (tying
weights). ``state_dict(keep_vars=True)`` gives the Parameters themselves, as ``parameters()``
does: placeholders between uses. A forward pre-hook installs the unit's real values (prefetched
while the previous unit ran), a forward hook puts the placeholders back. Autograd would keep the
installed tensors alive until backward; a saved-tensors hook replaces them by a token, and
backward loads the parameter again (prefetching the unit before it) when the token is unpacked.
Values are copied, never recomputed, so outputs and gradients are bit-identical to the resident
model.

Copies on CUDA (the copy-stream pattern of torchtune's ``OffloadActivations``): host-to-device
copies run on one side stream per streamer (``transfer.streams``: ``copy_new``, ``consume``), from
pinned memory (the host tier's homes are pinned; the disk tier reads into pinned staging on the
loader thread), so they overlap the compute stream instead of queueing on it. The copy's destination
is allocated on the side stream and an event is recorded after the copy; the stream that uses the
values (the current stream of the forward, or of the backward node that unpacks a token) waits on
that event, and the tensors are ``record_stream``-ed on it, so the allocator reuses their memory
only after that stream's work queued so far is done. The pinned source of an in-flight copy stays
reserved: the homes live as long as the streamer, and a staging block of the disk tier records the
copy's event, so its pool lends it again only after the copy (``tiers/host.py``). The host runs
ahead of the GPU, so memory the host has let go of may still be in use by queued kernels: every unit
the host is done with leaves an event on its stream, and a load that would put more than ``budget``
bytes on the device waits for the oldest of those events first (FSDP's rate limiter); prefetches
never wait, they are skipped.

Buffers are not streamed: they move to the device once, and stay there after ``close()``.

The model's own API goes on working while streamed: ``state_dict()`` holds copies of the values
read from the tier (on the host, not ``device``: gathering them on the device would defeat the
budget), ``load_state_dict()`` installs each unit's values while torch copies into them and
stores them back to the tier.

Saved-tensor hooks already active around the forward (``tt.offload``) still get every saved
tensor that is not a streamed parameter: the streamer's hooks, pushed on top of theirs, hand them
down; an offloader inside the model (``offload_module``) hands the streamed parameters up to the
streamer's (``_saved_hooks.py``). ``copy.deepcopy`` or pickling a streamed model is a
:class:`ConfigError` (copy the ``state_dict()``). Converting the model while streamed
(``model.to(dtype)``, ``.half()``, ``p.data = ...``) replaces the placeholders: the next use
raises :class:`ConfigError` (close first, convert, stream again).

A model can be streamed by one streamer at a time: streaming it again would record the first
streamer's NaN placeholders as weights, so it raises :class:`ConfigError`.

This module owns the parameter tensors' storage only; it never changes gradients.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tensortier._device import check_device, normalize_device
from tensortier._lifetime import Finalizer
from tensortier._saved_hooks import (
    STREAMED_ATTR,
    Outer,
    is_streamed,
    of_streamed,
    outer_hooks,
    pack_outer,
)
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, format_size, parse_size
from tensortier.errors import BudgetError, ClosedError, ConfigError
from tensortier.tiers.disk import DiskHandle, DiskStore
from tensortier.tiers.host import HostPool, pinned_copy
from tensortier.tiers.placement import Placement
from tensortier.transfer.streams import SideStreams, consume
from tensortier.transfer.streams import event as new_event


class ParamTier(str, Enum):
    """Where streamed parameters live between uses."""

    HOST = "host"
    DISK = "disk"


@dataclass
class StreamStats:
    """What :meth:`ParameterStreamer.stats` counts."""

    loads: int = 0  # unit loads (forward and backward)
    prefetch_hits: int = 0  # loads served by a prefetch already in flight
    bytes_loaded: int = 0
    peak_resident_bytes: int = 0  # most parameter bytes installed or prefetched at once


@dataclass(eq=False)
class _Slot:
    """One unique parameter: its home on the tier, its placeholder, how many users installed it."""

    name: str  # qualified name of its first owner (error messages)
    param: nn.Parameter
    nbytes: int
    home: Any = None  # a (pinned on CUDA) host tensor, or a DiskHandle
    placeholder: torch.Tensor | None = None
    installs: int = 0  # units whose forward is running with it installed


@dataclass(eq=False)
class _Unit:
    index: int
    module: nn.Module
    slots: list[_Slot]
    nbytes: int
    entered: int = 0  # forwards running whose pre-hook completed (its post-hook undoes them)
    pushed: list[bool] = field(default_factory=list)  # per running forward: it pushed the hooks

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots]


@dataclass(eq=False)
class _Load:
    """Values of one unit on their way to the device (or there)."""

    unit: int
    future: Future | None = None  # loader-thread job returning (tensors, event)
    tensors: list[torch.Tensor] | None = None
    event: Any = None  # CUDA: recorded on the side stream after the copies
    streams: dict = field(default_factory=dict)  # consumers that waited on ``event``, by handle


@dataclass(frozen=True)
class _Token:
    unit: int
    slot: int  # position in the unit's slots
    shape: tuple
    stride: tuple
    offset: int  # relative to the parameter's own storage offset


def _placeholder(p: nn.Parameter, device: torch.device) -> torch.Tensor:
    fill = float("nan") if (p.dtype.is_floating_point or p.dtype.is_complex) else 0
    return torch.full((1,), fill, dtype=p.dtype, device=device).expand(p.shape)


def _shutdown(
    loader: ThreadPoolExecutor | None, store: DiskStore | None, staging: HostPool | None = None
) -> None:
    """Cleanup that waits (joins the loader thread): run by ``close()`` or by the reaper."""
    if loader is not None:
        loader.shutdown(wait=True)  # its only job kind (a read or a copy) completes or raises
    if store is not None:
        store.close()
    if staging is not None:
        staging.close()  # blocks whose copies still run are unpinned once they are done


class ParameterStreamer:
    """Handle returned by :func:`stream_parameters`; ``close()`` makes the model resident again."""

    def __init__(
        self,
        model: nn.Module,
        *,
        budget: SizeLike | None,
        tier: ParamTier | str,
        device: torch.device | str | None,
        spill_dir: str | None,
    ):
        try:
            self.tier = ParamTier(tier)
        except ValueError:
            raise ConfigError(
                f"tier={tier!r} is not a parameter tier; pass one of {[t.value for t in ParamTier]}"
            ) from None
        if not isinstance(model, nn.Module):  # stream_parameters("cuda:0"): the model is first
            raise ConfigError(
                f"stream_parameters: model must be a torch.nn.Module, got "
                f"{type(model).__name__} {model!r}; call stream_parameters(model, budget, "
                f"device=...)"
            )
        self.model = model
        self.units, slots = _build_units(model)
        if not self.units:
            raise ConfigError("the model has no parameters to stream")
        _refuse_streamed(slots)
        self._slots = slots
        self._slot_of = {id(s.param): s for s in slots}
        self.device = _target_device(device, slots[0].param)
        self.budget = _check_budget(budget, max(u.nbytes for u in self.units))
        self._cuda = self.device.type == "cuda"
        self._stats = StreamStats()
        self._open_tier(spill_dir)
        self._pending: dict[int, _Load] = {}
        self._installed: dict[int, tuple[int, int]] = {}  # storage ptr -> (unit, slot position)
        self._live_bytes = 0
        self._hooks = []
        self._saved_ctx = None
        self._outer: tuple[Any, Any] | None = None  # saved-tensor hooks active around the forward
        self._loading: set[int] = set()  # slots installed by load_state_dict (by id)
        # the state dict being filled, and the values already given to it (by slot id)
        self._given: tuple[Any, dict[int, Any]] = (lambda: None, {})
        self._depth = 0
        self._resident = False  # inside ``resident()``
        self._last: _Load | None = None
        # CUDA: (event, bytes) of units the host let go of, possibly still read by queued kernels
        self._releasing: deque[tuple[Any, int]] = deque()
        self._releasing_bytes = 0
        self._closed = False
        self._take_over()
        register_stats("param_streamer", self)  # tt.stats() lists it while it is open

    def _open_tier(self, spill_dir: str | None) -> None:
        """The store, loader thread, staging and side stream; every parameter copied to its home
        (on failure nothing was swapped yet: the model is untouched)."""
        place = Placement((self.tier.value,), directory=spill_dir, where="stream_parameters")
        disk = self.tier is ParamTier.DISK
        store = place.open_disk(owner="tensortier-params") if disk else None
        loader = staging = None
        try:
            # CUDA host tier: copies are issued inline on the side stream, no thread needed
            if store is not None or not self._cuda:
                loader = ThreadPoolExecutor(1, thread_name_prefix="tt-params")
            # CUDA, disk tier: reads land in pinned staging blocks, lent again after their copy
            if store is not None and self._cuda:
                staging = HostPool(2 * self.budget, pin=True)
        except BaseException:
            _shutdown(loader, store, staging)
            raise
        self._store, self._loader, self._staging = store, loader, staging
        self._finalizer = Finalizer(self, _shutdown, loader, store, staging)
        self._copies = SideStreams()  # H2D only: one side stream, made now
        try:
            if self._cuda:
                self._copies.stream(self.device, "h2d")
            self._store_homes()
        except BaseException:
            self._finalizer()  # nothing was swapped yet: the model is untouched
            raise

    def _take_over(self) -> None:
        """Move the buffers to ``device``, swap every parameter for its placeholder and hook
        every unit's forward. A failure gives the parameters back and closes the tier now (not
        at garbage collection: a held traceback keeps this streamer alive)."""
        originals = [s.param.data for s in self._slots]
        try:
            self._swap_and_hook()
        except BaseException:
            with torch.no_grad():
                for s, data in zip(self._slots, originals):
                    s.param.data = data
            self._unhook()
            self._finalizer()
            raise

    def _swap_and_hook(self) -> None:
        _buffers_to(self.model, self.device)
        with torch.no_grad():
            for s in self._slots:
                s.param.data = s.placeholder
                setattr(s.param, STREAMED_ATTR, weakref.ref(self))
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post(u), always_call=True))
            self._hooks.append(u.module.register_state_dict_post_hook(self._make_state_dict(u)))
            self._hooks.append(u.module.register_load_state_dict_pre_hook(self._make_load_pre(u)))
            self._hooks.append(u.module.register_load_state_dict_post_hook(self._make_load_post(u)))
        self._hooks.append(self.model.register_forward_pre_hook(self._enter))
        self._hooks.append(self.model.register_forward_hook(self._exit, always_call=True))
        _guard_steps(self)

    def _store_homes(self) -> None:
        """Copy every parameter to its tier, before any parameter is touched."""
        with torch.no_grad():
            for s in self._slots:
                p = s.param.detach()
                if self._store is not None:
                    s.home = self._store.write(p.cpu())
                else:
                    s.home = pinned_copy(p) if self._cuda else p.to("cpu", copy=True)
                s.placeholder = _placeholder(s.param, self.device)
        self._placeholder_of = {s.placeholder.untyped_storage().data_ptr(): s for s in self._slots}

    # ------------------------------------------------------------ loading
    def _read(self, u: _Unit) -> tuple[list[torch.Tensor], Any]:
        """Loader thread: read (disk) or copy (CPU) one unit; on CUDA also start the H2D copy."""
        host, blocks = [], []
        for s in u.slots:
            if isinstance(s.home, DiskHandle):
                into = None
                if self._cuda:  # read into pinned memory so that the H2D copy below is async
                    blocks.append(self._staging.alloc(s.home.length))
                    into = blocks[-1].buffer
                host.append(self._store.get(s.home, into=into).result())  # bounded: one read
            else:
                host.append(s.home.clone())  # CPU device: the copy is the load
        if not self._cuda:
            return host, None
        loaded = self._to_device(host)
        for block in blocks:  # the pool lends a block again only once its copy has run
            block.record(loaded[1])
            block.free()
        return loaded

    def _to_device(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Copy pinned host tensors on the side stream; the event marks their arrival.
        Destinations come from the side stream's pool: the copies wait for no other stream."""
        return self._copies.copy_new(host, self.device)

    def _start(self, u: _Unit) -> _Load:
        if self._loader is None:  # CUDA, host tier: the homes are pinned, issue the copies now
            tensors, event = self._to_device([s.home for s in u.slots])
            return _Load(u.index, tensors=tensors, event=event)
        return _Load(u.index, future=self._loader.submit(self._read, u))

    def _ready(self, load: _Load) -> list[torch.Tensor]:
        """The unit's tensors, usable on the current stream."""
        if load.future is not None:
            # bounded: the job is one disk read per parameter, or a copy; it completes or raises
            load.tensors, load.event = load.future.result()
            load.future = None
        if load.event is not None:
            stream = torch.cuda.current_stream(self.device)
            if stream.cuda_stream not in load.streams:
                # a device-side wait (the host never blocks); the tensors' memory is not reused
                # before this stream is done
                consume(load.event, stream, load.tensors)
                load.streams[stream.cuda_stream] = stream
        return load.tensors

    def _released(self, nbytes: int, streams: Iterable = ()) -> None:
        """The host is done with ``nbytes`` of a unit; the device is done once each stream that
        read it (default: the current one) is done with the work queued so far (FSDP2 records
        its post-backward free on the stream that ran that backward). The bytes go with the last
        event: the queue is waited on in order."""
        if self._cuda:
            streams = list(streams) or [torch.cuda.current_stream(self.device)]
            for i, stream in enumerate(streams):
                event = new_event(blocking=True)  # a waiting host sleeps instead of spinning
                event.record(stream)
                self._releasing.append((event, nbytes if i == len(streams) - 1 else 0))
            self._releasing_bytes += nbytes

    def _make_room(self, nbytes: int, *, wait: bool) -> bool:
        """Whether ``nbytes`` more fit under ``budget`` on the device (waiting if ``wait``)."""
        while self._releasing and self._releasing[0][0].query():
            self._releasing_bytes -= self._releasing.popleft()[1]
        while self._releasing and self._live_bytes + self._releasing_bytes + nbytes > self.budget:
            if not wait:
                return False
            event, n = self._releasing.popleft()
            event.synchronize()  # bounded: recorded after kernels that are already queued
            self._releasing_bytes -= n
        return True

    def _prefetch(self, index: int) -> None:
        if not 0 <= index < len(self.units) or index in self._pending:
            return
        u = self.units[index]
        if self._live_bytes + u.nbytes > self.budget or not self._make_room(u.nbytes, wait=False):
            return
        self._live_bytes += u.nbytes
        self._stats.peak_resident_bytes = max(self._stats.peak_resident_bytes, self._live_bytes)
        self._pending[index] = self._start(u)

    def _load(self, u: _Unit) -> _Load:
        load = self._pending.pop(u.index, None)
        if load is not None:
            self._stats.prefetch_hits += 1
            self._live_bytes -= u.nbytes
        else:
            self._make_room(u.nbytes, wait=True)
            load = self._start(u)
        self._ready(load)
        self._stats.loads += 1
        self._stats.bytes_loaded += u.nbytes
        return load

    # ------------------------------------------------------------ hooks
    def _make_pre(self, u: _Unit):
        def pre(module, args):
            # the hooks also when no root forward runs and no other hooks are active: a
            # reentrant checkpoint's recompute in backward (HF's gradient checkpointing) calls
            # the blocks alone, and the parameters it saved were the placeholders again by its
            # inner backward: NaN gradients. (A non-reentrant recompute has its own hooks, which
            # keep what they save: pushing ours would change what it counts.)
            u.pushed.append(self._depth == 0 and outer_hooks() is None)
            if u.pushed[-1]:
                self._push()
            for s in u.slots:
                if s.installs == 0:
                    self._check_placeholder(s)
            # inside resident() every value is installed (and maybe updated since the tier's)
            tensors = [s.param.data for s in u.slots] if self._resident else self._load(u).tensors
            u.entered += 1
            for pos, (s, t) in enumerate(zip(u.slots, tensors)):
                if s.installs == 0:  # else an enclosing user of a shared parameter installed it
                    s.param.data = t
                    self._installed[t.untyped_storage().data_ptr()] = (u.index, pos)
                s.installs += 1
            self._live_bytes += u.nbytes
            self._stats.peak_resident_bytes = max(self._stats.peak_resident_bytes, self._live_bytes)
            if not self._resident:  # a prefetch now would read values from before the block
                self._prefetch(u.index + 1)

        return pre

    def _make_post(self, u: _Unit):
        def post(module, args, output):
            if u.pushed.pop():
                self._pop()
            if u.entered == 0:  # the pre-hook raised: it installed nothing
                return
            u.entered -= 1
            for s in u.slots:
                s.installs -= 1
                if s.installs == 0:
                    self._installed.pop(s.param.data.untyped_storage().data_ptr(), None)
                    s.param.data = s.placeholder
            self._live_bytes -= u.nbytes
            self._released(u.nbytes)

        return post

    def _enter(self, module, args) -> None:
        if self._depth == 0:
            self._release_last()
        self._push()

    def _push(self) -> None:
        """Saved tensors of the forward go through ``_pack`` (outermost module only)."""
        self._depth += 1
        if self._depth == 1:
            self._outer = outer_hooks()
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_ctx.__enter__()

    def _exit(self, module, args, output) -> None:
        self._pop()

    def _pop(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._saved_ctx is not None:
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = self._outer = None

    def _pack(self, t: torch.Tensor):
        hit = None
        # installed values and placeholders are dense; a sparse tensor has no storage to ask
        ours = self._installed or of_streamed(t)
        if ours and t.device == self.device and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            hit = self._installed.get(ptr)
            if hit is None and ptr in self._placeholder_of:
                raise _used_outside(self._placeholder_of[ptr])
        if hit is None:
            if self._outer is None:
                return t
            return pack_outer(self._outer, t)  # e.g. tt.offload's (_saved_hooks.py)
        unit, pos = hit
        base = self.units[unit].slots[pos].param.data
        rel = t.storage_offset() - base.storage_offset()
        return _Token(unit, pos, tuple(t.shape), tuple(t.stride()), rel)

    def _unpack(self, x):
        if isinstance(x, Outer):
            return x.unpack(x.packed)
        if not isinstance(x, _Token):
            return x
        if self._closed or self._resident:
            # a graph from before close(): the parameters hold their values again; inside
            # resident(): they are installed, maybe updated since the forward (as in torch)
            base = self.units[x.unit].slots[x.slot].param.data
            return base.as_strided(x.shape, x.stride, base.storage_offset() + x.offset)
        last = self._last
        if last is not None and last.unit == x.unit:
            tensors = self._ready(last)  # another saved view of the unit just loaded
        else:
            self._release_last()
            u = self.units[x.unit]
            last = self._last = self._load(u)
            self._live_bytes += u.nbytes
            tensors = last.tensors
            self._prefetch(x.unit - 1)  # backward runs the units in reverse
        base = tensors[x.slot]
        return base.as_strided(x.shape, x.stride, base.storage_offset() + x.offset)

    def _release_last(self) -> None:
        """Backward moved on from the unit it loaded last (its views are in queued kernels)."""
        if self._last is not None:
            nbytes = self.units[self._last.unit].nbytes
            self._live_bytes -= nbytes
            # the streams of the backward nodes that read it, not the next unit's
            self._released(nbytes, self._last.streams.values())
            self._last = None

    # ------------------------------------------------------------ resident views
    def _idle(self, p: nn.Parameter) -> bool:
        """Whether ``p`` is one of ours and holds its placeholder now (not inside a forward or
        a load)."""
        s = self._slot_of.get(id(p))
        return s is not None and s.installs == 0 and id(s) not in self._loading

    def _check_placeholder(self, s: _Slot) -> None:
        """A parameter between uses holds its placeholder; anything else came from outside."""
        data = s.param.data
        ph = s.placeholder
        if data.data_ptr() != ph.data_ptr() or data.dtype != ph.dtype or data.shape != ph.shape:
            raise ConfigError(
                f"parameter {s.name!r} was replaced while streamed (model.to(), .half(), "
                f"p.data = ..., HF resize_token_embeddings, which also copied the NaN "
                f"placeholder: now {data.dtype} {tuple(data.shape)} on {data.device}); the "
                f"streamer keeps its own values: call streamer.close() first (the model is "
                f"resident again), convert the model, then stream_parameters() again"
            )

    def _install_all(self, *, check: bool = True) -> list[int]:
        """Install every parameter; the storages installed now (saved as tokens in a forward)."""
        for s in self._slots:
            if check and s.installs == 0:
                self._check_placeholder(s)
        installed = []
        # every unit loaded before any is installed: a failed read leaves none installed
        loaded = [self._ready(self._start(u)) for u in self.units]
        for u, tensors in zip(self.units, loaded):
            for pos, (s, t) in enumerate(zip(u.slots, tensors)):
                if s.installs == 0:
                    s.param.data = t
                    installed.append(t.untyped_storage().data_ptr())
                    self._installed[installed[-1]] = (u.index, pos)
                s.installs += 1
        return installed

    def stats(self) -> StreamStats:
        """Counters of this streamer, live (they keep counting)."""
        return self._stats

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Install every parameter for the block (e.g. around ``optimizer.step()``), then store
        the possibly updated values back to their tier. The block runs in the caller's grad
        mode, as with a resident model: a forward there backpropagates, inside the block or
        after it (its parameters are reloaded then), and in-place edits of parameters need
        ``torch.no_grad()``. Nested blocks are the outer one (an inner exit stored the values
        and put the placeholders back, and the outer one then stored those NaN placeholders as
        the weights)."""
        self._check_open()
        if self._resident:
            yield
            return
        self._drop_prefetch()  # they hold values from before the update
        with torch.no_grad():
            installed = self._install_all()
        self._resident = True
        try:
            yield  # in the caller's grad mode: a forward here backpropagates (saved as tokens)
        finally:
            self._resident = False
            with torch.no_grad():
                for ptr in installed:
                    self._installed.pop(ptr, None)
                replaced = [s for s in self._slots if not _fits(s.param.data, s.placeholder)]
                for s in self._slots:
                    if s in replaced:  # its home keeps the value from before the block
                        s.param.data = s.placeholder
                    else:
                        self._store_back(s)
                    s.installs = 0
            if replaced:
                raise ConfigError(
                    f"parameter {replaced[0].name!r} was replaced inside resident() by one of "
                    f"another shape, dtype or device (HF resize_token_embeddings, .half(), "
                    f"p.data = ...); its new value was not kept: call streamer.close() first "
                    f"(the model is resident again), change the model, then stream_parameters() "
                    f"again"
                )

    def _store_back(self, s: _Slot) -> None:
        """Write the installed (possibly updated) value of ``s`` to its tier; placeholder back."""
        value = s.param.detach()
        if self._store is not None:
            new = self._store.write(value.cpu())
            self._store.free(s.home)
            s.home = new
        else:
            s.home.copy_(value)  # synchronous: the home is not read before it lands
        s.param.data = s.placeholder

    def _home_value(self, s: _Slot) -> torch.Tensor:
        """A host copy of the value on the tier (the caller may keep or edit it)."""
        if self._store is not None:
            return self._store.get(s.home).result()  # bounded: one read
        return s.home.clone()

    # ------------------------------------------------------------ state_dict / load_state_dict
    def _shared_value(self, state_dict: dict, s: _Slot) -> torch.Tensor:
        """The value of ``s`` for ``state_dict``: one tensor for all its keys (tied weights), as
        in the resident model's (weak references: the dict and its tensors are the caller's)."""
        ref, given = self._given
        if ref() is not state_dict:
            given = {}
            with contextlib.suppress(TypeError):  # a plain dict passed as ``destination=``
                self._given = (weakref.ref(state_dict), given)
        value = given[id(s)]() if id(s) in given else None
        if value is None:
            value = self._home_value(s)
            given[id(s)] = weakref.ref(value)
        return value

    def _make_state_dict(self, u: _Unit):
        slot_of = {id(s.param): s for s in u.slots}

        def hook(module, state_dict, prefix, local_metadata) -> None:
            for name, p in module._parameters.items():
                s = slot_of.get(id(p))
                key = prefix + name
                if s is None or key not in state_dict or isinstance(state_dict[key], nn.Parameter):
                    continue  # not ours, or keep_vars=True: the caller asked for the Parameter
                if state_dict[key].data_ptr() == s.placeholder.data_ptr():
                    state_dict[key] = self._shared_value(state_dict, s)
                elif self._idle(p):  # replaced while streamed: it would save what replaced it
                    self._check_placeholder(s)

        return hook

    def _make_load_pre(self, u: _Unit):
        def hook(module, state_dict, prefix, local_metadata, *args) -> None:
            if local_metadata.get("assign_to_params_buffers"):
                # torch would swap in the state dict's tensors as new, unstreamed Parameters
                raise ConfigError(
                    "load_state_dict(assign=True) on a streamed model would replace the "
                    "streamed parameters by resident ones; load without assign= (the values "
                    "are copied to the tier), or call streamer.close() first"
                )
            todo = [s for s in u.slots if s.installs == 0 and id(s) not in self._loading]
            for s in todo:
                self._check_placeholder(s)
            if not todo:
                return
            self._drop_prefetch()  # they hold the values from before the load
            for s, t in zip(u.slots, self._ready(self._start(u))):
                if s in todo:
                    s.param.data = t
                    self._loading.add(id(s))

        return hook

    def _make_load_post(self, u: _Unit):
        def hook(module, incompatible_keys) -> None:
            with torch.no_grad():
                for s in u.slots:
                    if id(s) in self._loading:
                        self._loading.discard(id(s))
                        self._store_back(s)

        return hook

    def _drop_prefetch(self) -> None:
        for index, load in list(self._pending.items()):
            if load.future is not None:
                load.future.exception()  # bounded: one read or copy; its error is not ours
            self._live_bytes -= self.units[index].nbytes
        self._pending.clear()
        self._release_last()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ParameterStreamer is closed; call stream_parameters() again")

    def close(self) -> None:
        """Make the model resident on ``device`` again and remove every hook and file."""
        if self._closed:
            return
        self._drop_prefetch()
        with torch.no_grad():
            for s in self._slots:
                s.installs = 0
            self._install_all(check=False)  # a converted model gets its streamed values back
        self._installed.clear()
        for s in self._slots:
            s.installs = 0
        self._unhook()
        self._closed = True
        self._finalizer()

    def _unhook(self) -> None:
        """The model's parameters and modules are no longer this streamer's."""
        for s in self._slots:
            with contextlib.suppress(AttributeError):
                delattr(s.param, STREAMED_ATTR)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _OPEN.discard(self)

    def __getstate__(self) -> dict:
        """Refused: ``copy.deepcopy(model)`` (an EMA, ``AveragedModel``) or pickling a streamed
        model reaches the streamer through its hooks, and failed on the loader's queue; the copy
        would hold the placeholders anyway."""
        raise ConfigError(
            "a streamed model cannot be copied or pickled (its parameters are placeholders, its "
            "hooks this streamer's): load model.state_dict() (the real weights) into a copy made "
            "before stream_parameters(), or close() the streamer first"
        )

    def __enter__(self) -> ParameterStreamer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _build_units(model: nn.Module) -> tuple[list[_Unit], list[_Slot]]:
    """One unit per module that owns parameters; one slot per unique Parameter (by identity)."""
    slots: dict[int, _Slot] = {}
    units: list[_Unit] = []
    for mname, m in model.named_modules():  # each module once, under its first name
        mine: list[_Slot] = []
        for pname, p in m._parameters.items():
            if p is None:
                continue
            slot = slots.get(id(p))
            if slot is None:
                name = f"{mname}.{pname}" if mname else pname
                slot = slots[id(p)] = _Slot(name, p, p.numel() * p.element_size())
            if slot not in mine:
                mine.append(slot)
        if mine:
            units.append(_Unit(len(units), m, mine, sum(s.nbytes for s in mine)))
    return units, list(slots.values())


def stream_parameters(
    model: nn.Module,
    budget: SizeLike | None = None,
    *,
    tier: ParamTier | str = ParamTier.HOST,
    device: torch.device | str | None = None,
    spill_dir: str | None = None,
) -> ParameterStreamer:
    """Keep ``model``'s parameters on host RAM (or disk) and bring each module's parameters to
    ``device`` only for its forward and backward, prefetching the next module within ``budget``
    bytes of installed parameters (default: twice the largest module). Outputs and gradients are
    identical to the resident model; parameters shared by several modules (tied weights) are
    stored once. Buffers move to ``device`` and stay there. Wrap optimizer steps in
    ``with streamer.resident():``; ``state_dict()`` (host copies) and ``load_state_dict()``
    work while streamed. A model is streamed by one streamer at a time
    (``ConfigError`` otherwise: close the first one).
    """
    return ParameterStreamer(model, budget=budget, tier=tier, device=device, spill_dir=spill_dir)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Buffers (attention masks, norm statistics, rotary tables) live on ``device`` for good, as
    ``model.to(device)`` would put them: they are small, and forward reads them next to the
    streamed parameters (H100 run 2: a CPU model streamed to ``"cuda"`` kept its causal mask on
    the CPU, and its forward failed). A buffer shared by several modules stays one tensor."""
    moved: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is None or b.device == device:
                continue
            if id(b) not in moved:
                moved[id(b)] = b.to(device)
            m._buffers[name] = moved[id(b)]


# open streamers, checked by one global optimizer step pre-hook (registered with the first one)
_OPEN: weakref.WeakSet[ParameterStreamer] = weakref.WeakSet()
_GUARD: list = []


def _guard_steps(streamer: ParameterStreamer) -> None:
    """A step on streamed parameters outside ``resident()`` failed in torch's kernel ("more than
    one element of the written-to tensor refers to a single memory location"), naming neither
    the streamer nor the fix; a child module replaced by one built from the placeholders (HF
    ``resize_token_embeddings``' new untied ``lm_head``) lost its weights silently. One hook of
    each for all streamers, never removed: a hook removed while another thread's ``step()``
    iterates torch's global hooks would break that step."""
    _OPEN.add(streamer)
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_before_step))
        _GUARD.append(register_module_module_registration_hook(_before_child_set))
        _GUARD.append(register_module_parameter_registration_hook(_before_param_set))


def _before_param_set(module: nn.Module, name: str, new: nn.Parameter | None) -> None:
    """Refuse re-assigning a streamed parameter, or assigning one to another place: the
    streamer installs each parameter for the modules that held it when streaming began, so the
    module given it would compute with its NaN placeholder (``tie_weights``, a tied head)."""
    old = module._parameters.get(name)
    if old is new or not _OPEN:
        return
    for p in (old, new):
        if p is not None and is_streamed(p):
            raise ConfigError(
                f"{type(module).__name__}.{name} = ...: the parameter replaced or assigned is "
                f"streamed by stream_parameters(), which installs it only for the modules that "
                f"held it when streaming began (elsewhere its value is a NaN placeholder); call "
                f"streamer.close() first (the model is resident again), change the model (e.g. "
                f"tie the weights), then stream_parameters() again"
            )


def _before_child_set(parent: nn.Module, name: str, new: nn.Module | None) -> None:
    """Refuse replacing a child that holds streamed parameters by one that does not hold them
    (a wrapper that keeps the child, as PEFT's, is fine)."""
    old = parent._modules.get(name)
    if old is None or old is new or not _OPEN:
        return
    kept = set() if new is None else {id(p) for p in new.parameters()}
    for p in old.parameters():
        if id(p) not in kept and is_streamed(p):
            slot = getattr(p, STREAMED_ATTR)()._slot_of[id(p)]
            raise ConfigError(
                f"child module {name!r} holds parameter {slot.name!r} streamed by "
                f"stream_parameters(); replacing it (HF resize_token_embeddings, "
                f"set_output_embeddings) drops that parameter, and a copy made from it now "
                f"copies its NaN placeholder: call streamer.close() first (the model is "
                f"resident again), change the model, then stream_parameters() again"
            )


def _before_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
    for streamer in list(_OPEN):
        if streamer._resident:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and streamer._idle(p):
                    raise ConfigError(
                        f"{type(opt).__name__}.step() on parameters held by stream_parameters() "
                        f"(their values are NaN placeholders between uses); call it inside "
                        f"`with streamer.resident(): opt.step()`"
                    )


def _fits(value: torch.Tensor, placeholder: torch.Tensor) -> bool:
    """Whether ``value`` can go to the home ``placeholder`` stands for (an update, not a
    conversion)."""
    return (value.shape, value.dtype, value.device) == (
        placeholder.shape,
        placeholder.dtype,
        placeholder.device,
    )


def _used_outside(s: _Slot) -> ConfigError:
    """A forward saved a placeholder for backward: code outside the module that owns ``s`` (a
    parent reading its child's weight) computed with its NaN values."""
    return ConfigError(
        f"parameter {s.name!r} was used outside the forward of the module that owns it (a "
        f"parent reading a child's weight, e.g. tied weights F.linear(x, self.embed.weight)): "
        f"there it holds stream_parameters()'s NaN placeholder. Use it through a module that "
        f"owns it (in the model, before streaming it, tie by sharing the Parameter: self.head "
        f"= nn.Linear(...); self.head.weight = self.embed.weight), or run the forward and "
        f"backward inside `with streamer.resident():` (every parameter installed)"
    )


def _refuse_streamed(slots: list[_Slot]) -> None:
    for s in slots:
        if is_streamed(s.param):
            raise ConfigError(
                f"parameter {s.name!r} is already streamed by another ParameterStreamer "
                f"(its values are that streamer's NaN placeholders); call close() on it "
                f"first (that makes the model resident again), or keep using it"
            )


def _target_device(device: torch.device | str | None, first: nn.Parameter) -> torch.device:
    # a tensor's .device is always "cuda:<i>" / "cpu": compare against the normalised form
    if device is not None:
        return check_device(device)
    return normalize_device(first.device)


def _check_budget(budget: SizeLike | None, largest: int) -> int:
    """Device bytes for installed and prefetched units: at least the largest unit (default 2x)."""
    out = 2 * largest if budget is None else parse_size(budget, name="budget", allow_zero=False)
    if out < largest:
        raise BudgetError(
            f"parameter budget {format_size(out)} cannot hold the largest module's "
            f"parameters ({format_size(largest)}); raise budget to at least that, or split "
            f"the module",
            budget=out,
            minimum=largest,
        )
    return out
