"""Building a catalog: records streamed into segment files by parallel writers, index, manifest.

Pipeline. The calling thread batches records by about ``batch_bytes`` of encoded blobs (``tiers.
itemcodec``, 8-byte aligned, never pickle); batch ``b`` goes to writer ``b % io_threads``, a
one-thread executor that owns its own segment files (``Segments(first=w, step=io_threads)``) and
writes the batch with ``O_DIRECT`` (the write releases the GIL). Bytes and str records travel
unencoded: the writer builds their headers with array operations straight into its aligned
staging buffer and checksums them there (``Segments.append_prefixed``), so the calling thread does
a few operations per record; other records are encoded and checksummed by the calling thread. Index rows come back in
batch order and are appended to ``index.bin``. At most ``2 * io_threads`` batches are in flight, so
memory stays bounded whatever the record count: 10M records stream through.

Atomicity (``PROTOCOL.md``). The builder holds ``.tt-build.lock`` for the whole build. Segments and
index are fsynced, then ``catalog.json`` is written to a temporary name, fsynced, renamed, and the
directory fsynced: the rename is the commit. A crash before it leaves a directory without a
manifest, which every open refuses ("incomplete build") and the next build reuses; an exception
removes everything the build wrote (and the directory if the build made it).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import stat
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import numpy as np

from tensortier import _modes
from tensortier._lifetime import DirLock
from tensortier._units import parse_size
from tensortier.data import _format, _sources
from tensortier.data._format import ALIGN, INDEX_DTYPE, Manifest
from tensortier.errors import ConfigError, SpillDirError
from tensortier.tiers import itemcodec
from tensortier.tiers.segments import Segments, record_crc32c_parts

MAX_WRITERS = 64
FAULT_ENV = "TENSORTIER_CATALOG_FAULT"  # "<point>[:<hit>]": SIGKILL there (crash tests only)


class _Faults:
    """Deterministic kill points (as ``checkpoint/_faults.py``): one comparison when unset."""

    def __init__(self) -> None:
        spec = os.environ.get(FAULT_ENV)
        self.target = None
        if spec:
            name, _, hit = spec.partition(":")
            self.target = (name, int(hit or 1))
        self.hits: collections.Counter = collections.Counter()

    def __call__(self, name: str) -> None:
        if self.target is None:
            return
        self.hits[name] += 1
        if (name, self.hits[name]) == self.target:
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class BuildArgs:
    """``Catalog.build``'s settings, checked (:func:`check_args`)."""

    root: str  # absolute
    segment_size: int
    io_threads: int
    batch_bytes: int
    mode: int


def check_args(directory, segment_size, io_threads, batch_bytes, mode) -> BuildArgs:
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(
            f"Catalog.build: directory must be a directory path (str or os.PathLike), got "
            f"{type(directory).__name__} {directory!r}"
        )
    seg = parse_size(segment_size, name="Catalog.build: segment_size", allow_zero=False)
    if seg >= 1 << 40:
        raise ConfigError(f"Catalog.build: segment_size={segment_size!r} must be below 1TiB")
    n = io_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WRITERS:
        raise ConfigError(
            f"Catalog.build: io_threads={io_threads!r} must be an int from 1 to {MAX_WRITERS} (threads "
            f"writing segment files at once; 2-4 keep one disk busy)"
        )
    batch = parse_size(batch_bytes, name="Catalog.build: batch_bytes", allow_zero=False)
    _modes.check_mode(mode, "Catalog.build")
    return BuildArgs(os.path.abspath(os.fspath(directory)), seg, io_threads, batch, mode)


def _prepare(root: str) -> tuple[DirLock, bool]:
    """Take the build lock on ``root``; remove a dead build's leftovers. Returns (lock, made).

    ``root`` is made here exclusively (``mkdir``, never "exists, fine": a directory someone else
    made under a shared parent such as /tmp is not ours), or it already exists and is ours: owned
    by this user, not writable by everyone, holding nothing or a dead build's plain files.
    """
    made = _make(root)
    if not made:
        _check_existing(root)  # before the lock file is made: a refused directory stays as it was
    try:
        lock = DirLock(root, name=_format.LOCK, what="Catalog.build")
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(root)
        raise
    try:
        if os.path.exists(os.path.join(root, _format.MANIFEST)):  # finished while we waited
            raise ConfigError(f"Catalog.build: a catalog already exists at path={root!r}")
        _check_entries(root)
        _remove_build_files(root, keep_lock=True)  # a dead build's leftovers
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, _format.LOCK))
        lock.release()
        raise
    return lock, made


