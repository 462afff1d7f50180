"""Reading records of a catalog: descriptors per process, coalesced reads, per-record checks.

Descriptors. One :class:`Descriptors` per process (a forked DataLoader worker makes its own on
first use and never touches the parent's lock or table). Segment files are opened on demand,
read-only, buffered or ``O_DIRECT``, and kept open up to ``max_open`` (idle ones closed least
recently used first); a descriptor in use by a read is never closed under it. The lock guards the
table only, never I/O.

Reads. :func:`read_blobs` sorts the wanted records by (segment, offset), coalesces neighbours
(``tiers.segments.coalesce``) and reads each run with one ``preadv`` into a fresh buffer,
page-aligned so the same code serves ``O_DIRECT``. Every record is checked against its index row
(key = record index, length, CRC) and its own header CRC; a record that fails, or that a truncated
file no longer holds, raises :class:`CorruptDataError` naming the record index and the file (or is
reported to ``errors``, for ``verify``). The blobs returned are views of the read buffers.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
from collections import OrderedDict

import numpy as np

from tensortier import _modes
from tensortier.data._format import segment_path
from tensortier.errors import ClosedError, CorruptDataError, TierFullError
from tensortier.tiers.host import PAGE
from tensortier.tiers.segments import REC, coalesce, item_ok

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _max_open_default() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(4, min(256, soft // 4))


class Descriptors:
    """Read-only descriptors of one catalog's segment files, for the process that made it."""

    def __init__(self, root: str, max_open: int | None = None):
        self.root = root
        self.pid = os.getpid()
        self.max_open = max(2, max_open or _max_open_default())
        self._lock = threading.Lock()
        self._fds: OrderedDict[tuple[int, bool], list[int]] = OrderedDict()  # -> [fd, users]
        self.closed = False  # set by close(): nothing opens again (a running loader stops)

    def acquire(self, seg: int, direct: bool) -> int:
        """A descriptor of segment ``seg`` for one read; :meth:`release` it after."""
        key = (seg, direct)
        with self._lock:
            if self.closed:
                raise ClosedError(f"Catalog {self.root!r} is closed")
            entry = self._fds.get(key)
            if entry is not None:
                entry[1] += 1
                self._fds.move_to_end(key)
                return entry[0]
        flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
        try:
            fd = os.open(segment_path(self.root, seg), flags)
        except PermissionError as exc:
            raise _modes.denied(segment_path(self.root, seg), exc, "Catalog") from exc
        except OSError as exc:
            if exc.errno not in (24, 23):  # EMFILE, ENFILE
                raise
            self.trim(0)
            try:
                fd = os.open(segment_path(self.root, seg), flags)
            except OSError as exc2:
                raise TierFullError(
                    f"cannot open {segment_path(self.root, seg)!r}: the process has no file "
                    f"descriptors left ({exc2.strerror}); raise the open-file limit (ulimit -n)",
                    tier="disk",
                    requested=0,
                ) from exc2
        with self._lock:
            if self.closed:  # closed while we opened it: it must not outlive the catalog
                os.close(fd)
                raise ClosedError(f"Catalog {self.root!r} is closed")
            entry = self._fds.get(key)
            if entry is not None:  # another thread opened it meanwhile: use theirs
                os.close(fd)
                entry[1] += 1
                return entry[0]
            self._fds[key] = [fd, 1]
            self._trim_locked(self.max_open)
        return fd

    def release(self, seg: int, direct: bool) -> None:
        with self._lock:
            entry = self._fds.get((seg, direct))
            if entry is not None:
                entry[1] -= 1
            if self.closed:
                self._trim_locked(0)
            elif len(self._fds) > self.max_open:
                self._trim_locked(self.max_open)

    def trim(self, keep: int) -> None:
        with self._lock:
            self._trim_locked(keep)

    def _trim_locked(self, keep: int) -> None:
        for key in list(self._fds):
            if len(self._fds) <= keep:
                return
            fd, users = self._fds[key]
            if users == 0:
                del self._fds[key]
                with contextlib.suppress(OSError):
                    os.close(fd)

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        """Close every descriptor; later :meth:`acquire` calls raise ClosedError.

        Runs on the closing thread or the reaper (``_lifetime.Finalizer``), never inside GC, so
        it may take the table's lock (held only for table updates, never during I/O). A read in
        flight keeps its descriptor until its release: its number is never reused under it.
        """
        with self._lock:
            self.closed = True
            self._trim_locked(0)  # descriptors in use are closed by their last release()


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, writable uint8 array (what ``O_DIRECT`` reads need)."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def _pread_into(fd: int, buf: np.ndarray, pos: int, direct: bool) -> int:
    """Fill ``buf`` from ``pos``; returns the bytes read (fewer only at end of file)."""
    view = memoryview(buf)
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], pos + got)
        if k == 0:
            break
        got += k
        if direct and got % PAGE:  # O_DIRECT: only the end of the file gives an unaligned count
            break
    return got


