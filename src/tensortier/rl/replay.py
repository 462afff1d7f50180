"""ReplayBuffer: a FIFO of variable items, sampled uniformly or by priority, RAM then disk.

Indices. ``add`` returns an int index that stays valid until the item is deleted, evicted (FIFO at
``max_items``) or used up (``max_uses``); indices are never reused, so a stale one is refused rather than
silently pointing at a newer item. ``update_priorities`` skips indices that went stale between
``sample`` and the update (counted in ``stats["stale_updates"]``), which is the normal case for a
learner racing collectors; an index that add() never returned is a KeyError (exactly for the last
``max_items`` adds, see ``ItemStore.issued``).

Concurrency. One lock guards the buffer; every public method is thread-safe. ``prefetch=k`` draws
up to ``k`` batches ahead on a background thread (``_prefetch.py``): those batches were drawn from
the priorities current at draw time (as with TorchRL's prefetch), and their ``max_uses`` accounting
happens then. ``sample`` behaves the same with and without prefetch: IndexError at once when
nothing can be drawn (empty, or drained by ``max_uses``, and no batch drawn ahead), or after
waiting up to ``timeout`` seconds for an add.

Parts. The buffer composes the item store (``_store.py``: bytes in RAM, then the remote pool or
disk), a sampler (``sampler.py``: sum/min trees or a uniform set), per-slot metadata
(``_slot_meta.py``: use counts, episode, step, policy version), an optional rate limiter
(``rate_limiter.py``) and its persistence (``_persist.py``: ``save``/``load``, the durable
buffer's reopen and ``checkpoint``). This module owns the lock and how those parts change together:
adding, sampling, priorities and waiting.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import numpy as np

from tensortier import _modes
from tensortier._renamed import renamed
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, check_int
from tensortier.errors import ClosedError, ConfigError, NodeLostError
from tensortier.rl import _persist, _saved, _sequence
from tensortier.rl._api import (
    DEFAULT,
    Batch,
    ReplayConfig,
    check_batch_size,
    check_replay_args,
    check_sequence_args,
    check_timeout,
    item_meta,
    priority_array,
)
from tensortier.rl._prefetch import STOP, Prefetcher
from tensortier.rl._slot_meta import SlotMeta
from tensortier.rl._store import ItemStore, as_index_array, check_items, not_picklable
from tensortier.rl.rate_limiter import RateLimit, RateLimiter
from tensortier.rl.sampler import Prioritized, PrioritizedState, Uniform, make_state
from tensortier.tiers import itemcodec as _codec

__all__ = ["Batch", "ReplayBuffer", "ReplayConfig"]

# ufunc reductions called directly: ndarray.max/min add a Python wrapper (~0.1 us a call)
_max_reduce, _min_reduce = np.maximum.reduce, np.minimum.reduce
NOT_ITERABLE = (
    "a ReplayBuffer is not iterable: draw batches with sample(batch_size), or read every item "
    "with buf[buf.indices()]"
)


class ReplayBuffer:
    """Prioritized or uniform replay over items held in RAM up to ``host_budget``, then on disk.

    >>> buf = tt.rl.ReplayBuffer(100_000, host_budget="4GiB", spill_dir="/data/rb",
    ...                          sampler=tt.rl.Prioritized(alpha=0.6, beta=0.4))
    >>> i = buf.add({"obs": obs, "action": a, "reward": r})
    >>> batch = buf.sample(256)
    >>> buf.update_priorities(batch.indices, td_error.abs())
    """

    @renamed(capacity="max_items", ram_budget="host_budget", spill="tier")
    def __init__(
        self,
        max_items: int,
        *,
        host_budget: SizeLike = "1GiB",
        spill_dir: str | os.PathLike | None = None,
        sampler: Uniform | Prioritized | None = None,
        max_uses: int | None = None,
        durable: bool = False,
        fsync: bool = False,
        prefetch: int = 0,
        seed: int | None = None,
        segment_size: SizeLike = "64MiB",
        rate_limit: RateLimit | None = None,
        tier: str | Sequence[str] = "disk",
        remote: Any = None,
    ):
        """``max_items``: the most items held (the oldest is evicted past it). ``tier``: where
        items evicted from RAM (past ``host_budget`` bytes) go: ``"disk"`` (segments in
        ``spill_dir``), ``"remote"`` (the ``remote`` RemoteStore pool, then disk when the pool is full; same as
        ``["remote", "disk"]``) or ``["remote"]`` (pool only: a full pool is TierFullError).
        Items on a memory node that is lost are dropped and counted in ``stats["lost_items"]``;
        sampling goes on over the rest. The pool is the caller's: ``close()`` frees this
        buffer's objects in it and leaves it open. A pool closed (or a Ray session ended) under
        the buffer loses every item in it: they are dropped the same way, with one warning."""
        # every argument is checked before anything is allocated or created
        self.config, tiers = check_replay_args(
            max_items,
            host_budget=host_budget,
            spill_dir=spill_dir,
            sampler=sampler,
            max_uses=max_uses,
            durable=durable,
            fsync=fsync,
            prefetch=prefetch,
            seed=seed,
            segment_size=segment_size,
            rate_limit=rate_limit,
            tier=tier,
            remote=remote,
        )
        c = self.config
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # notified by adds and close()
        self._closed = False
        self._prefetcher: Prefetcher | None = None
        self._stale_updates = 0
        self._store = ItemStore(
            c.max_items,
            c.host_budget,
            c.spill_dir,
            durable=c.durable,
            fsync=c.fsync,
            segment_size=c.segment_size,
            owner="tt-replay",
            what="ReplayBuffer",
            tiers=tiers,
            remote=remote,
        )
        try:
            self._sampler = make_state(c.max_items, c.sampler)
            self._store.on_drop = self._sampler.remove  # items lost with a memory node
            self._rng = np.random.default_rng(c.seed)
            self._meta = SlotMeta(c.max_items)
            self._persist = _persist.Persistence(
                c, self._store, self._sampler, self._meta, self._rng
            )
            if c.durable:
                self._persist.restore_durable()
            self._limiter: RateLimiter | None = None
            if rate_limit is not None:
                self._limiter = RateLimiter.balanced(rate_limit, len(self._store))
        except BaseException:
            self._store.close()  # releases the durable directory's lock
            raise
        register_stats("replay_buffer", self)  # tt.stats() lists it while it is open

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self._store)

    @property
    def max_items(self) -> int:
        """The most items held (the oldest is evicted past it)."""
        return self.config.max_items

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

    def __iter__(self) -> NoReturn:
        # without it, Python iterates through __getitem__(0), (1), ...: a KeyError on the first
        # index add() never returned
        raise TypeError(NOT_ITERABLE)

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this ReplayBuffer is closed")

    def _slots(self, indices: np.ndarray) -> np.ndarray:
        return self._store.live_slots(indices)

    def _live_slots(self) -> np.ndarray:
        """Every live slot (O(max_items): only the all-priorities-zero fallback needs it)."""
        return np.flatnonzero(self._store.keys >= 0)

    def _limit(self, op: str, n: int, timeout: float | None) -> None:
        """(lock held) Wait until the rate limiter admits ``op`` of ``n`` items (or raise)."""
        lim = self._limiter
        assert lim is not None
        (lim.check_insert if op == "insert" else lim.check_sample)(n)
        lim.wait(self._cond, op, n, self._store.__len__, timeout, self._check)

    # ------------------------------------------------------------------ add / get / update / delete
    def add(
        self,
        item: Any,
        *,
        episode: int | None = None,
        step: int | None = None,
        version: int | None = None,
        timeout: float | None = DEFAULT,
    ) -> int:
        """Store one item (dict of arrays/tensors/bytes/numbers, or one such value); returns its index.

        ``episode`` and ``step`` (ints >= 0) place the item in a trajectory for
        ``sample(seq_len=...)``; ``version`` is the policy version that produced it, for
        ``sample(max_staleness=...)``. With a ``rate_limit``, waits while sampling is behind, up to
        ``timeout`` seconds (default: the RateLimit's), then raises RateLimitTimeout with nothing
        added.
        """
        parts = _codec.encode_parts(item)
        meta = item_meta(1, episode, step, version)
        if meta is None and timeout is DEFAULT and self._limiter is None:
            with self._cond:
                self._check()
                store = self._store
                if store.nfree and not store.durable:
                    # the common case in Python scalars: a handful of 1-element numpy calls
                    # would cost more than the item's copy
                    key = store.add_one(parts)
                    slot = key % store.cap
                    self._meta.clear_one(slot)
                    self._sampler.add_one(slot)
                    self._cond.notify_all()  # samplers waiting for items
                    return key
        return int(self._extend_blobs([parts], timeout, meta)[0])

    def extend(
        self,
        items: Iterable[Any],
        *,
        episode: Any = None,
        step: Any = None,
        version: Any = None,
        timeout: float | None = DEFAULT,
    ) -> np.ndarray:
        """Store many items in one step (one lock, one batched spill); returns their indices.

        Equivalent to adding them one by one (same indices, priorities and order); with a
        ``rate_limit`` the batch is admitted whole (see :meth:`add`). ``episode``, ``step`` and
        ``version`` are each an int for all items or a sequence with one int per item.
        """
        blobs = [_codec.encode_parts(it) for it in check_items(items, "ReplayBuffer")]
        return self._extend_blobs(blobs, timeout, item_meta(len(blobs), episode, step, version))

    def _extend_blobs(
        self, blobs: list, timeout: float | None = DEFAULT, meta: tuple | None = None
    ) -> np.ndarray:
        """Add already-encoded items: blobs (Ray collectors encode on their side) or lists of
        parts from ``encode_parts``."""
        lim = self._limiter
        if timeout is not DEFAULT:
            timeout = check_timeout(timeout)
        elif lim is not None:
            timeout = lim.cfg.timeout
        with self._cond:
            self._check()
            if len(blobs) > self.max_items:
                raise ConfigError(
                    f"extend got {len(blobs)} items, more than max_items={self.max_items}; add "
                    f"them in chunks of at most {self.max_items}"
                )
            if lim is not None:
                self._limit("insert", len(blobs), timeout)
            keys, _ = self._store.add(blobs, on_evict=self._sampler.remove)
            if lim is not None:  # counted once stored: a failed add (disk full) is no insert
                lim.inserted(len(blobs))
            slots = keys % self.max_items
            self._meta.added(slots, meta)
            self._sampler.add(slots)
            self._cond.notify_all()  # samplers waiting for items (cheap when nobody waits)
            return keys

    def __getitem__(self, index: int | Sequence[int] | np.ndarray) -> Any:
        """The item at ``index`` (or a list of items for a sequence of indices), RAM or disk."""
        single = isinstance(index, (int, np.integer)) and not isinstance(index, bool)
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
            self._store.update(index, blob)

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
        return self._meta.policy_version

    @policy_version.setter
    def policy_version(self, v: int) -> None:
        v = check_int(v, f"policy_version must be an int >= 0, got {v!r}", minimum=0, numpy=True)
        with self._lock:
            self._meta.policy_version = max(self._meta.policy_version, v)

    def sample(
        self,
        batch_size: int,
        *,
        timeout: float | None = DEFAULT,
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
        n = check_batch_size(batch_size)
        wait = self._sample_timeout(timeout)
        if seq_len is not None or max_staleness is not None:
            check_sequence_args(seq_len, max_staleness, eta)
            return self._sample_filtered(n, wait, seq_len, max_staleness, bool(pad), float(eta))
        if self.config.prefetch:
            return self._sample_prefetched(n, wait)
        blobs, keys, weights = self._draw(n, wait)
        items, collated = _codec.decode_batch(blobs)  # outside the lock: adds continue meanwhile
        return Batch(items, keys, weights, collated)

    def _sample_timeout(self, timeout: Any) -> float | None:
        if timeout is DEFAULT:
            return self._limiter.cfg.timeout if self._limiter is not None else 0.0
        return check_timeout(timeout)

    def _sample_blobs(
        self, n: int, timeout: float | None = 0.0
    ) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """A batch as encoded blobs (the Ray actor: the learner decodes on its side)."""
        return self._draw(check_batch_size(n), check_timeout(timeout))

    def _empty(self, timeout: float | None) -> IndexError:
        waited = f" after waiting {timeout:g} s" if timeout else ""
        drained = " (drained by max_uses)" if self.config.max_uses is not None else ""
        wait = "a longer timeout" if timeout else "sample(..., timeout=seconds)"
        return IndexError(
            f"cannot sample from an empty ReplayBuffer{drained}{waited}; add items first, or pass "
            f"{wait} to wait for collectors"
        )

    def _wait_items(self, timeout: float | None) -> bool:
        """(lock held) Wait up to ``timeout`` seconds for an item; whether there is one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check()
            if len(self._store):
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # woken by an add or close(); the 1 s tick only re-checks (timeout=None waits
            # until one of those happens, which is what the caller asked for)
            self._cond.wait(1.0 if left is None else min(left, 1.0))

    def _draw(self, n: int, timeout: float | None) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        with self._cond:
            if self._limiter is not None:
                self._check()
                self._limit("sample", n, timeout)
            elif not self._wait_items(timeout):
                raise self._empty(timeout)
            return self._sample_locked(n)

    def _sample_locked(self, n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """(blobs, keys, weights) of a draw (references to the stored bytes, decoded by the
        caller after the lock is released)."""
        self._check()
        if len(self._store) == 0:
            raise self._empty(None)
        while True:
            slots, weights = self._sampler.sample(n, self._rng, self._live_slots)
            keys = self._store.keys[slots].copy()
            try:
                blobs = self._store.blobs(slots)
                break
            except NodeLostError:
                # the items that node held were dropped (each loss drops at least one, so this
                # ends); draw again from the rest
                self._redraw()
                if len(self._store) == 0:
                    raise self._empty(None) from None
        self._use(slots)
        if self._limiter is not None:  # counted once drawn: a failed read is no sample
            self._limiter.sampled(n)
            self._cond.notify_all()  # inserters waiting for sampling to catch up
        return blobs, keys, weights

    def _redraw(self) -> None:
        """(lock held) A draw whose items were lost is not a sample() call: beta annealing
        counts the draw that follows it only."""
        if isinstance(self._sampler, PrioritizedState):
            self._sampler.samples -= 1

    def _use(self, slots: np.ndarray) -> None:
        """(lock held) Count a draw of ``slots``; items drawn ``max_uses`` times are removed."""
        if self.config.max_uses is None:
            return
        done = self._meta.count_uses(slots, self.config.max_uses)
        if len(done):
            self._sampler.remove(done)
            self._store.remove(done)

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
        with self._cond:
            self._check()
            if self._limiter is not None:
                self._limit("sample", n, timeout)
            elif not len(self._store) and timeout != 0:
                self._wait_items(timeout)  # then draws, or says why it cannot
            while True:
                drawn, weights, mask = self._draw_filtered(n, seq_len, max_staleness, pad, eta)
                flat = drawn.reshape(-1)
                keys = self._store.keys[drawn].copy()
                try:
                    blobs = self._store.blobs(flat)
                    break
                except NodeLostError:
                    self._redraw()  # as in _sample_locked: those items were dropped
            self._use(flat if mask is None else drawn[mask])
            if self._limiter is not None:
                self._limiter.sampled(n)
                self._cond.notify_all()
        items, collated = _codec.decode_batch(blobs)
        if seq_len is not None:
            items = _sequence.fold(items, collated, n, seq_len)
        return Batch(items, keys, weights, collated, mask)

    def _draw_filtered(
        self, n: int, seq_len: int | None, max_staleness: int | None, pad: bool, eta: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(lock held) Slots of ``n`` items (or (n, seq_len) slices), weights and mask."""
        slots, why = self._meta.fresh(self._live_slots(), max_staleness)
        cfg = self._sampler.cfg
        prio = self._sampler.leaves(slots) if isinstance(cfg, Prioritized) else None
        beta = self.beta if prio is not None else None
        if seq_len is None:
            if not len(slots):
                raise IndexError(f"cannot sample: {why}; add items first")
            w = prio if prio is not None else np.ones(len(slots))
            pos, weights = _sequence.draw(w, n, self._rng, beta)
            drawn, mask = slots[pos], None
        else:
            m = self._meta
            alpha = cfg.alpha if prio is not None else 1.0
            drawn, weights, mask = _sequence.draw_slices(
                slots, m.episode, m.step, prio, alpha, n, seq_len, pad, eta, self._rng, beta,
                fresh=max_staleness is not None,
            )  # fmt: skip
        if prio is not None:
            self._sampler.samples += 1  # beta annealing counts sample() calls
        return drawn, weights, mask

    def _sample_prefetched(self, n: int, timeout: float | None) -> Batch:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check()
            p = self._prefetcher
            if p is None or p.n != n or not p.thread.is_alive():
                # a new batch size (batches drawn ahead for the old one are dropped), or a
                # thread that ended: start again
                self._stop_prefetch()
                p = self._prefetcher = Prefetcher(self._prefetch_one, n, self.config.prefetch)
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
                                size = len(self._store)
                                raise lim.timeout_error("sample", n, size, timeout) from None
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

    def _prefetch_one(self, p: Prefetcher) -> Batch | object | None:
        """(Prefetch thread) draw one batch; None when there is nothing to draw yet."""
        with self._cond:
            if self._closed:
                return STOP
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
        """Set the priorities of sampled items (e.g. ``|td_error|``); one value per index (a
        number for one index).

        Priorities must be finite and >= 0 (0: never drawn while another item has a positive
        priority; when all are 0, items are drawn uniformly with weights 1; with ``alpha=0``
        every weight ``p**0`` is 1, 0 included, as in TorchRL and Reverb), and ``p**alpha`` at
        most 1e290 so that their sum stays finite (ConfigError naming the limit). Indices that went
        stale since they were sampled are skipped and counted in ``stats["stale_updates"]``; an
        index that add() never returned raises KeyError and nothing is changed. (The buffer
        remembers which index each of its last ``max_items`` adds returned; an older index that is
        no longer stored cannot be told from a stale one and is skipped.)
        """
        keys = as_index_array(indices)
        prios = priority_array(priorities, keys)
        # the usual batch, all below the running max, is valid as it stands (one compare)
        below = self._sampler.below_max(prios)
        if not below:
            hi, lo = self._check_priorities(prios)
        with self._lock:
            self._check()
            stored = self._store.keys
            slots = keys % len(stored)
            # an empty slot's key is -1, so the one index never issued that can pass is -1 (in
            # the last slot, while it is empty): look for negatives only then
            live = np.count_nonzero(stored[slots] == keys)  # cheaper than .all() on 256 items
            if live != len(keys) or (stored[-1] < 0 and keys.size and keys.min() < 0):
                slots, prios = self._live_or_refuse(keys, slots, prios)
                if not below:
                    lo = float(prios.min()) if prios.size else lo
            if below:
                self._sampler.update_below_max(slots, prios)
            else:
                self._sampler.update(slots, prios, hi, lo)

    def _check_priorities(self, prios: np.ndarray) -> tuple[float, float]:
        """(largest, smallest) of ``prios``; ConfigError unless all are finite, >= 0 and within
        the sampler's limit."""
        hi, lo = (float(_max_reduce(prios)), float(_min_reduce(prios))) if len(prios) else (0, 0)
        if not (lo >= 0 and hi < np.inf):  # one pass catches NaN too
            if not np.isfinite(prios).all():
                raise ConfigError("priorities must be finite; got NaN or inf (check the loss)")
            raise ConfigError(f"priorities must be >= 0, got {lo} (pass |td_error|)")
        self._sampler.check(hi)  # a weight sum that overflows would sample wrongly
        return hi, lo

    def _live_or_refuse(
        self, keys: np.ndarray, slots: np.ndarray, prios: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(lock held) update_priorities' slow path: KeyError (nothing changed) for an index
        add() never returned, else the slots and priorities of the live indices, counting the
        stale ones in ``stats["stale_updates"]``."""
        live = (keys >= 0) & (self._store.keys[slots] == keys)
        issued = self._store.issued(keys)
        if not issued.all():
            first = int(keys[np.argmin(issued)])
            raise KeyError(
                f"index {first} was never returned by add() on this buffer (pass "
                f"batch.indices from sample(), not positions in the batch)"
            )
        self._stale_updates += int((~live).sum())
        return slots[live], prios[live]

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
    @renamed(dirname="directory")
    def save(self, directory: str | os.PathLike, *, mode: int = 0o600) -> None:
        """Write items, priorities and sampler state to ``directory`` (created; must be empty).

        ``mode``: every file gets it, 0o600 (private, the default), 0o640 or 0o644 (the group
        or everyone may read); the directory gets 0o700, 0o750 or 0o755 (``_modes.py``). A
        failed save removes what it wrote (and ``directory`` if it made it). The lock is held only
        while the index is copied: adds and samples go on while the bytes are (``_persist.py``).
        """
        directory = _persist.check_directory(directory, "save")
        _modes.check_mode(mode, "ReplayBuffer.save")
        with self._lock:
            self._check()
        made = _persist.prepare_dir(directory, mode)
        with self._lock:  # a short pause: copy the index, pin the items
            self._check()
            job = self._persist.begin_save()
        try:
            _persist.write_copy(directory, job, self.config.segment_size, mode, made)
        finally:
            with self._lock:
                self._store.unpin(job.pinned)

    @classmethod
    @renamed(dirname="directory", ram_budget="host_budget")
    def load(
        cls,
        directory: str | os.PathLike,
        *,
        host_budget: SizeLike | None = None,
        spill_dir: str | os.PathLike | None = None,
        prefetch: int = 0,
        seed: int | None = None,
        rate_limit: RateLimit | None = None,
    ) -> ReplayBuffer:
        """A new buffer with the items, indices, priorities and use counts saved in ``directory``.

        ``seed``: None goes on with the saved buffer's random stream when it was made with a
        ``seed`` (its samples are then those the saved buffer would have drawn next), else
        starts a fresh unseeded one; an int starts afresh from that seed.
        Only reads ``directory`` (a read-only copy works, and a damaged one is never changed);
        damage raises CorruptDataError naming the file, before or instead of a partial buffer.
        """
        directory = _persist.check_directory(directory, "load")
        meta, sampler, arrays = _saved.read(directory, fix=_persist.LOAD_FIX)
        cfg = meta["config"]
        resume = seed is None and "rng" in meta
        if resume:
            seed = meta["rng"]["seed"]  # restore_saved then sets the generator's saved state
        buf = cls(
            cfg["capacity"],  # the saved keys (format compatibility): max_items, host_budget
            host_budget=cfg["ram_budget"] if host_budget is None else host_budget,
            spill_dir=spill_dir,
            sampler=sampler,
            max_uses=cfg["max_uses"],
            prefetch=prefetch,
            seed=seed,
            segment_size=cfg["segment_size"],
            rate_limit=rate_limit,
        )
        try:
            buf._persist.restore_saved(directory, arrays, meta, resume)
            if rate_limit is not None:  # counters start balanced for the items loaded
                buf._limiter = RateLimiter.balanced(rate_limit, len(buf))
        except BaseException:
            buf.close()
            raise
        return buf

    def checkpoint(self) -> None:
        """Durable buffers: record priorities and use counts next to the segments (atomic)."""
        if not self.config.durable:
            raise ConfigError("checkpoint() is for durable=True buffers; use save(dir) otherwise")
        with self._lock:
            self._check()
            self._persist.checkpoint()

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
                    self._persist.checkpoint()
            finally:
                self._closed = True
                self._store.close()
                self._cond.notify_all()  # samplers waiting for items get ClosedError

    def __reduce__(self):
        raise not_picklable("ReplayBuffer")

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(len={len(self)}, max_items={self.max_items}, "
            f"sampler={self.config.sampler}, host_budget={self.config.host_budget})"
        )
