"""Sharded replay on Ray: K buffer actors, exact PER over their union, one rate limiter for all.

Layout. ``serve(buf, shards=K)`` starts K shard actors, each a ReplayBuffer with ``max_items/K``
slots, ``host_budget/K`` of RAM and its own spill directory on its node (durable shards:
``spill_dir/shard-i``). Ray places them (``scheduling_strategy="SPREAD"`` over nodes unless given).
The handle, :class:`ShardedReplayBuffer`, is picklable: collectors write each ``add``/``extend``
call whole to one shard, one on their own node first, else round-robin over the live shards.

Sampling is exact PER over the union (Ape-X's two levels). ``sample(B)`` asks every shard for its
priority mass, min and size in one parallel round trip, draws how many items each shard gives from
a multinomial over the masses, and each shard draws its share from its own sum tree (second round
trip): P(item i of shard s) = M_s / M * p_i / M_s = p_i / M, the single-buffer distribution. IS
weights are ``(p_i / p_min) ** -beta`` with the global min (beta annealed by this handle's
``sample`` calls), so they equal a single buffer's. Ids are global, ``index * K + shard``
(``locate`` splits them); ``update_priorities``, reads and deletes go to the owning shard. With
the template's ``prefetch > 0`` the next batch of the same size is drawn on a background thread
while the learner trains (one batch in flight, never more).

Rate limiting. With the template's ``rate_limit``, one :class:`RateLimiter` counts inserts and
samples of all shards in an async coordinator actor. A caller reserves its insert or sample there
before it touches a shard: the coordinator waits on an asyncio condition for at most ``_CHUNK``
seconds per call, the caller repeats until its own deadline, then raises RateLimitTimeout. No
actor thread is blocked (waiting calls are coroutines), nothing queues: each waiting caller holds
only its own batch. Shards' sizes reach the coordinator after each change (fire and forget, ordered
by a per-shard sequence number), for ``min_size_to_sample``. Each shard also counts the items
inserted into and drawn from it, so the coordinator is state that can be rebuilt, as Reverb's
limiter lives with its table: if it dies, ``restart_rate_limiter()`` (or ``restart_shard``) starts
it again under its Ray name with the sums of the shards' counters and sizes (exact but for calls
in flight and rare redraws; a shard restarted since contributes its counts since then), and
other handles find it by name.

Lost shards. A failed call to a shard (its actor or its node died) marks it lost in this handle:
``sample`` and ``add`` go on with the others, ``stats["lost_shards"]`` lists it, and calls that
need its items raise :class:`ShardLostError`. ``restart_shard(i)`` starts it again under the same
Ray name; a durable shard reopens its directory (every acknowledged add). Other handles look the
name up again at most every ``_REVIVE_S`` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import threading
import time
import uuid
from typing import Any, NoReturn

import numpy as np

from tensortier._ray import end_actors
from tensortier.errors import ClosedError, ConfigError, ShardLostError
from tensortier.rl._actors import (
    START_TIMEOUT,
    BufferActor,
    actor_class,
    check_local_tiers,
    check_num_cpus,
    check_resources,
    import_ray,
    kill_quietly,
    result,
    wait_started,
)
from tensortier.rl._api import (
    DEFAULT,
    Batch,
    ReplayConfig,
    check_batch_size,
    check_timeout,
    priority_array,
)
from tensortier.rl._store import as_index_array, check_items
from tensortier.rl.rate_limiter import RateLimit, RateLimiter
from tensortier.rl.replay import NOT_ITERABLE, ReplayBuffer
from tensortier.rl.sampler import Prioritized, PrioritizedState, check_priority, is_weights
from tensortier.tiers import itemcodec as _codec

_CHUNK = 1.0  # longest one coordinator wait holds (seconds); the caller repeats until its deadline
_REVIVE_S = 5.0  # how often a handle looks up a lost shard's name again (restarted elsewhere?)
_PREFETCH_WAIT = 5.0  # close(): longest wait for a batch being drawn ahead


# ---------------------------------------------------------------------- actors
def _mass(buf: ReplayBuffer) -> tuple[float, float, int]:
    """(priority mass, smallest positive leaf, size) of one shard; uniform: (size, 1, size)."""
    n = len(buf._store)
    samp = buf._sampler
    if isinstance(samp, PrioritizedState):
        tree = samp.tree
        return tree.total, tree.min_positive, n
    return float(n), 1.0, n


class _ShardActor(BufferActor):
    """One shard: a ReplayBuffer, plus the two-level sampling calls and a change counter."""

    def __init__(self, kwargs: dict):
        super().__init__("replay", kwargs, None)
        self.seq = 0  # bumped by every change of size: orders size reports at the coordinator
        self.inserted = 0  # items put here, and drawn here: the rate limiter's counts, kept with
        self.drawn = 0  # the data so that a lost coordinator can be rebuilt from them

    def info(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def _size(self) -> tuple[int, int]:
        self.seq += 1
        return self.seq, len(self.obj)

    def put(self, blobs: list[bytes]):
        keys = self.obj._extend_blobs(blobs)
        self.inserted += len(keys)
        return (keys, *self._size())

    def counts(self) -> tuple[int, int, int, int]:
        """(inserted, drawn, seq, size): what a rebuilt coordinator starts from."""
        return self.inserted, self.drawn, self.seq, len(self.obj)

    def mass(self) -> tuple[float, float, int]:
        with self.obj._lock:
            self.obj._check()
            return _mass(self.obj)

    def draw(self, n: int):
        """``n`` items by this shard's priorities: blobs, keys, leaves, this shard's (mass, min)
        and its size after the draw (``max_uses`` may remove items)."""
        buf = self.obj
        with buf._cond:
            buf._check()
            if len(buf._store) == 0:
                return [], np.empty(0, np.int64), np.empty(0), 0.0, math.inf, *self._size()
            total, low, _ = _mass(buf)
            slots, _ = buf._sampler.sample(n, buf._rng, buf._live_slots)
            leaves = np.asarray(buf._sampler.leaves(slots), np.float64)
            keys = buf._store.keys[slots].copy()
            blobs = buf._store.blobs(slots)
            self.drawn += len(keys)
            buf._use(slots)  # max_uses, as ReplayBuffer._sample_locked
            return blobs, keys, leaves, total, low, *self._size()

    def set_priorities(self, keys, priorities, top: float) -> None:
        """Update, and raise this shard's max priority (new items' priority) to the batch's."""
        buf = self.obj
        buf.update_priorities(keys, priorities)
        samp = buf._sampler
        if isinstance(samp, PrioritizedState):
            with buf._lock:
                samp.max_priority = max(samp.max_priority, top)

    def priorities(self, keys) -> np.ndarray:
        return self.obj.priorities(keys)

    def remove(self, keys):
        del self.obj[keys]
        return self._size()