class ReadStats:
    """Counters of one reader (plain ints: updated by one thread at a time or racily-summed)."""

    __slots__ = ("reads", "bytes_read", "records")

    def __init__(self) -> None:
        self.reads = 0
        self.bytes_read = 0
        self.records = 0


class Scratch:
    """A reusable read buffer of one I/O thread.

    Decoded records are views of the buffer they were read into; once none survives (bytes, str
    and numbers are copies), the buffer's reference count is back to ours alone and the next
    piece reuses it, instead of paying a page fault per 4 KiB of fresh memory.
    """

    def __init__(self) -> None:
        self.raw: np.ndarray | None = None

    def take(self, nbytes: int) -> np.ndarray:
        raw = self.raw
        if raw is None or len(raw) < nbytes + PAGE:
            raw = self.raw = np.empty(max(nbytes, 1 << 20) + PAGE, np.uint8)
        start = (-raw.ctypes.data) % PAGE
        return raw[start : start + nbytes]

    def release(self) -> None:
        """Call when the caller holds no view of the buffer; records still may."""
        if self.raw is not None and sys.getrefcount(self.raw) > 2:  # ours + the argument
            self.raw = None  # a record keeps a view: it owns the buffer now


def rows_ok(rows: np.ndarray, sizes: dict[int, int]) -> np.ndarray:
    """Which index ``rows`` name a segment of the catalog and a span inside it, at least a
    record header long (a flipped bit in the index must not become a huge or negative read)."""
    if not sizes:
        return np.zeros(len(rows), bool)
    known = np.fromiter(sizes, np.int64, len(sizes))
    limits = np.fromiter(sizes.values(), np.uint64, len(sizes))
    order = np.argsort(known)
    known, limits = known[order], limits[order]
    seg = rows["seg"].astype(np.int64)
    at = np.minimum(np.searchsorted(known, seg), len(known) - 1)
    limit = limits[at]
    length = rows["len"].astype(np.uint64)
    with np.errstate(over="ignore"):  # limit - length wraps only where length > limit: refused
        return (
            (known[at] == seg)
            & (length >= REC.size)
            & (length <= limit)
            & (rows["off"] <= limit - length)
        )


def row_problem(root: str, row: tuple, sizes: dict[int, int]) -> tuple[str, str]:
    """(segment file, what is wrong with index ``row`` = (seg, len, off, crc), or "")."""
    seg, length, off, _ = row
    path = segment_path(root, seg)
    if seg not in sizes:
        return path, (
            f"its index row names segment {seg}, which the catalog does not have (the index "
            f"is damaged; rebuild the catalog)"
        )
    if length < REC.size or off + length > sizes[seg]:
        return path, (
            f"its index row spans bytes {off}..{off + length}, which is not a record of this "
            f"{sizes[seg]}-byte segment (the index is damaged; rebuild the catalog)"
        )
    return path, ""


