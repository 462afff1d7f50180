"""Append-only segment files of variable-size records: the on-disk format of the RL stores
(replay buffer, memory bank: keyed, mutable through tombstones and compaction) and of the dataset
catalog (``tensortier.data``: write-once, the key of a record is its index).

Why not :class:`~tensortier.tiers.disk.DiskStore` extents: it rounds every tensor to 4 KiB
pages (a 10 KB transition would waste 20%), runs one thread-pool future per tensor (tens of
microseconds each, more than the read itself for small items), and its handles are never
persisted, so it cannot back a buffer that survives a restart. Segments pack records back to back,
spill a batch of items in one ``write``, read a batch of items with offset-sorted, coalesced
``pread`` calls, and can be re-scanned after a crash.

Record: ``magic u32 | payload length u32 | crc32 u32 | flags u32 | key i64 | payload``. Format 2
(magic ``TTR2``, what the RL stores write) checksums ``length | flags | key | payload`` with zlib's
CRC-32, so a flipped bit anywhere in a record is caught. Format 3 (``TTR3``,
``Segments(checksum="crc32c")``, what the catalog writes) checksums the same bytes with CRC-32C,
which the ``crc32c`` package computes in hardware at ~10 GB/s (zlib: 2-4 GB/s here, a third of a
catalog reader's CPU). Format 1 (``TTR1``, written before format 2 existed) checksummed the
payload only. Every format is read, each record's magic picking the rule.
``flags`` is 0 for an item and 1 for a tombstone (the key was removed; empty payload). A crash can
only tear the tail of the newest segment: :meth:`Segments.scan` stops there and truncates it
(never in ``readonly`` mode, which refuses any damage: reading a saved copy never modifies it).
Records are never rewritten in place; compaction (in ``_store.py``) copies a segment's live
records to the active segment and deletes the file, so the space of removed items comes back.

File modes. Files are created exclusively, never through a symlink, with exactly
``Segments(mode=...)`` (0600 by default; durable artifacts share one mode: ``_modes.py``).

Parallel writers. Each writer owns its files: ``Segments(root, first=w, step=n)`` numbers its
segments ``w, w + n, w + 2n, ...`` so ``n`` writers can fill one directory at once.

Direct appends. ``Segments(direct=True)`` (write-once builders: the dataset catalog) copies each
batch into a page-aligned staging buffer after the bytes of the file's last partial page and
writes it with ``O_DIRECT``, page-rounded: no page cache (buffered writes of gigabytes cost a CPU
core in page allocation and reclaim here, and evict what readers cache), one copy. The file ends
in zero padding up to a page boundary until :meth:`sync` or :meth:`close` truncates it to the
records. Falls back to buffered writes where the filesystem refuses ``O_DIRECT``.

Open files. Descriptors are opened on demand and kept in a small LRU (the active segment always
stays open), so a store with thousands of segments stays far below the process's open-file limit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

from tensortier._units import format_size
from tensortier.errors import CorruptDataError, TierFullError

REC = struct.Struct("<IIIIq")
_BODY = BODY = struct.Struct("<IIq")  # length | flags | key: the fields the format-2/3 CRC covers
MAGIC = 0x32525454  # b"TTR2" on disk
MAGIC_C = 0x33525454  # b"TTR3": format 2's coverage, CRC-32C
MAGIC_V1 = 0x31525454  # b"TTR1": payload-only CRC, read but never written
TOMBSTONE = 1
_NAME = re.compile(r"^seg-(\d{8})\.ttr$")
_GAP = 64 << 10  # coalesce reads of records closer than this
_PAGE = PAGE = 4096  # O_DIRECT alignment of offsets, lengths and memory


def record_crc(length: int, flags: int, key: int, payload: bytes | memoryview) -> int:
    """The format-2 checksum: header fields and payload."""
    return zlib.crc32(payload, zlib.crc32(_BODY.pack(length, flags, key)))


def record_crc32c(length: int, flags: int, key: int, payload: bytes | memoryview) -> int:
    """The format-3 checksum: header fields and payload, CRC-32C."""
    return crc32c.crc32c(payload, crc32c.crc32c(_BODY.pack(length, flags, key)))


def record_crc32c_parts(length: int, flags: int, key: int, parts) -> int:
    """:func:`record_crc32c` of the payload that ``parts`` (buffers) make back to back."""
    crc = crc32c.crc32c(_BODY.pack(length, flags, key))
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return crc


_MAGICS = (MAGIC, MAGIC_C, MAGIC_V1)
CHECKSUMS = {"crc32": (MAGIC, record_crc), "crc32c": (MAGIC_C, record_crc32c)}


def record_ok(magic: int, plen: int, crc: int, flags: int, key: int, payload) -> bool:
    """Does a record (header fields + payload) pass its checks?"""
    if flags not in (0, TOMBSTONE) or key < 0 or (flags == TOMBSTONE and plen):
        return False
    if magic == MAGIC:
        return crc == record_crc(plen, flags, key, payload)
    if magic == MAGIC_C:
        return crc == record_crc32c(plen, flags, key, payload)
    return magic == MAGIC_V1 and crc == zlib.crc32(payload)


def item_ok(data, off: int, length: int, key: int, crc: int) -> bool:
    """Is ``data[off : off + length]`` the format-2 item record of ``key`` with checksum ``crc``?

    The hot check of readers that keep an index of (length, CRC) per key; ``data`` is a
    memoryview (the caller checked the bounds).
    """
    magic, plen, rcrc, flags, rkey = REC.unpack_from(data, off)
    if rcrc != crc or rkey != key or flags != 0 or plen != length - REC.size:
        return False
    body = _BODY.pack(plen, 0, key)
    payload = data[off + REC.size : off + length]
    if magic == MAGIC_C:
        return crc32c.crc32c(payload, crc32c.crc32c(body)) == crc
    return magic == MAGIC and zlib.crc32(payload, zlib.crc32(body)) == crc


def payload_of(
    data, off: int, length: int, *, key: int | None = None, crc: int | None = None
) -> memoryview | None:
    """The payload of the item record at ``data[off : off + length]``, or None if it fails a check.

    ``length`` counts the header. Checks magic, length, flags and the CRC; ``key`` and ``crc``,
    when given, must also match the header (an index that knows them catches a record moved or
    swapped whole). Returns a view into ``data`` (no copy).
    """
    if off < 0 or length < REC.size or off + length > len(data):
        return None
    magic, plen, rcrc, flags, rkey = REC.unpack_from(data, off)
    payload = memoryview(data)[off + REC.size : off + length]
    if plen != length - REC.size or flags != 0:
        return None
    if (key is not None and rkey != key) or (crc is not None and rcrc != crc):
        return None
    return payload if record_ok(magic, plen, rcrc, flags, rkey, payload) else None


def coalesce(seg: np.ndarray, off: np.ndarray, length: np.ndarray, gap: int = _GAP):
    """Group records into reads: yields (segment, start, end, rows) in (segment, offset) order.

    ``rows`` are positions in the input arrays of the records that ``[start, end)`` of the segment
    covers; records closer than ``gap`` bytes share one read.
    """
    n = len(seg)
    if n == 0:
        return
    order = np.lexsort((off, seg))
    s, o = seg[order].astype(np.int64), off[order].astype(np.int64)
    e = o + length[order].astype(np.int64)
    base = s << 40  # one address space (segments < 1 TiB), so the running end restarts per file
    reach = np.maximum.accumulate(base + e)  # end of everything read so far
    new = np.ones(n, bool)
    new[1:] = (s[1:] != s[:-1]) | (base[1:] + o[1:] > reach[:-1] + gap)
    starts = np.flatnonzero(new).tolist() + [n]
    for a, b in zip(starts[:-1], starts[1:]):
        yield int(s[a]), int(o[a]), int(e[a:b].max()), order[a:b]


def _max_open_default() -> int:
    """Descriptors one store keeps open: a small share of the process limit, 4 to 64."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):  # pragma: no cover - every Linux has it
        return 16
    if soft == resource.RLIM_INFINITY:
        return 64
    return max(4, min(64, soft // 8))


@dataclass
class SegmentStats:
    files: int = 0
    file_bytes: int = 0
    live_bytes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    reads: int = 0  # pread calls
    compactions: int = 0
    bytes_compacted: int = 0
    open_files: int = 0  # descriptors open now (bounded by the LRU)


_IOV = 1024  # buffers per pwritev call (IOV_MAX on Linux)


def _nbytes(payload) -> int:
    """Bytes of a record's payload: one buffer, or a tuple of buffers written back to back."""
    return sum(map(len, payload)) if isinstance(payload, tuple) else len(payload)


def _copy_parts(view: memoryview, at: int, parts: list) -> None:
    """Copy ``parts`` back to back into ``view`` from ``at``."""
    for part in parts:
        view[at : at + len(part)] = part
        at += len(part)


def aligned_buffer(size: int) -> np.ndarray:
    """A page-aligned uint8 buffer of ``size`` bytes (what O_DIRECT writes from)."""
    raw = np.empty(size + _PAGE, np.uint8)
    at = (-raw.ctypes.data) % _PAGE
    return raw[at : at + size]


def _pwrite_all(fd: int, parts: list, offset: int) -> None:
    """Write ``parts`` back to back at ``offset`` with pwritev, finishing any short write."""
    for i in range(0, len(parts), _IOV):
        chunk = parts[i : i + _IOV]
        want = sum(len(p) for p in chunk)
        done = os.pwritev(fd, chunk, offset)
        if done < want:  # rare on regular files: finish with plain writes
            rest = memoryview(b"".join(chunk))[done:]
            while len(rest):
                k = os.pwrite(fd, rest, offset + done)
                done += k
                rest = rest[k:]
        offset += want


class Segments:
    """Numbered append-only files in ``root``; the caller keeps the index (segment, offset, length).

    ``readonly=True`` opens files ``O_RDONLY`` (a saved copy on a read-only mount), refuses writes
    and makes :meth:`scan` strict. Not thread-safe: the owner serialises calls (a concurrent
    reader opens its own ``Segments`` on the same directory).
    """

    def __init__(
        self,
        root: str,
        *,
        segment_size: int = 64 << 20,
        fsync: bool = False,
        readonly: bool = False,
        max_open: int | None = None,
        first: int = 0,
        step: int = 1,
        arg: str = "spill_dir",
        direct: bool = False,
        checksum: str = "crc32",
        mode: int = 0o600,
    ):
        self.root = root
        self.mode = mode  # of the files it creates, set exactly (``_modes.py``: one per artifact)
        self.first, self.step = first, step  # this writer's segment numbers: first + k * step
        self.arg = arg  # the argument that chose ``root``, named by a full-disk error
        self.direct = direct and not readonly and hasattr(os, "O_DIRECT")
        self.magic, self._crc = CHECKSUMS[checksum]  # what append writes (format 2 or 3)
        self._tail: dict[int, bytes] = {}  # direct: bytes of each file's last partial page
        self._stage: np.ndarray | None = None  # direct: page-aligned staging buffer
        self.segment_size = segment_size
        self.fsync = fsync
        self.readonly = readonly
        self.max_open = max(2, max_open if max_open is not None else _max_open_default())
        self._fds: OrderedDict[int, int] = OrderedDict()  # LRU of open descriptors
        self.size: dict[int, int] = {}  # bytes written per segment (its keys: every segment)
        self.live: dict[int, int] = {}  # bytes of live records (header included) per segment
        self.tombstones: dict[int, list[int]] = {}  # keys tombstoned per segment
        self.min_key: dict[int, int] = {}  # smallest item key ever written per segment
        self.active = -1
        self.pinned = 0  # > 0 while a reader (save) needs every file to stay
        self.stats = SegmentStats()

    def path(self, seg: int) -> str:
        return os.path.join(self.root, f"seg-{seg:08d}.ttr")

    @property
    def segments(self) -> list[int]:
        """Numbers of the segment files, oldest first."""
        return sorted(self.size)

    # ------------------------------------------------------------------ descriptors
    def _fd(self, seg: int, create: bool = False) -> int:
        """An open descriptor of ``seg`` (most recently used), opening it if needed."""
        fd = self._fds.get(seg)
        if fd is not None:
            self._fds.move_to_end(seg)
            return fd
        if self.readonly:
            flags = os.O_RDONLY
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW if create else 0)
            flags |= os.O_DIRECT if self.direct else 0
        try:
            fd = os.open(self.path(seg), flags | os.O_CLOEXEC, self.mode)
        except OSError as exc:
            if self.direct and exc.errno == errno.EINVAL:  # tmpfs and the like: buffered writes
                self.direct = False
                return self._fd(seg, create)
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._shrink(0)  # the process is out of descriptors: give back all but the active one
            try:
                fd = os.open(self.path(seg), flags | os.O_CLOEXEC, self.mode)
            except OSError as exc2:
                if exc2.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise TierFullError(
                    f"cannot open segment file {self.path(seg)!r}: the process has no file "
                    f"descriptors left ({exc2.strerror}); raise the open-file limit (ulimit -n) "
                    f"or close other files",
                    tier="disk",
                    requested=0,
                ) from exc2
        if create:
            os.fchmod(fd, self.mode)  # exactly: the umask may have taken bits away
        self._fds[seg] = fd
        self._shrink(self.max_open)
        self.stats.open_files = len(self._fds)
        return fd

    def _shrink(self, keep: int) -> None:
        """Close least recently used descriptors (never the active segment's) down to ``keep``."""
        for seg in list(self._fds):
            if len(self._fds) <= keep:
                break
            if seg == self.active:
                continue
            os.close(self._fds.pop(seg))
        self.stats.open_files = len(self._fds)

    def _register(self, seg: int) -> None:
        self.size.setdefault(seg, 0)
        self.live.setdefault(seg, 0)
        self.tombstones.setdefault(seg, [])
        self.stats.files = len(self.size)

    def _roll(self) -> None:
        after = max(self.size, default=-1) + 1  # the next number of this writer's sequence
        seg = self.first + max(0, -(-(after - self.first) // self.step)) * self.step
        self._fd(seg, create=True)
        self._register(seg)
        self.active = seg

    # ------------------------------------------------------------------ writing
    def append(
        self, records: Sequence[tuple[int, int, bytes]], crcs: list[int] | None = None
    ) -> list[tuple[int, int, int]]:
        """Append (key, flags, payload) records in one write; returns (segment, offset, length).

        ``payload`` is a buffer, or a tuple of buffers (format ``B``) that make the payload
        back to back (a builder's encoded pieces: copied once, into the write).
        ``length`` counts the 24-byte record header. ``crcs``, when given, receives each record's
        checksum (an index that stores them). A record may carry its checksum as a fourth element
        (``record_crc`` or ``record_crc32c`` as ``checksum`` says, computed by the thread that made the
        payload, so a writer thread need not take the GIL back for it). Raises TierFullError on a
        full disk, having truncated the partial write away.
        """
        if not records:
            return []
        if self.readonly:
            raise AssertionError("append on a read-only Segments")
        locs: list[tuple[int, int, int]] = []
        i = 0
        while i < len(records):  # fill the active segment, roll, continue
            if self.active < 0 or self.size[self.active] >= self.segment_size:
                self._roll()
            room = self.segment_size - self.size[self.active]
            j, n = i, 0
            while j < len(records) and (j == i or n + REC.size + _nbytes(records[j][2]) <= room):
                n += REC.size + _nbytes(records[j][2])
                j += 1
            locs += self._append_chunk(records[i:j], crcs)
            i = j
        return locs

    def _append_chunk(
        self, records: Sequence[tuple[int, int, bytes]], crcs: list[int] | None
    ) -> list[tuple[int, int, int]]:
        seg = self.active
        fd = self._fd(seg)
        base = pos = self.size[seg]
        parts, locs, sums = [], [], []
        for key, flags, payload, *known in records:
            n = _nbytes(payload)
            if isinstance(payload, tuple):  # the record's pieces, written back to back
                crc = known[0] if known else self._crc(n, flags, key, b"".join(payload))
                parts.append(REC.pack(self.magic, n, crc, flags, key))
                parts += payload
            else:
                crc = known[0] if known else self._crc(n, flags, key, payload)
                parts.append(REC.pack(self.magic, n, crc, flags, key))
                parts.append(payload)
            sums.append(crc)
            n += REC.size
            locs.append((seg, pos, n))
            pos += n
            if flags != TOMBSTONE:
                self.live[seg] += n
                self.min_key[seg] = min(self.min_key.get(seg, key), key)
            else:
                self.tombstones[seg].append(key)
        total = pos - base

        def undo() -> None:
            for key, flags, payload, *_ in records:
                if flags != TOMBSTONE:
                    self.live[seg] -= REC.size + _nbytes(payload)
                else:
                    self.tombstones[seg].remove(key)

        if self.direct:
            self._write(seg, fd, base, total, lambda view, p: _copy_parts(view, p, parts), undo)
        else:  # gathered writes: no joined copy of the batch in RAM
            self._write(seg, fd, base, total, lambda: _pwrite_all(fd, parts, base), undo)
        if crcs is not None:
            crcs += sums
        return locs

    def _write(self, seg: int, fd: int, base: int, total: int, fill, undo, staged=None) -> None:
        """Write a chunk of ``total`` bytes at ``base`` of ``seg``: direct, ``fill(view, at)``
        puts them into the staging buffer; buffered, ``fill()`` writes them. On an error the
        file is cut back, ``undo()`` reverses the caller's accounting and TierFullError says why.
        """
        try:
            if self.direct:
                self._write_direct(seg, fd, base, total, fill, staged)
            else:
                fill()
            if self.fsync:
                os.fdatasync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, base)
            undo()
            raise TierFullError(
                f"cannot write {format_size(total)} of records to {self.root!r} "
                f"({exc.strerror}); free disk space there or pick another {self.arg}",
                tier="disk",
                requested=total,
            ) from exc
        self.size[seg] = base + total
        self.stats.bytes_written += total
        self.stats.file_bytes += total
        self.stats.live_bytes = sum(self.live.values())
        if not self.fsync and not self.direct and total >= (1 << 20):
            # spilled data should leave the page cache, as the disk tier's does
            os.posix_fadvise(fd, base, total, os.POSIX_FADV_DONTNEED)

    def _write_direct(self, seg: int, fd: int, base: int, total: int, fill, staged=None) -> None:
        """Write ``total`` bytes at ``base`` with O_DIRECT: the file's partial last page, then
        what ``fill(view, at)`` puts into the page-aligned staging buffer at ``at``; or, with
        ``staged=(stage, start)``, the bytes a builder already put at ``stage[start:]`` (see
        :meth:`write_staged`)."""
        tail = self._tail.get(seg, b"")
        if staged is None:
            stage, head = self._staging(len(tail) + total), 0
            view = memoryview(stage)
            view[: len(tail)] = tail
            fill(view, len(tail))
        else:
            stage, start = staged
            head = start - len(
                tail
            )  # page-aligned: start = base (mod page), len(tail) = base % page
            view = memoryview(stage)
            view[head:start] = tail
        end = head + len(tail) + total
        stop = head + -(-(end - head) // _PAGE) * _PAGE
        stage[end:stop] = 0
        at, done = base - len(tail), 0
        while done < stop - head:  # regular files write it whole; loop for the rules' sake
            done += os.pwrite(fd, view[head + done : stop], at + done)
        self._tail[seg] = bytes(stage[end - (end - head) % _PAGE : end])

    def _staging(self, size: int) -> np.ndarray:
        """This store's page-aligned staging buffer, at least ``size`` bytes rounded to a page."""
        size = -(-size // _PAGE) * _PAGE
        if self._stage is None or len(self._stage) < size:
            # a quarter more than asked: chunks of one batch size differ by a record, and each
            # new buffer costs page faults on all it holds (0.1 CPU-s/GB of a build when
            # every few batches grew it by a few KB)
            self._stage = aligned_buffer(max(size + size // 4 // _PAGE * _PAGE, 1 << 20))
        return self._stage

    def write_staged(self, stage: np.ndarray, chunks: Sequence[tuple[int, int, int, int, int]]):
        """Write records a builder laid out itself (headers, checksums: the bytes of
        :meth:`append`) in ``stage``, a page-aligned uint8 buffer: chunk ``(seg, base, start,
        end, min_key)`` is ``stage[start:end]``, to be written at offset ``base`` of ``seg``.
        Direct writes need ``start = base (mod 4096)``, ``base % 4096`` bytes of room before
        ``start`` (the file's partial last page goes there) and room up to the next page after
        ``end``: then the records are written where they lie, without a copy. The builder
        placed them by :meth:`append`'s rule (a segment takes records while it holds less than
        ``segment_size`` bytes, then this writer's next number starts at 0): anything else is a
        bug and raises AssertionError before writing.
        """
        for seg, base, start, end, low in chunks:
            full = self.active < 0 or self.size[self.active] >= self.segment_size
            if seg != self.active and full:
                self._roll()
            if seg != self.active or base != self.size[seg] or (start - base) % _PAGE:
                raise AssertionError(
                    f"write_staged: chunk at {seg}:{base} (stage offset {start}) is not where "
                    f"the next record goes ({self.active}:{self.size[self.active]})"
                )
            self._write_chunk(seg, base, stage, start, end, low)

    def _write_chunk(self, seg: int, base: int, stage, start: int, end: int, low: int) -> None:
        fd, total = self._fd(seg), end - start

        def fill() -> None:  # buffered (the filesystem refused O_DIRECT)
            _pwrite_all(fd, [memoryview(stage)[start:end]], base)

        def undo() -> None:
            self.live[seg] -= total

        self.live[seg] += total
        self.min_key[seg] = min(self.min_key.get(seg, low), low)
        self._write(seg, fd, base, total, fill, undo, staged=(stage, start))

    def _trim(self, seg: int) -> None:
        """Cut a direct-written file's zero padding: it ends at its last record."""
        if seg in self._tail:
            os.ftruncate(self._fd(seg), self.size[seg])

    def sync(self) -> None:
        """fsync every segment file and the directory (a saved copy must survive power loss)."""
        for seg in self.segments:
            self._trim(seg)
            os.fsync(self._fd(seg))
        dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def release(self, seg: int, length: int) -> None:
        """A record of ``length`` bytes in ``seg`` is dead. Deletes the file once nothing lives."""
        self.live[seg] -= length
        self.stats.live_bytes -= length
        if (
            self.live[seg] <= 0
            and seg != self.active
            and not self.pinned
            and not self.needed_tombstones(seg)
        ):
            self.drop(seg)

    def sweep(self) -> None:
        """Delete sealed files with nothing live (deferred while pinned)."""
        if self.pinned:
            return
        for seg in list(self.size):
            if self.live[seg] <= 0 and seg != self.active and not self.needed_tombstones(seg):
                self.drop(seg)

    def add_live(self, seg: int, length: int) -> None:
        """Count a record found by :meth:`scan` as live."""
        self.live[seg] += length
        self.stats.live_bytes += length

    def needed_tombstones(self, seg: int) -> list[int]:
        """Tombstones in ``seg`` that still hide a record in another file (to carry on compaction).

        A record of key k can only sit in a segment whose smallest item key is <= k.
        """
        keys = self.tombstones.get(seg)
        if not keys:
            return []
        floor = min((k for s, k in self.min_key.items() if s != seg), default=None)
        return [] if floor is None else [k for k in keys if k >= floor]

    def drop(self, seg: int) -> None:
        if seg not in self.size:
            return
        fd = self._fds.pop(seg, None)
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(seg))
        self.stats.file_bytes -= self.size.pop(seg)
        self.live.pop(seg, None)
        self.tombstones.pop(seg, None)
        self.min_key.pop(seg, None)
        self.stats.files = len(self.size)
        self.stats.open_files = len(self._fds)

    def candidates(self, threshold: float = 0.5) -> list[int]:
        """Sealed segments whose live share fell under ``threshold`` (worth compacting)."""
        return [
            s
            for s, n in self.size.items()
            if s != self.active and n > 0 and self.live[s] < threshold * n
        ]

    # ------------------------------------------------------------------ reading
    def read_many(self, locs: np.ndarray) -> list[bytes]:
        """Payloads of item records at ``locs`` (rows of segment, offset, length), in order.

        Reads are sorted by (segment, offset) and neighbours are coalesced into one ``pread``;
        every record's magic, length, flags and CRC are checked.
        """
        if self.direct:
            raise AssertionError("read_many on a Segments that writes with O_DIRECT")
        out: list[bytes | None] = [None] * len(locs)
        if len(locs) == 0:
            return []
        for seg, start, end, rows in coalesce(locs[:, 0], locs[:, 1], locs[:, 2]):
            data = os.pread(self._fd(seg), end - start, start)
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
            if len(data) != end - start:
                raise CorruptDataError(
                    f"short read in {self.path(seg)}: wanted {end - start} bytes at {start}",
                    path=self.path(seg),
                )
            for row in rows.tolist():
                off = int(locs[row, 1]) - start
                payload = payload_of(data, off, int(locs[row, 2]))
                if payload is None:
                    raise CorruptDataError(
                        f"record at offset {start + off} of {self.path(seg)} failed its check "
                        f"(magic, length, flags or CRC); the file was modified or damaged",
                        path=self.path(seg),
                    )
                out[row] = bytes(payload)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ recovery
    def scan(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Register existing segments and yield (key, flags, segment, offset, length) in order.

        A torn or corrupt tail in the newest segment (a crash during a write) is truncated away;
        damage anywhere else raises CorruptDataError. In ``readonly`` mode any damage raises and
        nothing is modified.
        """
        segs = sorted(int(m.group(1)) for f in os.listdir(self.root) if (m := _NAME.match(f)))
        for seg in segs:
            self._register(seg)
        for idx, seg in enumerate(segs):
            last = idx == len(segs) - 1
            path = self.path(seg)
            pos = 0
            with open(path, "rb", buffering=1 << 20) as f:
                total = os.fstat(f.fileno()).st_size
                while pos < total:
                    head = f.read(REC.size)
                    bad = len(head) < REC.size
                    if not bad:
                        magic, plen, crc, flags, key = REC.unpack(head)
                        bad = magic not in _MAGICS or pos + REC.size + plen > total
                    if not bad:
                        payload = f.read(plen)
                        bad = len(payload) != plen or not record_ok(
                            magic, plen, crc, flags, key, payload
                        )
                    if bad:
                        if self.readonly:
                            raise CorruptDataError(
                                f"record at offset {pos} of {path} is damaged; this saved copy "
                                f"cannot be loaded (it was left unchanged)",
                                path=path,
                            )
                        if not last or self._valid_after(f, pos, total):
                            raise CorruptDataError(
                                f"record at offset {pos} of {path} is damaged; the buffer cannot "
                                f"be recovered safely (move the file away to recover the other "
                                f"segments)",
                                path=path,
                            )
                        os.truncate(path, pos)  # torn tail of an unacknowledged write
                        break
                    n = REC.size + plen
                    if flags == TOMBSTONE:
                        self.tombstones[seg].append(key)
                    else:
                        self.min_key[seg] = min(self.min_key.get(seg, key), key)
                    yield key, flags, seg, pos, n
                    pos += n
            self.size[seg] = pos
            self.stats.file_bytes += pos
        self.active = segs[-1] if segs else -1

    @staticmethod
    def _valid_after(f, pos: int, total: int) -> bool:
        """Is there an intact record after ``pos``? Then the damage is not a torn tail."""
        f.seek(pos + 1)
        data = f.read(total - pos - 1)
        at = data.find(b"TTR")
        while at >= 0:
            if at + REC.size <= len(data):
                magic, plen, crc, flags, key = REC.unpack_from(data, at)
                payload = data[at + REC.size : at + REC.size + plen]
                if len(payload) == plen and record_ok(magic, plen, crc, flags, key, payload):
                    return True
            at = data.find(b"TTR", at + 1)
        return False

    def close(self, remove: bool) -> None:
        if not remove:
            for seg in list(self._tail):
                with contextlib.suppress(OSError):
                    self._trim(seg)
        self._tail.clear()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self.stats.open_files = 0
        if remove:
            for seg in list(self.size):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(seg))
