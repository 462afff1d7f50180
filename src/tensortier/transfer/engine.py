"""Asynchronous moves between device, host, disk and remote memory, returned as futures.

* device -> host: a side stream of the *source's* device waits for that device's current stream
  (``wait_stream``, no host sync), copies into a pinned pool block and records an event. A
  completion thread waits on the events in order, then drops the source and resolves the future,
  so the source stays alive exactly until its copy has finished (no ``record_stream``, no
  device-wide sync).
* host -> device: the destination is allocated from the target device's second side stream
  (torchtune's unpack), so the copy waits for no compute already queued (a caller's own host
  tensor: after the caller's current stream, where its producer may be); ``result()`` makes the
  caller's stream wait on the copy's event and ``record_stream``-s the destination on it
  (device-side). The engine keeps the source block and the destination until the copy is done.
* host <-> a store (``to_store``/``from_store``: any :class:`~tensortier.tiers.base.Store`, the
  disk tier's files or other machines' RAM through
  :class:`~tensortier.tiers.remote.RemoteStore`): the store's I/O threads and futures; device
  tensors are staged through a host block, and read back into one before their H2D copy.
* codecs (``codec=``): raw bytes cross PCIe asynchronously and are encoded / decoded on the
  engine's host threads, so neither the caller nor the device ever waits for a data-dependent size.

On a CPU-only machine "device" is this process's memory: the same calls copy with ``torch`` on a
worker thread (``copy_`` releases the GIL), and disk reads land directly in the returned tensor.

A byte throttle bounds the data in flight so a burst of requests cannot pin unbounded memory. Each
public call takes its bytes once, on the caller's thread, and gives them back exactly once, when
its last stage finishes or fails (including failures raised synchronously). Threads that give bytes
back (the completion thread, copy workers, disk I/O callbacks) never wait for bytes: work chained
from them may overshoot the bound instead of deadlocking.

Lifetime (``LIFETIME.md``): no thread holds the engine. The completion thread runs a function of
its queue and a small state object; if the engine is dropped without ``close()``, its
``_lifetime.Finalizer`` stops the thread and the copy workers on the reaper thread.

CUDA streams, events and the copy sequence itself are ``streams.py``'s (:class:`SideStreams`, one
``d2h`` and one ``h2d`` stream per device for this engine).

This module schedules copies; it never decides *what* to move (that is the clients' and planner's job).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from tensortier._device import check_device
from tensortier._lifetime import Finalizer
from tensortier._renamed import renamed
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, check_int, parse_size
from tensortier.errors import ClosedError, ConfigError
from tensortier.tiers.base import Handle, Store, StoreBase, failed, gather
from tensortier.tiers.codecs import Codec, as_codec
from tensortier.tiers.disk import DiskStore, as_bytes, check_storable
from tensortier.tiers.host import HostBlock, HostPool, aligned_empty, default_budget
from tensortier.transfer.streams import SideStreams, consume

if TYPE_CHECKING:  # Ray is imported only when a RemoteStore is made
    from tensortier.tiers.remote import RemoteStore

T = TypeVar("T")
DIRECTIONS = ("d2h", "h2d", "h2disk", "disk2h", "h2remote", "remote2h")
log = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 30.0  # bound on joining the completion thread at close/GC


@dataclass
class TransferStats:
    bytes: dict[str, int]
    count: dict[str, int]
    wait_seconds: float = 0.0  # callers blocked in result() on unfinished transfers
    throttle_seconds: float = 0.0  # submitters blocked because too many bytes were in flight
    peak_inflight_bytes: int = 0

    @classmethod
    def empty(cls) -> TransferStats:
        return cls(bytes=dict.fromkeys(DIRECTIONS, 0), count=dict.fromkeys(DIRECTIONS, 0))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class HostTensor:
    """A tensor held in a :class:`HostBlock`; ``free()`` hands the block back to its pool.

    ``tensor`` keeps the block alive (``HostBlock.hold``): it stays valid after this object is
    dropped, until ``free()`` is called explicitly."""

    block: HostBlock
    dtype: torch.dtype
    shape: tuple[int, ...]
    _tensor: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self.block.hold().view(self.dtype).reshape(self.shape)
        return self._tensor

    @property
    def nbytes(self) -> int:
        return self.block.nbytes

    def free(self) -> None:
        self.block.free()


@dataclass
class Encoded:
    """A tensor stored through a codec: its payloads on the host (``HostTensor``) or in a store
    (its handles), plus what the codec needs to decode them. ``dtype``/``shape``/``nbytes``
    describe the original tensor."""

    codec: Codec
    meta: dict
    parts: list  # list[HostTensor] | list[Handle]
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def free(self, store: Store | None = None) -> None:
        """Give the payloads back: host blocks to their pool, stored ones to ``store``."""
        for part in self.parts:
            if isinstance(part, HostTensor):
                if not part.block.freed:
                    part.free()
            elif store is None:
                raise ValueError(
                    "these payloads are in a store: pass it, free(store=...) (e.g. the DiskStore)"
                )
            elif part in store:
                store.free(part)


class Transfer(Future, Generic[T]):
    """A future that accounts the time its caller waited, and can finish on the caller's thread."""

    def __init__(self, stats: TransferStats, lock: threading.Lock):
        super().__init__()
        self._stats, self._stats_lock = stats, lock
        self._on_result: Callable[[Any], Any] | None = None
        self.set_running_or_notify_cancel()

    def result(self, timeout: float | None = None) -> T:
        if not self.done():
            _refuse_in_callback("Transfer.result() of an unfinished transfer")
            t0 = time.perf_counter()
            value = super().result(timeout)
            with self._stats_lock:
                self._stats.wait_seconds += time.perf_counter() - t0
        else:
            value = super().result(timeout)
        return self._on_result(value) if self._on_result is not None else value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            _refuse_in_callback("Transfer.exception() of an unfinished transfer")
        return super().exception(timeout)


