"""NVMe tier: tensors in large preallocated files, carved into 4 KiB-aligned extents.

Layout. A store owns a private 0700 directory under ``spill_dir``. It holds *slabs*: files
preallocated with ``posix_fallocate`` (so a full disk shows up when a slab is made, not in the
middle of a tensor) and carved into extents by a first-fit free list that merges neighbours on
free. Repeated put/free of mixed sizes therefore reuses space instead of growing the files. A
disk with no room for a whole ``slab_size`` gets a slab of just the tensor's extent, after this
store's empty slabs are deleted if need be: a nearly full disk still takes what fits.

I/O. Every tensor is split into chunks written or read by a thread pool with ``os.pwrite`` and
``os.preadv`` (both release the GIL), so several requests are in flight, like an NVMe queue.
Files are opened with ``O_DIRECT`` when the filesystem allows it, so spilled data does not sit in
the page cache and the memory it frees stays free; otherwise writes are flushed with
``sync_file_range`` and dropped with ``posix_fadvise(DONTNEED)``. O_DIRECT needs aligned memory:
chunks whose memory is not page-aligned go through a per-thread aligned staging buffer.

Budget. ``budget`` bounds the bytes preallocated in slabs; no slab is ever larger than the
budget left, so any budget of at least one page can hold tensors up to its size.

Failure. A budget overrun raises :class:`TierFullError` from ``put`` itself; a full disk during
the write raises it from the returned future. Either way the extent is returned to the free list
and the store stays usable. ``close()``, garbage collection and leaving the ``with`` block remove
every file. Nothing is ever unpickled: handles live in memory only. Each 16 MiB chunk's CRC32C is
taken from the tensor as it is written and kept in its handle; a read checks it, so a spill file
changed or cut by anything else raises :class:`CorruptDataError` instead of returning garbage.

Lifetime and waits (``tensortier/LIFETIME.md``). Cleanup that joins the I/O threads runs through
``_lifetime.Finalizer``: on the caller's thread at ``close()``, on the reaper thread after GC, never
inside GC. ``free`` never blocks: it is called from other objects' finalizers and done-callbacks
(the activation offloader frees extents that way), so it pushes the extent onto a lock-free queue
and drains that queue only if the store's lock is free at once; otherwise the next call that takes
the lock drains it. The lock guards only in-memory bookkeeping, never I/O. Every future this store
returns resolves: a chunk either runs (``pwrite``/``preadv`` complete or fail) or is cancelled by
``close()``, which fails its future with :class:`ClosedError`; so ``write``/``read`` wait without a
timeout, and ``close()`` joins threads that only finish chunks already running.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import crc32c
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tensortier._lifetime import Finalizer, private_dir, remove_private_dir
from tensortier._renamed import renamed, renamed_attribute
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, align_up, check_int, format_size, parse_size
from tensortier.errors import (
    ClosedError,
    ConfigError,
    CorruptDataError,
    SpillDirError,
    TierFullError,
)
from tensortier.tiers.base import StoreBase, running, shut_down_io
from tensortier.tiers.codecs import flat_values
from tensortier.tiers.host import PAGE, aligned_empty

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CHUNK = 16 << 20  # bytes per pwrite/preadv (a multiple of PAGE); 16 MiB measured best here
_STAGE = 4 << 20  # aligned bounce buffer per I/O thread, for memory that is not page-aligned
_STAGE_MIN = 64 << 10  # its smallest size (it grows to the pieces it carries, up to _STAGE)
MAX_IO_THREADS = 256  # far past what saturates an NVMe queue (4-16); beyond it, a typo
_handle_ids = itertools.count()  # process-wide: a handle of one store never matches another's


@dataclass(frozen=True)
class DiskHandle:
    """Where one tensor lives on disk. Valid until ``DiskStore.free``; never persisted."""

    id: int
    slab: int
    offset: int
    length: int  # bytes reserved, a multiple of PAGE
    nbytes: int  # bytes of tensor data
    dtype: torch.dtype
    shape: tuple[int, ...]
    # CRC32C of each _CHUNK of the data, taken from the tensor as it was written
    checksums: tuple[int, ...] = field(default=(), repr=False)


@dataclass
class DiskStats:
    direct_io: bool = False
    file_bytes: int = 0  # bytes preallocated in slabs
    used_bytes: int = 0  # bytes in live extents
    peak_used_bytes: int = 0
    live_tensors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0  # summed over I/O threads
    read_seconds: float = 0.0
    puts: int = 0
    gets: int = 0
    staging_bytes: int = 0  # aligned bounce buffers held by the I/O threads (resident memory)

    def as_dict(self) -> dict:
        return asdict(self)


class _Slab:
    """One preallocated file and its free list of (offset, length) extents, sorted by offset."""

    def __init__(self, index: int, path: str, size: int, direct: bool):
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (_O_DIRECT if direct else 0)
        self.index, self.path, self.size = index, path, size
        self.fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError:
            os.close(self.fd)
            os.unlink(path)
            raise
        self.free_list: list[tuple[int, int]] = [(0, size)]
        self.free_bytes = size

    def alloc(self, length: int) -> int | None:
        for i, (off, ln) in enumerate(self.free_list):  # first fit keeps low offsets hot
            if ln >= length:
                if ln == length:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (off + length, ln - length)
                self.free_bytes -= length
                return off
        return None

    def release(self, offset: int, length: int) -> None:
        self.free_bytes += length
        i = bisect.bisect_left(self.free_list, (offset, 0))
        if i > 0:  # merge with the extent before
            prev_off, prev_len = self.free_list[i - 1]
            if prev_off + prev_len == offset:
                offset, length = prev_off, prev_len + length
                i -= 1
                del self.free_list[i]
        if i < len(self.free_list):  # and with the one after
            next_off, next_len = self.free_list[i]
            if offset + length == next_off:
                length += next_len
                del self.free_list[i]
        self.free_list.insert(i, (offset, length))

    @property
    def empty(self) -> bool:
        return self.free_bytes == self.size


class _Files:
    """The state cleanup needs, kept apart from the store so GC can collect it.

    ``cleanup`` joins the I/O threads, so it runs on the caller's thread (``close()``) or on the
    reaper thread after the store is collected, never inside GC (``tensortier._lifetime``).
    """

    def __init__(self, root: str):
        self.root = root
        self.slabs: dict[int, _Slab] = {}

    def cleanup(self, executor: ThreadPoolExecutor) -> None:
        # Queued chunks are cancelled (their futures fail with ClosedError); running ones finish.
        if not shut_down_io(executor, self.cleanup):
            return
        for slab in self.slabs.values():
            with contextlib.suppress(OSError):
                os.close(slab.fd)
        self.slabs.clear()
        remove_private_dir(self.root)


def _page_floor(n: int) -> int:
    return max(0, n) // PAGE * PAGE


def _libc_sync_file_range() -> Callable[[int, int, int], None] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    wait_write_wait = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on disk after it

    def sync(fd: int, offset: int, length: int) -> None:
        if fn(fd, offset, length, wait_write_wait) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return sync


_sync_file_range = _libc_sync_file_range()


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], pos + written)


def _pread_all(fd: int, view: memoryview, pos: int) -> None:
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], pos + got)
        if k == 0:
            raise CorruptDataError(f"short read at offset {pos + got}: the file was truncated")
        got += k


def _call_finished(
    finished: Callable[[BaseException | None], None], error: BaseException | None
) -> None:
    """Run a completion callback; if it fails, hand it its own error so its future still resolves."""
    try:
        finished(error)
    except BaseException as exc:
        if error is not None:
            raise
        finished(exc)


def _probe_direct(root: str) -> bool:
    """Can this filesystem do O_DIRECT? (tmpfs and some overlay filesystems cannot.)"""
    if not _O_DIRECT:
        return False
    path = os.path.join(root, ".probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_empty(PAGE)
        os.pwrite(fd, memoryview(buf.numpy()), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def check_storable(tensor: torch.Tensor) -> None:
    """A ``TypeError`` naming the fix for a tensor with no plain strided values to store."""
    if tensor.is_nested:
        raise TypeError(
            "nested tensors cannot be stored as one tensor; store each of t.unbind() instead"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(
            f"only strided (dense) tensors can be stored, got layout {tensor.layout}; "
            f"call .to_dense() first"
        )
    if tensor.is_quantized:
        raise TypeError(
            "quantized tensors cannot be stored; call .dequantize() or .int_repr() first"
        )
    if is_traceable_wrapper_subclass(tensor):  # its storage is not its values
        name = type(tensor).__name__
        fix = (
            "store t.to_local() (this rank's shard) or t.full_tensor() (every rank's, gathered)"
            if name == "DTensor"
            else "store the plain tensors it wraps"
        )
        raise TypeError(f"a {name} (a tensor subclass) cannot be stored as it is; {fix}")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat contiguous uint8 tensor (a view when already contiguous)."""
    check_storable(tensor)
    return flat_values(tensor).view(torch.uint8)