def _make(root: str) -> bool:
    """Make ``root`` (0700 until the build commits); False if it already exists."""
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.mkdir(root, 0o700)
        return True
    except FileExistsError:
        if os.path.lexists(root):
            return False
        raise SpillDirError(
            f"Catalog.build: cannot create path={root!r}: a parent is a file; pass a path under "
            f"a directory",
            path=root,
        ) from None
    except OSError as exc:
        raise SpillDirError(
            f"Catalog.build: cannot create path={root!r} ({exc.strerror}); pass a writable "
            f"location",
            path=root,
        ) from exc


def _check_existing(root: str) -> None:
    """Refuse an existing ``root`` that is not ours to build in (see :func:`_prepare`)."""
    if not os.path.isdir(root):
        raise ConfigError(f"Catalog.build: path={root!r} is a file; pass a directory")
    if os.path.exists(os.path.join(root, _format.MANIFEST)):
        raise ConfigError(
            f"Catalog.build: a catalog already exists at path={root!r}; catalogs are "
            f"immutable: build into a new directory, or delete this one first"
        )
    me = os.geteuid()
    for st in (os.lstat(root), os.stat(root)):  # the link (if any) and the directory
        if st.st_uid != me:
            raise ConfigError(
                f"Catalog.build: path={root!r} already exists and belongs to uid {st.st_uid}, "
                f"not to this process (uid {me}); build into a new path (it is made "
                f"exclusively) or into a directory you own"
            )
    if os.stat(root).st_mode & 0o002:
        raise ConfigError(
            f"Catalog.build: path={root!r} is writable by every user, who could plant files in "
            f"the catalog; build into a new path, or remove the write bit for others (chmod o-w)"
        )
    _check_entries(root)


def _check_entries(root: str) -> None:
    """Only a dead build's files may be in ``root``, and only as plain files of this user."""
    foreign = [n for n in os.listdir(root) if not _format.BUILD_FILES.match(n)]
    if foreign:
        raise ConfigError(
            f"Catalog.build: path={root!r} is not empty ({len(foreign)} other entries, e.g. "
            f"{sorted(foreign)[0]!r}); build into a new or empty directory"
        )
    me = os.geteuid()
    for name in os.listdir(root):
        st = os.lstat(os.path.join(root, name))
        if stat.S_ISLNK(st.st_mode):
            what = "a symlink"
        elif not stat.S_ISREG(st.st_mode):
            what = "not a regular file"
        elif st.st_uid != me:
            what = f"owned by uid {st.st_uid}"
        else:
            continue
        raise ConfigError(
            f"Catalog.build: path={root!r} holds {name!r}, which is {what}: not the leftover "
            f"of a build of yours; remove it, or build into a new path"
        )


def _remove_build_files(root: str, keep_lock: bool = False) -> None:
    for name in os.listdir(root):
        if _format.BUILD_FILES.match(name) and not (keep_lock and name == _format.LOCK):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name))


def _encode(rec: object, count: int) -> tuple[bytes | tuple[bytes, ...], int]:
    """(payload, CRC-32C of the format-3 record ``count``) of ``rec``, never aliasing the caller's
    memory: a blob whose pieces are all ``bytes`` (immutable: bytes and str records, the
    headers) travels as a tuple of them, copied once, into the writer's staging buffer; one
    with array or tensor pieces (which the caller may change once it has our blob) is joined."""
    try:
        parts = itemcodec.encode_aligned_parts(rec, ALIGN)
    except (TypeError, ValueError) as exc:
        parts = [_encode_coerced(rec, count, exc)]
    if not all(type(p) is bytes for p in parts):
        parts = [b"".join(parts)]
    size = sum(map(len, parts))
    crc = record_crc32c_parts(size, 0, count, parts)
    payload = tuple(parts) if len(parts) > 1 else parts[0]
    return payload, crc


def _encode_coerced(rec: object, count: int, first: Exception) -> bytes:
    """The blob of a record the codec refused as is: lists of numbers become arrays, or a
    TypeError naming the record and what a record may be."""
    try:
        return itemcodec.encode(_sources.coerce(rec), align=ALIGN)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"Catalog.build: record {count} cannot be stored: {exc}. A record is bytes, str, a "
            f"numpy array, a torch tensor, a Python number, a list of numbers (stored as an "
            f"array), or a dict of those keyed by str (never pickled)"
        ) from first


def _write_batch(segs: Segments, first: int, blobs: list, crcs: list[int]) -> np.ndarray:
    """One writer's job: append ``blobs`` (records ``first...``); their index rows."""
    locs = segs.append([(first + i, 0, b, c) for i, (b, c) in enumerate(zip(blobs, crcs))])
    return _rows(np.asarray(locs, np.int64).reshape(-1, 3), crcs)


