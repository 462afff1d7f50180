"""Read-ahead in a known order: pieces of the stream read on I/O threads, under a byte budget.

The stream of one rank (or one DataLoader worker's share of it) is a list of position ranges.
Pieces are cut from it: in ``block`` mode at window boundaries (a window is a few large sequential
reads), otherwise every ~``piece_bytes``; never across a range. Each piece runs on an I/O thread:
sort and coalesce its records, read, check every record, decode into views of the read buffer,
apply ``transform``. The consumer submits pieces in order while the bytes in flight stay within
``prefetch_budget`` bytes (always at least one piece), takes results in order, and cuts them into batches.

Waits. The consumer waits only on futures of its own executor; a piece always settles them (its
errors travel in the future) and ``close`` cancels queued ones (the consumer then raises
:class:`ClosedError`): there is no other wait. A stream closed early (or collected) hands its
pending futures to a lock-free deque that the owner drains (cancels) at its next call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from tensortier.data._files import ReadStats, Scratch, read_spans
from tensortier.data._order import Order
from tensortier.errors import ClosedError
from tensortier.tiers import itemcodec
from tensortier.tiers.segments import REC

PLAN_CHUNK = 65536  # positions planned at a time (index rows fetched in one gather)
GAP = 64 << 10  # coalesce records of a piece closer than this


@dataclass
class EpochBatch:
    """One batch of a rank's epoch.

    ``data``: the records (after ``transform``) as a list, or what ``collate`` made of that list;
    ``indices``: their record indices; ``position``: records of this rank's epoch consumed after
    this batch (what ``Loader.state_dict`` saves).
    """

    data: Any
    indices: np.ndarray
    epoch: int
    position: int

    def __len__(self) -> int:
        return len(self.indices)

    def pin_memory(self, device: str | None = None) -> EpochBatch:
        """``DataLoader(pin_memory=True)`` calls this on a type it does not know: the batch with
        its data's tensors in pinned memory, by torch's own rules (the records stayed pageable,
        so every host-to-device copy of them was synchronous)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return replace(self, data=pin_memory(self.data, device))


@dataclass
class LoaderStats:
    """Counters of a loader in this process (DataLoader workers keep their own)."""

    batches: int = 0
    records: int = 0
    pieces: int = 0
    reads: int = 0  # preadv calls
    bytes_read: int = 0  # from disk, alignment included
    wait_seconds: float = 0.0  # the consumer waited for a piece not read yet
    max_inflight_bytes: int = (
        0  # most record bytes submitted and not yet taken (<= prefetch_budget,
    )
    # unless one piece alone is larger)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Piece:
    positions: np.ndarray
    indices: np.ndarray
    rows: np.ndarray
    nbytes: int


