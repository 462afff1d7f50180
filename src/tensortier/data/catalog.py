"""``Catalog``: millions of read-only records, opened in O(1), read at random or in a known order.

A catalog is built once (:meth:`Catalog.build`) and never changes. Opening it reads a small JSON
manifest and maps the fixed-width index (20 bytes per record), so it costs the same for 1k or 10M
records. ``cat[i]`` reads one record with one ``pread`` and returns views of that read's buffer
(arrays and tensors are aligned, writable, and share nothing with other records);
``cat.read(indices)`` sorts and coalesces neighbours into large reads. ``cat.epochs(...)`` streams
epochs in a seeded order with read-ahead (``loader.py``).

What it must never do: write to the catalog directory, hold a lock a forked DataLoader worker
could inherit locked (descriptors are per process), or unpickle anything. Format and protocols:
``PROTOCOL.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np

from tensortier import _modes
from tensortier._lifetime import Finalizer
from tensortier._renamed import renamed
from tensortier._units import SizeLike, format_size, index_array, is_int
from tensortier.data import _build, _format
from tensortier.data._files import Descriptors, ReadStats, read_blobs, read_one
from tensortier.data._format import INDEX_DTYPE, Manifest
from tensortier.errors import ClosedError, ConfigError, CorruptDataError
from tensortier.tiers import itemcodec
from tensortier.tiers.host import PAGE

_GAP = 64 << 10  # random access: coalesce records closer than this
# The class Catalog.epochs makes. loader.py (which imports this module) registers its Loader here
# when it is imported, and ``import tensortier.data`` imports it: this module never imports the
# loader back, so the two form no import cycle.
_LOADER: list[Callable[..., Any]] = []


def register_loader(cls: Callable[..., Any]) -> None:
    """Make ``cls`` the class :meth:`Catalog.epochs` returns (``loader.py`` calls this)."""
    _LOADER[:] = [cls]


def as_indices(indices: Any, n: int, what: str = "indices") -> np.ndarray:
    """``indices`` (ints, a sequence, an array or a tensor) as int64 in ``[0, n)``; IndexError else."""
    arr = index_array(
        indices, f"{what} must be an int, a slice or a 1-D sequence of ints", copy=True
    )
    neg = arr < 0
    arr[neg] += n
    bad = (arr < 0) | (arr >= n)
    if bad.any():
        i = int(np.argmax(bad))
        first = int(arr[i]) - (n if neg[i] else 0)  # as given
        raise IndexError(f"record index {first} is out of range for a catalog of {n} records")
    return arr


def _replaced(directory: str, records: int, index_crc: int, found: str) -> str:
    """Why a catalog opened as (records, index_crc) is no longer the one at ``directory``."""
    return (
        f"the catalog at {directory!r} was deleted or replaced after it was opened (it held "
        f"{records} records with index checksum {index_crc:#010x}, {found}); open the new "
        f"catalog again and make new loaders (a saved loader state belongs to the old one)"
    )


@dataclass
class VerifyReport:
    """What :meth:`Catalog.verify` found: every record's checksum, the index, the file sizes."""

    records: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    bad: list[tuple[int, str, str]] = field(default_factory=list)  # (record, file, reason)
    problems: list[str] = field(default_factory=list)  # index or file level

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems


