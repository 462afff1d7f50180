"""Building a catalog: records streamed into segment files by parallel writers, index, manifest.

Pipeline. The calling thread batches records by about ``batch_bytes`` of encoded blobs (``tiers.
itemcodec``, 8-byte aligned, never pickle); batch ``b`` goes to writer ``b % io_threads``, a
one-thread executor that owns its own segment files (``Segments(first=w, step=io_threads)``).
The calling thread lays each record out where it will lie in that writer's file (it follows
``Segments.append``'s placement): one copy from the caller's object into a page-aligned stage,
header packed, CRC-32C computed while the bytes are in cache; the writer only writes the stage
with ``O_DIRECT`` (``Segments.write_staged``, which releases the GIL). Stages are reused, so a
build does not page-fault fresh memory per batch, and the source's objects die right after
their copy, so its allocator hands out the same (cached) memory again. At most ``2 *
io_threads`` batches are in flight, so memory stays bounded whatever the record count: 10M
records stream through.

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
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from tensortier import _modes
from tensortier._lifetime import DirLock
from tensortier._units import format_size, parse_size
from tensortier.data import _format, _sources
from tensortier.data._format import ALIGN, INDEX_DTYPE, Manifest
from tensortier.errors import ConfigError, RecordTypeError, SpillDirError
from tensortier.tiers import itemcodec
from tensortier.tiers.segments import BODY, MAGIC_C, REC, Segments, aligned_buffer
from tensortier.tiers.segments import PAGE as _PAGE

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
            raise ConfigError(f"Catalog.build: a catalog already exists in directory={root!r}")
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
            f"Catalog.build: cannot create directory={root!r}: a parent is a file; pass a path under "
            f"a directory",
            path=root,
        ) from None
    except OSError as exc:
        raise SpillDirError(
            f"Catalog.build: cannot create directory={root!r} ({exc.strerror}); pass a writable "
            f"location",
            path=root,
        ) from exc


def _check_existing(root: str) -> None:
    """Refuse an existing ``root`` that is not ours to build in (see :func:`_prepare`)."""
    if not os.path.isdir(root):
        raise ConfigError(f"Catalog.build: directory={root!r} is a file; pass a directory")
    if os.path.exists(os.path.join(root, _format.MANIFEST)):
        raise ConfigError(
            f"Catalog.build: a catalog already exists in directory={root!r}; catalogs are "
            f"immutable: build into a new directory, or delete this one first"
        )
    me = os.geteuid()
    for st in (os.lstat(root), os.stat(root)):  # the link (if any) and the directory
        if st.st_uid != me:
            raise ConfigError(
                f"Catalog.build: directory={root!r} already exists and belongs to uid {st.st_uid}, "
                f"not to this process (uid {me}); build into a new path (it is made "
                f"exclusively) or into a directory you own"
            )
    if os.stat(root).st_mode & 0o002:
        raise ConfigError(
            f"Catalog.build: directory={root!r} is writable by every user, who could plant files in "
            f"the catalog; build into a new path, or remove the write bit for others (chmod o-w)"
        )
    _check_entries(root)


def _check_entries(root: str) -> None:
    """Only a dead build's files may be in ``root``, and only as plain files of this user."""
    foreign = [n for n in os.listdir(root) if not _format.BUILD_FILES.match(n)]
    if foreign:
        raise ConfigError(
            f"Catalog.build: directory={root!r} is not empty ({len(foreign)} other entries, e.g. "
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
            f"Catalog.build: directory={root!r} holds {name!r}, which is {what}: not the leftover "
            f"of a build of yours; remove it, or build into a new path"
        )


def _remove_build_files(root: str, keep_lock: bool = False) -> None:
    for name in os.listdir(root):
        if _format.BUILD_FILES.match(name) and not (keep_lock and name == _format.LOCK):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name))


def _parts(rec: object, count: int) -> list:
    """The blob of record ``count`` as buffers to copy back to back (arrays and tensors as views
    of the caller's memory: the caller copies them before it takes the next record)."""
    try:
        return itemcodec.encode_aligned_parts(rec, ALIGN, numpy_scalars=True)
    except (TypeError, ValueError) as exc:
        return [_encode_coerced(rec, count, exc)]


