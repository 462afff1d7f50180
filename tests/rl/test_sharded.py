"""Sharded replay (serve(buf, shards=K)) on a Ray cluster of simulated nodes on this machine."""

import math
import os
import pickle
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from tensortier._ray import end_actors  # noqa: E402
from tensortier.errors import (  # noqa: E402
    ClosedError,
    ConfigError,
    CorruptDataError,
    RateLimitTimeout,
    ShardLostError,
)
from tensortier.rl import Prioritized, RateLimit, ReplayBuffer, serve  # noqa: E402
from tensortier.rl.sharded import ShardedReplayBuffer  # noqa: E402
from tests.ray_cluster import cluster_fixture  # noqa: E402
from tests.rl.test_serve import blocked_round_trip  # noqa: E402

_STORE = 80 << 20  # object store of each simulated node
# shards only on the worker nodes (a tiny custom resource): removing one never kills the driver's
_ON_WORKERS = {"resources": {"shard": 0.01}}
_WAIT = 30.0  # bound of every wait for another thread in these tests (never reached when right)


cluster = cluster_fixture("cluster", "nodes")  # its nodes: one CPU and a shard resource each


def _item(i: int) -> dict:
    return {"obs": np.full(4, i, np.float32), "i": i}


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z=3.719: p = 1e-4."""
    h = 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


# --------------------------------------------------------------------------- exact PER over shards
_N = 30
_PRIOS = np.linspace(0.05, 3.0, _N)  # items 0..14 (low) on shard 0, 15..29 (high) on shard 1


@pytest.fixture(scope="module")
def per_pair(cluster):
    cfg = Prioritized(alpha=0.6, beta=0.4)
    single = ReplayBuffer(100, sampler=cfg, seed=1)
    local = single.extend(_item(i) for i in range(_N))
    single.update_priorities(local, _PRIOS)
    sharded = serve(ReplayBuffer(100, sampler=cfg, seed=2), shards=2, **_ON_WORKERS)
    half = _N // 2
    ids = np.concatenate(
        [
            sharded.extend([_item(i) for i in range(half)], shard=0),
            sharded.extend([_item(i) for i in range(half, _N)], shard=1),
        ]
    )
    sharded.update_priorities(ids, _PRIOS)
    try:
        yield single, sharded, ids
    finally:
        sharded.close()
        single.close()


def test_shards_spread_over_nodes_and_ids_name_their_shard(per_pair, cluster):
    _, sharded, ids = per_pair
    _, workers = cluster
    assert isinstance(sharded, ShardedReplayBuffer) and sharded.shards == 2
    assert sorted(sharded.nodes) == sorted(n.node_id for n in workers)  # one shard per node
    shard, _ = sharded.locate(ids)
    assert (shard[: _N // 2] == 0).all() and (shard[_N // 2 :] == 1).all()
    assert [s["items"] for s in sharded.stats["shards"]] == [_N // 2, _N // 2]
    assert len(sharded) == _N


def test_an_extend_larger_than_a_shard_names_the_shard_capacity(per_pair):
    """The shard refused it as "more than max_items=50" for a buffer made with max_items=100."""
    _, sharded, _ = per_pair
    with pytest.raises(ConfigError, match=r"more than one shard holds \(max_items=50 on each of 2"):
        sharded.extend([_item(0)] * 51)
    assert len(sharded) == _N  # nothing added


def test_sharded_per_frequencies_match_single_buffer_chi_square(per_pair):
    single, sharded, ids = per_pair
    probs = single.priorities(single.indices())
    probs = probs / probs.sum()  # the single buffer's distribution, item i at position i
    pos = {int(g): i for i, g in enumerate(ids)}
    counts = np.zeros(_N)
    for _ in range(50):  # 50 x 2000 = 100k draws
        batch = sharded.sample(2000)
        np.add.at(counts, [pos[int(g)] for g in batch.indices], 1)
        assert (batch.items["i"] == [pos[int(g)] for g in batch.indices]).all()
    crit = _chi2_critical(_N - 1)
    assert _chi2(counts, probs) < crit
    # the test has power: sharding that gave each shard half of every batch is rejected
    mass = probs[: _N // 2].sum()
    halves = np.concatenate([probs[: _N // 2] / mass, probs[_N // 2 :] / (1 - mass)]) / 2
    assert _chi2(counts, halves) > 10 * crit
    # and the single buffer passes the same test
    single_counts = np.zeros(_N)
    for _ in range(50):
        b = single.sample(2000)
        np.add.at(single_counts, b.indices % single.max_items, 1)
    assert _chi2(single_counts, probs) < crit


def test_sharded_is_weights_equal_single_buffer_weights(per_pair):
    single, sharded, ids = per_pair
    pos = {int(g): i for i, g in enumerate(ids)}
    want = {}
    for _ in range(20):
        b = single.sample(256)
        for k, w in zip((b.indices % single.max_items).tolist(), b.weights.tolist()):
            want[k] = w
    got = {}
    for _ in range(20):
        b = sharded.sample(256)
        assert b.weights.dtype == np.float32
        for g, w in zip(b.indices.tolist(), b.weights.tolist()):
            got[pos[g]] = w
    common = sorted(set(want) & set(got))
    assert len(common) >= _N - 2 and {0, _N - 1} <= set(common)  # min and max priority drawn
    assert [got[k] for k in common] == [want[k] for k in common]  # bit-identical
    assert got[0] == 1.0 or want[0] == got[0]


def test_priority_updates_and_deletes_reach_the_owning_shard(cluster, spill_dir):
    tmpl = ReplayBuffer(100, sampler=Prioritized(alpha=1.0), spill_dir=spill_dir, host_budget=256)
    buf = serve(tmpl, shards=2, **_ON_WORKERS)  # items spill: the fixture checks nothing is left
    try:
        with pytest.raises(IndexError, match="empty"):
            buf.sample(1)
        a = buf.extend([_item(i) for i in range(5)], shard=0)
        b = buf.extend([_item(i) for i in range(5, 10)], shard=1)
        ids = np.concatenate([a, b])
        prios = np.arange(1.0, 11.0)
        buf.update_priorities(ids[::-1], prios[::-1])  # mixed order: routed by id, not position
        assert buf.priorities(ids).tolist() == prios.tolist()
        assert [it["i"] for it in buf[ids]] == list(range(10))
        del buf[[int(b[1]), int(a[3]), int(b[4])]]
        assert [s["items"] for s in buf.stats["shards"]] == [4, 3]
        with pytest.raises(ray.exceptions.RayTaskError, match="KeyError"):
            buf[int(b[1])]
        assert buf[int(b[0])]["i"] == 5 and buf[int(a[4])]["i"] == 4
        with pytest.raises(ConfigError, match="priorities"):
            buf.update_priorities(ids[:2], [1.0, float("nan")])
        with pytest.raises(ConfigError, match="shard must be"):
            buf.add(_item(0), shard=2)
        assert sum(s["disk_items"] for s in buf.stats["shards"]) > 0
    finally:
        buf.close()
        tmpl.close()


def test_a_bad_priority_update_never_poisons_a_shard(cluster):
    """Global ids -1 and -2 named local id -1 on a shard: an empty slot got a priority and every
    sample of every learner failed. Overflowing priorities made a shard's total inf. Both refused
    before any shard changes."""
    buf = serve(ReplayBuffer(100, sampler=Prioritized(alpha=1.0)), shards=2, **_ON_WORKERS)
    try:
        ids = np.concatenate([buf.extend([_item(i) for i in range(3)], shard=s) for s in (0, 1)])
        before = buf.priorities(ids).tolist()
        for bad in (-1, -2):
            with pytest.raises(KeyError, match=f"index {bad} was never returned"):
                buf.update_priorities([int(ids[0]), bad], [5.0, 1e6])
        with pytest.raises(ConfigError, match=r"at most 1e\+290"):
            buf.update_priorities(ids[:2], [1.0, 1e308])
        assert buf.priorities(ids).tolist() == before
        for _ in range(3):
            batch = buf.sample(32)
            assert set(batch.indices.tolist()) <= set(ids.tolist())
            assert np.isfinite(batch.weights).all() and (batch.weights > 0).all()
        new = buf.add(_item(9), shard=0)  # new items get the old max priority, not 1e308
        assert buf.priorities([new]).tolist() == [1.0]
    finally:
        buf.close()


def test_collectors_write_to_the_shard_on_their_node(cluster):
    buf = serve(ReplayBuffer(100), shards=2, **_ON_WORKERS)
    try:

        @ray.remote(num_cpus=0.5)
        def collect(b, n: int):
            return [int(b.add(_item(i))) for i in range(n)]

        node = buf.nodes[1]  # (one node: each one's first task starts a worker, seconds)
        pin = NodeAffinitySchedulingStrategy(node, soft=False)
        got = ray.get(collect.options(scheduling_strategy=pin).remote(buf, 4))
        assert buf.locate(got)[0].tolist() == [1, 1, 1, 1]
        # the driver's node has no shard: round-robin over both
        shard, _ = buf.locate([buf.add(_item(i)) for i in range(4)])
        assert sorted(shard.tolist()) == [0, 0, 1, 1]
        assert len(buf) == 8
    finally:
        buf.close()


# --------------------------------------------------------------------------- rate limiting
def test_rate_limiter_counts_over_all_shards(cluster):
    # spi 2, min size 4, error buffer 6: diff = 2*inserts - samples must stay in [2, 14]
    limit = RateLimit(2, min_size_to_sample=4, error_buffer=6, timeout=0)
    buf = serve(ReplayBuffer(100, rate_limit=limit), shards=2, **_ON_WORKERS)
    try:
        ids = [buf.add(_item(i)) for i in range(7)]  # (7 * 2 = 14): the 8th must wait
        assert sorted(np.bincount(buf.locate(ids)[0], minlength=2).tolist()) == [3, 4]
        with pytest.raises(RateLimitTimeout) as err:
            buf.add(_item(7))
        assert err.value.op == "insert" and err.value.inserts == 7
        n = 0
        with pytest.raises(RateLimitTimeout) as err:
            while n < 100:
                buf.sample(1)
                n += 1
        assert n == 12 and err.value.op == "sample"  # diff 14 -> 2
        buf.add(_item(8))  # diff 4: two more samples
        buf.sample(2)
        with pytest.raises(RateLimitTimeout):
            buf.sample(1)
        st = buf.stats["rate_limiter"]
        assert (st["inserts"], st["samples"]) == (8, 14)
        assert (st["insert_timeouts"], st["sample_timeouts"]) == (1, 2)
        assert st["diff_low"] >= limit.min_diff and st["diff_high"] <= limit.max_diff
        with pytest.raises(ConfigError, match="error_buffer"):
            buf.sample(20)  # can never fit the window
    finally:
        buf.close()


def _wait_until(pred) -> None:
    deadline = time.monotonic() + _WAIT
    while not pred():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.01)


def test_blocked_sample_is_released_by_an_insert(cluster):
    """Waits happen on the caller's side (a coordinator call holds at most _CHUNK seconds);
    an insert from another thread releases a blocked sample, a sample a blocked insert."""
    limit = RateLimit(1, min_size_to_sample=2, error_buffer=4, timeout=_WAIT)
    buf = serve(ReplayBuffer(100, rate_limit=limit), shards=2, **_ON_WORKERS)
    try:
        blocked_round_trip(buf, _wait_until)
    finally:
        buf.close()


def test_learner_prefetches_one_batch_ahead(cluster):
    """prefetch: the next batch is drawn while the learner trains, one in flight, never more
    (counted by the shared rate limiter: each call leaves exactly one batch drawn ahead)."""
    limit = RateLimit(100, min_size_to_sample=1, error_buffer=1000, timeout=_WAIT)
    tmpl = ReplayBuffer(100, rate_limit=limit, prefetch=2, sampler=Prioritized())
    buf = serve(tmpl, shards=2, **_ON_WORKERS)
    try:
        buf.extend([_item(i) for i in range(10)])
        for k in range(1, 4):
            batch = buf.sample(4)
            assert len(batch) == 4 and set(batch.items["i"].tolist()) <= set(range(10))
            _wait_until(lambda: buf._next[1].done())
            assert buf.stats["rate_limiter"]["samples"] == 4 * (k + 1)
        batch = buf.sample(3)  # another size: the batch of 4 drawn ahead is dropped
        assert len(batch) == 3
    finally:
        buf.close()


# --------------------------------------------------------------------------- lost shards
def test_killed_shard_is_reported_and_the_others_keep_serving(cluster):
    buf = serve(ReplayBuffer(100, sampler=Prioritized()), shards=2, **_ON_WORKERS)
    try:
        a = buf.extend([_item(i) for i in range(5)], shard=0)
        b = buf.extend([_item(i) for i in range(5, 10)], shard=1)
        _kill(buf._actors[0])
        with pytest.raises(ShardLostError) as err:
            buf[int(a[0])]
        assert err.value.shard == 0 and err.value.node == buf.nodes[0]
        assert 0 in buf.stats["lost_shards"] and buf.stats["shards"][0] is None
        for _ in range(5):  # continued service from shard 1
            batch = buf.sample(8)
            assert set(buf.locate(batch.indices)[0].tolist()) == {1}
        with pytest.raises(ShardLostError):
            buf.update_priorities(np.concatenate([a[:1], b[:1]]), [2.0, 3.0])
        assert buf.priorities(b[:1]).tolist() == [3.0**0.6]  # the live shard's part applied
        new = buf.extend([_item(10)])
        assert buf.locate(new)[0].tolist() == [1] and len(buf) == 6
        other = pickle.loads(pickle.dumps(buf))  # what a collector holds
        with pytest.raises(ShardLostError):
            other.add(_item(11), shard=0)
        buf.restart_shard(0)  # not durable: back, empty
        assert buf.stats["lost_shards"] == {} and len(buf) == 6
        assert other.locate(other.add(_item(11), shard=0))[0].tolist() == [0]  # found by name
        assert other.stats["lost_shards"] == {} and len(other) == 7
    finally:
        buf.close()


def test_a_lost_rate_limiter_is_rebuilt_from_the_shards_counters(cluster):
    """The coordinator was a single point of failure: once dead, every add and sample raised
    ClosedError for good and the shards' items were stranded. The shards count what they took
    and gave; restart_rate_limiter() (or restart_shard) rebuilds it from those counts."""
    limit = RateLimit(1, min_size_to_sample=2, error_buffer=8, timeout=0.5)
    buf = serve(ReplayBuffer(100, rate_limit=limit), shards=2, **_ON_WORKERS)
    other = pickle.loads(pickle.dumps(buf))  # what a collector holds
    try:
        buf.extend([_item(i) for i in range(6)], shard=0)
        buf.extend([_item(i) for i in range(6, 10)], shard=1)
        buf.sample(4)
        buf.sample(3)
        _kill(buf._coord)
        with pytest.raises(ClosedError, match="restart_rate_limiter"):
            buf.add(_item(10))
        with pytest.raises(ClosedError, match="restart_rate_limiter"):
            other.sample(1)
        buf.restart_rate_limiter()
        st = buf.stats["rate_limiter"]
        assert (st["inserts"], st["samples"], st["size"]) == (10, 7, 10)
        # still limiting where it left off: diff 10 - 7 = 3, min_diff 2 - 8 = -6
        assert len(buf.sample(9)) == 9
        with pytest.raises(RateLimitTimeout):
            buf.sample(1, timeout=0.2)
        other.add(_item(10))  # the collector's copy finds the new coordinator by its name
        assert len(buf.sample(1)) == 1  # released by that insert
        # coordinator and a non-durable shard lost together: restart_shard rebuilds both
        _kill(buf._coord)
        _kill(buf._actors[0])
        buf.restart_shard(0)
        st = buf.stats["rate_limiter"]
        assert st["size"] == len(buf) == st["inserts"] > 0  # shard 1's items, still there
        assert 0 <= st["samples"] <= 17  # shard 1's share of the 17 drawn; shard 0's went with it
        # the limiter goes on from shard 1's counts: inserting until diff leaves room for one
        for k in range(max(0, st["samples"] - st["inserts"] - 5)):
            other.add(_item(11 + k))
        assert len(buf.sample(1)) == 1
    finally:
        buf.close()


def _kill(actor) -> None:
    """Kill a shard's process and wait until Ray reports it dead (ray.kill is asynchronous)."""
    end_actors([actor], lambda a: a.ready.remote())


