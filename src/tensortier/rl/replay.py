"""ReplayBuffer: a FIFO of variable items, sampled uniformly or by priority, RAM then disk.

Indices. ``add`` returns an int index that stays valid until the item is deleted, evicted (FIFO at
capacity) or used up (``max_uses``); indices are never reused, so a stale one is refused rather than
silently pointing at a newer item. ``update_priorities`` skips indices that went stale between
``sample`` and the update (counted in ``stats["stale_updates"]``), which is the normal case for a
learner racing collectors; an index that add() never returned is a KeyError (exactly for the last
``capacity`` adds, see ``ItemStore.issued``).

Concurrency. One lock guards the buffer; every public method is thread-safe. ``prefetch=k`` draws
up to ``k`` batches ahead on a background thread: those batches were drawn from the priorities
current at draw time (as with TorchRL's prefetch), and their ``max_uses`` accounting happens then.
``sample`` behaves the same with and without prefetch: IndexError at once when nothing can be
drawn (empty, or drained by ``max_uses``, and no batch drawn ahead), or after waiting up to
``timeout`` seconds for an add. The prefetch thread holds only a weak reference to the buffer, so a
dropped buffer is collected and its thread stops (see ``LIFETIME.md``).

Persistence. ``save(dir)`` holds the lock only while it copies the index (numpy arrays); item
bytes are then copied from RAM references and from append-only segments that are pinned (no
compaction deletes them) until the copy ends, so adds and samples continue meanwhile. The format is
the segment format plus ``state.npz`` (keys, priority leaves, use counts) and ``buffer.json``;
nothing is pickled. ``durable=True`` writes every add through to segments in ``spill_dir``, so a
crash loses only adds that had not returned; ``checkpoint()`` (also run by ``close()``) records
priorities, which a reopen restores (items added after the last checkpoint get the max priority).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensortier import _modes
from tensortier._lifetime import Finalizer
from tensortier._units import SizeLike, check_int, is_int, parse_size
from tensortier.errors import (
    ClosedError,
    ConfigError,
    CorruptDataError,
    NodeLostError,
    SpillDirError,
)
from tensortier.rl import _saved, _sequence
from tensortier.rl._store import ItemStore, as_index_array, check_args, check_spill
from tensortier.rl.rate_limiter import RateLimit, RateLimiter
from tensortier.rl.sampler import Prioritized, Uniform, make_state
from tensortier.tiers import itemcodec as _codec
from tensortier.tiers.segments import Segments

log = logging.getLogger(__name__)
_STATE, _META = _saved.STATE, _saved.META
# per slot of capacity, beyond the store's index: use count 4, sampler (sum + min trees 17, or the
# uniform sampler's dense live array and positions 16)
_SLOT_BYTES = 48  # + episode, step and policy version, 8 bytes each
_DEFAULT: Any = object()  # timeout not given: 0 for sample() (None for add), or the RateLimit's
_STOP_WAIT = (
    5.0  # seconds close() waits for the prefetch thread (it checks its stop flag every 0.1 s)
)


@dataclass
class Batch:
    """A sample: ``items`` (a dict of stacked arrays/tensors when ``collated``, else a list of items),
    their ``indices`` (int64) and importance ``weights`` (float32, all 1 for uniform sampling).

    With ``sample(B, seq_len=T)``: fields are (B, T, ...) (a list of B lists when not collated),
    ``indices`` and ``mask`` are (B, T) and ``weights`` (B,), one per slice."""

    items: Any
    indices: np.ndarray
    weights: np.ndarray
    collated: bool
    mask: np.ndarray | None = None  # sample(seq_len=T): (B, T), False on padded positions

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


_as_index_array = as_index_array  # (kept for callers of the old private name)


def _check_batch_size(batch_size: Any) -> int:
    return check_int(
        batch_size,
        f"batch_size must be an int >= 1 (items drawn per sample, with replacement), got "
        f"{batch_size!r}",
        minimum=1,
        numpy=True,
    )


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ConfigError(
            f"timeout must be None (wait for an add) or seconds >= 0, got {timeout!r}"
        )
    return float(timeout)


def _meta(n: int, episode: Any, step: Any, version: Any) -> tuple:
    """(episode, step, version) as int64 arrays of ``n`` values (-1 where not given)."""
    out = []
    for name, v in (("episode", episode), ("step", step), ("version", version)):
        if v is None:
            out.append(np.full(n, -1, np.int64))
            continue
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        arr = np.asarray(v)
        if arr.ndim == 0:
            arr = np.full(n, arr)
        if (
            arr.shape != (n,)
            or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0)
            or (arr.size and arr.min() < 0)
        ):
            raise ConfigError(
                f"{name} must be an int >= 0 or one such int per item ({n} items), got {v!r:.80}"
            )
        out.append(arr.astype(np.int64, copy=False))
    return tuple(out)


def _check_sequence_args(seq_len: Any, max_staleness: Any, eta: Any) -> None:
    if seq_len is not None:
        msg = f"seq_len must be None or an int >= 1 (steps per slice), got {seq_len!r}"
        check_int(seq_len, msg, minimum=1, numpy=True)
    if max_staleness is not None:
        msg = (
            f"max_staleness must be None or an int >= 0 (policy versions behind "
            f"policy_version), got {max_staleness!r}"
        )
        check_int(max_staleness, msg, minimum=0, numpy=True)
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1:
        raise ConfigError(f"eta must be a number in [0, 1] (R2D2 uses 0.9), got {eta!r}")


class _Prefetcher:
    """The queue, stop flag and thread of one prefetch run; refers to the buffer only weakly."""

    def __init__(self, buf: ReplayBuffer, n: int, depth: int):
        self.n = n
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        self.pending = 0  # batches drawn (or failed) and not yet queued; written by the thread only
        self.thread = threading.Thread(
            target=_prefetch_run,
            args=(weakref.ref(buf), self),
            daemon=True,
            name="tt-replay-prefetch",
        )
        self.finalizer = Finalizer(buf, _stop_thread, self.stop, self.thread)
        self.thread.start()


def _stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread() and thread.ident is not None:
        thread.join(_STOP_WAIT)  # bounded: the loop looks at `stop` at least every 0.1 s
        if thread.is_alive():
            log.warning("tensortier: replay prefetch thread still busy after %.0f s", _STOP_WAIT)


_STOP = object()


def _prefetch_run(ref: weakref.ref, p: _Prefetcher) -> None:
    """Draw batches ahead into ``p.queue`` until stopped, closed, or the buffer is collected."""
    while not p.stop.is_set():
        buf = ref()
        if buf is None:
            return
        try:
            got = buf._prefetch_one(p)
        except BaseException as exc:  # handed to the caller of sample()
            traceback.clear_frames(exc.__traceback__)  # its frames must not keep `buf` alive
            got = exc
        del buf  # hold no strong reference while waiting below
        if got is None:
            continue
        if got is _STOP:
            return
        while not p.stop.is_set():
            try:
                p.queue.put(got, timeout=0.1)
                break
            except queue.Full:
                continue
        p.pending -= 1


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
        rate_limit: RateLimit | None = None,
        spill: str | Sequence[str] = "disk",
        remote: Any = None,
    ):
        """``spill``: where items evicted from RAM go: ``"disk"`` (segments in ``spill_dir``),
        ``"remote"`` (the ``remote`` RemoteStore pool, then disk when the pool is full; same as
        ``["remote", "disk"]``) or ``["remote"]`` (pool only: a full pool is TierFullError).
        Items on a memory node that is lost are dropped and counted in ``stats["lost_items"]``;
        sampling goes on over the rest. The pool is the caller's: ``close()`` frees this
        buffer's objects in it and leaves it open."""
        # every argument is checked before anything is allocated or created
        capacity = check_args(
            "ReplayBuffer",
            capacity,
            spill_dir=spill_dir,
            durable=durable,
            fsync=fsync,
            extra_slot_bytes=_SLOT_BYTES,
        )
        durable, fsync = bool(durable), bool(fsync)
        tiers = check_spill("ReplayBuffer", spill, remote, durable)
        if max_uses is not None:
            msg = (
                f"max_uses must be None or an int >= 1 (draws before an item is removed), got "
                f"{max_uses!r}"
            )
            check_int(max_uses, msg, minimum=1, numpy=True)
        msg = f"prefetch must be an int >= 0 (batches drawn ahead), got {prefetch!r}"
        check_int(prefetch, msg, minimum=0, numpy=True)
        if seed is not None:
            check_int(
                seed, f"seed must be None or an int >= 0, got {seed!r}", minimum=0, numpy=True
            )
        if rate_limit is not None and not isinstance(rate_limit, RateLimit):
            raise ConfigError(
                f"rate_limit must be None or tt.rl.RateLimit(samples_per_insert, ...), got "
                f"{rate_limit!r}"
            )
        sampler = Uniform() if sampler is None else sampler
        if not isinstance(sampler, (Uniform, Prioritized)):
            raise ConfigError(
                f"sampler must be tt.rl.Uniform() or tt.rl.Prioritized(...), got {sampler!r}"
            )
        self.config = ReplayConfig(
            capacity=capacity,
            ram_budget=parse_size(ram_budget, name="ram_budget"),
            spill_dir=None if spill_dir is None else os.fspath(spill_dir),
            sampler=sampler,
            max_uses=None if max_uses is None else int(max_uses),
            durable=durable,
            fsync=fsync,
            prefetch=int(prefetch),
            seed=None if seed is None else int(seed),
            segment_size=parse_size(segment_size, name="segment_size", allow_zero=False),
        )
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # notified by adds and close()
        self._closed = False
        self._prefetcher: _Prefetcher | None = None
        self._stale_updates = 0
        self._store = ItemStore(
            capacity,
            self.config.ram_budget,
            self.config.spill_dir,
            durable=durable,
            fsync=fsync,
            segment_size=self.config.segment_size,
            owner="tt-replay",
            what="ReplayBuffer",
            tiers=tiers,
            remote=remote,
        )
        try:
            self._sampler = make_state(capacity, sampler)
            self._store.on_drop = self._sampler.remove  # items lost with a memory node
            self._rng = np.random.default_rng(seed)
            self._uses = np.zeros(capacity, np.int32)
            # per slot: episode id, step in the episode, policy version (-1: not given)
            self._episode = np.full(capacity, -1, np.int64)
            self._step = np.full(capacity, -1, np.int64)
            self._version = np.full(capacity, -1, np.int64)
            self._policy_version = -1
            if durable:
                self._restore_durable()
            self._limiter: RateLimiter | None = None
            if rate_limit is not None:
                self._limiter = RateLimiter.balanced(rate_limit, len(self._store))
        except BaseException:
            self._store.close()  # releases the durable directory's lock
            raise

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
            if self._limiter is not None:
                out["rate_limiter"] = self._limiter.as_dict()
            return out

    def __contains__(self, index: object) -> bool:
        with self._lock:
            return self._store.contains(index)

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this ReplayBuffer is closed")

    def _slots(self, indices: np.ndarray) -> np.ndarray:
        return self._store.live_slots(indices)

    # ------------------------------------------------------------------ add / get / update / delete
    def add(
        self,
        item: Any,
        *,
        episode: int | None = None,
        step: int | None = None,
        version: int | None = None,
        timeout: float | None = _DEFAULT,
    ) -> int:
        """Store one item (dict of arrays/tensors/bytes/numbers, or one such value); returns its index.

        ``episode`` and ``step`` (ints >= 0) place the item in a trajectory for
        ``sample(seq_len=...)``; ``version`` is the policy version that produced it, for
        ``sample(max_staleness=...)``. With a ``rate_limit``, waits while sampling is behind, up to
        ``timeout`` seconds (default: the RateLimit's), then raises RateLimitTimeout with nothing
        added.
        """
        parts = _codec.encode_parts(item)
        if (
            episode is None
            and step is None
            and version is None
            and timeout is _DEFAULT
            and self._limiter is None
        ):
            with self._cond:
                self._check()
                store = self._store
                if store.nfree and not store.durable:
                    # the common case in Python scalars: a handful of 1-element numpy calls
                    # would cost more than the item's copy
                    key = store._add_one(parts)
                    slot = key % store.cap
                    self._uses[slot] = 0
                    self._episode[slot] = self._step[slot] = self._version[slot] = -1
                    self._sampler.add_one(slot)
                    self._cond.notify_all()  # samplers waiting for items
                    return key
        meta = None
        if episode is not None or step is not None or version is not None:
            meta = _meta(1, episode, step, version)
        return int(self._extend_blobs([parts], timeout, meta)[0])

    def extend(
        self,
        items: Iterable[Any],
        *,
        episode: Any = None,
        step: Any = None,
        version: Any = None,
        timeout: float | None = _DEFAULT,
    ) -> np.ndarray:
        """Store many items in one step (one lock, one batched spill); returns their indices.

        Equivalent to adding them one by one (same indices, priorities and order); with a
        ``rate_limit`` the batch is admitted whole (see :meth:`add`). ``episode``, ``step`` and
        ``version`` are each an int for all items or a sequence with one int per item.
        """
        blobs = [_codec.encode_parts(it) for it in items]
        meta = None
        if episode is not None or step is not None or version is not None:
            meta = _meta(len(blobs), episode, step, version)
        return self._extend_blobs(blobs, timeout, meta)

    def _extend_blobs(
        self, blobs: list, timeout: float | None = _DEFAULT, meta: tuple | None = None
    ) -> np.ndarray:
        """Add already-encoded items: blobs (Ray collectors encode on their side) or lists of
        parts from ``encode_parts``."""
        lim = self._limiter
        if timeout is not _DEFAULT:
            timeout = _check_timeout(timeout)
        elif lim is not None:
            timeout = lim.cfg.timeout
        with self._cond:
            self._check()
            if len(blobs) > self.capacity:
                raise ConfigError(
                    f"extend got {len(blobs)} items, more than capacity {self.capacity}; add them "
                    f"in chunks of at most {self.capacity}"
                )
            if lim is not None:
                lim.check_insert(len(blobs))
                store = self._store
                lim.wait(self._cond, "insert", len(blobs), store.__len__, timeout, self._check)
                lim.inserted(len(blobs))
            keys, _ = self._store.add(blobs, on_evict=self._sampler.remove)
            slots = keys % self.capacity
            self._uses[slots] = 0
            if meta is None:
                self._episode[slots] = self._step[slots] = self._version[slots] = -1
            else:
                self._episode[slots], self._step[slots], self._version[slots] = meta
                top = int(meta[2].max()) if len(meta[2]) else -1
                if top > self._policy_version:
                    self._policy_version = top
            self._sampler.add(slots)
            self._cond.notify_all()  # samplers waiting for items (cheap when nobody waits)
            return keys

    def __getitem__(self, index: int | Sequence[int] | np.ndarray) -> Any:
        """The item at ``index`` (or a list of items for a sequence of indices), RAM or disk."""
        single = is_int(index, numpy=True)
        keys = as_index_array(index, "index")
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
            [slot] = self._slots(as_index_array(index, "index"))
            self._store.replace(int(slot), blob)

    def __setitem__(self, index: int, item: Any) -> None:
        self.update(index, item)

    def __delitem__(self, index: int | Sequence[int] | np.ndarray) -> None:
        keys = as_index_array(index, "index")
        with self._lock:
            self._check()
            slots = np.unique(self._slots(keys))
            self._sampler.remove(slots)
            self._store.remove(slots)
            if self._limiter is not None:
                self._cond.notify_all()  # a smaller buffer may admit inserts again

    def delete(self, indices: int | Sequence[int] | np.ndarray) -> None:
        """Remove items (all or nothing: an unknown index removes none)."""
        self.__delitem__(indices)

    # ------------------------------------------------------------------ sampling
    @property
    def policy_version(self) -> int:
        """The newest policy version: the largest ``version`` added, or set by the learner
        (``buf.policy_version = v``; it never goes back). -1 before any. ``max_staleness``
        counts from it."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, v: int) -> None:
        v = check_int(v, f"policy_version must be an int >= 0, got {v!r}", minimum=0, numpy=True)
        with self._lock:
            self._policy_version = max(self._policy_version, int(v))

    def sample(
        self,
        batch_size: int,
        *,
        timeout: float | None = _DEFAULT,
        seq_len: int | None = None,
        max_staleness: int | None = None,
        pad: bool = False,
        eta: float = 0.9,
    ) -> Batch:
        """Draw ``batch_size`` items (with replacement) by the buffer's sampler.

        ``seq_len=T``: draw ``batch_size`` slices of T consecutive steps of one episode instead
        (items added with ``episode=`` and ``step=``); a slice never crosses an episode end or a
        missing step. ``pad=False`` draws only full slices; ``pad=True`` lets any step start one
        and repeats the run's last step past its end, with ``batch.mask`` False there. Prioritized
        buffers draw slices by R2D2's ``eta * max + (1 - eta) * mean`` of their items'
        priorities (see ``_sequence.py``). ``max_staleness=k`` draws only items (and slices whose
        every item) came from policy version >= ``policy_version - k``; items added without a
        ``version`` are excluded then. These two options cost O(items) per call and bypass
        ``prefetch``.

        When nothing can be drawn (the buffer is empty or drained by ``max_uses``, and no batch was
        drawn ahead), wait up to ``timeout`` seconds for an add, then raise IndexError; the default
        0 raises at once, ``None`` waits until an item arrives or the buffer is closed
        (ClosedError). The same holds with and without ``prefetch``. With a ``rate_limit``, a
        sample also waits while inserting is behind (default timeout: the RateLimit's), then
        raises RateLimitTimeout.
        """
        n = _check_batch_size(batch_size)
        wait = self._sample_timeout(timeout)
        if seq_len is not None or max_staleness is not None:
            _check_sequence_args(seq_len, max_staleness, eta)
            return self._sample_filtered(n, wait, seq_len, max_staleness, bool(pad), float(eta))
        if self.config.prefetch:
            return self._sample_prefetched(n, wait)
        blobs, keys, weights = self._draw(n, wait)
        items, collated = _codec.decode_batch(blobs)  # outside the lock: adds continue meanwhile
        return Batch(items, keys, weights, collated)

    def _sample_timeout(self, timeout: Any) -> float | None:
        if timeout is _DEFAULT:
            return self._limiter.cfg.timeout if self._limiter is not None else 0.0
        return _check_timeout(timeout)

    def _sample_blobs(
        self, n: int, timeout: float | None = 0.0
    ) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """A batch as encoded blobs (the Ray actor: the learner decodes on its side)."""
        return self._draw(_check_batch_size(n), _check_timeout(timeout))

    def _empty(self, timeout: float | None) -> IndexError:
        waited = f" after waiting {timeout:g} s" if timeout else ""
        drained = " (drained by max_uses)" if self.config.max_uses is not None else ""
        return IndexError(
            f"cannot sample from an empty ReplayBuffer{drained}{waited}; add items first, or pass "
            f"sample(..., timeout=seconds) to wait for collectors"
        )

    def _draw(self, n: int, timeout: float | None) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        deadline = None if timeout is None else time.monotonic() + timeout
        lim = self._limiter
        with self._cond:
            if lim is not None:
                self._check()
                lim.check_sample(n)
                lim.wait(self._cond, "sample", n, self._store.__len__, timeout, self._check)
                return self._sample_locked(n)
            while True:
                self._check()
                if len(self._store):
                    return self._sample_locked(n)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._empty(timeout)
                # woken by an add or close(); the 1 s tick only re-checks (timeout=None waits
                # until one of those happens, which is what the caller asked for)
                self._cond.wait(1.0 if left is None else min(left, 1.0))

    def _sample_locked(self, n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """(blobs, keys, weights) of a draw (references to the stored bytes, decoded by the
        caller after the lock is released)."""
        self._check()
        if len(self._store) == 0:
            raise self._empty(None)
        if self._limiter is not None:
            self._limiter.sampled(n)
            self._cond.notify_all()  # inserters waiting for sampling to catch up
        while True:
            slots, weights = self._sampler.sample(n, self._rng, self._live_slots)
            keys = self._store.keys[slots].copy()
            try:
                blobs = self._store.blobs(slots)
                break
            except NodeLostError:
                # the items that node held were dropped (each loss drops at least one, so this
                # ends); draw again from the rest
                if len(self._store) == 0:
                    raise self._empty(None) from None
        if self.config.max_uses is not None:
            np.add.at(self._uses, slots, 1)
            done = np.unique(slots[self._uses[slots] >= self.config.max_uses])
            if len(done):
                self._sampler.remove(done)
                self._store.remove(done)
        return blobs, keys, weights

    def _sample_filtered(
        self,
        n: int,
        timeout: float | None,
        seq_len: int | None,
        max_staleness: int | None,
        pad: bool,
        eta: float,
    ) -> Batch:
        """sample() with ``seq_len`` and/or ``max_staleness`` (see ``_sequence.py``)."""
        lim = self._limiter
        with self._cond:
            self._check()
            if lim is not None:
                lim.check_sample(n)
                lim.wait(self._cond, "sample", n, self._store.__len__, timeout, self._check)
            elif not len(self._store) and timeout != 0:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not len(self._store):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(1.0 if left is None else min(left, 1.0))
                    self._check()
            slots = self._live_slots()
            why = "the buffer is empty"
            if max_staleness is not None:
                cutoff = self._policy_version - max_staleness
                ver = self._version[slots]
                slots = slots[(ver >= 0) & (ver >= cutoff)]
                why = (
                    f"no item has a policy version >= {cutoff} (policy_version "
                    f"{self._policy_version} - max_staleness {max_staleness}; items added "
                    f"without version= are excluded)"
                )
            cfg = self._sampler.cfg
            prio = self._sampler.leaves(slots) if isinstance(cfg, Prioritized) else None
            beta = self.beta if prio is not None else None
            if seq_len is None:
                if not len(slots):
                    raise IndexError(f"cannot sample: {why}; add items first")
                pos, weights = _sequence.draw(
                    prio if prio is not None else np.ones(len(slots)), n, self._rng, beta
                )
                drawn, mask = slots[pos], None
            else:
                known = self._episode[slots] >= 0
                slots = slots[known & (self._step[slots] >= 0)]
                order, left = _sequence.runs(self._episode[slots], self._step[slots])
                slots = slots[order]
                starts = np.arange(len(slots)) if pad else np.flatnonzero(left >= seq_len)
                if not len(starts):
                    raise IndexError(
                        f"cannot sample slices of seq_len={seq_len}: no episode has {seq_len} "
                        f"consecutive steps in the buffer ({len(slots)} items with episode and "
                        f"step{'' if max_staleness is None else ' and fresh enough'}); add "
                        f"longer episodes, lower seq_len or pass pad=True"
                    )
                if prio is not None:
                    raw = prio[order]
                    a = cfg.alpha
                    if a > 0:
                        raw = raw ** (1.0 / a)
                    sp = _sequence.slice_priorities(raw, left, starts, seq_len, eta)
                    w = sp**a if a != 1 else sp
                else:
                    w = np.ones(len(starts))
                pos, weights = _sequence.draw(w, n, self._rng, beta)
                first = starts[pos]
                steps = np.arange(seq_len)
                mask = steps[None, :] < left[first][:, None]
                offs = np.minimum(steps[None, :], left[first][:, None] - 1)
                drawn = slots[first[:, None] + offs]  # (n, seq_len)
            if prio is not None:
                self._sampler.samples += 1  # beta annealing counts sample() calls
            flat = drawn.reshape(-1)
            keys = self._store.keys[drawn].copy()
            blobs = self._store.blobs(flat)
            if self.config.max_uses is not None:
                used = flat if mask is None else drawn[mask]
                np.add.at(self._uses, used, 1)
                done = np.unique(used[self._uses[used] >= self.config.max_uses])
                if len(done):
                    self._sampler.remove(done)
                    self._store.remove(done)
            if lim is not None:
                lim.sampled(n)
                self._cond.notify_all()
        items, collated = _codec.decode_batch(blobs)
        if seq_len is not None:
            if collated and isinstance(items, dict):
                items = {k: _fold(v, n, seq_len) for k, v in items.items()}
            elif collated:
                items = _fold(items, n, seq_len)
            else:
                items = [items[i * seq_len : (i + 1) * seq_len] for i in range(n)]
        return Batch(items, keys, weights, collated, mask)

    def _live_slots(self) -> np.ndarray:
        """Every live slot (O(capacity): only the all-priorities-zero fallback needs it)."""
        return np.flatnonzero(self._store.keys >= 0)

    def _sample_prefetched(self, n: int, timeout: float | None) -> Batch:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check()
            p = self._prefetcher
            if p is None or p.n != n or not p.thread.is_alive():
                # a new batch size (batches drawn ahead for the old one are dropped), or a
                # thread that ended: start again
                self._stop_prefetch()
                p = self._prefetcher = _Prefetcher(self, n, self.config.prefetch)
            try:
                got = p.queue.get_nowait()
            except queue.Empty:
                with self._cond:
                    self._check()
                    lim = self._limiter
                    refused = lim is not None and not lim.can_sample(n, len(self._store))
                    blocked = len(self._store) == 0 or refused
                    idle = blocked and p.pending == 0 and p.queue.empty()
                    if idle:  # nothing drawable, nothing being drawn, nothing drawn ahead
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            if refused:
                                assert lim is not None
                                raise lim._timeout("sample", n, len(self._store), timeout) from None
                            raise self._empty(timeout) from None
                        self._cond.wait(0.1 if left is None else min(left, 0.1))
                        continue
                try:  # a batch is being drawn: the thread queues it within a draw's time
                    got = p.queue.get(timeout=0.1)
                except queue.Empty:
                    continue
            if isinstance(got, BaseException):
                raise got
            return got

    def _prefetch_one(self, p: _Prefetcher) -> Batch | object | None:
        """(Prefetch thread) draw one batch; None when there is nothing to draw yet."""
        with self._cond:
            if self._closed:
                return _STOP
            lim = self._limiter
            if not len(self._store) or (
                lim is not None and not lim.can_sample(p.n, len(self._store))
            ):
                self._cond.wait(0.1)  # an add wakes it; the tick lets it see `stop`
                return None
            p.pending += 1  # from here on something is queued: a batch or the error
            blobs, keys, weights = self._sample_locked(p.n)
        items, collated = _codec.decode_batch(blobs)
        return Batch(items, keys, weights, collated)

    def _stop_prefetch(self) -> None:
        p, self._prefetcher = self._prefetcher, None
        if p is not None:
            p.finalizer()

    # ------------------------------------------------------------------ priorities
    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of sampled items (e.g. ``|td_error|``); one value per index.

        Priorities must be finite and >= 0 (0: never drawn while another item has a positive
        priority; when all are 0, items are drawn uniformly with weights 1), and ``p**alpha`` at
        most 1e290 so that their sum stays finite (ConfigError naming the limit). Indices that went
        stale since they were sampled are skipped and counted in ``stats["stale_updates"]``; an
        index that add() never returned raises KeyError and nothing is changed. (The buffer
        remembers which index each of its last ``capacity`` adds returned; an older index that is
        no longer stored cannot be told from a stale one and is skipped.)
        """
        keys = as_index_array(indices)
        if hasattr(priorities, "detach"):
            priorities = priorities.detach().float().cpu().numpy()
        try:
            prios = np.asarray(priorities, np.float64)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"priorities must be numbers, one per index, got {type(priorities).__name__}"
            ) from exc
        if prios.shape != keys.shape:
            raise ConfigError(
                f"priorities must have one value per index: got shape {prios.shape} for "
                f"{keys.shape[0]} indices (flatten with .reshape(-1))"
            )
        hi = float(prios.max()) if prios.size else 0.0
        if prios.size and not (prios.min() >= 0 and hi < np.inf):  # one pass catches NaN too
            if not np.isfinite(prios).all():
                raise ConfigError("priorities must be finite; got NaN or inf (check the loss)")
            raise ConfigError(
                f"priorities must be >= 0, got {float(prios.min())} (pass |td_error|)"
            )
        self._sampler.check(hi)  # a weight sum that overflows would sample wrongly
        with self._lock:
            self._check()
            slots = keys % self.capacity
            live = (keys >= 0) & (self._store.keys[slots] == keys)  # an empty slot's key is -1
            if not live.all():  # slow path: stale (skipped) or never issued (refused)
                issued = self._store.issued(keys)
                if not issued.all():
                    first = int(keys[np.argmin(issued)])
                    raise KeyError(
                        f"index {first} was never returned by add() on this buffer (pass "
                        f"batch.indices from sample(), not positions in the batch)"
                    )
                self._stale_updates += int((~live).sum())
                slots, prios = slots[live], prios[live]
            self._sampler.update(slots, prios, hi)

    def priorities(self, indices: Any) -> np.ndarray:
        """Current sampling weights p^alpha of ``indices`` (1 for uniform sampling)."""
        keys = as_index_array(indices)
        with self._lock:
            self._check()
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
            "episode": self._episode[slots],
            "step": self._step[slots],
            "version": self._version[slots],
        }

    def _state_meta(self) -> dict:
        return {
            "format": _saved.FORMAT,
            "version": _saved.VERSION,
            "config": self.config.to_dict(),
            "sampler_state": self._sampler.state(),
            "seq": int(self._store.seq),
            "policy_version": int(self._policy_version),
        }

    def save(self, dirname: str | os.PathLike, *, mode: int = 0o600) -> None:
        """Write items, priorities and sampler state to ``dirname`` (created; must be empty).

        ``mode``: every file gets it, 0o600 (private, the default), 0o640 or 0o644 (the group
        or everyone may read); the directory gets 0o700, 0o750 or 0o755 (``_modes.py``). A
        failed save removes what it wrote (and ``dirname`` if it made it).
        """
        if not isinstance(dirname, (str, os.PathLike)):
            raise ConfigError(f"save: dirname must be a path, got {type(dirname).__name__}")
        dirname = os.fspath(dirname)
        _modes.check_mode(mode, "ReplayBuffer.save")
        with self._lock:
            self._check()
        made = not os.path.lexists(dirname)
        try:
            os.makedirs(dirname, exist_ok=True)
            if os.listdir(dirname):
                raise ConfigError(f"save: {dirname!r} is not empty; pass a new or empty directory")
            _modes.set_dir(dirname, mode)
        except OSError as exc:
            raise SpillDirError(
                f"save: cannot use {dirname!r} as the save directory ({exc.strerror}); pass a "
                f"writable, new or empty directory",
                path=dirname,
            ) from exc
        store = self._store
        with self._lock:  # a short pause: copy the index, pin the segments
            self._check()
            far = self._fetch_remote()  # items in the remote pool, by slot
            arrays = self._state_arrays()
            meta = self._state_meta()
            slots = arrays["keys"] % self.capacity
            ram = [far.get(s, store.ram[s]) for s in slots.tolist()]
            locs = np.stack([store.seg[slots], store.off[slots], store.len[slots]], axis=1)
            root = store.segments.root if store.segments is not None else None
            store.compaction_paused += 1
            if store.segments is not None:
                store.segments.pinned += 1
        try:
            # our own descriptors: the store's LRU belongs to the threads holding the lock
            src = Segments(root, readonly=True) if root is not None else None
            out = Segments(dirname, segment_size=self.config.segment_size, mode=mode)
            try:
                step = 2048
                for i in range(0, len(slots), step):
                    part = ram[i : i + step]
                    need = [j for j, b in enumerate(part) if b is None]
                    if need:
                        assert src is not None
                        datas = src.read_many(locs[i : i + step][need])
                        for j, d in zip(need, datas):
                            part[j] = d
                    out.append(
                        [
                            (int(k), 0, b)
                            for k, b in zip(arrays["keys"][i : i + step].tolist(), part)
                        ]
                    )
                out.sync()
            finally:
                out.close(remove=False)
                if src is not None:
                    src.close(remove=False)
            _saved.write(dirname, arrays, meta, mode)
        except BaseException as exc:
            _remove_saved(dirname, made)
            if isinstance(exc, OSError):
                raise SpillDirError(
                    f"save: cannot write to {dirname!r} ({exc.strerror}); free space there or "
                    f"pass another directory (nothing was left behind)",
                    path=dirname,
                ) from exc
            raise
        finally:
            with self._lock:
                store.compaction_paused -= 1
                if store.segments is not None:
                    store.segments.pinned -= 1
                    store.segments.sweep()
                store._maybe_compact()

    def _fetch_remote(self) -> dict[int, bytes]:
        """(save) The bytes of every item in the remote pool; items lost meanwhile are dropped."""
        store = self._store
        while store.rspill is not None and store.rspill.loc:
            slots = np.fromiter(store.rspill.loc, np.int64, len(store.rspill.loc))
            try:
                return dict(zip(slots.tolist(), store.blobs(slots)))
            except NodeLostError:
                continue  # those items were dropped; fetch the rest
        return {}

    @classmethod
    def load(
        cls,
        dirname: str | os.PathLike,
        *,
        ram_budget: SizeLike | None = None,
        spill_dir: str | os.PathLike | None = None,
        prefetch: int = 0,
        seed: int | None = None,
        rate_limit: RateLimit | None = None,
    ) -> ReplayBuffer:
        """A new buffer with the items, indices, priorities and use counts saved in ``dirname``.

        Only reads ``dirname`` (a read-only copy works, and a damaged one is never changed);
        damage raises CorruptDataError naming the file, before or instead of a partial buffer.
        """
        if not isinstance(dirname, (str, os.PathLike)):
            raise ConfigError(f"load: dirname must be a path, got {type(dirname).__name__}")
        dirname = os.fspath(dirname)
        fix = "load another copy (the saved files were left unchanged)"
        meta, sampler, arrays = _saved.read(dirname, fix=fix)
        cfg = meta["config"]
        buf = cls(
            cfg["capacity"],
            ram_budget=cfg["ram_budget"] if ram_budget is None else ram_budget,
            spill_dir=spill_dir,
            sampler=sampler,
            max_uses=cfg["max_uses"],
            prefetch=prefetch,
            seed=seed,
            segment_size=cfg["segment_size"],
            rate_limit=rate_limit,
        )
        try:
            buf._load_items(dirname, arrays, fix)
            buf._store.finish_restore(meta["seq"])
            slots = arrays["keys"] % buf.capacity
            buf._sampler.add(slots, arrays["leaves"])
            buf._uses[slots] = arrays["uses"]
            buf._set_saved_meta(slots, arrays, meta)
            try:
                buf._sampler.load_state(meta["sampler_state"])
            except (TypeError, ValueError) as exc:
                raise CorruptDataError(
                    f"{os.path.join(dirname, _META)}: sampler_state is not valid ({exc}); {fix}",
                    path=dirname,
                ) from exc
            if rate_limit is not None:  # counters start balanced for the items loaded
                buf._limiter = RateLimiter.balanced(rate_limit, len(buf))
        except BaseException:
            buf.close()
            raise
        return buf

    def _load_items(self, dirname: str, arrays: dict[str, np.ndarray], fix: str) -> None:
        src = Segments(dirname, readonly=True)
        try:
            by_key = {k: (seg, off, ln) for k, fl, seg, off, ln in src.scan() if fl == 0}
            keys = arrays["keys"]
            missing = [int(k) for k in keys.tolist() if k not in by_key]
            if missing:
                raise CorruptDataError(
                    f"{dirname!r}: {len(missing)} saved items have no record (first: "
                    f"{missing[0]}); {fix}",
                    path=dirname,
                )
            step = 2048
            for i in range(0, len(keys), step):
                part = keys[i : i + step]
                locs = np.array([by_key[int(k)] for k in part.tolist()], np.int64).reshape(-1, 3)
                self._store.restore(part, src.read_many(locs))
        except PermissionError as exc:
            raise _modes.denied(exc.filename or dirname, exc, "ReplayBuffer.load") from exc
        except OSError as exc:
            raise CorruptDataError(
                f"cannot read the saved segments in {dirname!r} ({exc}); {fix}", path=dirname
            ) from exc
        finally:
            src.close(remove=False)

    def _restore_durable(self) -> None:
        store = self._store
        keys = store.recovered
        slots = keys % self.capacity
        leaves = None
        assert store.segments is not None
        root = store.segments.root
        have = [os.path.exists(os.path.join(root, name)) for name in (_STATE, _META)]
        if any(have) and not all(have):  # a crash during the first checkpoint()
            log.warning(
                "tensortier: %s has only one of %s and %s; reopening without priorities",
                root,
                _STATE,
                _META,
            )
        elif all(have):
            fix = (
                f"remove {_STATE} and {_META} from {root!r} to reopen the items at the max "
                f"priority with fresh use counts"
            )
            meta, _, saved = _saved.read(root, fix=fix)
            try:
                self._sampler.load_state(meta["sampler_state"])
            except (TypeError, ValueError) as exc:
                raise CorruptDataError(
                    f"{os.path.join(root, _META)}: sampler_state is not valid ({exc}); {fix}",
                    path=root,
                ) from exc
            saved_keys, saved_leaves, saved_uses = saved["keys"], saved["leaves"], saved["uses"]
            pos = np.searchsorted(saved_keys, keys)
            pos = np.minimum(pos, max(len(saved_keys) - 1, 0))
            known = saved_keys[pos] == keys if len(saved_keys) else np.zeros(len(keys), bool)
            leaves = np.full(len(keys), getattr(self._sampler, "max_priority", 1.0))
            alpha = getattr(self._sampler.cfg, "alpha", 1.0)
            leaves = leaves**alpha
            leaves[known] = saved_leaves[pos[known]]
            self._uses[slots[known]] = saved_uses[pos[known]]
            # episode, step and version of items added since the checkpoint stay -1 (unknown)
            sub = {k: saved[k][pos[known]] for k in _saved.OPTIONAL if k in saved}
            self._set_saved_meta(slots[known], sub, meta)
        self._sampler.add(slots, leaves)

    def _set_saved_meta(self, slots: np.ndarray, arrays: dict, meta: dict) -> None:
        """Episode, step and version saved with the items (absent in files from before them)."""
        for name, dest in (
            ("episode", self._episode),
            ("step", self._step),
            ("version", self._version),
        ):
            if name in arrays:
                dest[slots] = arrays[name]
        self._policy_version = max(self._policy_version, int(meta.get("policy_version", -1)))

    def checkpoint(self) -> None:
        """Durable buffers: record priorities and use counts next to the segments (atomic)."""
        if not self.config.durable:
            raise ConfigError("checkpoint() is for durable=True buffers; use save(dir) otherwise")
        with self._lock:
            self._check()
            self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        assert self._store.segments is not None
        _saved.write(self._store.segments.root, self._state_arrays(), self._state_meta())

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop prefetching; delete spill files (a durable buffer checkpoints and keeps them).

        A buffer dropped without ``close()`` has its spill files removed (and a durable
        directory's lock released, without a checkpoint) by the reaper thread after garbage
        collection.
        """
        if self._closed:
            return
        self._stop_prefetch()  # outside the lock: the prefetch thread takes it
        with self._cond:
            if self._closed:
                return
            try:
                if self.config.durable:
                    self._checkpoint_locked()
            finally:
                self._closed = True
                self._store.close()
                self._cond.notify_all()  # samplers waiting for items get ClosedError

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(len={len(self)}, capacity={self.capacity}, "
            f"sampler={self.config.sampler}, ram_budget={self.config.ram_budget})"
        )


def _fold(v: Any, n: int, seq_len: int) -> Any:
    """A stacked field of n * seq_len rows as (n, seq_len, ...); lists (bytes fields) as n lists."""
    if isinstance(v, list):
        return [v[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    return v.reshape(n, seq_len, *v.shape[1:])


def _remove_saved(dirname: str, made: bool) -> None:
    """Undo a failed save: remove the files it wrote (the directory was empty), and the
    directory if the save made it."""
    try:
        names = os.listdir(dirname)
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(dirname, name))
        except OSError:
            pass
    if made:
        try:
            os.rmdir(dirname)
        except OSError:
            pass
