"""PyTorch datasets over a catalog: map-style and a rank-and-worker-sharded iterable of batches.

``CatalogDataset``: ``ds[i]`` is ``cat[i]``; a DataLoader with a batch sampler fetches each batch
through ``__getitems__`` (one sorted, coalesced read). Any sampler works (``DistributedSampler``).

``EpochDataset``: yields whole batches (:class:`EpochBatch`) of one rank's epoch (use it with
``DataLoader(ds, batch_size=None, num_workers=n)``, as :class:`Loader` does). Worker ``w`` of ``n``
takes batches ``w, w + n, w + 2n, ...`` of the rank's stream and reads them ahead on its own I/O
threads; the DataLoader takes one batch from each worker in turn, so what it yields is the rank's
stream in order, whatever ``n``: a position saved with 2 workers resumes with 3.

Fork and spawn. Both pickle (spawn) or copy (fork) only the catalog's path and the settings;
descriptors, I/O threads and locks are made per process on first use, never inherited in use.
``transform`` and ``collate`` must be picklable for spawn (module-level functions).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tensortier._lifetime import Finalizer
from tensortier._renamed import renamed
from tensortier._stats import register as register_stats
from tensortier.data._epochs import WHAT, EpochConfig, check_int
from tensortier.data._order import Order
from tensortier.data._pipeline import EpochBatch, LoaderStats, stream
from tensortier.data.catalog import Catalog
from tensortier.errors import ConfigError

PIECE_BYTES = 4 << 20


def _catalog(catalog: Catalog | str | os.PathLike, what: str) -> Catalog:
    if isinstance(catalog, Catalog):
        return catalog
    if isinstance(catalog, (str, os.PathLike)):
        return Catalog.open(catalog)
    raise ConfigError(
        f"{what}: catalog must be a tt.data.Catalog or its path, got {type(catalog).__name__}"
    )


class CatalogDataset(Dataset):
    """Map-style dataset: ``ds[i] = transform(cat[i])``; batches are read in one coalesced pass."""

    def __init__(self, catalog: Catalog | str | os.PathLike, transform: Callable | None = None):
        self.catalog = _catalog(catalog, "CatalogDataset")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.catalog)

    def __getitem__(self, i: int) -> Any:
        rec = self.catalog[i]
        return rec if self.transform is None else self.transform(rec)

    def __getitems__(self, indices: list[int]) -> list:
        recs = self.catalog.read(indices)
        return recs if self.transform is None else [self.transform(r) for r in recs]


class EpochDataset(IterableDataset):
    """Batches of one rank's epoch in a seeded order, read ahead; see the module docstring.

    Arguments: the fields of :class:`~tensortier.data.EpochConfig` as keywords (``batch`` is
    required; as :class:`~tensortier.data.Loader`'s), or one ``config``; ``start`` (records of the
    rank's epoch already consumed) says where iteration begins (:meth:`set_epoch`).
    """

    @renamed(prefetch="prefetch_budget")
    def __init__(
        self,
        catalog: Catalog | str | os.PathLike,
        *,
        config: EpochConfig | None = None,
        start: int = 0,
        **options: Any,
    ):
        self.catalog = _catalog(catalog, WHAT)
        if config is None:
            config = EpochConfig.of(options)
        elif options:
            raise TypeError(f"{WHAT}: pass config= or the settings as keywords, not both")
        n = len(self.catalog)
        self.config = config.checked(n, self.catalog.manifest.payload_bytes)
        self.spec = self.config.spec(n)
        self.rank: int = self.config.rank  # type: ignore[assignment]
        self.batch = self.config.batch
        self._stats = LoaderStats()
        # (epoch, start) in shared memory: DataLoader workers get it shared (fork and spawn), so
        # set_epoch reaches persistent workers, which keep the copy of the dataset they started with
        self._where = torch.zeros(2, dtype=torch.int64)
        try:
            self._where.share_memory_()
        except RuntimeError:  # no shared memory here (/dev/shm): workers get copies, as before
            pass
        self.set_epoch(self.config.epoch, start)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_fin: Finalizer | None = None
        self._abandoned: deque = deque()  # futures of streams closed early (see _pipeline)
        register_stats("loader", self)  # tt.stats() lists it while it is open

    # ------------------------------------------------------------------ shape of an epoch
    @property
    def records_per_epoch(self) -> int:
        k = self.spec.per_rank
        return k // self.batch * self.batch if self.config.drop_last else k

    def stats(self) -> LoaderStats:
        """Counters of this dataset's reads, live (they keep counting)."""
        return self._stats

    def __len__(self) -> int:
        """Batches per epoch for this rank (all DataLoader workers together)."""
        return -(-self.records_per_epoch // self.batch)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        check_int("epoch", epoch, 0, "epochs count from 0", "set_epoch")
        check_int("start", start, 0, "start is a record position in the epoch", "set_epoch")
        if start > self.records_per_epoch or start % self.batch and start != self.records_per_epoch:
            raise ConfigError(
                f"start={start} is not a batch boundary of this epoch ({self.records_per_epoch} "
                f"records in batches of {self.batch})"
            )
        self._where[0], self._where[1] = epoch, start

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (:meth:`set_epoch`)."""
        return int(self._where[0])

    @property
    def start(self) -> int:
        """Records of :attr:`epoch` the next iteration skips (:meth:`set_epoch`)."""
        return int(self._where[1])

    # ------------------------------------------------------------------ iteration
    def _executor(self, threads: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():  # per process (fork)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tt-catalog-read")
            self._pool_pid = os.getpid()
            self._pool_fin = Finalizer(self, _shutdown, self._pool)  # joins: never inside GC
        return self._pool

    def iterate(
        self, epoch: int, start: int, worker: int = 0, workers: int = 1
    ) -> Iterator[EpochBatch]:
        """Batches of ``epoch`` from position ``start``: those of ``worker`` out of ``workers``."""
        end = self.records_per_epoch
        b = self.batch
        first = start // b + worker
        ranges = [(p * b, min(end, (p + 1) * b)) for p in range(first, -(-end // b), workers)]
        if workers == 1:  # one range: pieces may span batches
            ranges = [(start, end)] if start < end else []
        self.cancel_abandoned()
        self.catalog._check_open()
        order = Order(self.spec, epoch, self.rank)
        threads = max(1, self.config.io_threads // workers)
        budget = max(1, self.config.prefetch_budget // workers)  # type: ignore[operator]
        return stream(
            self.catalog,
            order,
            ranges,
            batch=b,
            executor=self._executor(threads),
            prefetch_budget=budget,
            # every thread gets work within the budget; large reads where the budget allows
            piece_bytes=max(1, min(PIECE_BYTES, budget // (2 * threads))),
            transform=self.config.transform,
            collate=self.config.collate,
            stats=self._stats,
            abandoned=self._abandoned,
            owner=self,  # a temporary dataset lives as long as its stream (its executor too)
        )

    def __iter__(self) -> Iterator[EpochBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.iterate(self.epoch, self.start, worker, workers)

    def cancel_abandoned(self) -> None:
        """Cancel the queued reads of streams that were closed early."""
        while True:
            try:
                self._abandoned.popleft().cancel()
            except IndexError:
                return

    def close(self) -> None:
        """Stop the read-ahead threads of this process (reads already running finish first)."""
        self.cancel_abandoned()
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool_fin()
        self._pool = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"], state["_pool_pid"], state["_pool_fin"] = None, 0, None
        state["_abandoned"] = deque()
        state["_stats"] = LoaderStats()  # a worker counts its own reads
        return state


def _shutdown(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
