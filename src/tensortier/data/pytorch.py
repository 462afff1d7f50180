"""PyTorch datasets over a catalog: map-style and a rank-and-worker-sharded iterable of batches.

``CatalogDataset``: ``ds[i]`` is ``cat[i]``; a DataLoader with a batch sampler fetches each batch
through ``__getitems__`` (one sorted, coalesced read). Any sampler works (``DistributedSampler``).

``EpochDataset``: yields whole :class:`Batch` es of one rank's epoch (use it with
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

import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tensortier._lifetime import Finalizer
from tensortier._units import SizeLike, check_int, parse_size
from tensortier.data._order import EVENS, SHUFFLES, Order, OrderSpec
from tensortier.data._pipeline import Batch, LoaderStats, stream
from tensortier.data.catalog import Catalog
from tensortier.errors import ConfigError

PIECE_BYTES = 4 << 20
BLOCK_BYTES = 1 << 20  # default block of block shuffle: about 1 MiB of records


def _catalog(catalog: Catalog | str | os.PathLike, what: str) -> Catalog:
    if isinstance(catalog, Catalog):
        return catalog
    if isinstance(catalog, (str, os.PathLike)):
        return Catalog.open(catalog)
    raise ConfigError(
        f"{what}: catalog must be a tt.data.Catalog or its path, got {type(catalog).__name__}"
    )


def _int(what: str, name: str, value: Any, low: int, fix: str) -> int:
    msg = f"{what}: {name}={value!r} must be an int >= {low}; {fix}"
    return check_int(value, msg, minimum=low)


def _rank_and_world(what: str, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): each one not given comes from torch.distributed when it is
    initialised (as ``DistributedSampler``); without it, a world size > 1 needs a rank."""
    source = {"rank": "", "world_size": ""}
    if dist.is_available() and dist.is_initialized():
        if rank is None:
            rank, source["rank"] = dist.get_rank(), " (from torch.distributed)"
        if world_size is None:
            world_size, source["world_size"] = dist.get_world_size(), " (from torch.distributed)"
    elif rank is None and world_size not in (None, 1):
        raise ConfigError(
            f"{what}: world_size={world_size!r} but no rank, and torch.distributed is not "
            f"initialised; pass rank= (this process's data-parallel rank), or initialise the "
            f"process group first (every rank would read the same share otherwise)"
        )
    world_size = 1 if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = _int(what, "world_size", world_size, 1, "pass the number of data-parallel ranks")
    rank = _int(what, "rank", rank, 0, "pass this process's rank")
    if rank >= world_size:
        raise ConfigError(
            f"{what}: rank={rank}{source['rank']} must be below world_size={world_size}"
            f"{source['world_size']}; pass rank= and world_size= of the data-parallel group"
        )
    return rank, world_size


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

    Arguments as :class:`~tensortier.data.Loader`; ``epoch`` and ``start`` (records of the rank's
    epoch already consumed) say where iteration begins (:meth:`set_epoch`).
    """

    def __init__(
        self,
        catalog: Catalog | str | os.PathLike,
        *,
        batch: int,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: str | bool = "full",
        block: int | None = None,
        window: int = 8,
        even: str = "pad",
        drop_last: bool = False,
        prefetch: SizeLike = "512MiB",
        io_threads: int = 16,
        transform: Callable | None = None,
        collate: Callable | None = None,
        epoch: int = 0,
        start: int = 0,
    ):
        what = "Catalog.epochs"
        self.catalog = _catalog(catalog, what)
        n = len(self.catalog)
        self.batch = _int(what, "batch", batch, 1, "pass the records per batch, e.g. batch=256")
        seed = check_int(seed, f"{what}: seed={seed!r} must be an int")
        rank, world_size = _rank_and_world(what, rank, world_size)
        if shuffle is True:
            shuffle = "full"
        elif shuffle is False:
            shuffle = "none"
        if shuffle not in SHUFFLES:
            raise ConfigError(
                f"{what}: shuffle={shuffle!r}; pass 'full' (any record anywhere), 'block' "
                f"(blocks of neighbours, for locality) or 'none' (index order)"
            )
        if block is None:
            mean = self.catalog.manifest.payload_bytes / n if n else 1.0
            block = max(1, round(BLOCK_BYTES / max(mean, 1.0)))
        block = _int(what, "block", block, 1, "pass the records per block of block shuffle")
        window = _int(what, "window", window, 1, "pass the blocks shuffled together")
        if even not in EVENS:
            raise ConfigError(
                f"{what}: even={even!r}; pass 'pad' (every rank gets ceil(n/world_size) records, "
                f"a few read twice) or 'drop' (n//world_size each, a few skipped per epoch)"
            )
        if even == "drop" and n < world_size:
            raise ConfigError(
                f"{what}: a catalog of {n} records gives no record to each of world_size="
                f"{world_size} ranks with even='drop'; use even='pad'"
            )
        if not isinstance(drop_last, bool):
            raise ConfigError(f"{what}: drop_last={drop_last!r} must be True or False")
        self.spec = OrderSpec(n, seed, shuffle, block, window, world_size, even)
        self.rank = rank
        self.drop_last = drop_last
        self.prefetch = parse_size(prefetch, name=f"{what}: prefetch", allow_zero=False)
        self.io_threads = _int(what, "io_threads", io_threads, 1, "4-16 keep an NVMe busy")
        for name, fn in (("transform", transform), ("collate", collate)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{what}: {name}={fn!r} must be callable or None")
        self.transform, self.collate = transform, collate
        self.stats = LoaderStats()
        self.set_epoch(epoch, start)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_fin: Finalizer | None = None
        self._abandoned: deque = deque()  # futures of streams closed early (see _pipeline)

    # ------------------------------------------------------------------ shape of an epoch
    @property
    def records_per_epoch(self) -> int:
        k = self.spec.per_rank
        return k // self.batch * self.batch if self.drop_last else k

    def __len__(self) -> int:
        """Batches per epoch for this rank (all DataLoader workers together)."""
        return -(-self.records_per_epoch // self.batch)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        epoch = _int("set_epoch", "epoch", epoch, 0, "epochs count from 0")
        start = _int("set_epoch", "start", start, 0, "start is a record position in the epoch")
        if start > self.records_per_epoch or start % self.batch and start != self.records_per_epoch:
            raise ConfigError(
                f"start={start} is not a batch boundary of this epoch ({self.records_per_epoch} "
                f"records in batches of {self.batch})"
            )
        self.epoch, self.start = epoch, start

    # ------------------------------------------------------------------ iteration
    def _executor(self, threads: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():  # per process (fork)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tt-catalog-read")
            self._pool_pid = os.getpid()
            self._pool_fin = Finalizer(self, _shutdown, self._pool)  # joins: never inside GC
        return self._pool

    def iterate(self, epoch: int, start: int, worker: int = 0, workers: int = 1) -> Iterator[Batch]:
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
        threads = max(1, self.io_threads // workers)
        prefetch = max(1, self.prefetch // workers)
        return stream(
            self.catalog,
            order,
            ranges,
            batch=b,
            executor=self._executor(threads),
            prefetch=prefetch,
            # every thread gets work within the budget; large reads where the budget allows
            piece_bytes=max(1, min(PIECE_BYTES, prefetch // (2 * threads))),
            transform=self.transform,
            collate=self.collate,
            stats=self.stats,
            abandoned=self._abandoned,
            owner=self,  # a temporary dataset lives as long as its stream (its executor too)
        )

    def __iter__(self) -> Iterator[Batch]:
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
        state["stats"] = LoaderStats()
        return state


def _shutdown(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
