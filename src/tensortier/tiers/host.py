"""Host-memory pool: page-aligned (pinned on CUDA) byte buffers under a budget, cached by size class.

Pinning memory costs milliseconds and fragments the heap, so blocks are rounded up to a size class
(four classes per power of two, at most 25% slack) and kept for reuse after ``free``, as PyTorch's
caching host allocator and FlashNeuron's buffer manager do. The budget counts every byte the pool
holds, cached or in use; a request that cannot fit, even after dropping the cache, raises
:class:`TierFullError` instead of letting the process run out of memory.

The pool pins its own memory (page-aligned CPU memory registered with ``cudaHostRegister``)
instead of going through PyTorch's caching host allocator, which rounds every request up to a
power of two and never unpins: with it, the 5/8..7/8 classes would really pin 8/8 (up to 1.6x the
budget) and eviction, :meth:`HostPool.empty_cache` and :meth:`HostPool.close` would return nothing
to the OS. Here every byte pinned is a byte accounted, and a released buffer is unregistered first.

Freed blocks come back through a lock-free queue that the pool drains under its lock at its next
call (``LIFETIME.md``): a block may be freed by garbage collection on any thread, even one that
holds the pool's lock, so freeing never takes it. ``alloc`` drains first, so a freed block is
reused at once.

A block is not lent again while a copy still reads or writes it, as in PyTorch's
``CachingHostAllocator``: whoever starts an asynchronous copy from or into a block records the
copy's completion on it (:meth:`HostBlock.record`: a CUDA event, or a host-side marker), and a
freed block whose copies have not all completed waits in a *busy* list (queried, never waited for,
at each drain) before it joins the cache. :meth:`HostBlock.hold` gives a tensor whose storage keeps
its block alive, so a view of pool memory never outlives its block by garbage collection.

This module owns host buffers only; it never touches files or devices.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from tensortier import _lifetime
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, format_size, is_int, parse_size
from tensortier.errors import ClosedError, ConfigError, TierFullError

log = logging.getLogger(__name__)
PAGE = 4096
_MIN_CLASS = PAGE
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context (every device), as cudaHostAlloc's


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its class: a multiple of 4 KiB, four classes per power of two."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    top = 1 << (nbytes - 1).bit_length()  # next power of two >= nbytes
    step = max(top // 8, PAGE)  # classes at 5/8, 6/8, 7/8, 8/8 of the power of two
    return (nbytes + step - 1) // step * step


def _completed(done) -> bool:
    """Whether a copy's completion marker (a CUDA event, or anything with ``query()``) has fired.
    A marker that cannot be queried (a dead CUDA context) counts as fired: its copy will never run."""
    try:
        return bool(done.query())
    except Exception:
        return True


def _running(copies: list) -> bool:
    """Whether any copy in ``copies`` is still running; forgets the ones that completed."""
    if copies and all(_completed(d) for d in copies):
        copies.clear()
    return bool(copies)


def _wait(copies: list) -> None:
    """Wait for every copy in ``copies``. Ends: CUDA events were recorded after work already queued,
    and host markers are set on every path of the job that recorded them."""
    for done in list(copies):
        if not _completed(done):
            done.synchronize()
    copies.clear()


def aligned_empty(nbytes: int, *, pin: bool = False, alignment: int = PAGE) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data pointer is ``alignment``-aligned (O_DIRECT needs it).

    ``pin=True``: page-locked (the package's one way to pin outside a :class:`HostPool`). The
    pages it spans are registered with ``cudaHostRegister``, counted in :func:`pinned_bytes`, and
    unregistered on the reaper thread once the last tensor sharing its storage is gone, after the
    devices have finished the copies queued before then. PyTorch's caching host allocator
    (``pin_memory=True``) would round every request up to a power of two and never unpin.
    """
    if pin:
        return _pinned_empty(nbytes, max(alignment, PAGE))
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % alignment
    # a storage of its own that starts at the aligned byte (the array keeps ``raw`` alive):
    # PyTorch's ``is_pinned()`` asks CUDA about the storage's first byte, which for a view of
    # ``raw`` lies in the unregistered page before the pinned ones (seen on an H100)
    return torch.from_numpy(raw.numpy()[offset : offset + nbytes])


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked CPU copy of ``t`` (same dtype and shape, contiguous); see :func:`aligned_empty`."""
    out = aligned_empty(t.numel() * t.element_size(), pin=True).view(t.dtype).view(t.shape)
    return out.copy_(t)


def pinned_bytes() -> int:
    """Host bytes that tensortier has page-locked right now: pool buffers and ``aligned_empty(pin=
    True)`` buffers, exactly the pages registered (PyTorch's own pinned memory is not counted)."""
    return _pinned[0]


_pinned = [0]  # bytes registered by _pin and not yet unregistered
_pinned_lock = threading.Lock()  # ordinary code only (pinning, the reaper), never a finalizer


def _pin(buffer: torch.Tensor) -> None:
    _register(buffer)
    with _pinned_lock:
        _pinned[0] += buffer.numel()


def _pinned_empty(nbytes: int, alignment: int) -> torch.Tensor:
    region = aligned_empty(max(PAGE, -(-nbytes // PAGE) * PAGE), alignment=alignment)
    _pin(region)
    array = region.numpy()  # the tensor below keeps this array alive, and only it does
    # when the last tensor on it is gone: unpin on the reaper (a finalizer never calls CUDA)
    finalizer = weakref.finalize(array, _lifetime.defer, _unpin_dropped, region)
    finalizer.atexit = False  # at exit the process's memory goes anyway
    _lifetime._reaper.start()  # from ordinary code (starting a thread inside GC can deadlock)
    return torch.from_numpy(array)[:nbytes]


def _unpin_dropped(region: torch.Tensor) -> None:
    """Reaper job for a dropped ``aligned_empty(pin=True)`` buffer. A copy queued before the last
    tensor died may still use it (PyTorch's allocator records such copies; here their streams
    are unknown), so every device with a context finishes its queued work first (a wait on work
    already queued: it ends), then the pages are unregistered and the memory freed."""
    _synchronize_devices()
    _unpin(region)


def _synchronize_devices() -> None:
    if not torch.cuda.is_initialized():
        return
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    for index in range(torch.cuda.device_count()):
        if has_context is None or has_context(index):  # never create a context here
            torch.cuda.synchronize(index)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _register(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer`` (page-aligned, a multiple of pages) for DMA; raises on failure."""
    err = int(
        torch.cuda.cudart().cudaHostRegister(
            buffer.data_ptr(), buffer.numel(), _HOST_REGISTER_PORTABLE
        )
    )
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed with cudaError {err}")


def _unregister(buffer: torch.Tensor) -> None:
    """Undo :func:`_register`; the buffer's memory goes back to the OS once it is dropped."""
    err = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with cudaError {err}")


@dataclass
class HostStats:
    budget: int
    in_use: int = 0  # bytes in blocks handed out (size-class bytes)
    cached: int = 0  # bytes in freed blocks kept for reuse
    busy: int = 0  # bytes in freed blocks that a copy still reads or writes (not lent yet)
    peak_in_use: int = 0
    peak_reserved: int = 0  # peak of in_use + busy + cached: what the pool took from the OS
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # cached blocks released to make room

    @property
    def reserved(self) -> int:
        return self.in_use + self.busy + self.cached

    def as_dict(self) -> dict:
        return {**asdict(self), "reserved": self.reserved}


class _Returns:
    """What block finalizers touch: a lock-free queue and two flags, never the pool itself."""

    __slots__ = ("queue", "closed", "pin", "stats", "lock")

    def __init__(self, pin: bool, stats: HostStats, lock: threading.Lock):
        self.queue: collections.deque = collections.deque()  # append/popleft are atomic
        self.closed = False
        self.pin = pin
        self.stats = stats  # after close, blocks given back leave ``in_use`` here
        self.lock = lock  # the pool's: ``in_use`` changes under it, closed or not


def _give_back(returns: _Returns, buffer: torch.Tensor, copies: list) -> None:
    """Finalizer of a :class:`HostBlock` (also its ``free``): never blocks, never takes a lock.
    ``copies``: completion markers of copies that may still use the buffer."""
    returns.queue.append((buffer, copies))
    if returns.closed:  # nobody will drain it: unpin on the reaper (closed is set before the
        _lifetime.defer(_drain_closed, returns)  # pool's last drain, so nothing is missed)


def _drain_closed(returns: _Returns) -> None:
    """Release blocks given back after the pool closed; they leave its ``in_use`` (a pool's
    stats must read 0 reserved once everything it lent came back, closed or not)."""
    items = []
    with returns.lock:
        while returns.queue:
            items.append(returns.queue.popleft())
        returns.stats.in_use -= sum(buffer.numel() for buffer, _ in items)
    _release_buffers(items, returns.pin)


def _release_buffers(items: list[tuple[torch.Tensor, list]], pin: bool) -> None:
    """Unpin ``(buffer, copies)`` the pool let go of; dropping them returns the memory to the OS.
    A buffer that a copy may still use is released on the reaper thread once the copy is done
    (never here: this may run on a thread that the copy's job needs)."""
    later = [(b, copies) for b, copies in items if _running(copies)]
    if later:
        _lifetime.defer(_release_when_done, later, pin)
    if pin:
        for buffer, copies in items:
            if not copies:
                _unpin(buffer)
    items.clear()


def _release_later(items: list[tuple[torch.Tensor, list]], pin: bool) -> None:
    """``_release_buffers`` for a path that is about to raise (the items must not be lost)."""
    try:
        _release_buffers(items, pin)
    except Exception:  # never hide the error being raised
        log.warning("tensortier: could not release host buffers", exc_info=True)


def _release_when_done(items: list[tuple[torch.Tensor, list]], pin: bool) -> None:
    for buffer, copies in items:
        _wait(copies)
        if pin:
            _unpin(buffer)
    items.clear()


def _unpin(buffer: torch.Tensor) -> None:
    try:
        _unregister(buffer)
    except RuntimeError:  # a dead CUDA context: the buffer goes anyway, say so
        log.warning("tensortier: could not unpin a host buffer", exc_info=True)
    with _pinned_lock:
        _pinned[0] -= buffer.numel()


def _release_all(
    cache: dict[int, list[torch.Tensor]], busy: list[tuple[torch.Tensor, list]], returns: _Returns
) -> None:
    """A pool's cleanup (``close()``, or the reaper once the pool is collected): unpin everything
    cached, busy (once its copies are done) and freed since the last drain."""
    returns.closed = True
    items = [(b, []) for blocks in cache.values() for b in blocks]
    cache.clear()
    items += busy
    busy.clear()
    _release_buffers(items, returns.pin)
    _drain_closed(returns)


class _Holder:
    """The base of a numpy array over a block's memory: it keeps the block alive (see ``hold``)."""

    __slots__ = ("__array_interface__", "_array", "_block")

    def __init__(self, array, block: HostBlock):
        self.__array_interface__ = array.__array_interface__
        self._array, self._block = array, block


class HostBlock:
    """A buffer lent by a :class:`HostPool`. ``view`` is the first ``nbytes`` of it.

    ``free`` (or garbage collection of the block) hands the memory back to the pool; ``view`` and
    ``buffer`` do not keep the block alive, :meth:`hold` does. Every asynchronous copy from or into
    the block must :meth:`record` its completion, so that the memory is not lent again under it.
    """

    __slots__ = ("nbytes", "buffer", "_pool", "_copies", "_finalizer", "__weakref__")

    def __init__(self, pool: HostPool, buffer: torch.Tensor, nbytes: int):
        self.nbytes = nbytes
        self.buffer = buffer  # the whole size-class buffer
        self._pool = pool
        self._copies: list = []  # completion markers of copies that may still use the buffer
        self._finalizer = weakref.finalize(self, _give_back, pool._returns, buffer, self._copies)

    @property
    def view(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def hold(self) -> torch.Tensor:
        """``view`` in a storage of its own that keeps this block alive: the pool does not lend the
        memory again while this tensor or any view of it lives (until an explicit ``free``)."""
        array = np.asarray(_Holder(self.buffer.numpy(), self))
        return torch.from_numpy(array)[: self.nbytes]

    def record(self, done) -> None:
        """An asynchronous copy reads or writes this block until ``done`` completes: a CUDA event
        recorded after the copy, or any object with ``query()`` and ``synchronize()``. Once freed,
        the block is lent again only after every recorded copy has completed."""
        if not self._finalizer.alive:
            raise RuntimeError(
                "a copy was started on a HostBlock that was already freed; keep the block (or "
                "its HostTensor) until the copy is issued and free it after"
            )
        copies = self._copies
        if len(copies) >= 4:  # a block copied again and again: forget finished copies
            copies[:] = [d for d in copies if not _completed(d)]
        copies.append(done)

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def free(self) -> None:
        """Return the memory to the pool. Freeing twice is an error (it would hide a use-after-free).

        Lock-free, so it may run in a finalizer; the pool takes the block back at its next call.
        """
        if not self._finalizer.alive:
            raise RuntimeError("HostBlock freed twice")
        self._finalizer()

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return (
            f"HostBlock({format_size(self.nbytes)} in {format_size(self.buffer.numel())}, {state})"
        )


class HostPool:
    """Caching allocator of host buffers under ``budget`` bytes.

    ``pin=None`` pins when CUDA is available (so device copies are true DMA and can be async).
    Thread-safe: transfer threads allocate and free concurrently. Pinning happens in ``alloc`` on a
    miss; call :meth:`warm` beforehand to keep it off a hot path.
    """

    def __init__(self, budget: SizeLike = "4GiB", *, pin: bool | None = None):
        self.budget = parse_size(budget, name="host budget", allow_zero=False)
        self.pin = _cuda_available() if pin is None else bool(pin)
        if self.pin and not _cuda_available():
            raise RuntimeError(
                "pin=True needs CUDA; pass pin=False or pin=None on a CPU-only machine"
            )
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._busy: list[tuple[torch.Tensor, list]] = []  # freed, a copy still uses it (FIFO)
        self._lock = threading.Lock()
        self._stats = HostStats(budget=self.budget)
        self._returns = _Returns(self.pin, self._stats, self._lock)
        self._finalizer = _lifetime.Finalizer(
            self, _release_all, self._free, self._busy, self._returns
        )
        register_stats("host_pool", self)  # tt.stats() lists it while it is open

    @property
    def stats(self) -> HostStats:
        """Counters, with every block freed so far taken back."""
        with self._lock:
            released = self._drain_locked()
        _release_buffers(released, self.pin)
        return self._stats

    @property
    def _closed(self) -> bool:
        return self._returns.closed

    def alloc(self, nbytes: int, *, wait: bool = True) -> HostBlock:
        """A block of at least ``nbytes`` bytes, reusing a cached one of the same class if any.

        When the budget is short only because freed blocks are still used by copies, ``wait=True``
        waits for those copies (a CUDA event or a transfer job that always finishes); threads that
        complete copies pass ``wait=False`` and get :class:`TierFullError` instead."""
        if not is_int(nbytes):
            raise TypeError(
                f"HostPool.alloc(nbytes): expected a byte count as an int, got "
                f"{type(nbytes).__name__} {nbytes!r}; convert sizes first, e.g. "
                f"tt.parse_size('1KiB')"
            )
        if nbytes < 0:
            raise ConfigError(f"HostPool.alloc: cannot allocate a negative size ({nbytes} bytes)")
        cls = size_class(nbytes)
        while True:
            buffer = copies = None
            with self._lock:
                released = self._drain_locked()
                if not self._closed:
                    try:
                        buffer = self._take_locked(cls, nbytes, released)
                    except TierFullError:
                        if not (wait and self._busy):
                            _release_later(released, self.pin)
                            raise
                        copies = list(self._busy[0][1])  # the oldest busy block's copies
            _release_buffers(released, self.pin)  # unpinning takes time: never under the lock
            if self._closed:
                raise ClosedError("HostPool is closed")
            if copies is None:
                break
            _wait(copies)  # outside the lock: the next drain moves that block to the cache
        if buffer is None:
            buffer = self._new_buffer(cls)
        return HostBlock(self, buffer, nbytes)

    def _take_locked(self, cls: int, nbytes: int, released: list) -> torch.Tensor | None:
        """A cached buffer of class ``cls`` (None: make a new one), accounted as in use; evicted
        buffers are appended to ``released``. Raises :class:`TierFullError` if it cannot fit."""
        s = self._stats
        cached = self._free.get(cls)
        if cached:
            buffer = cached.pop()
            s.cached -= cls
            s.hits += 1
        else:
            released += [(b, []) for b in self._make_room(cls, nbytes)]
            buffer = None
            s.misses += 1
        s.in_use += cls
        s.peak_in_use = max(s.peak_in_use, s.in_use)
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return buffer

    def _new_buffer(self, cls: int) -> torch.Tensor:
        try:
            buffer = aligned_empty(cls)
            if self.pin:
                _pin(buffer)
            return buffer
        except RuntimeError as exc:  # the OS (or CUDA) refused: undo the accounting
            with self._lock:
                self._stats.in_use -= cls
            raise TierFullError(
                f"host allocation of {format_size(cls)} failed: {exc}. Lower the host budget "
                f"(now {format_size(self.budget)}) to what this machine can give.",
                tier="host",
                requested=cls,
                in_use=self._stats.in_use,
                limit=self.budget,
            ) from exc

    def lend(self, nbytes: int, *, wait: bool = True) -> torch.Tensor:
        """An aligned uint8 tensor of ``nbytes`` whose memory returns to the pool by itself once the
        last tensor sharing its storage is gone. Reused memory is already mapped, so reads into it
        skip the first-touch page faults that dominate fresh allocations on many machines."""
        block = self.alloc(nbytes, wait=wait)
        array = block.buffer.numpy()  # the storage made below keeps this array alive, and only it
        weakref.finalize(array, block.free)
        return torch.from_numpy(array)[:nbytes]

    def warm(self, sizes: Iterable[int]) -> int:
        """Allocate (pin) one block per entry of ``sizes`` and cache them, so later ``alloc`` calls
        of those classes are hits (no ``cudaHostRegister`` on the hot path). Raises
        :class:`TierFullError` if they do not fit the budget together; returns the bytes reserved."""
        blocks = [self.alloc(int(n)) for n in sizes]
        for block in blocks:
            block.free()
        return self.stats.reserved

    def _make_room(self, cls: int, nbytes: int) -> list[torch.Tensor]:
        """Drop cached blocks until ``cls`` more bytes fit the budget (caller holds the lock).

        Returns the dropped buffers, for the caller to unpin outside the lock."""
        s = self._stats
        if s.in_use + s.busy + cls > self.budget:
            busy = f" ({format_size(s.busy)} freed but still read by copies)" if s.busy else ""
            raise TierFullError(
                f"host pool budget exceeded: asked for {format_size(nbytes)} "
                f"(class {format_size(cls)}) with {format_size(s.in_use + s.busy)}{busy} of "
                f"{format_size(self.budget)} in use. Free blocks or raise the host budget.",
                tier="host",
                requested=cls,
                in_use=s.in_use + s.busy,
                limit=self.budget,
            )
        evicted: list[torch.Tensor] = []
        for other in sorted(self._free, reverse=True):  # drop the biggest cached blocks first
            if s.reserved + cls <= self.budget:
                break
            blocks = self._free[other]
            while blocks and s.reserved + cls > self.budget:
                evicted.append(blocks.pop())
                s.cached -= other
                s.evictions += 1
        return evicted

    def _drain_locked(self) -> list[tuple[torch.Tensor, list]]:
        """Take back every freed block, and every busy block whose copies have completed (caller
        holds the lock; events are queried, never waited for). Returns what to release."""
        s, released = self._stats, []
        queue, busy = self._returns.queue, self._busy
        while queue:
            buffer, copies = queue.popleft()
            s.in_use -= buffer.numel()
            s.busy += buffer.numel()
            busy.append((buffer, copies))
        if busy:
            still = []
            for buffer, copies in busy:
                if self._closed:  # released once its copies are done (see _release_buffers)
                    s.busy -= buffer.numel()
                    released.append((buffer, copies))
                elif _running(copies):
                    still.append((buffer, copies))
                else:
                    s.busy -= buffer.numel()
                    self._free[buffer.numel()].append(buffer)
                    s.cached += buffer.numel()
            busy[:] = still
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return released

    def empty_cache(self) -> int:
        """Release every cached (free) block to the OS (unpinned first); returns the bytes released.
        Blocks that copies still use are released once they are cached."""
        with self._lock:
            released = self._drain_locked()
            for blocks in self._free.values():
                released += [(b, []) for b in blocks]
            self._free.clear()
            freed, self._stats.cached = self._stats.cached, 0
        _release_buffers(released, self.pin)
        return freed

    def close(self) -> None:
        """Release the cache to the OS; blocks still in use are released when they are freed, and
        blocks that copies still use once those copies are done (on the reaper thread)."""
        with self._lock:
            released = self._drain_locked()
            self._returns.closed = True  # before the last drain below (see _give_back)
            released += self._drain_locked()
            for blocks in self._free.values():
                released += [(b, []) for b in blocks]
            self._free.clear()
            self._stats.cached = 0
        _release_buffers(released, self.pin)
        self._finalizer()  # nothing left to release; detaches the GC-time cleanup

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"HostPool(budget={format_size(s.budget)}, in_use={format_size(s.in_use)}, "
            f"cached={format_size(s.cached)}, pin={self.pin})"
        )


def default_budget() -> int:
    """The budget of a pool nobody sized: 4 GiB, or a quarter of the machine's RAM if less."""
    import psutil

    return min(4 << 30, psutil.virtual_memory().total // 4)


__all__ = [
    "PAGE",
    "HostBlock",
    "HostPool",
    "HostStats",
    "aligned_empty",
    "pinned_bytes",
    "pinned_copy",
    "size_class",
]
