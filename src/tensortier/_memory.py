"""Process memory on a CPU-only machine, where RAM *is* the device memory: what a budget measures
(RSS and its kernel high-water mark) and glibc's allocator, which decides whether freed
activations ever leave it.

glibc serves allocations above an adaptive *mmap threshold* with their own mappings and returns
them to the OS on free; after the first such free it raises the threshold (up to 32 MiB), so
activations are then carved from the heap, whose freed middle never leaves the process. Measured
on a 6-layer GPT under disk offload: heap 750 MiB with 533 MiB of it free after one forward, a
step's RSS peak 560-1100 MiB instead of the 145 MiB actually live. :func:`release_freed_memory`
fixes the threshold, so every freed block of 128 KiB or more is unmapped at once.

glibc consults that threshold only when no free chunk of its heap fits a request, so a heap that
grew before the threshold was fixed (plain training before ``tt.offload()``) still serves
activations: their pages, given back by a trim, are faulted in again and stay after ``free``
(the profiled passes of GPT 8x128 peaked at 104-112 MiB instead of 23-37). The first fix of
the threshold therefore also retires the heap's free chunks of the threshold or more
(:func:`_retire_free_heap`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied: int | None = None
_lock = threading.Lock()
_retired: list[int] = []  # addresses of heap chunks taken out of use, held for the process's life


def release_freed_memory(threshold: int = 128 << 10) -> bool:
    """Make glibc return freed blocks of ``threshold`` bytes or more to the OS (``mallopt``).

    Process-wide and lasting, like ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment. The cost
    is first-touch page faults on every new large allocation (memory the heap would have reused);
    the gain is that a CPU memory budget (RSS) sees what is live. Returns whether it applied
    (False off glibc). Idempotent.
    """
    global _applied
    with _lock:  # bounded: two mallopt calls
        if _applied == threshold:
            return True
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, threshold)
            )
        except (OSError, AttributeError):
            return False
        if ok:
            first, _applied = _applied is None, threshold
            log.debug("glibc mmap/trim threshold fixed at %d bytes", threshold)
            if first:
                _retire_free_heap(libc, threshold)
        return ok


def _heap_range() -> tuple[int, int] | None:
    """The ``[heap]`` mapping of this process (glibc's main arena, grown by ``brk``)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    start, end = (int(x, 16) for x in line.split()[0].split("-"))
                    return start, end
    except OSError:
        pass
    return None


def _retire_free_heap(libc: ctypes.CDLL, threshold: int) -> int:
    """Take the main heap's free chunks of ``threshold`` bytes or more out of use; return their
    bytes. Called with the threshold fixed, on the thread that fixed it.

    Why: glibc serves a request from a free chunk of its heap before it considers ``mmap``, and
    the heap's middle never shrinks. Each chunk is ``malloc``-ed after a trim (its pages are not
    resident and are never touched beyond its header: address space, not RSS) and held for
    good; a request that misses is mmapped (the threshold is fixed), freed, and the size halved.
    """
    libc.malloc_trim(0)  # first: it may lower the heap's end
    heap = _heap_range()
    if heap is None:
        return 0
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, taken = 1 << ((heap[1] - heap[0]).bit_length() - 1), 0
    while size >= threshold:
        p = libc.malloc(size)
        if p and heap[0] <= p and p + size <= heap[1]:
            _retired.append(p)  # a chunk of the heap: kept out of use
            taken += size
            continue
        if p:
            libc.free(p)  # mmapped: no free chunk this large is left
        size //= 2
    if taken:
        log.debug("%d bytes of glibc's heap retired in %d chunks", taken, len(_retired))
    return taken


def trim() -> bool:
    """Give the free pages of every glibc arena back to the OS now (``malloc_trim(0)``)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; 0 if unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HighWater:
    """The RSS high-water mark since :meth:`start`, correct under nesting: the kernel keeps one
    mark per process, so every reset made through :func:`reset_peak_rss` first hands the mark
    it erases to the watches still open."""

    def __init__(self) -> None:
        self.seen = 0

    def start(self) -> bool:
        ok = reset_peak_rss()
        self.seen = 0
        with _lock:
            _watches.add(self)
        return ok

    def stop(self) -> int:
        with _lock:
            _watches.discard(self)
        return max(self.seen, status_bytes("VmHWM"))


_watches: weakref.WeakSet[HighWater] = weakref.WeakSet()


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (``VmHWM``) to the current RSS (Linux only); open
    :class:`HighWater` watches keep the mark it erases."""
    hwm = status_bytes("VmHWM")
    with _lock:  # bounded: a few attribute updates
        for w in list(_watches):
            w.seen = max(w.seen, hwm)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_bytes("VmHWM") > 0
    except OSError:
        return False