class _Coordinator:
    """One RateLimiter for every shard (async actor: waiting callers are coroutines)."""

    def __init__(self, cfg: RateLimit, shards: int, counts: list | None = None):
        """``counts``: each shard's (inserted, drawn, seq, size) when rebuilt after a loss."""
        counts = counts or [(0, 0, -1, 0)] * shards
        self.lim = RateLimiter(
            cfg, inserts=sum(c[0] for c in counts), samples=sum(c[1] for c in counts)
        )
        self.seqs = [c[2] for c in counts]
        self.sizes = [c[3] for c in counts]
        # extremes of diff once min_size_to_sample items were inserted (the window holds from
        # then on; during the warm-up diff only grows toward it)
        self.low, self.high = math.inf, -math.inf
        self._cond: asyncio.Condition | None = None

    def _c(self) -> asyncio.Condition:
        if self._cond is None:  # made inside the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    async def ready(self) -> bool:
        return True

    async def acquire(self, op: str, n: int, wait_s: float, first: bool) -> bool:
        """Reserve an insert or sample of ``n`` items; False if not admitted within ``wait_s``."""
        lim = self.lim
        (lim.check_insert if op == "insert" else lim.check_sample)(n)
        can = lim.can_insert if op == "insert" else lim.can_sample
        cond = self._c()
        async with cond:
            ok = can(n, sum(self.sizes))
            if not ok and first:
                if op == "insert":
                    lim.stats.insert_waits += 1
                else:
                    lim.stats.sample_waits += 1
            if not ok and wait_s > 0:
                t0 = time.monotonic()
                try:
                    pred = lambda: can(n, sum(self.sizes))  # noqa: E731
                    await asyncio.wait_for(cond.wait_for(pred), wait_s)
                    ok = True
                except asyncio.TimeoutError:
                    pass
                lim.stats.waited_s += time.monotonic() - t0
            if not ok:
                return False
            (lim.inserted if op == "insert" else lim.sampled)(n)
            if lim.stats.inserts >= lim.cfg.min_size_to_sample:
                self.low, self.high = min(self.low, lim.diff), max(self.high, lim.diff)
            cond.notify_all()
            return True

    async def release(self, op: str, n: int) -> None:
        """Undo a reservation whose shard call failed."""
        st = self.lim.stats
        if op == "insert":
            st.inserts -= n
        else:
            st.samples -= n
        async with self._c():
            self._c().notify_all()

    async def report(self, shard: int, seq: int, size: int) -> None:
        if seq > self.seqs[shard]:
            self.seqs[shard], self.sizes[shard] = seq, size
            async with self._c():
                self._c().notify_all()

    async def reset(self, shard: int, size: int) -> None:
        """A restarted shard (its sequence numbers start again)."""
        self.seqs[shard], self.sizes[shard] = 0, size
        async with self._c():
            self._c().notify_all()

    async def timeout_error(self, op: str, n: int, timeout: float | None) -> Exception:
        return self.lim.timeout_error(op, n, sum(self.sizes), timeout)

    async def stats(self) -> dict:
        cfg = self.lim.cfg
        return {
            **self.lim.as_dict(),
            "size": sum(self.sizes),
            "diff_low": self.low,
            "diff_high": self.high,
            "diff_center": cfg.samples_per_insert * cfg.min_size_to_sample,
        }


