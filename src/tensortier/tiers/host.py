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

This module owns host buffers only; it never touches files or devices.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from tensortier import _lifetime
from tensortier._units import SizeLike, format_size, parse_size
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


def aligned_empty(nbytes: int, *, pin: bool = False, alignment: int = PAGE) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data pointer is ``alignment``-aligned (O_DIRECT needs it).

    ``pin=True`` takes the memory from PyTorch's caching host allocator (rounded up to a power of
    two and cached by PyTorch); :class:`HostPool` pins exactly what it accounts instead.
    """
    if pin:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: page-aligned
        if buf.data_ptr() % alignment == 0:
            return buf
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset : offset + nbytes]


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
    peak_in_use: int = 0
    peak_reserved: int = 0  # peak of in_use + cached: what the pool took from the OS
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # cached blocks released to make room

    @property
    def reserved(self) -> int:
        return self.in_use + self.cached

    def as_dict(self) -> dict:
        return {**asdict(self), "reserved": self.reserved}


class _Returns:
    """What block finalizers touch: a lock-free queue and two flags, never the pool itself."""

    __slots__ = ("queue", "closed", "pin")

    def __init__(self, pin: bool):
        self.queue: collections.deque = collections.deque()  # append/popleft are atomic
        self.closed = False
        self.pin = pin


def _give_back(returns: _Returns, buffer: torch.Tensor) -> None:
    """Finalizer of a :class:`HostBlock` (also its ``free``): never blocks, never takes a lock."""
    returns.queue.append(buffer)
    if returns.closed:  # nobody will drain it: unpin on the reaper (closed is set before the
        _lifetime.defer(_drain_closed, returns)  # pool's last drain, so nothing is missed)


def _drain_closed(returns: _Returns) -> None:
    buffers = []
    while returns.queue:
        buffers.append(returns.queue.popleft())
    _release_buffers(buffers, returns.pin)


def _release_buffers(buffers: list[torch.Tensor], pin: bool) -> None:
    """Unpin buffers the pool let go of; dropping them then returns the memory to the OS."""
    if pin:
        for buffer in buffers:
            try:
                _unregister(buffer)
            except RuntimeError:  # a dead CUDA context: the buffer goes anyway, say so once
                log.warning("tensortier: could not unpin a host buffer", exc_info=True)
    buffers.clear()


def _release_all(cache: dict[int, list[torch.Tensor]], returns: _Returns) -> None:
    """A pool's cleanup (``close()``, or the reaper once the pool is collected): unpin everything
    cached and everything freed since the last drain."""
    returns.closed = True
    buffers = [b for blocks in cache.values() for b in blocks]
    cache.clear()
    _release_buffers(buffers, returns.pin)
    _drain_closed(returns)


class HostBlock:
    """A buffer lent by a :class:`HostPool`. ``view`` is the first ``nbytes`` of it.

    Keep the block alive while any view of its memory is in use; ``free`` (or garbage collection of
    the block) hands the memory back to the pool for reuse.
    """

    __slots__ = ("nbytes", "buffer", "_pool", "_finalizer", "__weakref__")

    def __init__(self, pool: HostPool, buffer: torch.Tensor, nbytes: int):
        self.nbytes = nbytes
        self.buffer = buffer  # the whole size-class buffer
        self._pool = pool
        self._finalizer = weakref.finalize(self, _give_back, pool._returns, buffer)

    @property
    def view(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

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
        self._lock = threading.Lock()
        self._returns = _Returns(self.pin)
        self._stats = HostStats(budget=self.budget)
        self._finalizer = _lifetime.Finalizer(self, _release_all, self._free, self._returns)

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

    def alloc(self, nbytes: int) -> HostBlock:
        """A block of at least ``nbytes`` bytes, reusing a cached one of the same class if any."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(
                f"HostPool.alloc(nbytes): expected a byte count as an int, got "
                f"{type(nbytes).__name__} {nbytes!r}; convert sizes first, e.g. "
                f"tt.parse_size('1KiB')"
            )
        if nbytes < 0:
            raise ConfigError(f"HostPool.alloc: cannot allocate a negative size ({nbytes} bytes)")
        cls = size_class(nbytes)
        evicted: list[torch.Tensor] = []
        with self._lock:
            released = self._drain_locked()
            if self._closed:
                raise ClosedError("HostPool is closed")
            s = self._stats
            cached = self._free.get(cls)
            if cached:
                buffer = cached.pop()
                s.cached -= cls
                s.hits += 1
            else:
                try:
                    evicted = self._make_room(cls, nbytes)
                finally:
                    released += evicted
                buffer = None
                s.misses += 1
            s.in_use += cls
            s.peak_in_use = max(s.peak_in_use, s.in_use)
            s.peak_reserved = max(s.peak_reserved, s.reserved)
        _release_buffers(released, self.pin)  # unpinning takes time: never under the lock
        if buffer is None:
            buffer = self._new_buffer(cls)
        return HostBlock(self, buffer, nbytes)

    def _new_buffer(self, cls: int) -> torch.Tensor:
        try:
            buffer = aligned_empty(cls)
            if self.pin:
                _register(buffer)
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

    def lend(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 tensor of ``nbytes`` whose memory returns to the pool by itself once the
        last tensor sharing its storage is gone. Reused memory is already mapped, so reads into it
        skip the first-touch page faults that dominate fresh allocations on many machines."""
        block = self.alloc(nbytes)
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
        if s.in_use + cls > self.budget:
            raise TierFullError(
                f"host pool budget exceeded: asked for {format_size(nbytes)} "
                f"(class {format_size(cls)}) with {format_size(s.in_use)} of "
                f"{format_size(self.budget)} in use. Free blocks or raise the host budget.",
                tier="host",
                requested=cls,
                in_use=s.in_use,
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

    def _drain_locked(self) -> list[torch.Tensor]:
        """Take back every freed block (caller holds the lock); returns buffers to release."""
        s, released = self._stats, []
        queue = self._returns.queue
        while queue:
            buffer = queue.popleft()
            cls = buffer.numel()
            s.in_use -= cls
            if self._closed:
                released.append(buffer)
                continue
            self._free[cls].append(buffer)
            s.cached += cls
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return released

    def empty_cache(self) -> int:
        """Release every cached (free) block to the OS (unpinned first); returns the bytes released."""
        with self._lock:
            released = self._drain_locked()
            for blocks in self._free.values():
                released += blocks
            self._free.clear()
            freed, self._stats.cached = self._stats.cached, 0
        _release_buffers(released, self.pin)
        return freed

    def close(self) -> None:
        """Release the cache to the OS; blocks still in use are released when they are freed."""
        with self._lock:
            released = self._drain_locked()
            self._returns.closed = True  # before the last drain below (see _give_back)
            released += self._drain_locked()
            for blocks in self._free.values():
                released += blocks
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


__all__ = ["PAGE", "HostBlock", "HostPool", "HostStats", "aligned_empty", "size_class"]
