"""MemoryBank: a FIFO of variable-size items with fast index access, on the replay buffer's storage.

Same storage as :class:`~tensortier.rl.ReplayBuffer` (RAM up to a budget, then segment files,
FIFO eviction past ``max_items``, never-reused indices) without a sampler: what an agent's episodic
memory or a retrieval store needs. ``get_many`` reads disk-resident items in one sorted pass.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from tensortier._renamed import renamed
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, parse_size
from tensortier.errors import ClosedError
from tensortier.rl._store import (
    ItemStore,
    as_index_array,
    check_args,
    check_items,
    check_tier,
    not_picklable,
)
from tensortier.tiers import itemcodec as _codec


class MemoryBank:
    """``bank.append(item) -> index``; ``bank[index]``; ``bank[index] = item``; ``del bank[index]``.

    >>> bank = tt.rl.MemoryBank(100_000, host_budget="2GiB", spill_dir="/data/mb")
    >>> i = bank.append({"embedding": e, "text": b"..."})
    """

    @renamed(capacity="max_items", ram_budget="host_budget", spill="tier")
    def __init__(
        self,
        max_items: int,
        *,
        host_budget: SizeLike = "1GiB",
        spill_dir: str | os.PathLike | None = None,
        durable: bool = False,
        fsync: bool = False,
        segment_size: SizeLike = "64MiB",
        tier: str | Sequence[str] = "disk",
        remote: Any = None,
    ):
        """``max_items``, ``tier`` and ``remote``: as :class:`~tensortier.rl.ReplayBuffer`'s (RAM -> remote
        pool -> disk); reading an item lost with its memory node (or with a pool closed under
        the bank) raises NodeLostError once, and the lost items are dropped."""
        max_items = check_args(
            "MemoryBank", max_items, spill_dir=spill_dir, durable=durable, fsync=fsync
        )
        durable, fsync = bool(durable), bool(fsync)
        tiers = check_tier("MemoryBank", tier, remote, durable)
        self._lock = threading.RLock()
        self._closed = False
        self._store = ItemStore(
            max_items,
            parse_size(host_budget, name="host_budget"),
            spill_dir,
            durable=durable,
            fsync=fsync,
            segment_size=parse_size(segment_size, name="segment_size", allow_zero=False),
            owner="tt-membank",
            what="MemoryBank",
            tiers=tiers,
            remote=remote,
        )
        register_stats("memory_bank", self)  # tt.stats() lists it while it is open

    @property
    def max_items(self) -> int:
        """The most items held (the oldest is evicted past it)."""
        return self._store.cap

    @property
    def stats(self) -> dict:
        with self._lock:
            return self._store.stats.as_dict()

    def __len__(self) -> int:
        return len(self._store)

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this MemoryBank is closed")

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        return self._store.live_slots(keys, "append()")

    def append(self, item: Any) -> int:
        """Store ``item`` at the end (evicting the oldest past ``max_items``); returns its index."""
        return int(self.extend([item])[0])

    def extend(self, items: Iterable[Any]) -> np.ndarray:
        blobs = [_codec.encode_parts(it) for it in check_items(items, "MemoryBank")]  # one copy
        with self._lock:
            self._check()
            return self._store.add(blobs)[0]

    def get_many(self, indices: Sequence[int] | np.ndarray) -> list[Any]:
        """Items at ``indices`` in order; disk-resident ones in one offset-sorted pass."""
        keys = as_index_array(indices, "indices")
        with self._lock:
            self._check()
            blobs = self._store.blobs(self._slots(keys))
        return [_codec.decode(b) for b in blobs]

    def __getitem__(self, index: int | Sequence[int] | np.ndarray) -> Any:
        """The item at ``index``, or a list of items for a sequence of indices (as
        ``ReplayBuffer`` and a served bank)."""
        single = isinstance(index, int) or getattr(index, "ndim", None) == 0  # 0-d: one index
        items = self.get_many([index] if single else index)
        return items[0] if single else items

    def __setitem__(self, index: int, item: Any) -> None:
        blob = _codec.encode(item)
        with self._lock:
            self._check()
            self._store.update(index, blob, "append()")

    def __delitem__(self, index: int | Sequence[int]) -> None:
        keys = as_index_array(index, "index")
        with self._lock:
            self._check()
            self._store.remove(np.unique(self._slots(keys)))

    def __contains__(self, index: object) -> bool:
        with self._lock:
            return self._store.contains(index)

    def indices(self) -> np.ndarray:
        """Indices of stored items, oldest first."""
        with self._lock:
            return self._store.order()

    def __iter__(self) -> Iterator[Any]:
        """Items oldest first (a snapshot of the indices; items deleted meanwhile are skipped)."""
        for key in self.indices().tolist():
            try:
                yield self[key]
            except KeyError:
                continue

    def close(self) -> None:
        """Delete spill files (a durable bank keeps its segments). A bank dropped without
        ``close()`` is cleaned up by the reaper thread after garbage collection."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._store.close()

    def __reduce__(self):
        raise not_picklable("MemoryBank")

    def __enter__(self) -> MemoryBank:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