class Catalog:
    """A read-only store of records built by :meth:`build`; open it with :meth:`open`.

    >>> tt.data.Catalog.build("/data/meta", records)      # bytes, str, arrays, tensors, dicts
    >>> cat = tt.data.Catalog.open("/data/meta")
    >>> cat[123], cat[10:20], len(cat), cat.read([5, 3, 9])
    >>> for batch in cat.epochs(batch=256, seed=0, rank=r, world_size=n): ...

    ``direct``: the epoch loader reads with ``O_DIRECT`` (no page-cache pollution, no extra copy)
    when None and the filesystem allows it, always with True (error if it cannot), never with
    False. Random access (``cat[i]``, :meth:`read`) is buffered, so repeated reads hit the cache.
    Picklable (the directory travels, the catalog reopens); safe in forked and spawned workers.
    """

    @renamed(path="directory")
    def __init__(self, directory: str | os.PathLike, *, direct: bool | None = None, max_open=None):
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(
                f"Catalog.open: directory must be a directory path (str or os.PathLike), got "
                f"{type(directory).__name__} {directory!r}"
            )
        if direct is not None and not isinstance(direct, bool):
            raise ConfigError(
                f"Catalog.open: direct={direct!r}; pass True (O_DIRECT reads), False (page "
                f"cache) or None (O_DIRECT where the filesystem supports it)"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self._direct_arg = direct
        self._max_open = max_open
        try:
            self.manifest: Manifest = _format.read_manifest(self.directory)
        except (FileNotFoundError, NotADirectoryError):  # none, or a file: say which
            _format.refuse_incomplete(self.directory)  # raises why, unless it just completed
            self.manifest = _format.read_manifest(self.directory)
        n = self.manifest.records
        index_path = os.path.join(self.directory, _format.INDEX)
        try:
            size = os.stat(index_path).st_size
        except FileNotFoundError as exc:
            raise CorruptDataError(
                f"the catalog index {index_path} is missing; rebuild the catalog", path=index_path
            ) from exc
        if size != n * INDEX_DTYPE.itemsize:
            raise CorruptDataError(
                f"the catalog index {index_path} has {size} bytes, but {n} records need "
                f"{n * INDEX_DTYPE.itemsize} (it was truncated or replaced); rebuild the catalog",
                path=index_path,
            )
        # mapped, not read: opening costs the same for 1k or 10M records
        try:
            self._index = (
                np.memmap(index_path, dtype=INDEX_DTYPE, mode="r", shape=(n,))
                if n
                else np.empty(0, INDEX_DTYPE)
            )
        except PermissionError as exc:
            raise _modes.denied(index_path, exc, "Catalog.open") from exc
        self._check_readable()
        self._files = Descriptors(self.directory, max_open)
        self._finalizers = [Finalizer(self, self._files.close)]
        self._direct: bool | None = None
        self._stats = ReadStats()

    # ------------------------------------------------------------------ build / open
    @classmethod
    @renamed(path="directory", writers="io_threads")
    def build(
        cls,
        directory: str | os.PathLike,
        records: Iterable,
        *,
        segment_size: SizeLike = "1GiB",
        io_threads: int = 2,
        batch_bytes: SizeLike = "8MiB",
        progress: bool = False,
        direct: bool | None = None,
        mode: int = 0o600,
    ) -> Catalog:
        """Stream ``records`` into a new catalog in ``directory`` and open it.

        ``records``: an iterable of records, a Hugging Face ``datasets.Dataset`` /
        ``IterableDataset`` or a ``pyarrow.Table`` / ``RecordBatch`` (one dict per row, read a
        column at a time from Arrow: ``_sources.py``). A record is bytes, str, a numpy array, a
        torch tensor, a Python number, a list of numbers (stored as a numpy array), or a dict of
        those keyed by str (``tensortier.errors.RecordTypeError``, a ``TypeError``, naming the
        record, the field and the fix otherwise; nothing is pickled).
        Records go to ``segment_size`` files written by ``io_threads`` threads at once,
        ``batch_bytes`` per write; only a few batches are in memory at a time.

        ``directory`` is made exclusively, or must be an existing directory of this user's, not
        writable by everyone, that is empty or holds a dead build's leftovers (refused otherwise:
        a directory someone else made under /tmp is not ours). ``mode``: every file of the
        catalog gets it, 0o600 (private, the default), 0o640 (the group may read) or 0o644
        (everyone may read); the directory gets 0o700, 0o750 or 0o755 to match. A crash or an
        exception leaves nothing that opens as a catalog (an exception removes what was
        written). Statistics: ``catalog.build_stats``.
        """
        args = _build.check_args(directory, segment_size, io_threads, batch_bytes, mode)
        stats = _build.build(args, records, progress=progress)
        cat = cls(directory, direct=direct)
        cat.build_stats = stats
        return cat

    @classmethod
    @renamed(path="directory")
    def open(
        cls,
        directory: str | os.PathLike,
        *,
        direct: bool | None = None,
        max_open: int | None = None,
    ) -> Catalog:
        """Open the catalog in ``directory``: O(1) time and memory in the number of records.

        A build still running is refused (``ConfigError`` naming its pid); a build that died is
        ``CorruptDataError``; no catalog at all is ``FileNotFoundError``.
        """
        return cls(directory, direct=direct, max_open=max_open)

    def _check_readable(self) -> None:
        """Refuse at open a catalog whose segment files this process may not read (one
        ``access`` per segment file), instead of failing at every read."""
        for seg in self.manifest.segments:
            path = _format.segment_path(self.directory, seg)
            if not os.access(path, os.R_OK) and os.path.exists(path):  # missing: CorruptDataError
                raise _modes.denied(path, None, "Catalog.open")

    # ------------------------------------------------------------------ per process
    def _fds(self) -> Descriptors:
        files = self._files
        if files.pid != os.getpid():  # a forked worker: its own table, never the parent's lock
            self._check_same()  # it opens the files by path, under the parent's mapped index
            files = self._files = Descriptors(self.directory, self._max_open)
            self._finalizers.append(Finalizer(self, files.close))
        return files

    def _check_same(self) -> None:
        """CorruptDataError if the directory no longer holds this catalog (deleted, or rebuilt:
        another record count or index checksum)."""
        try:
            now = _format.read_manifest(self.directory)
            found = f"now {now.records} with {now.index_crc:#010x}"
        except FileNotFoundError:
            now, found = None, "now no catalog"
        m = self.manifest
        if now is None or (now.records, now.index_crc) != (m.records, m.index_crc):
            self._replaced = _replaced(self.directory, m.records, m.index_crc, found)
            raise CorruptDataError(self._replaced, path=self.directory)

    def _check_open(self) -> None:
        if self._index is None:
            replaced = getattr(self, "_replaced", None)
            if replaced is not None:
                raise CorruptDataError(replaced, path=self.directory)
            raise ClosedError(f"Catalog {self.directory!r} is closed")

    def direct_io(self) -> bool:
        """Does the epoch loader read with O_DIRECT here (see ``direct``)?"""
        if self._direct is None:
            ok = self._probe_direct()
            if self._direct_arg and not ok:
                raise ConfigError(
                    f"direct=True but the filesystem of {self.directory!r} refuses O_DIRECT reads; "
                    f"pass direct=None to fall back to buffered reads"
                )
            self._direct = ok if self._direct_arg is None else self._direct_arg
        return self._direct

    def _probe_direct(self) -> bool:
        if not self.manifest.segments or not getattr(os, "O_DIRECT", 0):
            return False
        seg = min(self.manifest.segments)
        try:
            fd = os.open(_format.segment_path(self.directory, seg), os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        try:
            from tensortier.data._files import aligned_buffer

            os.preadv(fd, [memoryview(aligned_buffer(PAGE))], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ access
    def stats(self) -> ReadStats:
        """Counters of this catalog's random-access reads, live (they keep counting)."""
        return self._stats

    def __len__(self) -> int:
        return self.manifest.records

    def __getitem__(self, key: Any) -> Any:
        """``cat[i]`` one record; ``cat[a:b:c]`` and ``cat[[i, j, ...]]`` a list of records. A 0-d
        integer array or tensor (``torch.randint(n, ())``) is an int, as numpy and torch index."""
        if getattr(key, "ndim", None) == 0 and not isinstance(key, np.generic):
            key = int(as_indices(key, len(self), "a 0-d index must hold an int")[0])
        if isinstance(key, slice):
            return self.read(np.arange(*key.indices(len(self))))
        if is_int(key, numpy=True):
            self._check_open()
            n, i = len(self), int(key)
            if not -n <= i < n:
                raise IndexError(f"record index {i} is out of range for a catalog of {n} records")
            i += n if i < 0 else 0
            seg, length, off, crc = self._index[i].item()
            blob = read_one(
                self._fds(), i, (seg, length, off, crc), self.manifest.segments, self._stats
            )
            return itemcodec.decode(blob, copy=False)
        if isinstance(key, (str, bytes, float, bool)) or key is None:
            raise TypeError(
                f"catalog indices must be ints, slices or sequences of ints, not "
                f"{type(key).__name__}"
            )
        return self.read(key)

    def read(self, indices: Any) -> list:
        """Records ``indices`` in the order given; the reads are sorted and coalesced."""
        self._check_open()
        idx = as_indices(indices, len(self))
        rows = self._index[idx]
        blobs = read_blobs(
            self._fds(), idx, rows, self.manifest.segments, gap=_GAP, stats=self._stats
        )
        return [itemcodec.decode(b, copy=False) for b in blobs]

    def __iter__(self) -> Iterator:
        step = 1024
        for a in range(0, len(self), step):
            yield from self.read(np.arange(a, min(len(self), a + step)))

    @renamed(prefetch="prefetch_budget")
    def epochs(self, batch: int, **kwargs: Any) -> Any:
        """A :class:`~tensortier.data.Loader` over this catalog (see its arguments)."""
        self._check_open()
        assert _LOADER, "tensortier.data.loader registers the Loader class when imported"
        return _LOADER[0](self, batch=batch, **kwargs)

    # ------------------------------------------------------------------ inspection
    def info(self) -> dict:
        m = self.manifest
        return {
            "directory": self.directory,
            "records": m.records,
            "payload_bytes": m.payload_bytes,
            "file_bytes": m.file_bytes,
            "index_bytes": m.records * INDEX_DTYPE.itemsize,
            "segments": len(m.segments),
            "io_threads": m.writers,  # the build's (the manifest's "writers")
            "created": m.created,
            "format_version": m.version,
            "mean_record_bytes": m.payload_bytes / m.records if m.records else 0.0,
        }

    def verify(self, *, progress: bool = False, chunk_bytes: int = 64 << 20) -> VerifyReport:
        """Read every record and check every checksum; also the index's and each file's size.

        Reports every bad record (index, file, reason) instead of stopping at the first.
        """
        import time

        self._check_open()
        t0 = time.monotonic()
        report = VerifyReport()
        m = self.manifest
        for seg, size in sorted(m.segments.items()):
            path = _format.segment_path(self.directory, seg)
            try:
                actual = os.stat(path).st_size
            except FileNotFoundError:
                report.problems.append(f"{path} is missing")
                continue
            if actual != size:
                report.problems.append(f"{path} has {actual} bytes, the manifest says {size}")
        crc = 0
        with open(os.path.join(self.directory, _format.INDEX), "rb") as f:
            while chunk := f.read(16 << 20):
                crc = crc32c.crc32c(chunk, crc)
        if crc != m.index_crc:
            report.problems.append(
                f"{os.path.join(self.directory, _format.INDEX)} does not match the checksum in the "
                f"manifest (the index was modified or damaged)"
            )
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=m.file_bytes, desc="verify", unit="B", unit_scale=True)
        n = len(self)
        step = max(1, int(chunk_bytes // max(1.0, m.payload_bytes / max(1, n))))
        direct = self.direct_io()
        stats = ReadStats()
        files = self._fds()
        for a in range(0, n, step):
            b = min(n, a + step)
            before = stats.bytes_read
            read_blobs(
                files,
                np.arange(a, b, dtype=np.int64),
                np.asarray(self._index[a:b]),
                m.segments,
                direct=direct,
                gap=1 << 20,
                stats=stats,
                errors=report.bad,
            )
            if bar is not None:
                bar.update(stats.bytes_read - before)
        if bar is not None:
            bar.close()
        report.records = n
        report.bytes_read = stats.bytes_read
        report.seconds = time.monotonic() - t0
        return report

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the segment descriptors and unmap the index (records already read stay valid)."""
        for fin in self._finalizers:
            fin()
        self._index = None

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        m = self.manifest
        return {"directory": self.directory, "direct": self._direct_arg, "max_open": self._max_open,
                "records": m.records, "index_crc": m.index_crc,
                "closed": self._index is None}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        """Reopen the directory (a spawned DataLoader worker does) and check that it still holds
        the catalog that was pickled: one rebuilt there since would be read under the parent's
        orders and positions, silently other records. It is refused at the first read (raising
        here would kill a worker before the DataLoader can report why)."""
        try:
            self.__init__(state["directory"], direct=state["direct"], max_open=state["max_open"])
        except (OSError, CorruptDataError) as exc:  # deleted, or damaged: refused at first read
            gone = isinstance(exc, (FileNotFoundError, NotADirectoryError))
            self._unopened(state, "now no catalog" if gone else f"now unreadable: {exc}")
            return
        now = self.manifest
        if (state.get("records", now.records), state.get("index_crc", now.index_crc)) != (
            now.records,
            now.index_crc,
        ):
            self.close()
            found = f"now {now.records} with {now.index_crc:#010x}"
            self._replaced = _replaced(self.directory, state["records"], state["index_crc"], found)
        if state.get(
            "closed"
        ):  # a closed catalog stays closed in a worker: reads raise ClosedError
            self.close()

    def _unopened(self, state: dict, found: str) -> None:
        """A closed catalog standing for the pickled one that can no longer be opened: its
        length and settings as pickled, every read a ``CorruptDataError`` saying why."""
        self.directory, self._direct_arg = state["directory"], state["direct"]
        self._max_open, self._direct, self._stats = state["max_open"], None, ReadStats()
        records, crc = state["records"], state["index_crc"]
        self.manifest = Manifest(records, 0, {}, crc, 0, "")
        self._index, self._files, self._finalizers = None, None, []
        self._replaced = _replaced(self.directory, records, crc, found)

    def __repr__(self) -> str:
        return (
            f"Catalog({self.directory!r}, records={len(self)}, "
            f"size={format_size(self.manifest.file_bytes)})"
        )
