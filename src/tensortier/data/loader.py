"""``Loader``: epochs of a catalog in a seeded, rank-split order, read ahead, resumable exactly.

Iterating yields batches (:class:`EpochBatch`) of the current epoch from the current position;
when an epoch is exhausted the loader moves to the next one (a new order from the same seed).
``state_dict()`` is ``(epoch, position)`` plus what decides the order; ``load_state_dict`` resumes with exactly
the remaining sequence, with any ``num_workers`` (the position counts records of the rank's
stream, which every worker count yields in the same order: ``pytorch.py``).

``num_workers=0`` reads ahead on I/O threads of this process; ``num_workers=n`` runs a
``torch.utils.data.DataLoader`` of ``n`` processes (``multiprocessing_context`` "fork", "spawn" or
"forkserver"), each reading ahead its share of the batches (``prefetch_budget`` and
``io_threads`` are divided among them; the DataLoader itself queues ``2 * n`` batches more).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from tensortier._renamed import renamed
from tensortier.data._epochs import EpochConfig
from tensortier.data._order import derive_key
from tensortier.data._pipeline import EpochBatch, LoaderStats
from tensortier.data.catalog import Catalog, register_loader
from tensortier.data.pytorch import EpochDataset
from tensortier.errors import ClosedError, ConfigError

STATE_FORMAT = "tensortier-catalog-loader"
STATE_VERSION = 1


def _identity(batch: EpochBatch) -> EpochBatch:
    return batch


class Loader:
    """Stateful epochs of a catalog (made by :meth:`Catalog.epochs`).

    Arguments: the fields of :class:`~tensortier.data.EpochConfig` as keywords (``batch``
    records per batch, required; ``seed``; ``rank``/``world_size``; ``shuffle``, ``block``,
    ``window``; ``even``; ``drop_last``; ``prefetch_budget`` bytes read ahead; ``io_threads`` (read threads);
    ``transform``/``collate``; ``epoch``), or one ``config``; ``num_workers`` and
    ``multiprocessing_context`` as a DataLoader's.
    """

    @renamed(prefetch="prefetch_budget")
    def __init__(
        self,
        catalog: Catalog | str | os.PathLike,
        *,
        num_workers: int = 0,
        multiprocessing_context: str | None = None,
        config: EpochConfig | None = None,
        **options: Any,
    ):
        self.dataset = EpochDataset(catalog, config=config, **options)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(
                f"Catalog.epochs: num_workers={num_workers!r} must be an int >= 0 (0 reads ahead "
                f"on threads of this process)"
            )
        if multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise ConfigError(
                f"Catalog.epochs: multiprocessing_context={multiprocessing_context!r}; pass "
                f"'fork', 'spawn', 'forkserver' or None (the platform default)"
            )
        self.num_workers = num_workers
        self.multiprocessing_context = multiprocessing_context
        self.epoch, self.position = self.dataset.epoch, 0
        # weak: the generator refers to this loader, so a strong reference back would make a
        # cycle that only the cyclic GC frees -- maybe inside a forked DataLoader worker, which
        # would then run the abandoned iterator's cleanup on its parent's worker processes
        self._active: weakref.ref | None = None
        self._token: object | None = None  # the running iteration's; close() clears it
        self._runner = 0  # the thread that last ran the active iteration's next()

    # ------------------------------------------------------------------ shape
    @property
    def catalog(self) -> Catalog:
        return self.dataset.catalog

    def stats(self) -> LoaderStats:
        """Counters of this loader's reads, live (they keep counting)."""
        return self.dataset.stats()

    @property
    def records_per_epoch(self) -> int:
        return self.dataset.records_per_epoch

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self.dataset)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[EpochBatch]:
        self._stop()
        if self.position >= self.records_per_epoch > 0:
            # the epoch's last batch was taken without the final next() (islice, a step count
            # that breaks at the end): this iteration is the next epoch, as state_dict() says
            self.epoch, self.position = self.epoch + 1, 0
        self._token = token = object()
        self._runner = threading.get_ident()
        gen = self._run(self.epoch, self.position, token)
        self._active = weakref.ref(gen)
        return gen

    def _run(self, epoch: int, start: int, token: object) -> Iterator[EpochBatch]:
        ds = self.dataset
        pid = os.getpid()
        if self.num_workers == 0:
            batches = ds.iterate(epoch, start)
        else:
            import torch
            from torch.utils.data import DataLoader

            ds.set_epoch(epoch, start)  # the workers get a copy of the dataset as it is now
            # the workers' base seed from this position, not from torch's global generator: a
            # draw there per epoch would change the model's dropout with num_workers (and after
            # a resume), and seeded from the order's seed, workers' random transforms repeat
            seed = derive_key(ds.spec.seed, epoch, start, ds.rank, 0x3EED)
            loader = DataLoader(
                ds,
                batch_size=None,
                num_workers=self.num_workers,
                multiprocessing_context=self.multiprocessing_context,
                collate_fn=_identity,
                persistent_workers=False,
                generator=torch.Generator().manual_seed(seed),
            )
            batches = iter(loader)
        try:
            for b in batches:
                if self._token is not token:  # closed (or iterated again) by another thread
                    raise ClosedError(
                        "Loader: this iteration was stopped by close(), set_epoch(), "
                        "load_state_dict() or a new iteration of the loader in another thread"
                    )
                ds.catalog._check_open()  # closed since: workers' copies would read on
                self.position = b.position
                if self.num_workers:
                    ds._stats.batches += 1
                    ds._stats.records += len(b)
                yield b
                self._runner = threading.get_ident()
            self.epoch, self.position = epoch + 1, 0
        finally:
            if os.getpid() == pid:  # a forked child's copy owns neither threads nor workers
                close = getattr(batches, "close", None)  # a generator: cancels its read-ahead
                if close is not None:
                    close()
                else:
                    shutdown = getattr(batches, "_shutdown_workers", None)
                    if shutdown is not None:
                        shutdown()

    def _stop(self) -> None:
        ref, self._active = self._active, None
        gen = ref() if ref is not None else None
        self._token = None  # an iteration of another thread stops at its next batch
        if gen is not None and self._runner == threading.get_ident() and not gen.gi_running:
            gen.close()  # closing another thread's generator races with its next() (ValueError)
        self.dataset.cancel_abandoned()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration."""
        self._stop()
        self.dataset.set_epoch(epoch, 0)
        self.epoch, self.position = self.dataset.epoch, 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Where this rank is: epoch and records consumed, and what decides the order."""
        epoch, position = self.epoch, self.position
        if position >= self.records_per_epoch:  # the epoch's last batch was consumed
            epoch, position = epoch + 1, 0
        spec = self.dataset.spec
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "rank": self.dataset.rank,
            "records": spec.n,
            "seed": spec.seed,
            "shuffle": spec.shuffle,
            "block": spec.block,
            "window": spec.window,
            "world_size": spec.world_size,
            "even": spec.even,
            "batch": self.dataset.batch,
            "index_crc32": self.catalog.manifest.index_crc,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved state: the next iteration yields exactly the remaining batches.

        The order-deciding settings (catalog, seed, shuffle, block, window, world_size, even,
        rank) must match this loader's; the batch size must too (positions are batch
        boundaries). ``num_workers`` may differ.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError(
                "Loader.load_state_dict: not a state from Loader.state_dict() "
                f"(got {type(state).__name__})"
            )
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"Loader.load_state_dict: state version {state.get('version')!r}; this tensortier "
                f"reads version {STATE_VERSION}"
            )
        mine = self.state_dict()
        for key in ("index_crc32", "records", "seed", "shuffle", "block", "window", "world_size",
                    "even", "rank", "batch"):  # fmt: skip
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"Loader.load_state_dict: the state was saved with {key}={state.get(key)!r} "
                    f"but this loader has {key}={mine[key]!r}; create the loader with the same "
                    f"catalog and {key} to resume (its order would differ otherwise)"
                )
        epoch, position = state.get("epoch"), state.get("position")
        self._stop()
        try:
            self.dataset.set_epoch(epoch, position)
        except ConfigError as exc:
            raise ConfigError(f"Loader.load_state_dict: {exc}") from exc
        self.epoch, self.position = epoch, position

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop reading ahead and the I/O threads (the catalog stays open)."""
        self._stop()
        self.dataset.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        spec = self.dataset.spec
        return (
            f"Loader({self.catalog.directory!r}, batch={self.dataset.batch}, shuffle={spec.shuffle!r}, "
            f"rank={self.dataset.rank}/{spec.world_size}, epoch={self.epoch}, "
            f"position={self.position}/{self.records_per_epoch})"
        )


register_loader(Loader)  # Catalog.epochs makes this class (catalog.py does not import this module)
