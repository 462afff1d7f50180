"""ReplayBuffer: a FIFO of variable items, sampled uniformly or by priority, RAM then disk.

Indices. ``add`` returns an int index that stays valid until the item is deleted, evicted (FIFO at
capacity) or used up (``max_uses``); indices are never reused, so a stale one is refused rather than
silently pointing at a newer item. ``update_priorities`` skips indices that went stale between
``sample`` and the update (counted in ``stats["stale_updates"]``), which is the normal case for a
learner racing collectors; an index that was never issued is an error.

Concurrency. One lock guards the buffer; every public method is thread-safe. ``prefetch=k`` draws
up to ``k`` batches ahead on a background thread: those batches were drawn from the priorities
current at draw time (as with TorchRL's prefetch), and their ``max_uses`` accounting happens then.

Persistence. ``save(dir)`` holds the lock only while it copies the index (numpy arrays); item
bytes are then copied from RAM references and from append-only segments that are pinned (no
compaction deletes them) until the copy ends, so adds and samples continue meanwhile. The format is
the segment format plus ``state.npz`` (keys, priority leaves, use counts) and ``buffer.json``;
nothing is pickled. ``durable=True`` writes every add through to segments in ``spill_dir``, so a
crash loses only adds that had not returned; ``checkpoint()`` (also run by ``close()``) records
priorities, which a reopen restores (items added after the last checkpoint get the max priority).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensortier._units import SizeLike, parse_size
from tensortier.errors import ClosedError, ConfigError, CorruptDataError
from tensortier.rl import _codec
from tensortier.rl._segments import Segments
from tensortier.rl._store import ItemStore
from tensortier.rl.sampler import Prioritized, Uniform, make_state, sampler_from_dict

_STATE = "state.npz"
_META = "buffer.json"


@dataclass
class Batch:
    """A sample: ``items`` (a dict of stacked arrays/tensors when ``collated``, else a list of items),
    their ``indices`` (int64) and importance ``weights`` (float32, all 1 for uniform sampling)."""

    items: Any
    indices: np.ndarray
    weights: np.ndarray
    collated: bool

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class ReplayConfig:
    capacity: int
    ram_budget: int
    spill_dir: str | None
    sampler: Uniform | Prioritized
    max_uses: int | None
    durable: bool
    fsync: bool
    prefetch: int
    seed: int | None
    segment_size: int

    def to_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "ram_budget": self.ram_budget,
            "sampler": self.sampler.to_dict(),
            "max_uses": self.max_uses,
            "segment_size": self.segment_size,
        }


def _as_index_array(indices: Any, name: str = "indices") -> np.ndarray:
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    arr = np.asarray(indices)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(
            f"{name} must be an int or a 1-D sequence of ints, got {arr.dtype} {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


class ReplayBuffer:
    """Prioritized or uniform replay over items held in RAM up to ``ram_budget``, then on disk.

    >>> buf = tt.rl.ReplayBuffer(100_000, ram_budget="4GiB", spill_dir="/data/rb",
    ...                          sampler=tt.rl.Prioritized(alpha=0.6, beta=0.4))
    >>> i = buf.add({"obs": obs, "action": a, "reward": r})
    >>> batch = buf.sample(256)
    >>> buf.update_priorities(batch.indices, td_error.abs())
    """

    def __init__(
        self,
        capacity: int,
        *,
        ram_budget: SizeLike = "1GiB",
        spill_dir: str | os.PathLike | None = None,
        sampler: Uniform | Prioritized | None = None,
        max_uses: int | None = None,
        durable: bool = False,
        fsync: bool = False,
        prefetch: int = 0,
        seed: int | None = None,
        segment_size: SizeLike = "64MiB",
    ):
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, (int, np.integer))
            or capacity < 1
        ):
            raise ConfigError(f"capacity must be an int >= 1, got {capacity!r}")
        if max_uses is not None and (not isinstance(max_uses, (int, np.integer)) or max_uses < 1):
            raise ConfigError(f"max_uses must be None or an int >= 1, got {max_uses!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(
                f"prefetch must be an int >= 0 (batches drawn ahead), got {prefetch!r}"
            )
        sampler = Uniform() if sampler is None else sampler
        self.config = ReplayConfig(
            capacity=int(capacity),
            ram_budget=parse_size(ram_budget, name="ram_budget"),
            spill_dir=None if spill_dir is None else os.fspath(spill_dir),
            sampler=sampler,
            max_uses=None if max_uses is None else int(max_uses),
            durable=durable,
            fsync=fsync,
            prefetch=prefetch,
            seed=seed,
            segment_size=parse_size(segment_size, name="segment_size", allow_zero=False),
        )
        self._sampler = make_state(self.config.capacity, sampler)
        self._lock = threading.RLock()
        self._rng = np.random.default_rng(seed)
        self._uses = np.zeros(self.config.capacity, np.int32)
        self._stale_updates = 0
        self._closed = False
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._prefetch_size = 0
        self._store = ItemStore(
            self.config.capacity,
            self.config.ram_budget,
            self.config.spill_dir,
            durable=durable,
            fsync=fsync,
            segment_size=self.config.segment_size,
            owner="tt-replay",
        )
        if durable:
            self._restore_durable()

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self._store)

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def beta(self) -> float:
        """The importance-sampling exponent the next ``sample`` uses (annealed when configured)."""
        return getattr(self._sampler, "beta", 0.0)

    @property
    def stats(self) -> dict:
        with self._lock:
            out = self._store.stats.as_dict()
            segs = self._store.segments
            if segs is not None:
                out.update({f"disk_{k}": v for k, v in segs.stats.__dict__.items()})
            out["stale_updates"] = self._stale_updates
            return out

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            return False
        with self._lock:
            return bool(self._store.slots(np.array([index]))[0] >= 0)

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this ReplayBuffer is closed")

    def _slots(self, indices: np.ndarray) -> np.ndarray:
        slots = self._store.slots(indices)
        bad = slots < 0
        if bad.any():
            first = int(indices[np.argmax(bad)])
            raise KeyError(
                f"index {first} is not in the buffer ({int(bad.sum())} of {len(indices)} missing): "
                f"it was deleted, evicted, used up, or never returned by add()"
            )
        return slots

    # ------------------------------------------------------------------ add / get / update / delete
    def add(self, item: Any) -> int:
        """Store one item (dict of arrays/tensors/bytes/numbers, or one such value); returns its index."""
        return int(self.extend([item])[0])

    def extend(self, items: Iterable[Any]) -> np.ndarray:
        """Store many items in one step (one lock, one batched spill); returns their indices."""
        return self._extend_blobs([_codec.encode(it) for it in items])

    def _extend_blobs(self, blobs: list[bytes]) -> np.ndarray:
        """Add already-encoded items (Ray collectors encode on their side)."""
        with self._lock:
            self._check()
            if len(blobs) > self.capacity:
                raise ConfigError(
                    f"extend got {len(blobs)} items, more than capacity {self.capacity}"
                )
            keys, _ = self._store.add(blobs, on_evict=self._sampler.remove)
            slots = keys % self.capacity
            self._uses[slots] = 0
            self._sampler.add(slots)
            return keys

    def __getitem__(self, index: int | Sequence[int] | np.ndarray) -> Any:
        """The item at ``index`` (or a list of items for a sequence of indices), RAM or disk."""
        single = isinstance(index, (int, np.integer)) and not isinstance(index, bool)
        keys = _as_index_array(index, "index")
        with self._lock:
            self._check()
            blobs = self._store.blobs(self._slots(keys))
        items = [_codec.decode(b) for b in blobs]
        return items[0] if single else items

    def update(self, index: int, item: Any) -> None:
        """Replace the item at ``index`` in place; its priority and use count are kept."""
        blob = _codec.encode(item)
        with self._lock:
            self._check()
            [slot] = self._slots(_as_index_array(index, "index"))
            self._store.replace(int(slot), blob)

    def __setitem__(self, index: int, item: Any) -> None:
        self.update(index, item)

    def __delitem__(self, index: int | Sequence[int] | np.ndarray) -> None:
        keys = _as_index_array(index, "index")
        with self._lock:
            self._check()
            slots = np.unique(self._slots(keys))
            self._sampler.remove(slots)
            self._store.remove(slots)

    def delete(self, indices: int | Sequence[int] | np.ndarray) -> None:
        """Remove items (all or nothing: an unknown index removes none)."""
        self.__delitem__(indices)

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_size: int) -> Batch:
        """Draw ``batch_size`` items (with replacement) by the buffer's sampler."""
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, (int, np.integer))
            or batch_size < 1
        ):
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if self.config.prefetch:
            return self._sample_prefetched(int(batch_size))
        with self._lock:
            blobs, keys, weights = self._sample_locked(int(batch_size))
        items, collated = _codec.decode_batch(blobs)  # outside the lock: adds continue meanwhile
        return Batch(items, keys, weights, collated)

    def _sample_blobs(self, n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        with self._lock:
            return self._sample_locked(n)

    def _sample_locked(self, n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        self._check()
        if len(self._store) == 0:
            raise IndexError("cannot sample from an empty ReplayBuffer; add items first")
        slots, weights = self._sampler.sample(n, self._rng)
        keys = self._store.keys[slots].copy()
        blobs = self._store.blobs(slots)
        if self.config.max_uses is not None:
            np.add.at(self._uses, slots, 1)
            done = np.unique(slots[self._uses[slots] >= self.config.max_uses])
            if len(done):
                self._sampler.remove(done)
                self._store.remove(done)
        return blobs, keys, weights

    def _sample_prefetched(self, n: int) -> Batch:
        if self._thread is None or self._prefetch_size != n:
            self._stop_prefetch()
            self._prefetch_size = n
            self._queue = queue.Queue(self.config.prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._prefetch_loop,
                args=(n, self._queue, self._stop),
                daemon=True,
                name="tt-replay-prefetch",
            )
            self._thread.start()
        assert self._queue is not None
        while True:
            self._check()
            try:
                got = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(got, BaseException):
                raise got
            return got

    def _prefetch_loop(self, n: int, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with self._lock:
                    if self._closed:
                        return
                    drawn = self._sample_locked(n) if len(self._store) else None
                if drawn is not None:
                    blobs, keys, weights = drawn
                    items, collated = _codec.decode_batch(blobs)
                    batch = Batch(items, keys, weights, collated)
                else:
                    batch = None
            except BaseException as exc:  # handed to the caller of sample()
                batch = exc
            if batch is None:
                time.sleep(0.001)
                continue
            while not stop.is_set():
                try:
                    q.put(batch, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _stop_prefetch(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of sampled items (e.g. ``|td_error|``); one value per index.

        Priorities must be finite and >= 0. Indices that went stale since they were sampled are
        skipped; an index never issued raises KeyError and nothing is changed.
        """
        keys = _as_index_array(indices)
        if hasattr(priorities, "detach"):
            priorities = priorities.detach().float().cpu().numpy()
        prios = np.asarray(priorities, np.float64)
        if prios.shape != keys.shape:
            raise ValueError(
                f"priorities must have one value per index: got shape {prios.shape} for "
                f"{keys.shape[0]} indices (flatten with .reshape(-1))"
            )
        hi = float(prios.max()) if prios.size else 0.0
        if prios.size and not (prios.min() >= 0 and hi < np.inf):  # one pass catches NaN too
            if not np.isfinite(prios).all():
                raise ValueError("priorities must be finite; got NaN or inf (check the loss)")
            raise ValueError(f"priorities must be >= 0, got {float(prios.min())} (pass |td_error|)")
        with self._lock:
            self._check()
            slots = keys % self.capacity
            live = self._store.keys[slots] == keys
            if not live.all():  # slow path: stale (skipped) or never issued (refused)
                issued = self._store.issued(keys)
                if not issued.all():
                    first = int(keys[np.argmin(issued)])
                    raise KeyError(f"index {first} was never returned by add() on this buffer")
                self._stale_updates += int((~live).sum())
                slots, prios = slots[live], prios[live]
            self._sampler.update(slots, prios, hi)

    def priorities(self, indices: Any) -> np.ndarray:
        """Current sampling weights p^alpha of ``indices`` (1 for uniform sampling)."""
        keys = _as_index_array(indices)
        with self._lock:
            return np.asarray(self._sampler.leaves(self._slots(keys)), np.float64)

    def indices(self) -> np.ndarray:
        """Indices of all stored items, oldest first."""
        with self._lock:
            return self._store.order()

    # ------------------------------------------------------------------ persistence
    def _state_arrays(self) -> dict[str, np.ndarray]:
        keys = self._store.order()
        slots = keys % self.capacity
        return {
            "keys": keys,
            "leaves": np.asarray(self._sampler.leaves(slots), np.float64),
            "uses": self._uses[slots].copy(),
        }

    def _state_meta(self) -> dict:
        return {
            "format": "tensortier-replay",
            "version": 1,
            "config": self.config.to_dict(),
            "sampler_state": self._sampler.state(),
            "seq": int(self._store.seq),
        }

    @staticmethod
    def _write_state(dirname: str, arrays: dict, meta: dict) -> None:
        tmp = os.path.join(dirname, _STATE + ".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, os.path.join(dirname, _STATE))
        tmp = os.path.join(dirname, _META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(dirname, _META))

    def save(self, dirname: str | os.PathLike) -> None:
        """Write items, priorities and sampler state to ``dirname`` (created; must be empty)."""
        dirname = os.fspath(dirname)
        os.makedirs(dirname, exist_ok=True)
        if os.listdir(dirname):
            raise ConfigError(f"save: {dirname!r} is not empty; pass a new or empty directory")
        store = self._store
        with self._lock:  # a short pause: copy the index, pin the segments
            self._check()
            arrays = self._state_arrays()
            meta = self._state_meta()
            slots = arrays["keys"] % self.capacity
            ram = [store.ram[s] for s in slots.tolist()]
            locs = np.stack([store.seg[slots], store.off[slots], store.len[slots]], axis=1)
            store.compaction_paused += 1
            if store.segments is not None:
                store.segments.pinned += 1
        try:
            out = Segments(dirname, segment_size=self.config.segment_size)
            try:
                step = 2048
                for i in range(0, len(slots), step):
                    part = ram[i : i + step]
                    need = [j for j, b in enumerate(part) if b is None]
                    if need:
                        assert store.segments is not None
                        datas = store.segments.read_many(locs[i : i + step][need])
                        for j, d in zip(need, datas):
                            part[j] = d
                    out.append(
                        [
                            (int(k), 0, b)
                            for k, b in zip(arrays["keys"][i : i + step].tolist(), part)
                        ]
                    )
                for fd in out.fds.values():
                    os.fsync(fd)
            finally:
                out.close(remove=False)
            self._write_state(dirname, arrays, meta)
        finally:
            with self._lock:
                store.compaction_paused -= 1
                if store.segments is not None:
                    store.segments.pinned -= 1
                    store.segments.sweep()
                store._maybe_compact()

    @classmethod
    def load(
        cls,
        dirname: str | os.PathLike,
        *,
        ram_budget: SizeLike | None = None,
        spill_dir: str | os.PathLike | None = None,
        prefetch: int = 0,
        seed: int | None = None,
    ) -> ReplayBuffer:
        """A new buffer with the items, indices, priorities and use counts saved in ``dirname``."""
        dirname = os.fspath(dirname)
        try:
            with open(os.path.join(dirname, _META)) as f:
                meta = json.load(f)
            with np.load(os.path.join(dirname, _STATE), allow_pickle=False) as z:
                arrays = {k: z[k] for k in ("keys", "leaves", "uses")}
        except FileNotFoundError as exc:
            raise CorruptDataError(
                f"{dirname!r} holds no saved ReplayBuffer ({exc.filename} is missing)",
                path=dirname,
            ) from exc
        if meta.get("format") != "tensortier-replay":
            raise CorruptDataError(f"{dirname!r} is not a saved ReplayBuffer", path=dirname)
        cfg = meta["config"]
        buf = cls(
            cfg["capacity"],
            ram_budget=cfg["ram_budget"] if ram_budget is None else ram_budget,
            spill_dir=spill_dir,
            sampler=sampler_from_dict(cfg["sampler"]),
            max_uses=cfg["max_uses"],
            prefetch=prefetch,
            seed=seed,
            segment_size=cfg["segment_size"],
        )
        src = Segments(dirname)
        try:
            records = [(k, seg, off, ln) for k, fl, seg, off, ln in src.scan() if fl == 0]
            by_key = {k: (seg, off, ln) for k, seg, off, ln in records}
            keys = arrays["keys"]
            missing = [int(k) for k in keys.tolist() if k not in by_key]
            if missing:
                raise CorruptDataError(
                    f"{dirname!r}: {len(missing)} saved items have no record (first: {missing[0]})",
                    path=dirname,
                )
            step = 2048
            for i in range(0, len(keys), step):
                part = keys[i : i + step]
                locs = np.array([by_key[int(k)] for k in part.tolist()], np.int64).reshape(-1, 3)
                blobs = src.read_many(locs)
                buf._store.restore(part, blobs)
        finally:
            src.close(remove=False)
        buf._store.seq = max(buf._store.seq, int(meta["seq"]))
        slots = arrays["keys"] % buf.capacity
        buf._sampler.add(slots, arrays["leaves"])
        buf._uses[slots] = arrays["uses"]
        buf._sampler.load_state(meta["sampler_state"])
        return buf

    def _restore_durable(self) -> None:
        store = self._store
        keys = store.recovered
        slots = keys % self.capacity
        leaves = None
        root = store.segments.root if store.segments is not None else ""
        state_path = os.path.join(root, _STATE)
        if os.path.exists(state_path):
            with np.load(state_path, allow_pickle=False) as z:
                saved_keys, saved_leaves, saved_uses = z["keys"], z["leaves"], z["uses"]
            with open(os.path.join(root, _META)) as f:
                self._sampler.load_state(json.load(f)["sampler_state"])
            pos = np.searchsorted(saved_keys, keys)
            pos = np.minimum(pos, max(len(saved_keys) - 1, 0))
            known = saved_keys[pos] == keys if len(saved_keys) else np.zeros(len(keys), bool)
            leaves = np.full(len(keys), getattr(self._sampler, "max_priority", 1.0))
            alpha = getattr(self._sampler.cfg, "alpha", 1.0)
            leaves = leaves**alpha
            leaves[known] = saved_leaves[pos[known]]
            self._uses[slots[known]] = saved_uses[pos[known]]
        self._sampler.add(slots, leaves)

    def checkpoint(self) -> None:
        """Durable buffers: record priorities and use counts next to the segments (atomic)."""
        if not self.config.durable:
            raise ConfigError("checkpoint() is for durable=True buffers; use save(dir) otherwise")
        with self._lock:
            self._check()
            arrays, meta = self._state_arrays(), self._state_meta()
            assert self._store.segments is not None
            self._write_state(self._store.segments.root, arrays, meta)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop prefetching; delete spill files (a durable buffer checkpoints and keeps them)."""
        if self._closed:
            return
        self._stop_prefetch()
        if self.config.durable:
            self.checkpoint()
        with self._lock:
            self._closed = True
            self._store.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._stop.set()
                self._store.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(len={len(self)}, capacity={self.capacity}, "
            f"sampler={self.config.sampler}, ram_budget={self.config.ram_budget})"
        )