def _encode_coerced(rec: object, count: int, first: Exception) -> bytes:
    """The blob of a record the codec refused as is: lists of numbers become arrays, or a
    :class:`RecordTypeError` naming the record, the field at fault and what a record may be."""
    try:
        return itemcodec.encode(_sources.coerce(rec), align=ALIGN, numpy_scalars=True)
    except (TypeError, ValueError) as exc:
        raise RecordTypeError(
            f"Catalog.build: record {count} cannot be stored: {exc}. {RECORDS}",
            record=count,
            field=_bad_field(rec),
        ) from first


RECORDS = (
    "A record is bytes, str, a numpy array or scalar, a torch tensor, a Python number, a list of "
    "numbers (stored as an array), or a dict of those keyed by str (never pickled)"
)


def _bad_field(rec: object) -> object:
    """The key of the first field of a dict record that cannot be stored alone, else None."""
    if not isinstance(rec, Mapping):
        return None
    for key, value in rec.items():
        if not isinstance(key, str) or not key:
            return key
        try:
            itemcodec.encode(_sources.coerce({key: value}), align=ALIGN, numpy_scalars=True)
        except (TypeError, ValueError):
            return key
    return None


_HEAD = REC.size  # record header (segments.py)
_MAX_RECORDS = 65536  # per batch