def read_blobs(
    files: Descriptors,
    indices: np.ndarray,
    rows: np.ndarray,
    sizes: dict[int, int],
    *,
    direct: bool = False,
    gap: int = 64 << 10,
    stats: ReadStats | None = None,
    errors: list | None = None,
    scratch: Scratch | None = None,
) -> list[np.ndarray | None]:
    """The blobs of records ``indices`` (their index ``rows``), in the order asked, as views.

    ``errors``: instead of raising, append ``(index, file, reason)`` for each bad record and
    return None in its place (``verify``). ``scratch``: read into its buffer (see
    :class:`Scratch`); by default into fresh memory.
    """
    out: list[np.ndarray | None] = [None] * len(indices)
    if not len(indices):
        return out
    ok = rows_ok(rows, sizes)
    if not ok.all():  # damaged index rows: reported (or raised) here, the others read
        keys = indices.tolist()
        for p in np.flatnonzero(~ok).tolist():
            path, reason = row_problem(files.root, rows[p].item(), sizes)
            _bad(errors, keys[p], path, reason)
        sel = np.flatnonzero(ok)
        got = read_blobs(
            files, indices[sel], rows[sel], sizes, direct=direct, gap=gap, stats=stats,
            errors=errors, scratch=scratch,
        )  # fmt: skip
        for p, blob in zip(sel.tolist(), got):
            out[p] = blob
        return out
    runs = list(coalesce(rows["seg"], rows["off"], rows["len"], gap))
    spans, total = [], 0
    for _, start, end, _ in runs:  # each run page-aligned in the buffer (O_DIRECT needs it)
        lo = start - start % PAGE if direct else start
        hi = -(-end // PAGE) * PAGE if direct else end
        spans.append((lo, hi, total))
        total += -(-(hi - lo) // PAGE) * PAGE
    buf = scratch.take(total) if scratch is not None else aligned_buffer(total)
    reader = _RunReader(files, buf, indices, rows, direct, stats, errors)
    for (seg, _, _, members), span in zip(runs, spans):
        reader.read(seg, members.tolist(), *span, out)
    return out


def _bad(errors: list | None, key: int, path: str, reason: str) -> None:
    """A bad record: CorruptDataError, or ``(key, path, reason)`` appended to ``errors``."""
    if errors is None:
        raise CorruptDataError(f"record {key} in {path}: {reason}", path=path)
    errors.append((key, path, reason))


class _RunReader:
    """Reads coalesced runs of records into one buffer and checks every record read."""

    def __init__(self, files, buf, indices, rows, direct, stats, errors) -> None:
        self.files, self.buf, self.view = files, buf, memoryview(buf)
        self.offs, self.lens = rows["off"].tolist(), rows["len"].tolist()
        self.crcs, self.keys = rows["crc"].tolist(), indices.tolist()
        self.direct, self.stats, self.errors = direct, stats, errors

    def read(self, seg: int, members: list[int], lo: int, hi: int, at: int, out: list) -> None:
        """Read bytes ``lo..hi`` of segment ``seg`` to ``buf[at:]``; ``out[p]`` for each record
        ``p`` of ``members`` that is whole and intact."""
        path = segment_path(self.files.root, seg)
        try:
            fd = self.files.acquire(seg, self.direct)
        except FileNotFoundError:
            for p in members:
                _bad(self.errors, self.keys[p], path, "the segment file is missing")
            return
        try:
            got = _pread_into(fd, self.buf[at : at + hi - lo], lo, self.direct)
        finally:
            self.files.release(seg, self.direct)
        if self.stats is not None:
            self.stats.reads += 1
            self.stats.bytes_read += got
            self.stats.records += len(members)
        for p in members:
            o, n, off = at + self.offs[p] - lo, self.lens[p], self.offs[p]
            if o + n > at + got:
                reason = (
                    f"the file ends at byte {lo + got} but the record spans bytes "
                    f"{off}..{off + n} (the file was truncated)"
                )
            elif not item_ok(self.view, o, n, self.keys[p], self.crcs[p]):
                reason = (
                    f"the record at offset {off} failed its check (header, length or CRC): the "
                    f"file was modified or damaged"
                )
            else:
                out[p] = self.buf[o + REC.size : o + n]
                continue
            _bad(self.errors, self.keys[p], path, reason)


def read_one(
    files: Descriptors, index: int, row: tuple, sizes: dict[int, int], stats: ReadStats | None
) -> np.ndarray:
    """The blob of one record (``row`` = its index row as a tuple): one ``pread``, no planning."""
    seg, length, off, crc = row
    path, problem = row_problem(files.root, row, sizes)
    if problem:
        raise CorruptDataError(f"record {index} in {path}: {problem}", path=path)
    buf = np.empty(length, np.uint8)  # numpy memory is 16-aligned: the fields' 8 are kept
    try:
        fd = files.acquire(seg, False)
    except FileNotFoundError as exc:
        raise CorruptDataError(
            f"record {index} in {path}: the segment file is missing", path=path
        ) from exc
    try:
        got = _pread_into(fd, buf, off, False)
    finally:
        files.release(seg, False)
    if stats is not None:
        stats.reads += 1
        stats.bytes_read += got
        stats.records += 1
    if got < length:
        raise CorruptDataError(
            f"record {index} in {path}: the file ends at byte {off + got} but the record spans "
            f"bytes {off}..{off + length} (the file was truncated)",
            path=path,
        )
    if not item_ok(memoryview(buf), 0, length, index, crc):
        raise CorruptDataError(
            f"record {index} in {path}: the record at offset {off} failed its check (header, "
            f"length or CRC): the file was modified or damaged",
            path=path,
        )
    return buf[REC.size :]
