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

import crc32c
import numpy as np

from tensortier import _modes
from tensortier.data import _aio
from tensortier.data._format import segment_path
from tensortier.errors import ClosedError, CorruptDataError, TierFullError
from tensortier.tiers.host import PAGE
from tensortier.tiers.segments import MAGIC, MAGIC_C, REC, item_ok

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


def _pread_into(fd: int, buf, pos: int, direct: bool) -> int:
    """Fill ``buf`` (an array or memoryview) from ``pos``; returns the bytes read (fewer only at
    end of file)."""
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
    buf, pos, ok = read_spans(
        files, indices, rows, sizes, direct=direct, gap=gap, stats=stats, errors=errors,
        scratch=scratch,
    )  # fmt: skip
    ends = (pos + rows["len"]).tolist()
    return [
        buf[p + REC.size : e] if good else None
        for p, e, good in zip(pos.tolist(), ends, ok.tolist())
    ]


def read_spans(
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read and check records ``indices``: ``(buf, pos, ok)``, record ``p`` being
    ``buf[pos[p] : pos[p] + rows["len"][p]]`` (header included) where ``ok[p]``.

    One ``preadv`` per coalesced run, one descriptor acquired per segment; the header of every
    record is checked against its row with array operations over the whole read, then each CRC is
    one C call (no per-record Python beyond it). Bad records raise, or go to ``errors``
    (see :func:`read_blobs`).
    """
    n = len(indices)
    pos, ok = np.zeros(n, np.int64), np.zeros(n, bool)
    good = rows_ok(rows, sizes) if n else ok
    if not good.all():  # damaged index rows: reported (or raised) here, the others read
        keys = indices.tolist()
        for p in np.flatnonzero(~good).tolist():
            path, reason = row_problem(files.root, rows[p].item(), sizes)
            _bad(errors, keys[p], path, reason)
    sel = np.flatnonzero(good)
    plan = _Plan(rows[sel], gap, direct)
    buf = scratch.take(plan.total) if scratch is not None else aligned_buffer(plan.total)
    got, missing = plan.read(files, buf, direct, stats)
    pos[sel] = plan.pos
    ok[sel] = _check(files.root, buf, plan, indices[sel], rows[sel], got, missing, errors)
    return buf, pos, ok


class _Plan:
    """Coalesced runs of records (sorted by segment and offset) and where each lands in the
    read buffer: every run starts page-aligned there (``O_DIRECT`` reads need it)."""

    def __init__(self, rows: np.ndarray, gap: int, direct: bool) -> None:
        n = len(rows)
        seg, off = rows["seg"].astype(np.int64), rows["off"].astype(np.int64)
        end = off + rows["len"].astype(np.int64)
        self.order = order = np.lexsort((off, seg))
        s, o, e = seg[order], off[order], end[order]
        base = s << 40  # one address space (segments < 1 TiB): the running end restarts per file
        new = np.ones(n, bool)
        if n:
            reach = np.maximum.accumulate(base + e)
            new[1:] = (s[1:] != s[:-1]) | (base[1:] + o[1:] > reach[:-1] + gap)
        first = np.flatnonzero(new)
        run = np.cumsum(new) - 1  # run of each sorted record
        self.seg, lo = s[first], o[first]
        hi = np.maximum.reduceat(e, first) if n else lo
        if direct:
            lo, hi = lo - lo % PAGE, -(-hi // PAGE) * PAGE
        size = -(-(hi - lo) // PAGE) * PAGE
        self.lo, self.hi = lo, hi
        self.at = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
        self.total = int(size.sum())
        self.run = np.empty(n, np.int64)
        self.run[order] = run
        self.pos = self.at[self.run] + off - lo[self.run]

    def read(self, files: Descriptors, buf, direct: bool, stats) -> tuple[np.ndarray, np.ndarray]:
        """Read every run, all submitted at once with AIO where the reads are ``O_DIRECT`` (else
        one ``preadv`` each); one descriptor per segment. (bytes got, segment missing) per run."""
        runs = len(self.seg)
        got, missing = np.zeros(runs, np.int64), np.zeros(runs, bool)
        fds = np.full(runs, -1, np.int64)
        bounds = [0, *(np.flatnonzero(np.diff(self.seg)) + 1).tolist(), runs] if runs else [0]
        held: list[int] = []
        try:
            for a, b in zip(bounds[:-1], bounds[1:]):  # runs a..b read one segment
                seg = int(self.seg[a])
                try:
                    fds[a:b] = files.acquire(seg, direct)
                except FileNotFoundError:
                    missing[a:b] = True
                    continue
                held.append(seg)
            ctx = _aio.context() if direct and runs > 1 else None
            if ctx is not None:
                self._submit(ctx, buf, fds, got, missing)
            else:
                self._preadv(buf, fds, got, missing, direct)
        finally:
            for seg in held:
                files.release(seg, direct)
        if stats is not None:
            stats.reads += int((~missing).sum())
            stats.bytes_read += int(got.sum())
            stats.records += int((~missing[self.run]).sum())
        return got, missing

    def _preadv(self, buf, fds, got, missing, direct: bool, runs=None) -> None:
        view, lo, hi, at = memoryview(buf), self.lo, self.hi, self.at
        todo = np.flatnonzero(~missing) if runs is None else runs
        for r in todo.tolist():  # (got[r] > 0: the rest of a run AIO read in part)
            a, b, pos = int(at[r] + got[r]), int(at[r] + hi[r] - lo[r]), int(lo[r] + got[r])
            got[r] += _pread_into(int(fds[r]), view[a:b], pos, direct)

    def _submit(self, ctx, buf, fds, got, missing) -> None:
        """AIO reads of every run, :data:`_aio.DEPTH` at a time; runs that came back short
        without reaching the end of the file are finished with ``preadv``."""
        live = np.flatnonzero(~missing)
        want = self.hi - self.lo
        addr = buf.ctypes.data + self.at
        for c in range(0, len(live), _aio.DEPTH):
            r = live[c : c + _aio.DEPTH]
            res = ctx.read(_aio.control_blocks(fds[r], addr[r], want[r], self.lo[r]))
            if (res < 0).any():
                err = int(-res[res < 0][0])
                raise OSError(err, os.strerror(err))
            got[r] = res
        short = live[(got[live] < want[live]) & (got[live] > 0) & (got[live] % PAGE == 0)]
        if len(short):
            self._preadv(buf, fds, got, missing, True, short)


_HEAD = np.arange(REC.size)


def _check(root, buf, plan: _Plan, keys, rows, got, missing, errors) -> np.ndarray:
    """Which records of ``plan`` are whole, match their index row and pass their CRC; the
    others go to :func:`_bad` in (segment, offset) order."""
    lens = rows["len"].astype(np.int64)
    run, pos = plan.run, plan.pos
    whole = ~missing[run] & (pos + lens <= plan.at[run] + got[run])
    ok = whole.copy()
    w = np.flatnonzero(whole)
    if len(w):
        head = buf[pos[w, None] + _HEAD]  # (records, 24): a copy, so it can be viewed as ints
        fields = head[:, :16].view("<u4")
        magic = fields[:, 0]
        ok[w] = (
            ((magic == MAGIC_C) | (magic == MAGIC))
            & (fields[:, 1] == lens[w] - REC.size)
            & (fields[:, 2] == rows["crc"][w])
            & (fields[:, 3] == 0)
            & (head[:, 16:].view("<i8")[:, 0] == keys[w])
        )
        c = w[ok[w] & (magic == MAGIC_C)]
        view = memoryview(buf)
        sums = [  # format 3: CRC-32C of length | flags | key | payload (the CRC field skipped)
            crc32c.crc32c(view[p + 12 : p + n], crc32c.crc32c(view[p + 4 : p + 8]))
            for p, n in zip(pos[c].tolist(), lens[c].tolist())
        ]
        ok[c] = np.asarray(sums, np.int64) == rows["crc"][c]
        for p in w[ok[w] & (magic == MAGIC)].tolist():  # format 2 (zlib), never written here
            ok[p] = item_ok(view, int(pos[p]), int(lens[p]), int(keys[p]), int(rows["crc"][p]))
    for p in plan.order[~ok[plan.order]].tolist():
        _report(root, plan, p, keys, rows, got, missing, errors)
    return ok


def _report(root, plan: _Plan, p: int, keys, rows, got, missing, errors) -> None:
    """Raise (or record) why record ``p`` of ``plan`` is bad."""
    r, off, n = int(plan.run[p]), int(rows["off"][p]), int(rows["len"][p])
    if missing[r]:
        reason = "the segment file is missing"
    elif plan.pos[p] + n > plan.at[r] + got[r]:
        reason = (
            f"the file ends at byte {int(plan.lo[r] + got[r])} but the record spans bytes "
            f"{off}..{off + n} (the file was truncated)"
        )
    else:
        reason = (
            f"the record at offset {off} failed its check (header, length or CRC): the file was "
            f"modified or damaged"
        )
    _bad(errors, int(keys[p]), segment_path(root, int(plan.seg[r])), reason)


def _bad(errors: list | None, key: int, path: str, reason: str) -> None:
    """A bad record: CorruptDataError, or ``(key, path, reason)`` appended to ``errors``."""
    if errors is None:
        raise CorruptDataError(f"record {key} in {path}: {reason}", path=path)
    errors.append((key, path, reason))


def read_one(
    files: Descriptors, index: int, row: tuple, sizes: dict[int, int], stats: ReadStats | None
) -> np.ndarray:
    """The blob of one record (``row`` = its index row as a tuple): one ``pread``, no planning."""
    seg, length, off, crc = row
    limit = sizes.get(seg)
    if limit is None or length < REC.size or off + length > limit:
        path, problem = row_problem(files.root, row, sizes)
        raise CorruptDataError(f"record {index} in {path}: {problem}", path=path)
    buf = np.empty(length, np.uint8)  # numpy memory is 16-aligned: the fields' 8 are kept
    try:
        fd = files.acquire(seg, False)
    except FileNotFoundError as exc:
        path = segment_path(files.root, seg)
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
        path = segment_path(files.root, seg)
        raise CorruptDataError(
            f"record {index} in {path}: the file ends at byte {off + got} but the record spans "
            f"bytes {off}..{off + length} (the file was truncated)",
            path=path,
        )
    if not item_ok(memoryview(buf), 0, length, index, crc):
        path = segment_path(files.root, seg)
        raise CorruptDataError(
            f"record {index} in {path}: the record at offset {off} failed its check (header, "
            f"length or CRC): the file was modified or damaged",
            path=path,
        )
    return buf[REC.size :]