# ---------------------------------------------------------------------- handle
class ShardedReplayBuffer:
    """Client of K replay shards on Ray (see the module doc); made by ``serve(buf, shards=K)``.

    >>> buf = tt.rl.serve(tt.rl.ReplayBuffer(1_000_000, sampler=tt.rl.Prioritized()), shards=4)
    >>> ids = buf.extend(items)            # a collector, anywhere in the cluster
    >>> batch = buf.sample(256)            # the learner: global ids, global IS weights
    >>> buf.update_priorities(batch.indices, td.abs())
    """

    def __init__(self, actors: list, names: list[str], nodes: list[str], spawn: dict, coord):
        self._actors = list(actors)
        self._names = list(names)
        self.nodes = list(nodes)  # the Ray node id of each shard
        self._spawn = spawn  # options, per-shard kwargs, sampler, rate limit, prefetch
        self._coord = coord
        self._init_local()

    def _init_local(self) -> None:
        """State of this process only (not pickled)."""
        self._mu = threading.Lock()  # guards _actors, nodes and _lost (never held while waiting)
        self._lost: dict[int, str] = {}
        self._revive_at = 0.0
        self._local: list[int] | None = None
        self._rr = os.getpid()
        self._rng = np.random.default_rng(self._spawn["seed"])
        self._calls = 0  # sample() calls: beta annealing
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._next: tuple[int, concurrent.futures.Future] | None = None
        self._closed = False

    def __getstate__(self) -> dict:
        keep = ("_actors", "_names", "nodes", "_spawn", "_coord")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local()
        self._rng = np.random.default_rng()  # copies (other learners) must not draw alike

    # -------------------------------------------------------------- basics
    @property
    def shards(self) -> int:
        return len(self._actors)

    @property
    def rate_limit(self) -> RateLimit | None:
        return self._spawn["rate_limit"]

    def locate(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """(shard, index in that shard) of global ids."""
        g = as_index_array(ids)
        return g % self.shards, g // self.shards

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this ShardedReplayBuffer is closed; serve a buffer again")

    def _lost_error(self, i: int) -> ShardLostError:
        return ShardLostError(
            f"shard {i} of this replay buffer is lost ({self._lost.get(i, 'gone')}; node "
            f"{self.nodes[i]}); its items are unreachable, the other shards keep serving. "
            f"restart_shard({i}) brings a durable shard back with its items",
            shard=i,
            node=self.nodes[i],
        )

    def _mark_lost(self, i: int, why: str) -> None:
        with self._mu:
            first = i not in self._lost
            self._lost.setdefault(i, why)
        if first and self._coord is not None:  # its items no longer count for min_size
            with contextlib.suppress(Exception):
                self._coord.reset.remote(i, 0)

    def _get(self, i: int, ref):
        """``ray.get`` of a call to shard ``i``: tensortier's errors as themselves, a dead shard as
        ShardLostError (Ray fails calls to a dead actor, so this cannot hang on one)."""
        ray = import_ray()
        try:
            return result(ref)
        except ray.exceptions.RayActorError as exc:
            self._mark_lost(i, type(exc).__name__)
            raise self._lost_error(i) from exc

    def _revive(self, force: bool = False) -> None:
        """Look lost shards up by name: a restart (by any handle) replaced the actor."""
        if not self._lost or (not force and time.monotonic() < self._revive_at):
            return
        self._revive_at = time.monotonic() + _REVIVE_S
        ray = import_ray()
        for i in list(self._lost):
            try:  # the same actor answering again (Ray restarted it, or it was unreachable)
                actor = ray.get_actor(self._names[i])  # or a new one: restart_shard elsewhere
                info = ray.get(actor.info.remote(), timeout=_REVIVE_S)
                size = ray.get(actor.length.remote(), timeout=_REVIVE_S)
            except Exception:  # not restarted (yet), or died again
                continue
            if self._coord is not None:
                with contextlib.suppress(Exception):
                    self._coord.reset.remote(i, size)
            with self._mu:
                self._actors[i], self.nodes[i] = actor, info["node"]
                self._lost.pop(i, None)

    def _alive(self) -> list[int]:
        self._revive()
        return [i for i in range(self.shards) if i not in self._lost]

    def _need(self, i: int) -> None:
        if i in self._lost:
            self._revive(force=True)
            if i in self._lost:
                raise self._lost_error(i)

    # -------------------------------------------------------------- rate limiting
    def _timeout(self, timeout: Any) -> float | None:
        if timeout is DEFAULT:
            lim = self.rate_limit
            return lim.timeout if lim is not None else 0.0
        return check_timeout(timeout)

    def _acquire(self, op: str, n: int, timeout: float | None) -> bool:
        """Reserve ``op`` of ``n`` items at the coordinator, waiting up to ``timeout`` seconds."""
        if self._coord is None:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        first = True
        while True:
            left = _CHUNK if deadline is None else max(0.0, deadline - time.monotonic())
            ok = self._coord_call("acquire", op, n, min(left, _CHUNK), first)
            if ok:
                return True
            first = False
            if deadline is not None and time.monotonic() >= deadline:
                raise self._coord_call("timeout_error", op, n, timeout)

    def _coord_call(self, method: str, *args):
        ray = import_ray()
        try:
            return result(getattr(self._coord, method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            if self._find_coord():  # another handle restarted it: the call again, there
                return self._coord_call(method, *args)
            raise ClosedError(
                "the rate limiter's coordinator actor of this sharded buffer is gone (its "
                "process or node died); restart_rate_limiter() rebuilds it from the shards' "
                "counters, or close() and serve the buffer again"
            ) from exc

    def _find_coord(self) -> bool:
        """Look the coordinator up by name: True if a live one other than ours answers."""
        ray = import_ray()
        try:
            actor = ray.get_actor(self._spawn["coord_name"])
            if actor._actor_id == self._coord._actor_id:
                return False
            ray.get(actor.ready.remote(), timeout=_REVIVE_S)
        except Exception:  # no such name (not restarted), or it died again
            return False
        with self._mu:
            self._coord = actor
        return True

    def _release(self, op: str, n: int) -> None:
        if self._coord is not None:
            with contextlib.suppress(Exception):
                self._coord.release.remote(op, n)

    def _report(self, i: int, seq: int, size: int) -> None:
        if self._coord is not None:
            self._coord.report.remote(i, seq, size)  # fire and forget: ordered by seq

    # -------------------------------------------------------------- add
    def add(self, item: Any, *, shard: int | None = None, timeout: Any = DEFAULT) -> int:
        return int(self.extend([item], shard=shard, timeout=timeout)[0])

    append = add

    def extend(self, items, *, shard: int | None = None, timeout: Any = DEFAULT) -> np.ndarray:
        """Store ``items`` in one shard (``shard``, else one on this node, else round-robin) in
        one call; returns their global ids. With a rate limit, waits up to ``timeout`` (default:
        the RateLimit's) while sampling is behind, then raises RateLimitTimeout, nothing added."""
        self._check()
        if shard is not None and (
            isinstance(shard, bool)
            or not isinstance(shard, (int, np.integer))
            or not 0 <= shard < self.shards
        ):
            raise ConfigError(
                f"shard must be None (pick one) or an int in [0, {self.shards}), got {shard!r}"
            )
        blobs = [_codec.encode(it) for it in check_items(items, "ShardedReplayBuffer")]
        if not blobs:
            return np.empty(0, np.int64)
        cap = self._spawn["kwargs"][0]["max_items"]
        if len(blobs) > cap:  # the shard would say "more than max_items=cap": not the caller's
            raise ConfigError(
                f"extend got {len(blobs)} items, more than one shard holds (max_items={cap} on "
                f"each of {self.shards} shards; one extend goes to one shard); add them in "
                f"chunks of at most {cap}"
            )
        wait = self._timeout(timeout) if self._coord is not None else 0.0
        reserved = self._acquire("insert", len(blobs), wait)
        try:
            tried: set[int] = set()
            while True:
                i = int(shard) if shard is not None else self._pick(tried)
                if shard is not None:
                    self._need(i)
                try:
                    keys, seq, size = self._get(i, self._actors[i].put.remote(blobs))
                    break
                except ShardLostError:
                    tried.add(i)
                    if shard is not None or len(tried) >= self.shards:
                        raise
        except BaseException:
            if reserved:
                self._release("insert", len(blobs))
            raise
        self._report(i, seq, size)
        return np.asarray(keys, np.int64) * self.shards + i

    def _pick(self, tried: set[int]) -> int:
        alive = [i for i in self._alive() if i not in tried]
        if not alive:
            raise ShardLostError(
                "every shard of this replay buffer is lost; restart_shard(i) or serve again",
                shard=-1,
            )
        if self._local is None:
            here = import_ray().get_runtime_context().get_node_id()
            self._local = [i for i, node in enumerate(self.nodes) if node == here]
        cand = [i for i in self._local if i in alive] or alive
        self._rr += 1
        return cand[self._rr % len(cand)]

    # -------------------------------------------------------------- sample
    def sample(self, batch_size: int, *, timeout: Any = DEFAULT) -> Batch:
        """``batch_size`` items drawn from the union of the live shards (exact PER; see the module
        doc). Empty buffer: IndexError after ``timeout`` (default 0); with a rate limit, waits up
        to ``timeout`` (default: the RateLimit's) while inserting is behind."""
        n = check_batch_size(batch_size)
        self._check()
        wait = self._timeout(timeout)
        if not self._spawn["prefetch"]:
            return self._draw(n, wait)
        nxt, self._next = self._next, None
        batch = None
        if nxt is not None:
            m, fut = nxt
            try:
                got = fut.result()  # bounded: the draw's own waits end by its timeout
                batch = got if m == n else None  # another size: dropped, as ReplayBuffer does
            except (IndexError, TimeoutError):
                batch = None  # drawn ahead under an old wait: try again now, with this one
        if batch is None:
            batch = self._draw(n, wait)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "tt-shard-prefetch")
        self._next = (n, self._pool.submit(self._draw, n, wait))
        return batch

    def _beta(self) -> float:
        c = self._spawn["sampler"]
        if not isinstance(c, Prioritized):
            return 0.0
        if c.beta_steps <= 0:
            return c.beta
        return c.beta + min(1.0, self._calls / c.beta_steps) * (c.beta_final - c.beta)

    def _draw(self, n: int, timeout: float | None) -> Batch:
        reserved = self._acquire("sample", n, timeout)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            tries = 0
            while True:
                self._check()
                got = self._draw_once(n)
                if got is not None:
                    return got
                tries += 1  # a shard may have changed between the round trips: retry twice
                if tries > 2 and deadline is not None and time.monotonic() >= deadline:
                    why = f" after waiting {timeout:g} s" if timeout else ""
                    raise IndexError(
                        f"cannot sample from an empty sharded replay buffer{why}; add items "
                        f"first, or pass sample(..., timeout=seconds) to wait for collectors"
                    )
                time.sleep(0.01)  # rare: empty, or a shard changed between the two round trips
        except BaseException:
            if reserved:
                self._release("sample", n)
            raise

    def _draw_once(self, n: int) -> Batch | None:
        """One two-level draw; None when the shards are empty or changed in between."""
        alive = self._alive()
        if not alive:
            raise ShardLostError(
                "every shard of this replay buffer is lost; restart_shard(i) or serve again",
                shard=-1,
            )
        if len(alive) == 1:  # one shard: its own draw is the union's, one round trip
            ids, counts, low, total = alive, np.array([n]), math.inf, 0.0
        else:
            refs = [(i, self._actors[i].mass.remote()) for i in alive]
            masses = {}
            for i, ref in refs:
                with contextlib.suppress(ShardLostError):  # marked lost: served by the others
                    masses[i] = self._get(i, ref)
            if not masses:
                return None
            ids = sorted(masses)
            tot = np.array([masses[i][0] for i in ids], np.float64)
            sizes = np.array([masses[i][2] for i in ids], np.float64)
            if not sizes.sum():
                return None
            total = tot.sum()
            by = tot if total > 0 else sizes  # all priorities 0: uniform, as one buffer does
            counts = self._rng.multinomial(n, by / by.sum())
            low = min(masses[i][1] for i in ids)
        refs = [(i, c, self._actors[i].draw.remote(int(c))) for i, c in zip(ids, counts) if c]
        parts, short = [], False
        for i, c, ref in refs:
            try:
                blobs, keys, leaves, mass, mn, seq, size = self._get(i, ref)
            except ShardLostError:
                short = True
                continue
            self._report(i, seq, size)
            short |= len(keys) < c
            low = min(low, mn)
            if len(alive) == 1:
                total = mass
            parts.append((i, blobs, keys, leaves))
        if short:
            return None  # redraw from the shards as they are now (rare)
        blobs = [b for p in parts for b in p[1]]
        keys = np.concatenate([np.asarray(p[2], np.int64) * self.shards + p[0] for p in parts])
        leaves = np.concatenate([p[3] for p in parts])
        prio = isinstance(self._spawn["sampler"], Prioritized) and total > 0
        weights = is_weights(leaves, low, self._beta()) if prio else np.ones(n, np.float32)
        self._calls += 1
        order = self._rng.permutation(n)  # shards come out in order; do not leak that
        keys, weights = keys[order], weights[order]
        blobs = [blobs[j] for j in order.tolist()]
        items, collated = _codec.decode_batch(blobs)
        return Batch(items, keys, weights, collated)

    # -------------------------------------------------------------- by id
    def _by_shard(self, ids: Any) -> tuple[np.ndarray, np.ndarray, list[int]]:
        g = as_index_array(ids)
        if g.size and g.min() < 0:  # -1 would name a shard's local -1: an empty slot's key
            raise KeyError(
                f"index {int(g.min())} was never returned by add() on this buffer (pass "
                f"batch.indices from sample(), not positions in the batch)"
            )
        shard, local = g % self.shards, g // self.shards
        return shard, local, sorted(set(shard.tolist()))

    def _each(self, ids: Any, call) -> tuple[np.ndarray, dict, list[int]]:
        """Send ``call(actor, local_keys, positions)`` to every owning shard at once; returns the
        answers of the live ones and the lost shards among the owners."""
        self._check()
        shard, local, owners = self._by_shard(ids)
        refs, lost = [], []
        for i in owners:
            if i in self._lost:
                self._revive(force=True)
            if i in self._lost:
                lost.append(i)
                continue
            pos = np.flatnonzero(shard == i)
            refs.append((i, pos, call(self._actors[i], local[pos], pos)))
        out = {}
        for i, pos, ref in refs:
            try:
                out[i] = (pos, self._get(i, ref))
            except ShardLostError:
                lost.append(i)
        return shard, out, sorted(lost)

    def update_priorities(self, ids: Any, priorities: Any) -> None:
        """Set priorities of sampled items on their shards. Items of a lost shard are gone: the
        others are updated, then ShardLostError names the first lost one."""
        g = as_index_array(ids)
        prios = priority_array(priorities, g)
        if prios.size and not (np.isfinite(prios).all() and prios.min() >= 0):
            raise ConfigError("priorities must be finite and >= 0 (pass |td_error|)")
        top = float(prios.max()) if prios.size else 0.0
        sampler = self._spawn["sampler"]
        if isinstance(sampler, Prioritized):
            check_priority(top, sampler.alpha)  # before any shard changes
        _, _, lost = self._each(
            g, lambda a, keys, pos: a.set_priorities.remote(keys, prios[pos], top)
        )
        if lost:
            raise self._lost_error(lost[0])

    def priorities(self, ids: Any) -> np.ndarray:
        """Current sampling weights p^alpha of ``ids`` (ShardLostError for a lost shard's)."""
        g = as_index_array(ids)
        _, out, lost = self._each(g, lambda a, keys, pos: a.priorities.remote(keys))
        if lost:
            raise self._lost_error(lost[0])
        res = np.empty(len(g), np.float64)
        for pos, vals in out.values():
            res[pos] = vals
        return res

    def __getitem__(self, ids: Any):
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        g = as_index_array(ids, "index")
        _, out, lost = self._each(g, lambda a, keys, pos: a.get_blobs.remote(keys))
        if lost:
            raise self._lost_error(lost[0])
        items: list = [None] * len(g)
        for pos, blobs in out.values():
            for p, b in zip(pos.tolist(), blobs):
                items[p] = _codec.decode(b)
        return items[0] if single else items

    def delete(self, ids: Any) -> None:
        """Remove items from their shards (per shard all or nothing: an unknown id removes none
        of that shard's)."""
        _, out, lost = self._each(ids, lambda a, keys, pos: a.remove.remote(keys))
        for i, (_, (seq, size)) in out.items():
            self._report(i, seq, size)
        if lost:
            raise self._lost_error(lost[0])

    __delitem__ = delete

    def __iter__(self) -> NoReturn:
        raise TypeError(NOT_ITERABLE)  # (else Python iterates through self[0], self[1], ...)

    def __len__(self) -> int:
        """Items in the live shards."""
        self._check()
        refs = [(i, self._actors[i].length.remote()) for i in self._alive()]
        total = 0
        for i, ref in refs:
            with contextlib.suppress(ShardLostError):
                total += self._get(i, ref)
        return total

    @property
    def stats(self) -> dict:
        """Per shard stats (None for a lost one), ``lost_shards`` {shard: why}, ``nodes``, and the
        shared ``rate_limiter``'s counters."""
        self._check()
        refs = [(i, self._actors[i].stats.remote()) for i in self._alive()]
        per: list[dict | None] = [None] * self.shards
        for i, ref in refs:
            with contextlib.suppress(ShardLostError):
                per[i] = self._get(i, ref)
        out: dict = {
            "shards": per,
            "lost_shards": dict(self._lost),
            "nodes": list(self.nodes),
            "items": sum(s["items"] for s in per if s and "items" in s),
        }
        if self._coord is not None:
            out["rate_limiter"] = self._coord_call("stats")
        return out

    # -------------------------------------------------------------- lifetime
    def restart_shard(self, i: int, *, start_timeout: float | None = START_TIMEOUT) -> None:
        """Start shard ``i`` again (after its actor or node died; a live one is ended first). A
        durable shard reopens ``spill_dir/shard-i``: every add it acknowledged is back, with the
        priorities of its last checkpoint (later ones: the max priority). A non-durable shard
        comes back empty. Placed by the buffer's scheduling strategy."""
        self._check()
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.shards:
            raise ConfigError(f"restart_shard: i must be an int in [0, {self.shards}), got {i!r}")
        ray = import_ray()
        end_actors([self._actors[i]], lambda a: a.ready.remote())
        actor = _start_shard(ray, self._spawn, int(i), start_timeout)
        info = ray.get(actor.info.remote())
        with self._mu:
            self._actors[i], self.nodes[i] = actor, info["node"]
            self._lost.pop(i, None)
            self._local = None
        if self._coord is not None:
            size = self._get(i, actor.length.remote())
            try:
                self._coord_call("reset", int(i), size)
            except ClosedError:  # the coordinator is gone too: rebuilt, with this shard's size
                self.restart_rate_limiter(start_timeout=start_timeout)

    def restart_rate_limiter(self, *, start_timeout: float | None = START_TIMEOUT) -> None:
        """Start the rate limiter's coordinator again (after its process or node died; a live
        one is ended first) from the live shards' own counters: inserts and samples are the
        sums of the items each shard took and gave, sizes their sizes. Call it where
        ``restart_shard`` would be called (the process that owns the buffer: Ray ends an actor
        with its creator); other handles find the new one by name."""
        self._check()
        if self._coord is None:
            raise ConfigError("restart_rate_limiter: this sharded buffer has no rate_limit")
        ray = import_ray()
        end_actors([self._coord], lambda a: a.ready.remote())
        refs = [(i, self._actors[i].counts.remote()) for i in self._alive()]
        counts = [(0, 0, -1, 0)] * self.shards
        for i, ref in refs:
            with contextlib.suppress(ShardLostError):  # a lost shard holds nothing to count
                counts[i] = self._get(i, ref)
        coord = _start_coord(ray, self._spawn, counts, start_timeout)
        with self._mu:
            self._coord = coord

    def close(self) -> None:
        """Close every shard (non-durable ones delete their spill files; durable ones checkpoint)
        and end the actors. Idempotent."""
        if self._closed:
            return
        self._closed = True
        nxt, self._next = self._next, None
        if nxt is not None:
            with contextlib.suppress(Exception):
                nxt[1].result(timeout=_PREFETCH_WAIT)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        ray = import_ray()
        refs = [a.close.remote() for j, a in enumerate(self._actors) if j not in self._lost]
        for ref in refs:
            with contextlib.suppress(Exception):  # a dead shard has nothing left to close
                ray.get(ref, timeout=60)
        end_actors(self._actors, lambda a: a.ready.remote())
        if self._coord is not None:
            self._find_coord()  # another handle may have restarted it
            end_actors([self._coord], lambda a: a.ready.remote())

    def __enter__(self) -> ShardedReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedReplayBuffer(shards={self.shards}, lost={sorted(self._lost)})"


# ---------------------------------------------------------------------- serve
def _create_shard(ray, spawn: dict, i: int):
    opts = dict(spawn["options"], name=spawn["names"][i])
    try:
        return ray.remote(_ShardActor).options(**opts).remote(spawn["kwargs"][i])
    except ValueError as exc:  # e.g. the name is taken
        raise ConfigError(f"serve: Ray could not create replay shard {i}: {exc}") from exc


def _start_shard(ray, spawn: dict, i: int, start_timeout: float | None):
    actor = _create_shard(ray, spawn, i)
    try:
        wait_started(ray, actor, start_timeout, f"replay shard {i}", spawn["req"])
    except BaseException:
        kill_quietly(ray, [actor])
        raise
    return actor


def _start_coord(ray, spawn: dict, counts: list | None, start_timeout: float | None):
    """The rate limiter's coordinator under its Ray name (fresh, or rebuilt from ``counts``)."""
    opts = {"num_cpus": 0, "name": spawn["coord_name"]}
    try:
        coord = (
            ray.remote(_Coordinator)
            .options(**opts)
            .remote(spawn["rate_limit"], len(spawn["names"]), counts)
        )
    except ValueError as exc:  # the name is taken: a live coordinator (or one dying) has it
        raise ConfigError(
            f"Ray could not create the rate limiter {spawn['coord_name']!r}: {exc}"
        ) from exc
    try:
        wait_started(ray, coord, start_timeout, "rate limiter", {})
    except BaseException:
        kill_quietly(ray, [coord])
        raise
    return coord


def serve_sharded(
    obj: ReplayBuffer,
    shards: Any,
    *,
    num_cpus: float = 0,
    name: str | None = None,
    start_timeout: float | None = START_TIMEOUT,
    **actor_options: Any,
) -> ShardedReplayBuffer:
    """``serve(buf, shards=K)``: K shard actors made from ``buf``'s settings (``buf`` must be
    empty: its items are not carried over) and, with a rate limit, one coordinator."""
    _check_sharded_args(obj, shards, num_cpus, name)
    ray = import_ray()
    limit = obj._limiter.cfg if obj._limiter is not None else None
    if obj.config.durable:
        obj.close()  # releases spill_dir; each shard owns spill_dir/shard-i
    opts = {"num_cpus": num_cpus, "scheduling_strategy": "SPREAD", **actor_options}
    actor_class(ray, _ShardActor, opts)  # Ray's objections to the options, before anything runs
    if not ray.is_initialized():
        ray.init()
    req = check_resources(ray, opts, "replay shard")
    k = int(shards)
    prefix = name or f"tt-replay-{uuid.uuid4().hex[:12]}"
    spawn = {
        "options": opts,
        "kwargs": _shard_kwargs(obj.config, k),
        "names": [f"{prefix}-shard-{i}" for i in range(k)],
        "coord_name": f"{prefix}-rate-limiter",
        "req": req,
        "sampler": obj.config.sampler,
        "rate_limit": limit,
        "prefetch": bool(obj.config.prefetch),
        "seed": obj.config.seed,
    }
    actors: list = []
    coord = None
    try:
        for i in range(k):  # all at once: they start in parallel
            actors.append(_create_shard(ray, spawn, i))
        for i, a in enumerate(actors):
            wait_started(ray, a, start_timeout, f"replay shard {i}", req)
        infos = ray.get([a.info.remote() for a in actors])
        if limit is not None:
            coord = _start_coord(ray, spawn, None, start_timeout)
    except BaseException:
        kill_quietly(ray, [*actors, coord])
        raise
    return ShardedReplayBuffer(actors, spawn["names"], [x["node"] for x in infos], spawn, coord)


def _check_sharded_args(obj: object, shards: Any, num_cpus: object, name: object) -> None:
    if not isinstance(obj, ReplayBuffer):
        raise ConfigError(f"serve(shards=K) takes a ReplayBuffer, got {type(obj).__name__}")
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ConfigError(f"shards must be an int >= 1 (buffer actors), got {shards!r}")
    check_local_tiers(obj, f"serve(shards={shards})")
    if len(obj):
        raise ConfigError(
            f"serve(shards={shards}) takes an empty ReplayBuffer as a template (its settings are "
            f"used; its {len(obj)} items would not be carried over); add items through the handle"
        )
    check_num_cpus(num_cpus)
    if name is not None and not isinstance(name, str):
        raise ConfigError(
            f"name must be a str (prefix of the shards' Ray names) or None, got {name!r}"
        )


def _shard_kwargs(c: ReplayConfig, k: int) -> list[dict]:
    """Each shard's ReplayBuffer arguments: 1/k of ``max_items`` and ``host_budget`` (rounded up), a
    seed of its own, a durable shard's own directory ``spill_dir/shard-i``."""
    per_cap = -(-c.max_items // k)
    per_ram = -(-c.host_budget // k)
    out = []
    for i in range(k):
        spill = c.spill_dir
        if c.durable:
            assert spill is not None
            spill = os.path.join(spill, f"shard-{i}")
        out.append(
            {
                "max_items": per_cap,
                "host_budget": per_ram,
                "spill_dir": spill,
                "sampler": c.sampler,
                "max_uses": c.max_uses,
                "durable": c.durable,
                "fsync": c.fsync,
                "seed": None if c.seed is None else c.seed + 1 + i,
                "segment_size": c.segment_size,
            }
        )
    return out