class DiskStore(StoreBase):
    """A tensor store on local disk (ideally NVMe) with async, thread-pooled I/O.

    >>> with DiskStore("/mnt/nvme/tt", budget="64GiB") as store:
    ...     h = store.put(x).result()      # Future[DiskHandle]
    ...     y = store.get(h).result()      # bit-identical to x
    ...     store.free(h)

    ``spill_dir``: the directory its private directory is made in (``None``: the system temporary
    directory, ``tempfile.gettempdir()``, which may be RAM-backed tmpfs: pass the NVMe's path).
    ``budget``: the bytes its files may take (``None``: no limit); ``io_threads``: its I/O threads.
    ``direct=None`` uses O_DIRECT if the filesystem supports it; ``False`` forces buffered I/O.
    ``slab_size`` is the preallocation unit; larger tensors get a slab of their own size.
    Implements :class:`~tensortier.tiers.base.Store` (``put_many``/``get_many``: one put or get
    per tensor, all in flight at once). ``.directory`` is its private directory under
    ``spill_dir`` (removed at close).
    """

    tier = "disk"
    _handle_type = DiskHandle
    root = renamed_attribute("root", "directory")  # the vocabulary's name; goes in 0.2

    @renamed(capacity="budget")
    def __init__(
        self,
        spill_dir: str | os.PathLike | None = None,
        *,
        budget: SizeLike | None = None,
        slab_size: SizeLike = "256MiB",
        io_threads: int = 4,
        direct: bool | None = None,
        owner: str = "tensortier",
    ):
        self.budget = (
            None if budget is None else parse_size(budget, name="disk budget", allow_zero=False)
        )
        if self.budget is not None and self.budget < PAGE:
            raise ConfigError(
                f"disk budget={budget!r} is below one {PAGE}-byte page, so no tensor could be "
                f"stored; pass a budget of at least {format_size(PAGE)}, or None for no limit"
            )
        slab = align_up(parse_size(slab_size, name="slab_size", allow_zero=False), PAGE)
        # A slab larger than the budget could never be made: cap it (puts then work up to budget).
        self.slab_size = slab if self.budget is None else min(slab, _page_floor(self.budget))
        io_threads = check_int(
            io_threads,
            f"io_threads={io_threads!r} ({type(io_threads).__name__}): pass the number of I/O "
            f"threads as an int from 1 to {MAX_IO_THREADS}, e.g. io_threads=4 (4-16 saturate an "
            f"NVMe drive)",
            minimum=1,
            maximum=MAX_IO_THREADS,
        )
        if direct is not None and not isinstance(direct, bool):
            raise ConfigError(
                f"direct={direct!r}: pass True (require O_DIRECT), False (buffered I/O) or None "
                f"(O_DIRECT when the filesystem supports it)"
            )
        self.directory = private_dir(spill_dir, owner)
        self._files = _Files(self.directory)
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="tt-disk")
        self._finalizer = Finalizer(self, self._files.cleanup, self._executor)
        can_direct = _probe_direct(self.directory)
        if direct and not can_direct:
            self._finalizer()
            raise SpillDirError(
                f"direct=True but {self.directory!r} does not support O_DIRECT; pass "
                f"direct=None to fall back to buffered I/O",
                path=self.directory,
            )
        self.direct = can_direct if direct is None else bool(direct)
        self.stats = DiskStats(direct_io=self.direct)
        self._lock = threading.Lock()  # bookkeeping only; never held across I/O or a wait
        self._live: dict[int, DiskHandle] = {}
        # extents given back by free() and not yet on a free list: (slab, offset, length)
        self._freed: collections.deque[tuple[int, int, int]] = collections.deque()
        self._slab_ids = itertools.count()
        self._staging = threading.local()
        register_stats("disk_store", self)  # tt.stats() lists it while it is open

    # ---------------------------------------------------------------- allocation
    def _full(self, message: str, requested: int) -> TierFullError:
        """The error for a request of ``requested`` bytes that finds no room (budget or disk)."""
        return TierFullError(
            message,
            tier="disk",
            requested=requested,
            in_use=self.stats.used_bytes,
            limit=self.budget,
        )

    def _allocate(self, length: int) -> tuple[_Slab, int]:
        with self._lock:
            self._check_open()
            self._drain_freed_locked()
            for slab in self._files.slabs.values():
                off = slab.alloc(length)
                if off is not None:
                    return slab, off
            size = self._new_slab_size(length)
            if size < max(self.slab_size, length):  # budget is short: drop empty slabs first
                self._trim_locked()
                size = self._new_slab_size(length)
            if self.budget is not None and length > _page_floor(self.budget):
                raise self._full(
                    f"a {format_size(length)} tensor is larger than the whole disk budget of "
                    f"{format_size(self.budget)}, so freeing tensors cannot make room; raise the "
                    f"budget to at least {format_size(length)}",
                    length,
                )
            if size < length:
                raise self._full(
                    f"disk tier budget exceeded: a {format_size(length)} tensor needs a new "
                    f"file but {format_size(self.stats.file_bytes)} of "
                    f"{format_size(self.budget)} are allocated ({format_size(self.stats.used_bytes)} "
                    f"live). Free tensors or raise the budget.",
                    length,
                )
            slab = self._new_slab(size, length)
            self._files.slabs[slab.index] = slab
            self.stats.file_bytes += slab.size
            off = slab.alloc(length)
            assert off is not None
            return slab, off

    def _new_slab(self, size: int, length: int) -> _Slab:
        """A new slab of ``size`` bytes (lock held). Where the disk has no room for that: one of
        just ``length`` (the tensor's own extent: a nearly full disk still takes what fits), then
        the same again after deleting this store's empty slabs (their space is not contiguous)."""
        error: OSError | None = None
        for trim in (False, True):
            if trim:
                if not any(slab.empty for slab in self._files.slabs.values()):
                    break
                self._trim_locked()
            for want in (size, length) if size > length else (size,):
                index = next(self._slab_ids)
                path = os.path.join(self.directory, f"slab-{index:05d}.bin")
                try:
                    return _Slab(index, path, want, self.direct)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    error = exc
        assert error is not None
        raise self._full(
            f"disk full in {self.directory!r}: cannot preallocate {format_size(length)} "
            f"({error.strerror}). Free space there or pick another spill_dir.",
            length,
        ) from error

    def _new_slab_size(self, length: int) -> int:
        """Size of the next slab: ``slab_size`` (or ``length`` if larger), cut to the budget left."""
        size = max(self.slab_size, length)
        if self.budget is None:
            return size
        return min(size, _page_floor(self.budget - self.stats.file_bytes))

    def _trim_locked(self) -> None:
        for index, slab in list(self._files.slabs.items()):
            if slab.empty:
                os.close(slab.fd)
                os.unlink(slab.path)
                del self._files.slabs[index]
                self.stats.file_bytes -= slab.size

    def trim(self) -> int:
        """Delete slabs that hold no live tensor; returns the bytes given back to the filesystem."""
        with self._lock:
            self._drain_freed_locked()
            before = self.stats.file_bytes
            self._trim_locked()
            return before - self.stats.file_bytes

    def _release(self, slab: _Slab, offset: int, length: int) -> None:
        with self._lock:
            if slab.index in self._files.slabs:
                slab.release(offset, length)

    def _drain_freed_locked(self) -> None:
        """Put the extents queued by :meth:`free` back on their slabs' free lists (lock held)."""
        for index, offset, length in self._take_freed():
            slab = self._files.slabs.get(index)
            if slab is not None:
                slab.release(offset, length)
            self.stats.used_bytes -= length
            self.stats.live_tensors -= 1

    # ---------------------------------------------------------------- public API
    def put(self, tensor: torch.Tensor) -> Future[DiskHandle]:
        """Start writing ``tensor`` (CPU, any dtype/shape/strides); returns a future of its handle.

        Do not modify ``tensor`` in place until the future is done. Raises :class:`TierFullError`
        at once when the budget is exceeded; a full disk fails the future with the same error.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"DiskStore.put(tensor): expected a torch.Tensor, got {type(tensor).__name__}; "
                f"convert it first, e.g. torch.as_tensor(value)"
            )
        check_storable(tensor)
        if tensor.device.type != "cpu":
            raise ValueError(
                f"DiskStore.put(tensor) takes CPU tensors, got one on {tensor.device}; "
                f"use TransferEngine.to_store to move device tensors"
            )
        self._check_open()
        data = as_bytes(tensor.detach())
        nbytes = data.numel()
        length = align_up(nbytes, PAGE)
        slab, offset = self._allocate(length) if length else (None, 0)
        handle = DiskHandle(
            next(_handle_ids),
            slab.index if slab else -1,
            offset,
            length,
            nbytes,
            tensor.dtype,
            tuple(tensor.shape),
        )
        done: Future[DiskHandle] = running()
        sums = [0] * -(-nbytes // _CHUNK)

        def write(fd: int, pos: int, chunk: torch.Tensor) -> None:
            sums[(pos - offset) // _CHUNK] = crc32c.crc32c(memoryview(chunk.numpy()))
            self._write_chunk(fd, pos, chunk)

        def finished(error: BaseException | None) -> None:
            nonlocal handle
            if error is None:
                handle = replace(handle, checksums=tuple(sums))
                with self._lock:
                    self._live[handle.id] = handle
                    self.stats.used_bytes += length
                    self.stats.peak_used_bytes = max(
                        self.stats.peak_used_bytes, self.stats.used_bytes
                    )
                    self.stats.live_tensors += 1
                    self.stats.puts += 1
                done.set_result(handle)
            else:
                if slab is not None:
                    self._release(slab, offset, length)
                done.set_exception(self._translate(error, length))

        self._run_chunks(write, slab, offset, data, finished)
        return done

    def get(self, handle: DiskHandle, *, into: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Start reading a tensor back; returns a future of a CPU tensor bit-identical to the one put.

        ``into``: a uint8 buffer of at least ``handle.length`` bytes to read into (page-aligned
        memory avoids a staging copy); by default a fresh aligned buffer is allocated.
        """
        if not isinstance(handle, DiskHandle):
            raise TypeError(
                f"DiskStore.get(handle): expected the DiskHandle returned by put(), got "
                f"{type(handle).__name__}"
            )
        with self._lock:
            self._check_open()
            if self._live.get(handle.id) is not handle:
                raise KeyError(f"{handle} is not live in this store (freed, or from another store)")
            slab = self._files.slabs.get(handle.slab)
        if into is None:
            into = aligned_empty(handle.length)
        elif (
            into.dtype != torch.uint8
            or into.numel() < handle.length
            or not into.is_contiguous()
            or into.device.type != "cpu"
            or into.data_ptr() % 64
        ):
            raise ValueError(
                f"`into` must be a contiguous, 64-byte aligned CPU uint8 tensor of "
                f">= {handle.length} bytes"
            )
        done: Future[torch.Tensor] = running()

        def finished(error: BaseException | None) -> None:
            if error is not None:
                done.set_exception(error)
                return
            with self._lock:
                self.stats.gets += 1
            done.set_result(into[: handle.nbytes].view(handle.dtype).reshape(handle.shape))

        read = self._checked_read(handle, slab)
        self._run_chunks(read, slab, handle.offset, into[: handle.length], finished)
        return done

    def free(self, handle: DiskHandle) -> None:
        """Give a tensor's extent back. Pending reads of it must have completed.

        Never blocks and never waits for the store's lock, so finalizers and done-callbacks may
        call it: the extent goes onto a lock-free queue, drained here when the lock is free at
        once (the common case: the space is reusable on return) or by the next call that takes it.
        After ``close()`` it is a no-op (everything was freed).
        """
        if not isinstance(handle, DiskHandle):
            raise TypeError(
                f"DiskStore.free(handle): expected the DiskHandle returned by put(), got "
                f"{type(handle).__name__}"
            )
        if self.closed:
            return
        self._unlive(handle)
        self._freed.append((handle.slab, handle.offset, handle.length))  # deque.append: atomic
        self._drain_soon()

    def close(self) -> None:
        """Wait for pending I/O, then delete every file and the private directory."""
        self._finalizer()
        self._live.clear()

    def __repr__(self) -> str:
        return (
            f"DiskStore({self.directory!r}, live={len(self._live)}, "
            f"files={format_size(self.stats.file_bytes)}, direct_io={self.direct})"
        )

    # ---------------------------------------------------------------- I/O
    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"DiskStore {self.directory!r} is closed")

    def _run_chunks(
        self,
        fn,
        slab: _Slab | None,
        offset: int,
        data: torch.Tensor,
        finished: Callable[[BaseException | None], None],
    ) -> None:
        """Run ``fn`` over CHUNK-sized pieces of ``data`` on the pool; call ``finished`` once."""
        n = data.numel()
        starts = list(range(0, n, _CHUNK))
        if not starts:
            _call_finished(finished, None)
            return
        state = {"left": len(starts), "error": None}
        lock = threading.Lock()  # per request; held for two assignments, never across I/O

        def settle(error: BaseException | None) -> None:
            with lock:
                if error is not None and state["error"] is None:
                    state["error"] = error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                _call_finished(finished, state["error"])

        def one(start: int) -> None:
            error = None
            try:
                fn(slab.fd, offset + start, data[start : start + _CHUNK])
            except BaseException as exc:  # delivered through the future, not lost in the pool
                error = exc
            settle(error)

        def cancelled(f: Future) -> None:  # close() dropped the queued chunk: fail, never hang
            if f.cancelled():
                settle(ClosedError(f"DiskStore {self.directory!r} was closed before this I/O ran"))

        try:
            for start in starts:
                self._executor.submit(one, start).add_done_callback(cancelled)
        except RuntimeError as exc:  # executor shut down under us
            raise ClosedError(f"DiskStore {self.directory!r} is closed") from exc

    def _stage(self, need: int) -> torch.Tensor:
        """This I/O thread's aligned bounce buffer for a chunk of ``need`` bytes: pieces of at
        most ``_STAGE`` bytes, the buffer sized to the largest piece the thread has carried, in
        powers of two from ``_STAGE_MIN`` (headroom: a buffer regrown by every slightly larger
        chunk is page-faulted anew each time). Why not ``_STAGE`` from the start: the buffer is
        resident, and on a CPU-only machine a memory budget pays for it; an offloader whose
        saved tensors are all below 4 MiB was charged 4 MiB per thread (issue 27)."""
        want = min(_STAGE, max(_STAGE_MIN, 1 << (max(1, need) - 1).bit_length()))
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < want:
            held = 0 if buf is None else buf.numel() + PAGE
            buf = self._staging.buf = aligned_empty(want)
            with self._lock:  # aligned_empty over-allocates a page
                self.stats.staging_bytes += want + PAGE - held
        return buf

    def _write_chunk(self, fd: int, pos: int, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        n = data.numel()
        if self.direct and (data.data_ptr() % PAGE or n % PAGE):
            stage = self._stage(n)  # unaligned memory: copy through a small aligned buffer
            step = stage.numel()
            for start in range(0, n, step):
                piece = data[start : start + step]
                k = piece.numel()
                padded = align_up(k, PAGE)
                stage[:k].copy_(piece)
                if padded > k:
                    stage[k:padded].zero_()
                _pwrite_all(fd, memoryview(stage[:padded].numpy()), pos + start)
        else:
            _pwrite_all(fd, memoryview(data.numpy()), pos)
            if not self.direct:
                if _sync_file_range is not None:
                    _sync_file_range(fd, pos, n)
                else:
                    os.fdatasync(fd)
                os.posix_fadvise(fd, pos, n, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.stats.bytes_written += n
            self.stats.write_seconds += time.perf_counter() - t0

    def _read_chunk(self, fd: int, pos: int, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        n = data.numel()
        if self.direct and data.data_ptr() % PAGE:
            stage = self._stage(n)
            step = stage.numel()
            for start in range(0, n, step):
                k = min(step, n - start)
                _pread_all(fd, memoryview(stage[:k].numpy()), pos + start)
                data[start : start + k].copy_(stage[:k])
        else:
            _pread_all(fd, memoryview(data.numpy()), pos)
            if not self.direct:
                os.posix_fadvise(fd, pos, n, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.stats.bytes_read += n
            self.stats.read_seconds += time.perf_counter() - t0

    def _checked_read(self, handle: DiskHandle, slab: _Slab | None) -> Callable:
        """A chunk reader for ``handle`` that checks each chunk's CRC32C: a spill file changed or
        cut by anything but this store raises :class:`CorruptDataError`, never returns garbage."""

        def read(fd: int, pos: int, chunk: torch.Tensor) -> None:
            start = pos - handle.offset
            path = slab.path if slab else self.directory
            where = f"spill file {path!r}"
            try:
                self._read_chunk(fd, pos, chunk)
            except CorruptDataError as exc:
                raise CorruptDataError(f"{where}: {exc}; the tensor is lost", path=path) from exc
            data = chunk[: max(0, handle.nbytes - start)]
            if crc32c.crc32c(memoryview(data.numpy())) != handle.checksums[start // _CHUNK]:
                raise CorruptDataError(
                    f"{where} is damaged: bytes {pos}..{pos + data.numel()} of a "
                    f"{handle.dtype} tensor of shape {handle.shape} fail their CRC32C (something "
                    f"other than this store changed the file); the tensor is lost. Nothing else "
                    f"may write to the store's private directory {self.directory!r}",
                    path=path,
                )

        return read

    def _translate(self, error: BaseException, length: int) -> BaseException:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            full = self._full(
                f"disk full while writing {format_size(length)} to {self.directory!r} ({error.strerror}). "
                f"The write was rolled back; free space there or pick another spill_dir.",
                length,
            )
            full.__cause__ = error
            return full
        return error