class _Evil:
    """Unpickling this creates ``marker`` (builtins.open): proof that something unpickled."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_durable_shard_restarted_reloads_every_acknowledged_item(cluster, tmp_path):
    d = tmp_path / "durable"
    tmpl = ReplayBuffer(100, spill_dir=d, durable=True, host_budget="4KiB", sampler=Prioritized())
    buf = serve(tmpl, shards=2, **_ON_WORKERS)
    try:
        acked = {}
        for i in range(40):  # single adds and batches, both shards, some spilled to disk
            if i % 4 == 0:
                ids = buf.extend([_item(1000 + i + k) for k in range(3)])
                acked.update({int(g): 1000 + i + k for k, g in enumerate(ids)})
            else:
                acked[int(buf.add(_item(i)))] = i
        assert {"shard-0", "shard-1"} <= set(os.listdir(d))
        _kill(buf._actors[0])  # the process dies: no checkpoint, no close
        with pytest.raises(ShardLostError):
            buf[list(acked)]
        buf.restart_shard(0)
        keys = list(acked)
        assert [it["i"] for it in buf[keys]] == [acked[k] for k in keys]
        assert len(buf) == len(acked)
        batch = buf.sample(64)
        assert {int(g) for g in batch.indices} <= set(acked)
    finally:
        buf.close()
    # reopened as a whole from the directories: the same items; a planted pickle is refused
    again = serve(
        ReplayBuffer(100, spill_dir=d, durable=True, sampler=Prioritized()),
        shards=2,
        **_ON_WORKERS,
    )
    try:
        assert [it["i"] for it in again[keys]] == [acked[k] for k in keys]
    finally:
        again.close()
    _Evil.marker = str(tmp_path / "unpickled")
    state = d / "shard-0" / "state.npz"
    z = dict(np.load(state))
    z["keys"] = np.array([_Evil()], dtype=object)
    np.savez(state, **z)  # savez pickles object arrays; a shard must never unpickle them
    with pytest.raises(CorruptDataError):
        serve(
            ReplayBuffer(100, spill_dir=d, durable=True, sampler=Prioritized()),
            shards=2,
            **_ON_WORKERS,
        )
    assert not os.path.exists(_Evil.marker)


def test_lost_node_is_reported_and_the_other_node_keeps_serving(cluster):
    c, workers = cluster
    buf = serve(ReplayBuffer(100), shards=2, **_ON_WORKERS)
    try:
        ids = [buf.extend([_item(i) for i in range(4)], shard=s) for s in range(2)]
        doomed = next(n for n in workers if n.node_id == buf.nodes[1])
        pid = ray.get(buf._actors[1].info.remote(), timeout=_WAIT)["pid"]
        c.remove_node(doomed, allow_graceful=False)
        # A lost machine loses its processes with it; a simulated node's raylet dies at once but
        # its worker process exits only when it notices, and until then it still answers direct
        # actor calls (a fresh-clone CI run read the item back from it under load).
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_until(
            lambda: not any(n["NodeID"] == doomed.node_id and n["Alive"] for n in ray.nodes())
        )
        with pytest.raises(ShardLostError, match=doomed.node_id) as err:
            buf[int(ids[1][0])]
        assert err.value.node == doomed.node_id
        assert [it["i"] for it in buf[ids[0]]] == [0, 1, 2, 3]
        assert set(buf.locate(buf.sample(16).indices)[0].tolist()) == {0}
        assert buf.locate(buf.extend([_item(9)]))[0].tolist() == [0]
    finally:
        buf.close()
        workers[workers.index(doomed)] = c.add_node(
            num_cpus=1, object_store_memory=_STORE, resources={"shard": 1}
        )


def test_bad_arguments_are_config_errors(cluster):
    with pytest.raises(ConfigError, match="shards must be"):
        serve(ReplayBuffer(10), shards=0)
    full = ReplayBuffer(10)
    full.add(_item(0))
    with pytest.raises(ConfigError, match="empty ReplayBuffer"):
        serve(full, shards=2)