class _Batch:
    """Records ``first...`` laid out by the calling thread where they go in the writer's files
    (see the module doc): record ``i`` at ``offs[i]`` of ``stage``, ``rlen[i]`` bytes (header
    included), checksum ``crcs[i]``; ``chunks`` ``[segment, offset in it, stage offset, first
    record]`` per segment the batch reaches (:meth:`Segments.write_staged`)."""

    __slots__ = ("first", "stage", "at", "offs", "rlen", "crcs", "chunks", "size")

    def __init__(self, first: int, stage: np.ndarray, seg: int, used: int, seg_size: int):
        self.first, self.stage = first, stage
        self.offs: list[int] = []
        self.rlen: list[int] = []
        self.crcs: list[int] = []
        self.size = 0  # blob bytes (headers excluded), what batch_bytes counts
        self.at = used % _PAGE  # the file's partial last page goes before it
        self.chunks = [[seg, used, self.at, 0]] if seg >= 0 and used < seg_size else []

    def grow(self, need: int) -> np.ndarray:
        """A bigger stage holding what this one holds (a record larger than the batch)."""
        big = aligned_buffer(-(-max(need, 2 * len(self.stage)) // _PAGE) * _PAGE)
        big[: self.at] = self.stage[: self.at]
        self.stage = big
        return big


def _fill(b: _Batch, it: Iterator, pos: list[int], args: BuildArgs) -> bool:
    """Lay records from ``it`` out in ``b`` until it holds ``batch_bytes`` of blobs or
    ``_MAX_RECORDS`` records; False once ``it`` is exhausted. ``pos`` ``[segment, bytes, first
    segment]``: where the writer's next record goes, by :meth:`Segments.append`'s rule (a
    segment takes records while it holds less than ``segment_size`` bytes). Per record one
    copy, straight from the caller's object (bytes, str's UTF-8, an array's memory) into the
    stage, and its checksum while those bytes are in the CPU's cache."""
    seg, used = pos[0], pos[1]
    limit, seg_size, step = args.batch_bytes, args.segment_size, args.io_threads
    offs, rlen, crcs, chunks = b.offs, b.rlen, b.crcs, b.chunks
    view, cap, at, size = memoryview(b.stage), len(b.stage), b.at, 0
    crc, body, rec_pack = crc32c.crc32c, BODY.pack, REC.pack_into
    more = True
    for rec in it:
        t = type(rec)
        arr = None
        if t is bytes or t is str:
            data = rec if t is bytes else rec.encode("utf-8", "surrogatepass")
            k = len(data)
            n = _WIDTH + k + (-k & 7)
        elif (arr := _array(rec, t)) is not None:  # a numpy array or a CPU tensor
            pre, shape, data = arr
            k = len(data)
            n = pre[0].size + k + (-k & 7)
        else:
            parts = _parts(rec, b.first + len(offs))
            n = sum(map(len, parts))
        if n > _MAX_BLOB:
            _too_large(b.first + len(offs), n)
        if seg < 0 or used >= seg_size:  # the writer's next segment, from its offset 0
            seg, used = (pos[2] if seg < 0 else seg + step), 0
            at = -(-at // _PAGE) * _PAGE
            chunks.append([seg, 0, at, len(offs)])
        if at + _HEAD + n + _PAGE > cap:
            b.at = at
            view = memoryview(b.grow(at + _HEAD + n + _PAGE))
            cap = len(view)
        o, end = at + _HEAD, at + _HEAD + n
        if t is bytes or t is str:
            if k & 7:
                view[end - 8 : end] = _ZERO  # the padding (data overwrites its start)
            view[o + _WIDTH : o + _WIDTH + k] = data
            pre, head, blanks = _PREFIX[t]
            pre.pack_into(view, o, head, k, 0, k, blanks)
        elif arr is not None:
            if k & 7:
                view[end - 8 : end] = _ZERO
            view[o + pre[0].size : o + pre[0].size + k] = data
            pre[0].pack_into(view, o, pre[1], *shape, 0, k, pre[2])
        else:
            for p in parts:
                view[o : o + len(p)] = p
                o += len(p)
        key = b.first + len(offs)
        # gil_release_mode 0: a thread that let the GIL go here would wait a switch interval
        # (5 ms) for a writer to give it back, once per record
        c = crc(view[at + _HEAD : end], crc(body(n, 0, key), 0, 0), 0)
        rec_pack(view, at, MAGIC_C, n, c, 0, key)
        offs.append(at)
        rlen.append(_HEAD + n)
        crcs.append(c)
        at, used, size = end, used + _HEAD + n, size + n
        if size >= limit or len(offs) >= _MAX_RECORDS:
            break
    else:
        more = False
    pos[0], pos[1] = seg, used
    b.at, b.size = at, size
    return more


_MAX_BLOB = 2**32 - 1 - _HEAD  # the index row's u32 length holds the header too


def _too_large(count: int, n: int) -> None:
    """Refuse record ``count`` of ``n`` encoded bytes before any of it is copied."""
    raise ConfigError(
        f"Catalog.build: record {count} is {format_size(n)} encoded; a record holds at most "
        f"{format_size(_MAX_BLOB)} (its length is 32 bits); split it into several records"
    )


def _array(rec: object, t: type) -> tuple | None:
    """(prefix, shape, payload bytes) of a record that is one C-contiguous numpy array or
    dense CPU tensor: its blob is the prefix (``_prefix_of``), the payload, zeros up to 8 bytes:
    the codec's bytes without its per-field dispatch. None for any other record."""
    if t is np.ndarray:
        dt = rec.dtype
        if not rec.flags.c_contiguous or dt.hasobject or dt.fields is not None:
            return None
        return _prefix_of("np", dt.str, rec.ndim), rec.shape, rec.reshape(-1).view(np.uint8)
    if t is not torch.Tensor:
        return None
    name = _TORCH_NAMES.get(rec.dtype)
    if (
        name is None
        or rec.layout is not torch.strided
        or rec.device.type != "cpu"
        or rec.is_quantized
        or rec.is_conj()
        or rec.is_neg()
        or not rec.is_contiguous()
        or rec.numel() < 2  # (empty, or one element of any stride: the codec's path)
    ):
        return None
    data = rec.detach().reshape(-1).view(torch.uint8).numpy()
    return _prefix_of("pt", name, rec.dim()), tuple(rec.shape), data


_TORCH_NAMES = {d: name for name, d in itemcodec.TORCH_DTYPES.items()}
_ARRAY_PREFIXES: dict[tuple, tuple] = {}


def _prefix_of(kind: str, dtype: str, ndim: int) -> tuple:
    """(struct, static header, blanks) packing the blob header of one array/tensor (cached)."""
    key = (kind, dtype, ndim)
    got = _ARRAY_PREFIXES.get(key)
    if got is None:
        head, count, blanks = itemcodec.single_prefix(kind, dtype, ndim, ALIGN)
        got = (struct.Struct(f"<{len(head)}s{count}Q{len(blanks)}s"), head, blanks)
        if len(_ARRAY_PREFIXES) > 1024:
            _ARRAY_PREFIXES.clear()
        _ARRAY_PREFIXES[key] = got
    return got


_PREFIX = {bytes: _prefix_of("b", "u1", 1), str: _prefix_of("s", "u1", 1)}
_WIDTH = _PREFIX[bytes][0].size  # the same for both
_ZERO = bytes(8)


def _rows(b: _Batch) -> np.ndarray:
    """The index rows of ``b``'s records."""
    n = len(b.offs)
    c = np.array(b.chunks, np.int64).reshape(-1, 4)
    count = np.diff(np.append(c[:, 3], n))
    rows = np.empty(n, INDEX_DTYPE)
    rows["seg"] = np.repeat(c[:, 0], count)
    rows["off"] = np.array(b.offs, np.int64) + np.repeat(c[:, 1] - c[:, 2], count)
    rows["len"], rows["crc"] = b.rlen, b.crcs
    return rows


def _stage_size(batch_bytes: int) -> int:
    """A batch's stage: its blobs, their headers, a record past the limit, pages of room."""
    return -(-(batch_bytes + max(batch_bytes // 4, 64 << 10) + 2 * _PAGE) // _PAGE) * _PAGE


class _Writers:
    """The writer threads of one build: writer ``w`` owns its segment files and takes every
    ``io_threads``-th batch; results come back in batch order (see the module doc)."""

    def __init__(self, args: BuildArgs):
        self.args = args
        self.pools: list[ThreadPoolExecutor] = []
        self.segs: list[Segments] = []
        self.pos = [[-1, 0, w] for w in range(args.io_threads)]  # see _fill
        self.free: list[np.ndarray] = []  # stages of batches written, to reuse
        self.pending: collections.deque[tuple[_Batch, np.ndarray, Future]] = collections.deque()
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

    def fill(self, first: int, it: Iterator) -> tuple[_Batch | None, bool]:
        """The next batch (records ``first...`` from ``it``) laid out for its writer, or None
        if ``it`` had none left; and whether ``it`` may hold more."""
        pos = self.pos[self.batches % len(self.pools)]
        a = self.args
        stage = self.free.pop() if self.free else aligned_buffer(_stage_size(a.batch_bytes))
        b = _Batch(first, stage, pos[0], pos[1], a.segment_size)
        more = _fill(b, it, pos, a)
        if not b.offs:
            self.free.append(b.stage)
            return None, False
        return b, more

    def submit(self, b: _Batch) -> None:
        """Queue ``b`` to its writer, with its index rows."""
        w = self.batches % len(self.pools)
        nexts = [first for *_, first in b.chunks[1:]]  # each chunk ends where the next starts
        ends = [b.offs[r - 1] + b.rlen[r - 1] for r in nexts] + [b.at]
        chunks = [
            (seg, base, start, end, b.first + r)
            for (seg, base, start, r), end in zip(b.chunks, ends)
        ]
        fut = self.pools[w].submit(self.segs[w].write_staged, b.stage, chunks)
        self.pending.append((b, _rows(b), fut))
        self.batches += 1

    def results(self, keep: int) -> Iterator[tuple[int, np.ndarray]]:
        """(records, index rows) of the oldest batches until at most ``keep`` are in flight."""
        while len(self.pending) > keep:
            b, rows, fut = self.pending.popleft()
            fut.result()
            if len(self.free) <= 2 * len(self.pools):
                self.free.append(b.stage)
            yield len(rows), rows

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


def _encode_all(records: Iterable, writers: _Writers, index: _Index) -> tuple[int, int]:
    """Lay ``records`` out in batches of about ``batch_bytes`` of blobs for the writers (at most
    ``2 * io_threads`` in flight); (records, payload bytes)."""
    it = iter(records)
    count = payload = 0
    more = True
    while more:
        b, more = writers.fill(count, it)
        if b is None:
            break
        writers.submit(b)
        count += len(b.offs)
        payload += b.size
        index.add(writers, 2 * len(writers.pools))
    index.add(writers, 0)
    return count, payload


def _write(args: BuildArgs, records: Iterable, writers: _Writers, point: _Faults, bar) -> Manifest:
    """Write segments, index and (last: the commit) the manifest."""
    index_fd = _modes.create(os.path.join(args.root, _format.INDEX), args.mode)
    with open(index_fd, "wb", buffering=1 << 20) as f:
        index = _Index(f, point, bar)
        count, payload = _encode_all(records, writers, index)
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