class _HostCopy(threading.Event):
    """Completion of a host-side job that reads or writes a pool block (a copy worker's copy, a
    decode, a disk write): the CPU counterpart of a CUDA event for ``HostBlock.record``. The job
    sets it on every path (``_on_cpu``), so a wait on it ends."""

    def query(self) -> bool:
        return self.is_set()

    def synchronize(self) -> None:
        self.wait()


def _record_host(blocks) -> _HostCopy:
    done = _HostCopy()
    for block in blocks:
        block.record(done)
    return done


def _check_live(where: str, parts) -> None:
    for part in parts:
        if isinstance(part, HostTensor) and part.block.freed:
            raise ValueError(
                f"TransferEngine.{where}: this HostTensor was already freed; its memory may "
                "belong to another tensor now. Free it only after its last transfer was issued"
            )


# ------------------------------------------------------------------------- the byte throttle
_local = threading.local()


def _mark_releasing() -> None:
    """For threads that give bytes back: their acquires never wait (see the module docstring)."""
    _local.releasing = 1


@contextlib.contextmanager
def _releasing():
    depth = getattr(_local, "releasing", 0)
    _local.releasing = depth + 1
    try:
        yield
    finally:
        _local.releasing = depth


class _Ticket:
    """Bytes one public call took from the throttle; ``release`` gives them back, once."""

    __slots__ = ("nbytes", "_throttle")

    def __init__(self, throttle: _Throttle, nbytes: int):
        self.nbytes, self._throttle = nbytes, throttle

    def release(self) -> None:
        self._throttle.release(self)


class _Throttle:
    """Blocks submitters while more than ``limit`` bytes are in flight (one oversize request passes).

    A wait here ends when in-flight transfers finish or fail; every path of every transfer releases
    its ticket, and the threads that release never wait here, so the wait cannot hang while the
    device and the disk make progress.
    """

    def __init__(self, limit: int, stats: TransferStats):
        self.limit, self.inflight, self.stats = limit, 0, stats
        self.closing = False
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> _Ticket:
        releasing = getattr(_local, "releasing", 0)
        with self._cond:
            self._check_closing(releasing)
            if self.inflight and self.inflight + nbytes > self.limit and not releasing:
                t0 = time.perf_counter()
                while self.inflight and self.inflight + nbytes > self.limit and not self.closing:
                    self._cond.wait()
                self.stats.throttle_seconds += time.perf_counter() - t0
                self._check_closing(releasing)
            self.inflight += nbytes
            self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.inflight)
        return _Ticket(self, nbytes)

    def _check_closing(self, releasing: int) -> None:
        """Once ``close()`` began, only work chained from transfers in flight (on releasing
        threads, whose bytes ``close`` is waiting for) is taken: a new call would start after
        ``close``'s wait and find the engine's threads gone (a CUDA copy whose future never
        resolves)."""
        if self.closing and not releasing:
            raise ClosedError("TransferEngine is closed (close() was called); make a new one")

    def refuse_new(self) -> None:
        """``close()`` began: new calls raise ClosedError, callers waiting for bytes too."""
        with self._cond:
            self.closing = True
            self._cond.notify_all()

    def release(self, ticket: _Ticket) -> None:
        with self._cond:
            nbytes, ticket.nbytes = ticket.nbytes, 0
            if nbytes:
                self.inflight -= nbytes
                self._cond.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.inflight == 0, timeout)


# ------------------------------------------------------------------------- the completion thread
class _Pending:
    """A device copy in flight: ``event`` completes when it is done; ``keep`` is what must live
    until then (source, destination); ``on_done``/``on_fail`` finish the transfer."""

    __slots__ = ("event", "keep", "on_done", "on_fail")

    def __init__(
        self, event, keep, on_done: Callable[[], None], on_fail: Callable[[BaseException], None]
    ):
        self.event, self.keep, self.on_done, self.on_fail = event, keep, on_done, on_fail

    def wait(self) -> None:
        # A blocking event: the thread sleeps, GIL released. No timeout: it returns when the copy
        # (queued behind the producer's kernels) has run, or raises on a device error.
        self.event.synchronize()

    def complete(self) -> None:
        self.keep = self.event = None  # the copy is done: the source may go now, not later
        on_done, self.on_done, self.on_fail = self.on_done, None, None
        on_done()

    def fail(self, error: BaseException) -> None:
        self.keep = self.event = None
        on_fail, self.on_done, self.on_fail = self.on_fail, None, None
        if on_fail is not None:
            on_fail(error)