def _pieces(
    index: np.ndarray, order: Order, ranges: list[tuple[int, int]], piece_bytes: int, limit: int
) -> Iterator[_Piece]:
    """Pieces of ``ranges``: ~``piece_bytes`` each, a whole window in block mode (up to 16 pieces'
    worth and half of ``limit``, the read-ahead budget)."""
    for a, b in ranges:
        for c in range(a, b, PLAN_CHUNK):
            d = min(b, c + PLAN_CHUNK)
            idx = order.indices(c, d)
            rows = np.asarray(index[idx])
            cum = np.cumsum(rows["len"], dtype=np.int64)
            wins = order.windows(c, d)
            big = (
                piece_bytes if wins is None else max(piece_bytes, min(16 * piece_bytes, limit // 2))
            )
            cut = np.diff(cum // big) != 0
            if wins is not None:
                cut |= np.diff(wins) != 0
            bounds = [0, *(np.flatnonzero(cut) + 1).tolist(), d - c]
            for s, e in zip(bounds[:-1], bounds[1:]):
                yield _Piece(
                    np.arange(c + s, c + e, dtype=np.int64),
                    idx[s:e],
                    rows[s:e],
                    int(cum[e - 1] - (cum[s - 1] if s else 0)),
                )


_local = threading.local()


def _read_piece(catalog, piece: _Piece, direct: bool, transform) -> tuple[list, ReadStats]:
    stats = ReadStats()
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = Scratch()
    buf, pos, _ = read_spans(
        catalog._fds(),
        piece.indices,
        piece.rows,
        catalog.manifest.segments,
        direct=direct,
        gap=GAP,
        stats=stats,
        scratch=scratch,
    )  # every record is intact here: a bad one raised
    head = REC.size
    records = itemcodec.decode_spans(buf, pos + head, piece.rows["len"].astype(np.int64) - head)
    del buf
    scratch.release()
    if transform is not None:
        records = [transform(r) for r in records]
    return records, stats


class _ReadAhead:
    """Pieces submitted in order while the bytes in flight stay within ``prefetch_budget`` (always at
    least one piece), and their results taken in order."""

    def __init__(
        self, catalog, plan: Iterator[_Piece], executor, prefetch_budget, transform, stats
    ):
        self.catalog, self.plan, self.executor = catalog, plan, executor
        self.prefetch_budget, self.transform, self.stats = prefetch_budget, transform, stats
        self.direct = catalog.direct_io()
        self.upcoming = next(plan, None)
        self.inflight: deque[tuple[_Piece, Future]] = deque()
        self.inflight_bytes = 0

    def _fill(self) -> None:
        stats, up = self.stats, self.upcoming
        while up is not None and (
            not self.inflight or self.inflight_bytes + up.nbytes <= self.prefetch_budget
        ):
            if self.catalog._index is None:
                raise ClosedError(f"Catalog {self.catalog.directory!r} was closed while reading")
            try:
                args = (self.catalog, up, self.direct, self.transform)
                fut = self.executor.submit(_read_piece, *args)
            except RuntimeError as exc:  # the executor was shut down (loader closed)
                raise ClosedError("the loader was closed") from exc
            self.inflight.append((up, fut))
            self.inflight_bytes += up.nbytes
            stats.max_inflight_bytes = max(stats.max_inflight_bytes, self.inflight_bytes)
            up = self.upcoming = next(self.plan, None)

    def next(self) -> tuple[_Piece, list] | None:
        """The next piece and its records (waiting for them if needed); None at the end."""
        self._fill()
        if not self.inflight:
            return None
        piece, fut = self.inflight[0]
        if not fut.done():
            t0 = time.perf_counter()
            try:
                # wait, not result(): the piece's own error is raised below; what a signal
                # handler raises here (KeyboardInterrupt) goes on, the piece left in flight
                wait([fut])
            finally:
                self.stats.wait_seconds += time.perf_counter() - t0
        self.inflight.popleft()
        try:
            got, read_stats = fut.result()
        except CancelledError as exc:
            raise ClosedError("the loader was closed while reading ahead") from exc
        self.inflight_bytes -= piece.nbytes
        self.stats.pieces += 1
        self.stats.reads += read_stats.reads
        self.stats.bytes_read += read_stats.bytes_read
        return piece, got


class _Batches:
    """Records taken in order, cut into batches."""

    def __init__(self, epoch: int, collate: Callable | None, stats: LoaderStats):
        self.epoch, self.collate, self.stats = epoch, collate, stats
        self.records: list = []
        self.positions: list[np.ndarray] = []
        self.indices: list[np.ndarray] = []
        self.held = 0  # records in `records`

    def take(self, piece: _Piece, records: list) -> None:
        self.records += records
        self.positions.append(piece.positions)
        self.indices.append(piece.indices)
        self.held += len(records)

    def emit(self, n: int) -> EpochBatch:
        data, self.records = self.records[:n], self.records[n:]
        pos = np.concatenate(self.positions)
        idx = np.concatenate(self.indices)
        self.positions[:] = [pos[n:]] if self.held > n else []
        self.indices[:] = [idx[n:]] if self.held > n else []
        self.held -= n
        self.stats.batches += 1
        self.stats.records += n
        out = self.collate(data) if self.collate is not None else data
        return EpochBatch(out, idx[:n], self.epoch, int(pos[n - 1]) + 1)


def stream(
    catalog,
    order: Order,
    ranges: list[tuple[int, int]],
    *,
    batch: int,
    executor: ThreadPoolExecutor,
    prefetch_budget: int,
    piece_bytes: int,
    transform: Callable | None,
    collate: Callable | None,
    stats: LoaderStats,
    abandoned: deque,
    owner: object = None,
) -> Iterator[EpochBatch]:
    """Batches of the records at ``ranges`` of ``order``, read ahead (see the module docstring).

    ``owner`` (the dataset whose ``executor`` this is) is kept alive by the stream's frame: a
    dataset made only to iterate it must not shut its executor down under the stream.
    """
    plan = _pieces(catalog._index, order, ranges, piece_bytes, prefetch_budget)
    ahead = _ReadAhead(catalog, plan, executor, prefetch_budget, transform, stats)
    out = _Batches(order.epoch, collate, stats)
    try:
        while (done := ahead.next()) is not None:
            out.take(*done)
            while out.held >= batch:
                yield out.emit(batch)
        if out.held:
            yield out.emit(out.held)
    finally:
        # Reads ahead of an abandoned stream are cancelled by the owner's next call: this may run
        # inside garbage collection, where taking a future's lock (cancel) is not allowed.
        abandoned.extend(fut for _, fut in ahead.inflight)
