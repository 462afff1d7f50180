"""Host-memory pool: page-aligned (pinned on CUDA) byte buffers under a budget, cached by size class.

Allocating pinned memory costs milliseconds and fragments the heap, so blocks are rounded up to a
size class (four classes per power of two, at most 25% slack) and kept for reuse after ``free``,
as PyTorch's caching host allocator and FlashNeuron's buffer manager do. The budget counts every
byte the pool holds, cached or in use; a request that cannot fit, even after dropping the cache,
raises :class:`TierFullError` instead of letting the process run out of memory.

This module owns host buffers only; it never touches files or devices.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from tensortier._units import SizeLike, format_size, parse_size
from tensortier.errors import ClosedError, TierFullError

PAGE = 4096
_MIN_CLASS = PAGE


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its class: a multiple of 4 KiB, four classes per power of two."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    top = 1 << (nbytes - 1).bit_length()  # next power of two >= nbytes
    step = max(top // 8, PAGE)  # classes at 5/8, 6/8, 7/8, 8/8 of the power of two
    return (nbytes + step - 1) // step * step


def aligned_empty(nbytes: int, *, pin: bool = False, alignment: int = PAGE) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data pointer is ``alignment``-aligned (O_DIRECT needs it)."""
    if pin:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: page-aligned
        if buf.data_ptr() % alignment == 0:
            return buf
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset : offset + nbytes]


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
        self._finalizer = weakref.finalize(self, pool._reclaim, buffer)

    @property
    def view(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def free(self) -> None:
        """Return the memory to the pool. Freeing twice is an error (it would hide a use-after-free)."""
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
    Thread-safe: transfer threads allocate and free concurrently.
    """

    def __init__(self, budget: SizeLike = "4GiB", *, pin: bool | None = None):
        self.budget = parse_size(budget, name="host budget", allow_zero=False)
        self.pin = torch.cuda.is_available() if pin is None else pin
        if self.pin and not torch.cuda.is_available():
            raise RuntimeError(
                "pin=True needs CUDA; pass pin=False or pin=None on a CPU-only machine"
            )
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = False
        self.stats = HostStats(budget=self.budget)

    def alloc(self, nbytes: int) -> HostBlock:
        """A block of at least ``nbytes`` bytes, reusing a cached one of the same class if any."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        cls = size_class(nbytes)
        with self._lock:
            if self._closed:
                raise ClosedError("HostPool is closed")
            cached = self._free.get(cls)
            if cached:
                buffer = cached.pop()
                self.stats.cached -= cls
                self.stats.hits += 1
            else:
                self._make_room(cls, nbytes)
                buffer = None
                self.stats.misses += 1
            self.stats.in_use += cls
            self.stats.peak_in_use = max(self.stats.peak_in_use, self.stats.in_use)
            self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)
        if buffer is None:
            try:
                buffer = aligned_empty(cls, pin=self.pin)
            except RuntimeError as exc:  # the OS (or CUDA) refused: undo the accounting
                with self._lock:
                    self.stats.in_use -= cls
                raise TierFullError(
                    f"host allocation of {format_size(cls)} failed: {exc}. Lower the host budget "
                    f"(now {format_size(self.budget)}) to what this machine can give.",
                    tier="host",
                    requested=cls,
                    in_use=self.stats.in_use,
                    limit=self.budget,
                ) from exc
        return HostBlock(self, buffer, nbytes)

    def lend(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 tensor of ``nbytes`` whose memory returns to the pool by itself once the
        last tensor sharing its storage is gone. Reused memory is already mapped, so reads into it
        skip the first-touch page faults that dominate fresh allocations on many machines."""
        block = self.alloc(nbytes)
        array = block.buffer.numpy()  # the storage made below keeps this array alive, and only it
        weakref.finalize(array, block.free)
        return torch.from_numpy(array)[:nbytes]

    def _make_room(self, cls: int, nbytes: int) -> None:
        """Drop cached blocks until ``cls`` more bytes fit the budget (caller holds the lock)."""
        if self.stats.in_use + cls > self.budget:
            raise TierFullError(
                f"host pool budget exceeded: asked for {format_size(nbytes)} "
                f"(class {format_size(cls)}) with {format_size(self.stats.in_use)} of "
                f"{format_size(self.budget)} in use. Free blocks or raise the host budget.",
                tier="host",
                requested=cls,
                in_use=self.stats.in_use,
                limit=self.budget,
            )
        for other in sorted(self._free, reverse=True):  # drop the biggest cached blocks first
            if self.stats.reserved + cls <= self.budget:
                break
            blocks = self._free[other]
            while blocks and self.stats.reserved + cls > self.budget:
                blocks.pop()
                self.stats.cached -= other
                self.stats.evictions += 1

    def _reclaim(self, buffer: torch.Tensor) -> None:
        cls = buffer.numel()
        with self._lock:
            self.stats.in_use -= cls
            if self._closed:
                return
            self._free[cls].append(buffer)
            self.stats.cached += cls
            self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)

    def empty_cache(self) -> None:
        """Release every cached (free) block to the OS."""
        with self._lock:
            self._free.clear()
            self.stats.cached = 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()
            self.stats.cached = 0

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