def _write_plain(segs: Segments, first: int, kind: type, raw: list[bytes]) -> np.ndarray:
    """One writer's job for a batch of only bytes (or only str: ``raw`` their UTF-8) records
    ``first...``: headers by array operations, checksums here (see ``Segments.append_prefixed``)."""
    lens = np.fromiter(map(len, raw), np.int64, len(raw))
    prefix = itemcodec.bytes_prefixes(_KINDS[kind], lens, ALIGN)
    keys = np.arange(first, first + len(raw), dtype=np.int64)
    locs, crcs = segs.append_prefixed(keys, prefix, raw)
    return _rows(locs, crcs)


def _rows(locs: np.ndarray, crcs) -> np.ndarray:
    rows = np.empty(len(locs), INDEX_DTYPE)
    rows["seg"], rows["off"], rows["len"] = locs[:, 0], locs[:, 1], locs[:, 2]
    rows["crc"] = crcs
    return rows


_KINDS = {bytes: "b", str: "s"}  # record types a batch can carry unencoded (``_write_plain``)
_WIDTH = len(itemcodec.bytes_prefixes("b", np.zeros(1), ALIGN)[0])  # their header, both kinds


def _encode_raw(raw: list[bytes], kind: type, first: int) -> tuple[list, list[int]]:
    """The blobs and checksums :func:`_encode` gives the records of a plain batch (``raw``: their
    bytes or UTF-8), for a batch that has just met a record of another type."""
    rows = itemcodec.bytes_prefixes(_KINDS[kind], [len(r) for r in raw], ALIGN)
    blobs, crcs = [], []
    for i, (row, data) in enumerate(zip(rows, raw)):
        parts = (row.tobytes(), data, bytes(-len(data) % ALIGN))
        blobs.append(parts)
        crcs.append(record_crc32c_parts(sum(map(len, parts)), 0, first + i, parts))
    return blobs, crcs


class _Writers:
    """The writer threads of one build: writer ``w`` owns its segment files and takes every
    ``io_threads``-th batch; results come back in batch order (see the module doc)."""

    def __init__(self, args: BuildArgs):
        self.pools: list[ThreadPoolExecutor] = []
        self.segs: list[Segments] = []
        self.pending: collections.deque[tuple[int, Future]] = collections.deque()
        self.batches = 0
        try:
            for w in range(args.io_threads):
                self.pools.append(ThreadPoolExecutor(1, thread_name_prefix=f"tt-catalog-w{w}"))
                self.segs.append(
                    Segments(
                        args.root,
                        segment_size=args.segment_size,
                        first=w,
                        step=args.io_threads,
                        arg="path",
                        direct=True,
                        checksum="crc32c",
                        mode=args.mode,
                    )
                )
        except BaseException:
            self.shutdown(failed=True)
            raise

    def submit(self, first: int, kind: type | None, blobs: list, crcs: list[int]) -> None:
        """Queue the batch of records ``first...`` to the next writer: encoded ``blobs`` and
        their ``crcs`` (``kind`` None), or the bytes of records all of type ``kind``."""
        w = self.batches % len(self.pools)
        if kind is None:
            fut = self.pools[w].submit(_write_batch, self.segs[w], first, blobs, crcs)
        else:
            fut = self.pools[w].submit(_write_plain, self.segs[w], first, kind, blobs)
        self.pending.append((len(blobs), fut))
        self.batches += 1

    def results(self, keep: int) -> Iterator[tuple[int, np.ndarray]]:
        """(records, index rows) of the oldest batches until at most ``keep`` are in flight."""
        while len(self.pending) > keep:
            n, fut = self.pending.popleft()
            yield n, fut.result()

    def sync(self, point: _Faults) -> dict[int, int]:
        """Make every segment durable and close it; the segment sizes (for the manifest)."""
        for s in self.segs:
            s.sync()
        point("segments-synced")
        sizes = {n: b for s in self.segs for n, b in s.size.items()}
        for s in self.segs:
            s.close(remove=False)
        return sizes

    def shutdown(self, failed: bool = False) -> None:
        for p in self.pools:
            p.shutdown(wait=True, cancel_futures=failed)
        if failed:
            for s in self.segs:
                s.close(remove=False)


