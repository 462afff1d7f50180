"""Append-only segment files of variable-size records: the disk tier of the RL stores.

Why not :class:`~tensortier.tiers.disk.DiskStore` extents: it rounds every tensor to 4 KiB
pages (a 10 KB transition would waste 20%), runs one thread-pool future per tensor (tens of
microseconds each, more than the read itself for small items), and its handles are never
persisted, so it cannot back a buffer that survives a restart. Segments pack records back to back,
spill a batch of items in one ``write``, read a batch of items with offset-sorted, coalesced
``pread`` calls, and can be re-scanned after a crash.

Record: ``magic u32 | payload length u32 | crc32(payload) u32 | flags u32 | key i64 | payload``.
``flags`` is 0 for an item and 1 for a tombstone (the key was removed; empty payload). A crash can
only tear the tail of the newest segment: :meth:`Segments.scan` stops there and truncates it.
Records are never rewritten in place; :meth:`Segments.compact` copies a segment's live records to
the active segment and deletes the file, so the space of removed items comes back.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tensortier._units import format_size
from tensortier.errors import CorruptDataError, TierFullError

REC = struct.Struct("<IIIIq")
MAGIC = 0x31525454  # "TTR1"
TOMBSTONE = 1
_NAME = re.compile(r"^seg-(\d{8})\.ttr$")
_GAP = 64 << 10  # coalesce reads of records closer than this


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


_IOV = 1024  # buffers per pwritev call (IOV_MAX on Linux)


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
    """Numbered append-only files in ``root``; the caller keeps the index (segment, offset, length)."""

    def __init__(self, root: str, *, segment_size: int = 64 << 20, fsync: bool = False):
        self.root = root
        self.segment_size = segment_size
        self.fsync = fsync
        self.fds: dict[int, int] = {}
        self.size: dict[int, int] = {}  # bytes written per segment
        self.live: dict[int, int] = {}  # bytes of live records (header included) per segment
        self.tombstones: dict[int, list[int]] = {}  # keys tombstoned per segment
        self.min_key: dict[int, int] = {}  # smallest item key ever written per segment
        self.active = -1
        self.pinned = 0  # > 0 while a reader (save) needs every file to stay
        self.stats = SegmentStats()
        self.lock = threading.Lock()

    def path(self, seg: int) -> str:
        return os.path.join(self.root, f"seg-{seg:08d}.ttr")

    def _open(self, seg: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fds[seg] = os.open(self.path(seg), flags, 0o600)
        self.size.setdefault(seg, 0)
        self.live.setdefault(seg, 0)
        self.tombstones.setdefault(seg, [])
        self.stats.files = len(self.fds)

    def _roll(self) -> None:
        seg = max(self.fds, default=-1) + 1
        self._open(seg, create=True)
        self.active = seg

    # ------------------------------------------------------------------ writing
    def append(self, records: Sequence[tuple[int, int, bytes]]) -> list[tuple[int, int, int]]:
        """Append (key, flags, payload) records in one write; returns (segment, offset, length).

        ``length`` counts the 24-byte record header. Raises TierFullError on a full disk, having
        truncated the partial write away.
        """
        if not records:
            return []
        locs: list[tuple[int, int, int]] = []
        i = 0
        while i < len(records):  # fill the active segment, roll, continue
            if self.active < 0 or self.size[self.active] >= self.segment_size:
                self._roll()
            room = self.segment_size - self.size[self.active]
            j, n = i, 0
            while j < len(records) and (j == i or n + REC.size + len(records[j][2]) <= room):
                n += REC.size + len(records[j][2])
                j += 1
            locs += self._append_chunk(records[i:j])
            i = j
        return locs

    def _append_chunk(
        self, records: Sequence[tuple[int, int, bytes]]
    ) -> list[tuple[int, int, int]]:
        seg, fd = self.active, self.fds[self.active]
        base = pos = self.size[seg]
        parts, locs = [], []
        for key, flags, payload in records:
            parts.append(REC.pack(MAGIC, len(payload), zlib.crc32(payload), flags, key))
            parts.append(payload)
            n = REC.size + len(payload)
            locs.append((seg, pos, n))
            pos += n
            if flags != TOMBSTONE:
                self.live[seg] += n
                self.min_key[seg] = min(self.min_key.get(seg, key), key)
            else:
                self.tombstones[seg].append(key)
        total = pos - base
        try:
            _pwrite_all(fd, parts, base)  # gathered writes: no joined copy of the batch in RAM
            if self.fsync:
                os.fdatasync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, base)
            for key, flags, payload in records:  # undo the accounting
                if flags != TOMBSTONE:
                    self.live[seg] -= REC.size + len(payload)
                else:
                    self.tombstones[seg].remove(key)
            raise TierFullError(
                f"cannot write {format_size(total)} of replay records to {self.root!r} "
                f"({exc.strerror}); free disk space there or pick another spill_dir",
                tier="disk",
                requested=total,
            ) from exc
        self.size[seg] = pos
        self.stats.bytes_written += total
        self.stats.file_bytes += total
        self.stats.live_bytes = sum(self.live.values())
        if not self.fsync and total >= (1 << 20):
            # spilled data should leave the page cache, as the disk tier's does
            os.posix_fadvise(fd, base, total, os.POSIX_FADV_DONTNEED)
        return locs

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
        for seg in list(self.fds):
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
        fd = self.fds.pop(seg, None)
        if fd is None:
            return
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(seg))
        self.stats.file_bytes -= self.size.pop(seg)
        self.live.pop(seg, None)
        self.tombstones.pop(seg, None)
        self.min_key.pop(seg, None)
        self.stats.files = len(self.fds)

    def candidates(self, threshold: float = 0.5) -> list[int]:
        """Sealed segments whose live share fell under ``threshold`` (worth compacting)."""
        return [
            s
            for s, n in self.size.items()
            if s != self.active and n > 0 and self.live[s] < threshold * n
        ]

    # ------------------------------------------------------------------ reading
    def read_many(self, locs: np.ndarray) -> list[bytes]:
        """Payloads of records at ``locs`` (rows of segment, offset, length), in the given order.

        Reads are sorted by (segment, offset) and neighbours are coalesced into one ``pread``;
        every record's magic, length and CRC are checked.
        """
        n = len(locs)
        out: list[bytes | None] = [None] * n
        if n == 0:
            return []
        order = np.lexsort((locs[:, 1], locs[:, 0]))
        i = 0
        while i < n:
            seg, start = int(locs[order[i], 0]), int(locs[order[i], 1])
            end = start + int(locs[order[i], 2])
            j = i + 1
            while j < n:
                s2, o2, l2 = (int(x) for x in locs[order[j]])
                if s2 != seg or o2 > end + _GAP:
                    break
                end = max(end, o2 + l2)
                j += 1
            data = os.pread(self.fds[seg], end - start, start)
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
            if len(data) != end - start:
                raise CorruptDataError(
                    f"short read in {self.path(seg)}: wanted {end - start} bytes at {start}",
                    path=self.path(seg),
                )
            for k in range(i, j):
                row = order[k]
                off = int(locs[row, 1]) - start
                out[row] = self._check(data, off, int(locs[row, 2]), seg)
            i = j
        return out  # type: ignore[return-value]

    def _check(self, data: bytes, off: int, length: int, seg: int) -> bytes:
        magic, plen, crc, _flags, _key = REC.unpack_from(data, off)
        payload = data[off + REC.size : off + length]
        if magic != MAGIC or plen != length - REC.size or zlib.crc32(payload) != crc:
            raise CorruptDataError(
                f"record at offset {off} of {self.path(seg)} failed its check (magic, length or "
                f"CRC); the file was modified or damaged",
                path=self.path(seg),
            )
        return payload

    # ------------------------------------------------------------------ recovery
    def scan(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Open existing segments and yield (key, flags, segment, offset, length) in write order.

        A torn or corrupt tail in the newest segment (a crash during a write) is truncated away;
        damage anywhere else raises CorruptDataError.
        """
        segs = sorted(int(m.group(1)) for f in os.listdir(self.root) if (m := _NAME.match(f)))
        for seg in segs:
            self._open(seg, create=False)
        for idx, seg in enumerate(segs):
            fd, last = self.fds[seg], idx == len(segs) - 1
            total = os.fstat(fd).st_size
            pos = 0
            with open(self.path(seg), "rb", buffering=1 << 20) as f:
                while pos < total:
                    head = f.read(REC.size)
                    bad = len(head) < REC.size
                    if not bad:
                        magic, plen, crc, flags, key = REC.unpack(head)
                        bad = magic != MAGIC or pos + REC.size + plen > total
                    if not bad:
                        payload = f.read(plen)
                        bad = len(payload) != plen or zlib.crc32(payload) != crc
                    if bad:
                        if not last or self._valid_after(f, pos, total):
                            raise CorruptDataError(
                                f"record at offset {pos} of {self.path(seg)} is damaged; the "
                                f"buffer cannot be recovered safely (move the file away to "
                                f"recover the other segments)",
                                path=self.path(seg),
                            )
                        os.ftruncate(fd, pos)  # torn tail of an unacknowledged write
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
        at = data.find(REC.pack(MAGIC, 0, 0, 0, 0)[:4])
        while at >= 0:
            if at + REC.size <= len(data):
                _, plen, crc, _, _ = REC.unpack_from(data, at)
                payload = data[at + REC.size : at + REC.size + plen]
                if len(payload) == plen and zlib.crc32(payload) == crc:
                    return True
            at = data.find(data[at : at + 4], at + 1)
        return False

    def close(self, remove: bool) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        if remove:
            for seg in list(self.fds):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(seg))
        self.fds.clear()