class _Completer:
    """Waits for device events in submission order on one thread, started at first use.

    The thread runs :func:`_complete_events` on this object, which never refers to the engine.
    After a device error every pending and later item fails with it, and ``error`` is set so the
    engine's next call raises it.
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stopped = False
        self._lock = threading.Lock()

    def put(self, item: _Pending) -> None:
        with self._lock:  # never after stop's None: nobody would wait for the item
            if not self.stopped:
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=_complete_events, args=(self,), name="tt-cuda-events", daemon=True
                    )
                    self.thread.start()
                self.queue.put(item)
                return
        item.fail(ClosedError("TransferEngine is closed; a copy issued now would never finish"))

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        with self._lock:
            self.stopped = True
            thread = self.thread
            if thread is not None:
                self.queue.put(None)
        if thread is None:
            return
        if thread is not threading.current_thread():
            thread.join(timeout)  # bounded: a wedged device must not hang close() or the reaper
            if thread.is_alive():
                log.warning(
                    "tensortier: the transfer completion thread did not stop in %ss", timeout
                )


def _complete_events(completer: _Completer) -> None:
    _mark_releasing()
    q = completer.queue
    while True:
        item = q.get()  # ends: stop() (close() or the engine's finalizer) posts None
        if item is None:
            return
        try:
            if completer.error is None:
                item.wait()
        except BaseException as exc:  # a device error: fail this and every later transfer
            completer.error = exc
            log.error("tensortier: a device copy failed; failing pending transfers", exc_info=True)
        try:
            if completer.error is None:
                item.complete()
            else:
                item.fail(completer.error)
        except BaseException:  # a bug in a continuation must not stop the thread
            log.exception("tensortier: a transfer continuation failed")
        del item  # nothing of a finished transfer stays referenced while the thread waits


def _fail_then_release(fut: Transfer, ticket: _Ticket, error: BaseException) -> None:
    """Fail ``fut`` (unless done), then give the bytes back, even if a callback raises."""
    try:
        with _releasing():
            if not fut.done():
                fut.set_exception(error)
    finally:
        ticket.release()


def _refuse_in_callback(what: str) -> None:
    """A wait on an engine thread (a transfer's callback, a copy worker, the completion thread)
    may wait for work queued behind itself on that very thread: the executor self-deadlock
    (stop 36). Refused even where another thread happens to be free: whether it deadlocks must
    not depend on ``io_threads`` or the device (the completion thread is always one)."""
    if getattr(_local, "releasing", 0):
        raise RuntimeError(
            f"{what} called from a transfer's callback (on an engine thread) would wait for work "
            "queued behind that callback, which then never runs; chain the next step with "
            "add_done_callback, or wait from your own thread"
        )


def _shutdown(completer: _Completer, executor: ThreadPoolExecutor) -> None:
    """The engine's cleanup: ``close()``, or the reaper once the engine was collected."""
    completer.stop()
    executor.shutdown(wait=True)  # idle by now: nothing pending refers to a collected engine


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_tensor(where: str, value: object, *also: type) -> None:
    if not isinstance(value, (torch.Tensor, *also)):
        kinds = " or ".join(["a torch.Tensor", *(t.__name__ for t in also)])
        raise TypeError(
            f"TransferEngine.{where}: expected {kinds}, got {type(value).__name__}; convert it "
            f"first, e.g. torch.as_tensor(value)"
        )
    if isinstance(value, torch.Tensor):  # before any copy: torch's own errors do not say why
        check_storable(value)
        if value.is_meta:
            raise ValueError(
                f"TransferEngine.{where}: a meta tensor holds no data to move; materialize it "
                f"first, e.g. torch.empty_like(t, device='cpu')"
            )


def _check_tiers(host: object, disk: object, remote: object) -> None:
    """At construction, not at the first transfer: ``host="8GiB"`` (the pool's budget where the
    pool belongs) used to fail later as "'str' object has no attribute 'alloc'"."""
    if host is not None and not isinstance(host, HostPool):
        raise ConfigError(
            f"TransferEngine(host={host!r}): pass a HostPool, e.g. host=tt.HostPool('8GiB'), "
            f"or None for a pool of the default size that the engine owns"
        )
    for name, store, example in (
        ("disk", disk, "disk=tt.DiskStore('/mnt/nvme/tt')"),
        ("remote", remote, "remote=tt.tiers.RemoteStore(budget='8GiB') (after ray.init)"),
    ):
        if store is not None and not isinstance(store, (StoreBase, Store)):
            raise ConfigError(
                f"TransferEngine({name}={store!r}): pass a Store, e.g. {example}, or None"
            )


class TransferEngine:
    """Moves tensors between tiers asynchronously.

    >>> engine = TransferEngine(host=HostPool("8GiB"), disk=DiskStore("/mnt/nvme/tt"))
    >>> h = engine.to_host(activation)          # Transfer[HostTensor]
    >>> d = engine.to_store(activation, "disk")   # Transfer[DiskHandle]
    >>> x = engine.from_store(d.result(), "disk", to="device").result()
    >>> r = engine.to_store(activation, pool)     # any Store, e.g. a RemoteStore
    >>> x = engine.from_store(r.result(), pool, to="device").result()

    ``device`` is the default target of ``to_device``/``from_store(to="device")``; each call may
    name another with ``device=``. Copies of a tensor on ``cuda:k`` run on ``cuda:k``'s streams.
    ``host=None`` makes a pool of :func:`~tensortier.tiers.host.default_budget` bytes that the
    engine owns and closes. ``inflight_budget`` bounds the bytes in transfers not yet finished
    (their sources are still held); ``io_threads`` is the number of host copy/codec threads.
    """

    @renamed(max_inflight="inflight_budget", threads="io_threads")
    def __init__(
        self,
        *,
        host: HostPool | None = None,
        disk: DiskStore | None = None,
        remote: RemoteStore | None = None,
        inflight_budget: SizeLike = "512MiB",
        device: torch.device | str | None = None,
        io_threads: int = 2,
    ):
        io_threads = check_int(
            io_threads,
            f"io_threads must be an int >= 1, got {io_threads!r}; the default is 2",
            minimum=1,
        )
        limit = parse_size(inflight_budget, name="inflight_budget", allow_zero=False)
        _check_tiers(host, disk, remote)
        self.device = check_device(device)
        self._owns_host = host is None
        self.host = host if host is not None else HostPool(default_budget())
        self.disk = disk
        self.remote = remote  # not owned: the caller closes it
        self.stats = TransferStats.empty()
        self._lock = threading.Lock()
        self._throttle = _Throttle(limit, self.stats)
        self._closed = False
        self._streams = SideStreams()  # per device: a d2h and an h2d stream, made on first use
        self._completer = _Completer()
        self._cpu = ThreadPoolExecutor(
            io_threads, thread_name_prefix="tt-copy", initializer=_mark_releasing
        )
        self._finalizer = Finalizer(self, _shutdown, self._completer, self._cpu)
        register_stats("transfer_engine", self)  # tt.stats() lists it while it is open

    # ---------------------------------------------------------------- public API
    def to_host(
        self, tensor: torch.Tensor, *, codec: Codec | str | None = None
    ) -> Transfer[HostTensor] | Transfer[Encoded]:
        """Copy a device (or CPU) tensor into a host pool block.

        With ``codec`` (a codec or its name, e.g. ``"zstd"``): the result is an :class:`Encoded`
        whose payloads sit in pool blocks; the raw bytes are copied asynchronously and encoded on
        the engine's host threads.
        """
        self._check_open()
        _check_tensor("to_host(tensor)", tensor)
        codec = as_codec(codec)
        src = tensor.detach()
        nbytes = _nbytes(src)
        fut = self._new()
        ticket = self._throttle.acquire(nbytes)
        try:
            if codec is not None:

                def stored(payloads: list[torch.Tensor], meta: dict) -> None:
                    parts = self._payloads_to_host(payloads)
                    self._count("d2h", nbytes)
                    self._resolve(
                        fut,
                        ticket,
                        Encoded(codec, meta, parts, src.dtype, tuple(src.shape), nbytes),
                    )

                self._encode(src, codec, stored, self._failer(fut, ticket))
            else:
                block = self._alloc(nbytes)
                out = HostTensor(block, src.dtype, tuple(src.shape))

                def copied() -> None:
                    self._count("d2h", nbytes)
                    self._resolve(fut, ticket, out)

                try:
                    self._d2h(src, out, copied, self._failer(fut, ticket, block))
                except BaseException:
                    block.free()
                    raise
        except BaseException:
            ticket.release()
            raise
        return fut

    def to_device(
        self,
        host: HostTensor | Encoded | torch.Tensor,
        *,
        free: bool = False,
        device: torch.device | str | None = None,
    ) -> Transfer[torch.Tensor]:
        """Copy a host tensor (or decode an :class:`Encoded` one) to ``device`` (default: the
        engine's). ``free=True`` returns the host block(s) once copied. ``device="cpu"`` gives a
        CPU tensor, also in an engine whose default device is a GPU."""
        self._check_open()
        _check_tensor("to_device(host)", host, HostTensor, Encoded)
        target = self._target(device)
        if isinstance(host, Encoded):
            if not all(isinstance(p, HostTensor) for p in host.parts):
                raise ValueError(
                    "these payloads are in a store: use from_store(encoded, store, to='device')"
                )
            _check_live("to_device(encoded)", host.parts)
            nbytes = host.nbytes
        else:
            _check_live("to_device(host)", [host])
            src = host.tensor if isinstance(host, HostTensor) else host.detach()
            nbytes = _nbytes(src)
        fut = self._new()
        ticket = self._throttle.acquire(nbytes)
        try:
            if isinstance(host, Encoded):
                release = host.free if free else None
                self._decode_to(
                    fut,
                    ticket,
                    host,
                    [p.tensor for p in host.parts],
                    "device",
                    target,
                    release,
                )
            else:
                block = host.block if isinstance(host, HostTensor) else None
                release = host.free if (free and block is not None) else None
                # a caller's own tensor may still be written by work queued on its stream
                after = self._caller_stream(target) if block is None else None
                self._h2d_future(fut, ticket, src, target, after, release, block)
        except BaseException:
            ticket.release()
            raise
        return fut

    def to_store(
        self,
        tensor: torch.Tensor | HostTensor,
        store: Store | str,
        *,
        free: bool = False,
        codec: Codec | str | None = None,
    ) -> Transfer[Handle] | Transfer[Encoded]:
        """Write a device, CPU or host-pool tensor to ``store``: a :class:`Store` (a
        :class:`DiskStore`, a :class:`~tensortier.tiers.remote.RemoteStore`), or ``"disk"`` /
        ``"remote"`` for the one this engine was made with.

        Device tensors are staged through a host block, which is returned to the pool once
        written. ``free=True`` frees a given :class:`HostTensor` once written (or once the write
        failed). With ``codec`` (a codec or its name) the result is an :class:`Encoded` whose
        payloads are handles of ``store``. A full store raises ``TierFullError`` here for CPU and host tensors, and fails
        the future for device tensors (known only once staged).
        """
        self._check_open()
        _check_tensor("to_store(tensor)", tensor, HostTensor)
        codec = as_codec(codec)
        store = self._store(store)
        is_host = isinstance(tensor, HostTensor)
        _check_live("to_store(tensor)", [tensor])
        src = tensor.tensor if is_host else tensor.detach()
        nbytes = tensor.nbytes if is_host else _nbytes(src)
        fut = self._new()
        ticket = self._throttle.acquire(nbytes)
        try:
            after = tensor.free if (is_host and free) else None
            if codec is not None:
                block = tensor.block if is_host else None
                self._encode_to_store(fut, ticket, store, src, codec, after, block, nbytes)
            elif src.device.type == "cuda":
                self._staged_to_store(fut, ticket, store, src, nbytes)
            else:  # on the caller's thread: a full tier raises TierFullError here, at once
                inner = store.put(src)  # a pool block is page-aligned: O_DIRECT writes from it
                if is_host:  # the write reads the block until it is done
                    written_out = _record_host([tensor.block])
                    inner.add_done_callback(lambda _: written_out.set())

                def written(handles: list) -> None:
                    if after is not None:
                        after()
                    self._resolve(fut, ticket, handles[0])

                fail = self._failer(fut, ticket, after)
                self._collect(gather([inner]), written, fail, f"h2{store.tier}")
        except BaseException:
            ticket.release()
            if is_host and free and not tensor.block.freed:
                tensor.free()
            raise
        return fut

    def to_disk(self, tensor: torch.Tensor | HostTensor, **kwargs) -> Transfer:
        """``to_store(tensor, "disk", ...)``: the engine's own disk tier."""
        return self.to_store(tensor, "disk", **kwargs)

    def from_disk(self, handle: Handle | Encoded, **kwargs) -> Transfer:
        """``from_store(handle, "disk", ...)``: the engine's own disk tier."""
        return self.from_store(handle, "disk", **kwargs)

    def from_store(
        self,
        handle: Handle | Encoded,
        store: Store | str,
        *,
        to: str = "device",
        free: bool = False,
        device: torch.device | str | None = None,
    ) -> Transfer[torch.Tensor] | Transfer[HostTensor]:
        """Read a tensor back from ``store`` (as in :meth:`to_store`), to a host pool block
        (``to="host"``) or to ``device`` (default: the engine's; ``device="cpu"`` reads straight
        into process memory). An :class:`Encoded` with stored payloads is decoded on the engine's
        host threads. ``free=True`` frees the stored copy once read. A stale handle raises
        ``KeyError`` here; a lost memory node fails the future with ``NodeLostError`` naming it."""
        self._check_open()
        if to not in ("host", "device"):
            raise ConfigError(f"to must be 'host' or 'device', got {to!r}")
        if not isinstance(handle, Encoded) and not isinstance(getattr(handle, "nbytes", None), int):
            raise TypeError(
                f"TransferEngine.from_store(handle): expected the handle (or Encoded) that "
                f"to_store returned, got {type(handle).__name__} {handle!r:.60}"
            )
        store = self._store(store)
        target = self._target(device) if to == "device" else torch.device("cpu")
        fut = self._new()
        ticket = self._throttle.acquire(handle.nbytes)
        try:
            if isinstance(handle, Encoded):
                self._from_store_encoded(fut, ticket, store, handle, to, target, free)
            elif to == "device" and target.type == "cpu":
                self._read_to_cpu(fut, ticket, store, handle, free)
            else:
                self._read_to_block(fut, ticket, store, handle, to, target, free)
        except BaseException:
            ticket.release()
            raise
        return fut

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every transfer submitted so far has finished (device->host and host->device
        copies included). Raises ``TimeoutError`` after ``timeout`` seconds (None: no bound; every
        transfer gives its bytes back when it finishes or fails, so this returns while the device
        and the disk make progress)."""
        _refuse_in_callback("TransferEngine.synchronize()")
        if not self._throttle.wait_idle(timeout):
            raise TimeoutError(
                f"{self._throttle.inflight} bytes still in flight after {timeout}s; the device or "
                "the disk is not making progress"
            )

    def close(self) -> None:
        """Wait for transfers in flight, then stop the engine's threads (and its own host pool)."""
        if self._closed:
            return
        _refuse_in_callback("TransferEngine.close()")
        self._throttle.refuse_new()  # calls made from now on raise; those in flight finish
        self.synchronize()
        self._closed = True
        self._finalizer()
        if self._owns_host:
            self.host.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- plumbing
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("TransferEngine is closed")
        if self._completer.error is not None:
            raise self._completer.error  # a device copy failed earlier: say so, never hang

    def _need_remote(self) -> RemoteStore:
        if self.remote is None:
            raise ValueError(
                "this TransferEngine has no remote tier; pass remote=RemoteStore(budget) "
                "(after ray.init)"
            )
        return self.remote

    def _need_disk(self) -> DiskStore:
        if self.disk is None:
            raise ValueError("this TransferEngine has no disk tier; pass disk=DiskStore(spill_dir)")
        return self.disk

    def _store(self, store: Store | str) -> Store:
        """``store``, or the engine's own for ``"disk"``/``"remote"``."""
        if store == "disk":
            return self._need_disk()
        if store == "remote":
            return self._need_remote()
        if isinstance(store, (StoreBase, Store)):  # the nominal check first: it is fast
            return store
        raise TypeError(
            f"TransferEngine: store={store!r} is not a Store; pass a DiskStore or RemoteStore, "
            f"or 'disk'/'remote' for the engine's own"
        )

    def _target(self, device: torch.device | str | None) -> torch.device:
        return self.device if device is None else check_device(device)

    @staticmethod
    def _caller_stream(target: torch.device):
        """The caller's current stream of ``target``, captured now: where the producer of a
        caller's own host tensor (a ``non_blocking`` D2H into pinned memory) may still be queued."""
        return torch.cuda.current_stream(target) if target.type == "cuda" else None

    def _alloc(self, nbytes: int) -> HostBlock:
        """A pool block; threads that complete transfers never wait for busy blocks (they could
        be waiting for their own jobs), they get ``TierFullError`` like a full pool."""
        return self.host.alloc(nbytes, wait=not getattr(_local, "releasing", 0))

    def _new(self) -> Transfer:
        return Transfer(self.stats, self._lock)

    def _count(self, direction: str, nbytes: int) -> None:
        with self._lock:  # a store of another tier than disk/remote adds its own directions
            self.stats.bytes[direction] = self.stats.bytes.get(direction, 0) + nbytes
            self.stats.count[direction] = self.stats.count.get(direction, 0) + 1

    @staticmethod
    def _resolve(fut: Transfer, ticket: _Ticket, value, on_result=None) -> None:
        """Finish a transfer: its future first (so ``synchronize`` implies resolved), then bytes."""
        if on_result is not None:
            fut._on_result = on_result
        try:
            with _releasing():
                if not fut.done():
                    fut.set_result(value)  # runs the callbacks: a BaseException escapes Future's
        finally:
            ticket.release()

    @staticmethod
    def _failer(fut: Transfer, ticket: _Ticket, undo=None) -> Callable[[BaseException], None]:
        """What a stage calls on failure: undo (free a block), fail the future, give bytes back."""

        def fail(error: BaseException) -> None:
            if fut.done():  # failed after it was handed out: what it holds is the caller's now
                ticket.release()
                return
            try:
                if isinstance(undo, HostBlock):
                    if not undo.freed:
                        undo.free()
                elif undo is not None:
                    undo()
            finally:
                _fail_then_release(fut, ticket, error)

        return fail

    def _on_cpu(
        self,
        fn: Callable[[], None],
        fail: Callable[[BaseException], None],
        done: _HostCopy | None = None,
    ) -> None:
        """Run ``fn`` on a copy worker; any exception goes to ``fail``. ``done`` (recorded on the
        blocks ``fn`` uses) is set on every path: by ``fn`` as soon as it is done with them, else
        when it returns or raises, or here if the job cannot be submitted."""

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                if done is not None:
                    done.set()
                fail(exc)
            finally:
                if done is not None:
                    done.set()

        try:
            self._cpu.submit(run)
        except BaseException:
            if done is not None:
                done.set()
            raise

    # ---------------------------------------------------------------- stages
    def _d2h(self, src: torch.Tensor, out: HostTensor, then: Callable[[], None], fail) -> None:
        """Copy ``src`` into ``out``; ``then()`` once done (on a releasing thread)."""
        if src.device.type != "cuda":
            done = _record_host([out.block])

            def copy() -> None:
                out.tensor.copy_(src)
                done.set()
                then()

            self._on_cpu(copy, fail, done)
            return
        # after the producer (the device's current stream); src is kept, not record_stream-ed
        event = self._streams.copy([(out.tensor, src)], src.device, direction="d2h", blocking=True)
        out.block.record(event)  # the pool lends the block again only after the copy
        self._completer.put(_Pending(event, src, then, fail))  # keeps src until the copy is done

    def _h2d(
        self, src: torch.Tensor, target: torch.device, after, issued, then, fail, block=None
    ) -> None:
        """Copy host ``src`` (the memory of pool ``block``, if any) to ``target``, after the work
        queued on stream ``after`` (None: the source is complete on the host).
        ``issued(dst, on_result)`` as soon as ``dst`` can be handed out (CUDA: at once,
        ``on_result`` orders the reader after the copy); ``then()`` once the copy is complete and
        ``src`` may be reused. The copy's completion is recorded on ``block``, so freeing the block
        before then never lets the pool lend the memory under the copy."""
        if target.type != "cuda":
            done = _record_host([block] if block is not None else [])

            def copy() -> None:
                out = torch.empty(src.shape, dtype=src.dtype)
                out.copy_(src)
                done.set()
                issued(out, None)
                then()

            self._on_cpu(copy, fail, done)
            return
        # dst is the h2d side stream's memory (torchtune's unpack): no wait for the compute
        # queued so far, which a destination from the caller's pool would need
        (dst,), event = self._streams.copy_new([src], target, after=after, blocking=True)
        if block is not None:
            block.record(event)

        def on_result(value: torch.Tensor) -> torch.Tensor:
            # the reader's stream waits for the copy (device-side, no host sync) and is recorded
            # on dst: freed, its memory is reused only after the reader's work queued so far
            consume(event, torch.cuda.current_stream(target), [value])
            return value

        issued(dst, on_result)
        # src and dst live until the copy ran (a pool block, a caller's tensor: not reused under it)
        self._completer.put(_Pending(event, (src, dst), then, fail))

    def _h2d_future(self, fut, ticket, src, target, after, release, block) -> None:
        """``to_device`` of a raw host tensor: resolve ``fut`` when issued, bytes back when done."""

        def then() -> None:
            try:
                self._count("h2d", _nbytes(src))
                if release is not None:
                    release()  # raises if the caller freed it too: the bytes still go back
            finally:
                ticket.release()

        def fail(error: BaseException) -> None:
            # after a device error the host block may still be read by a dead copy: not reused
            _fail_then_release(fut, ticket, error)

        issue = lambda dst, on: self._issue(fut, dst, on)  # noqa: E731
        self._h2d(src, target, after, issue, then, fail, block)

    @staticmethod
    def _issue(fut: Transfer, dst: torch.Tensor, on_result) -> None:
        if on_result is not None:
            fut._on_result = on_result
        with _releasing():
            if not fut.done():
                fut.set_result(dst)

    def _encode(self, src: torch.Tensor, codec: Codec, then, fail, block=None) -> None:
        """``then(payloads, meta)`` on a host thread: device tensors are copied raw first.
        ``block``: the pool block that holds ``src``, if any (read until encoded)."""
        if src.device.type != "cuda":
            done = _record_host([block] if block is not None else [])

            def encode_host() -> None:
                encoded = codec.encode(src)
                done.set()
                then(*encoded)

            self._on_cpu(encode_host, fail, done)
            return
        block = self._alloc(_nbytes(src))
        raw = HostTensor(block, src.dtype, tuple(src.shape))

        def encode() -> None:
            try:
                payloads, meta = codec.encode(raw.tensor)
            finally:
                block.free()
            then(payloads, meta)

        def copied() -> None:
            self._on_cpu(encode, fail)

        def failed(error: BaseException) -> None:
            if not block.freed:
                block.free()
            fail(error)

        try:
            self._d2h(src, raw, copied, failed)
        except BaseException:
            block.free()
            raise

    def _payloads_to_host(self, payloads: list[torch.Tensor]) -> list[HostTensor]:
        parts: list[HostTensor] = []
        try:
            for p in payloads:
                data = as_bytes(p)
                block = self._alloc(data.numel())
                block.view.copy_(data)
                parts.append(HostTensor(block, p.dtype, tuple(p.shape)))
        except BaseException:
            for part in parts:
                part.free()
            raise
        return parts

    def _staged_to_store(self, fut, ticket, store: Store, src: torch.Tensor, nbytes: int) -> None:
        """``to_store`` of a device tensor: D2H into a pool block, then write the block."""
        block = self._alloc(nbytes)
        staged = HostTensor(block, src.dtype, tuple(src.shape))
        fail = self._failer(fut, ticket, block)

        def copied() -> None:
            self._count("d2h", nbytes)

            def written(handles: list) -> None:
                block.free()
                self._resolve(fut, ticket, handles[0])

            self._write_all(store, [staged.tensor], written, fail, f"h2{store.tier}")

        try:
            self._d2h(src, staged, copied, fail)
        except BaseException:
            block.free()
            raise

    def _encode_to_store(
        self, fut, ticket, store: Store, src: torch.Tensor, codec: Codec, after, block, nbytes
    ) -> None:
        """``to_store(codec=)``: encode on a host thread (device tensors copied raw first), then
        write the payloads. ``after`` frees the source host tensor once encoded; ``block`` is its
        pool block (read until encoded), if any."""

        def encoded(payloads: list[torch.Tensor], meta: dict) -> None:
            if after is not None:
                after()

            def written(handles: list) -> None:
                shape = tuple(src.shape)
                self._resolve(fut, ticket, Encoded(codec, meta, handles, src.dtype, shape, nbytes))

            self._write_all(store, payloads, written, self._failer(fut, ticket), f"h2{store.tier}")

        self._encode(src, codec, encoded, self._failer(fut, ticket, after), block)

    def _write_all(self, store: Store, tensors: list[torch.Tensor], then, fail, direction) -> None:
        """Store ``tensors`` from a transfer thread: a synchronous error (a full tier) fails like
        an asynchronous one. ``then(handles)`` once all are written; else ``fail`` (the store
        frees what was written)."""
        try:
            if len(tensors) == 1:  # put_many of one would pack it (a copy) on some stores
                stored = gather([store.put(tensors[0])])
            else:
                stored = store.put_many(tensors)
        except BaseException as exc:
            stored = failed(exc)
        self._collect(stored, then, fail, direction)

    def _collect(self, stored: Future, then, fail, direction: str) -> None:
        """``then(handles)`` once ``stored`` (a future of a list of handles) is done, else
        ``fail``; on the thread that finished it, as a releasing thread."""

        def done(f: Future) -> None:
            with _releasing():
                error = f.exception()
                if error is not None:
                    fail(error)
                    return
                handles = f.result()
                if handles:
                    self._count(direction, sum(h.nbytes for h in handles))
                then(handles)

        stored.add_done_callback(done)

    def _read_to_cpu(self, fut, ticket, store: Store, handle: Handle, free: bool) -> None:
        """Process memory is the target: read straight into it. A disk read lands in recycled
        pool memory when the pool is not pinned (no first-touch page faults; pinned memory is
        kept for DMA); a remote read lands in fresh NumPy memory, which is faster there (huge
        pages: ``tiers/remote.py``)."""
        into = None
        if isinstance(store, DiskStore) and not self.host.pin:
            with contextlib.suppress(Exception):  # full pool: the disk allocates instead
                into = self.host.lend(handle.length, wait=not getattr(_local, "releasing", 0))
        inner = store.get(handle, into=into)  # KeyError for a stale handle: raised here

        def done(f: Future) -> None:
            with _releasing():
                if f.exception() is not None:
                    self._failer(fut, ticket)(f.exception())
                    return
                try:
                    if free:
                        store.free(handle)
                except BaseException as exc:
                    self._failer(fut, ticket)(exc)
                    return
                self._count(f"{store.tier}2h", handle.nbytes)
                self._resolve(fut, ticket, f.result())

        inner.add_done_callback(done)

    def _read_to_block(self, fut, ticket, store: Store, handle, to, target, free) -> None:
        """Read ``handle`` of ``store`` into a pool block, then hand it out (``to="host"``) or
        copy it to ``target``."""
        block = self._alloc(handle.length)
        try:
            inner = store.get(handle, into=block.buffer)
        except BaseException:
            block.free()
            raise
        host = HostTensor(block, handle.dtype, handle.shape)
        block.nbytes = handle.nbytes
        fail = self._failer(fut, ticket, block)

        def read_done(f: Future) -> None:
            with _releasing():
                if f.exception() is not None:
                    fail(f.exception())
                    return
                try:
                    if free:
                        store.free(handle)
                    self._count(f"{store.tier}2h", handle.nbytes)
                    if to == "host":
                        self._resolve(fut, ticket, host)
                    else:
                        h2d = (fut, ticket, host.tensor, target, None, host.free, block)
                        self._h2d_future(*h2d)
                except BaseException as exc:
                    fail(exc)

        inner.add_done_callback(read_done)

    def _from_store_encoded(
        self, fut, ticket, store: Store, enc: Encoded, to, target, free
    ) -> None:
        if any(isinstance(p, HostTensor) for p in enc.parts):
            raise ValueError("these payloads are on the host: use to_device(encoded)")
        stored = store.get_many(enc.parts)  # KeyError for a stale handle: raised here

        def done(f: Future) -> None:
            with _releasing():
                if f.exception() is not None:
                    self._failer(fut, ticket)(f.exception())
                    return
                self._count(f"{store.tier}2h", enc.payload_bytes)
                release = (lambda: enc.free(store)) if free else None
                self._decode_to(fut, ticket, enc, f.result(), to, target, release)

        stored.add_done_callback(done)

    def _decode_to(self, fut, ticket, enc: Encoded, payloads, to, target, release) -> None:
        """Decode on a host thread, then hand out a host block (``to="host"``), a CPU tensor, or
        copy the raw bytes to ``target`` from a pool block. Host payloads are read until decoded."""
        done = _record_host([p.block for p in enc.parts if isinstance(p, HostTensor)])

        def decode() -> None:
            raw = enc.codec.decode(payloads, enc.meta)
            done.set()
            if release is not None:
                release()
            if to == "device" and target.type != "cuda":
                self._resolve(fut, ticket, raw)
                return
            data = as_bytes(raw)
            block = self._alloc(data.numel())
            block.view.copy_(data)
            host = HostTensor(block, raw.dtype, tuple(raw.shape))
            if to == "host":
                self._resolve(fut, ticket, host)
            else:
                self._h2d_future(fut, ticket, host.tensor, target, None, host.free, block)

        self._on_cpu(decode, self._failer(fut, ticket), done)

    # test seam: the completion path is device-agnostic (any object with ``synchronize()``)
    def _enqueue(self, event, keep, on_done, on_fail) -> None:
        self._completer.put(_Pending(event, keep, on_done, on_fail))


__all__ = [
    "Encoded",
    "HostTensor",
    "Transfer",
    "TransferEngine",
    "TransferStats",
    "aligned_empty",
    "as_bytes",
]