class _Index:
    """``index.bin`` as it is written: rows in record order, their running CRC."""

    def __init__(self, f, point: _Faults, bar) -> None:
        self.f, self.point, self.bar = f, point, bar
        self.crc = 0

    def add(self, writers: _Writers, keep: int) -> None:
        """Append the rows of finished batches until at most ``keep`` are in flight."""
        for n, rows in writers.results(keep):
            raw = rows.tobytes()
            self.f.write(raw)
            self.crc = crc32c.crc32c(raw, self.crc)
            self.point("batch-indexed")
            if self.bar is not None:
                self.bar.update(n)


def _encode_all(
    records: Iterable, writers: _Writers, index: _Index, batch_bytes: int
) -> tuple[int, int]:
    """Batch ``records`` by about ``batch_bytes`` of blobs for the writers (at most
    ``2 * io_threads`` in flight); (records, payload bytes). A batch starting with a bytes or
    str record stays plain (records unencoded: the writer lays them out) while its records are
    of that type; another type turns it into a batch of encoded blobs. The boundaries count
    blob sizes either way, so the same records give the same files."""
    kind, batch, sums = None, [], []  # plain: kind, raw bytes; encoded: None, blobs and CRCs
    size = count = payload = 0
    width = _WIDTH
    for rec in records:
        t = type(rec)
        if not batch and t in _KINDS:
            kind = t
        if t is kind:
            data = rec if t is bytes else rec.encode("utf-8", "surrogatepass")
            batch.append(data)
            n = width + len(data) + (-len(data) & 7)
        else:
            if kind is not None:  # a plain batch meets another type: encode what it holds
                batch, sums = _encode_raw(batch, kind, count - len(batch))
                kind = None
            # the checksum is computed here: a writer thread taking the GIL back after each
            # checksum call would wait for this loop's switch interval (5 ms) every time
            blob, crc = _encode(rec, count)
            n = len(blob) if type(blob) is bytes else sum(map(len, blob))
            batch.append(blob)
            sums.append(crc)
        size += n
        count += 1
        payload += n
        if size >= batch_bytes or len(batch) >= 65536:
            writers.submit(count - len(batch), kind, batch, sums)
            kind, batch, sums, size = None, [], [], 0
            index.add(writers, 2 * len(writers.pools))
    if batch:
        writers.submit(count - len(batch), kind, batch, sums)
    index.add(writers, 0)
    return count, payload


def _write(args: BuildArgs, records: Iterable, writers: _Writers, point: _Faults, bar) -> Manifest:
    """Write segments, index and (last: the commit) the manifest."""
    index_fd = _modes.create(os.path.join(args.root, _format.INDEX), args.mode)
    with open(index_fd, "wb", buffering=1 << 20) as f:
        index = _Index(f, point, bar)
        count, payload = _encode_all(records, writers, index, args.batch_bytes)
        f.flush()
        os.fsync(f.fileno())
    point("index-synced")
    sizes = writers.sync(point)
    if bar is not None:
        bar.close()
    manifest = Manifest(
        records=count,
        payload_bytes=payload,
        segments=sizes,
        index_crc=index.crc,
        writers=args.io_threads,  # the manifest's key (format compatibility)
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    _modes.set_dir(args.root, args.mode)  # the one rule: every file `mode`, the directory to match
    _format.write_manifest(args.root, manifest, point, args.mode)
    return manifest


def build(args: BuildArgs, records: Iterable, *, progress: bool = False) -> dict:
    """Build the catalog ``args`` describe from ``records``; returns build statistics.

    See :meth:`tensortier.data.Catalog.build` (the public entry point).
    """
    records, total = _sources.source(records)
    if isinstance(records, (bytes, str, dict)) or not isinstance(records, Iterable):
        raise TypeError(
            f"Catalog.build: records must be an iterable of records, a datasets.Dataset or a "
            f"pyarrow Table, got {type(records).__name__} (wrap a single record in a list)"
        )
    t0 = time.monotonic()
    lock, made = _prepare(args.root)
    writers = bar = None
    try:
        writers = _Writers(args)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="catalog build", unit="rec", unit_scale=True)
        manifest = _write(args, records, writers, _Faults(), bar)
    except BaseException:
        if bar is not None:
            bar.close()
        if writers is not None:
            writers.shutdown(failed=True)
        _remove_build_files(args.root)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(args.root)
        lock.release()
        raise
    writers.shutdown()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(args.root, _format.LOCK))  # complete: nothing of the build remains
    lock.release()
    seconds = time.monotonic() - t0
    return {
        "records": manifest.records,
        "payload_bytes": manifest.payload_bytes,
        "file_bytes": manifest.file_bytes,
        "segments": len(manifest.segments),
        "seconds": seconds,
        "bytes_per_s": manifest.file_bytes / seconds if seconds > 0 else 0.0,
    }
