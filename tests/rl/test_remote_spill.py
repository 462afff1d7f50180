"""Replay buffer and memory bank spilling RAM -> remote pool -> disk, on a Ray cluster of
simulated nodes on this machine (one cluster for the module, tiny items)."""

import warnings
from concurrent.futures import Future

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier.errors import ConfigError, NodeLostError, TierFullError  # noqa: E402
from tensortier.rl import MemoryBank, Prioritized, ReplayBuffer  # noqa: E402
from tensortier.rl._remote_spill import RemoteSpill  # noqa: E402
from tensortier.tiers.remote import RemoteStore  # noqa: E402
from tests.ray_cluster import cluster_fixture  # noqa: E402

_STORE = 96 << 20


cluster = cluster_fixture("cluster", "workers")


def _items(n: int, size: int = 20_000, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"obs": rng.integers(0, 256, size + i, dtype=np.uint8), "i": i, "t": torch.full((3,), i)}
        for i in range(n)
    ]


def _same(got: dict, want: dict) -> bool:
    return (
        got["obs"].dtype == want["obs"].dtype
        and got["obs"].tobytes() == want["obs"].tobytes()
        and got["i"] == want["i"]
        and torch.equal(got["t"], want["t"])
    )


def test_spill_to_remote_then_disk_keeps_every_item_bit_exact(cluster, tmp_path):
    """A pool too small for the overflow: the oldest RAM items go to the pool, the rest to disk;
    every item reads back bit-exact from wherever it lives, and freeing reaches the pool."""
    sent = []
    with RemoteStore("640KiB", timeout=30) as pool:
        real_put = pool.put

        def put(t):  # what crosses to the memory nodes: flat uint8 tensors, never objects
            sent.append((t.dtype, t.dim()))
            return real_put(t)

        pool.put = put
        items = _items(60)
        buf = ReplayBuffer(
            64,
            host_budget="160KiB",
            tier="remote",
            remote=pool,
            spill_dir=tmp_path,
            sampler=Prioritized(),
            seed=0,
        )
        keys = [buf.add(it) for it in items[:20]]
        for i in range(20, 60, 8):
            keys += buf.extend(items[i : i + 8]).tolist()
        st = buf.stats
        assert st["remote_items"] > 0 and st["disk_items"] > 0 and st["ram_items"] > 0
        assert st["remote_items"] + st["disk_items"] + st["ram_items"] == 60
        assert len(pool) > 0 and set(sent) == {(torch.uint8, 1)}
        for k, it in zip(keys, items):
            assert _same(buf[k], it)
        batch = buf.sample(40)
        assert not batch.collated  # (items of different lengths)
        for got, k in zip(batch.items, batch.indices.tolist()):
            assert keys[got["i"]] == k and _same(got, items[got["i"]])
        assert buf.stats["remote_reads"] > 0
        far = [k for k in keys if k % 64 in buf._store.rspill.loc]
        buf.delete(far)  # their batches are freed in the pool
        assert buf.stats["remote_items"] == 0 and len(pool) == 0
        for k, it in zip(keys, items):
            if k not in far:
                assert _same(buf[k], it)
        buf.close()
        assert len(pool) == 0 and not pool.closed  # the pool is the caller's


def test_save_fetches_remote_items(cluster, tmp_path):
    with RemoteStore("4MiB", timeout=30) as pool:
        items = _items(24)
        buf = ReplayBuffer(32, host_budget="64KiB", tier="remote", remote=pool)
        keys = buf.extend(items).tolist()
        assert buf.stats["remote_items"] > 0
        buf.save(tmp_path / "s")
        buf.close()
        assert len(pool) == 0
        back = ReplayBuffer.load(tmp_path / "s")
        assert back.indices().tolist() == keys
        assert all(_same(g, it) for g, it in zip(back[keys], items))
        back.close()


def test_node_loss_drops_its_items_counts_them_and_sampling_goes_on(cluster, tmp_path):
    c, _ = cluster
    doomed = c.add_node(num_cpus=0, object_store_memory=_STORE)
    pool = RemoteStore("8MiB", nodes=[doomed.node_id], timeout=30)
    try:
        items = _items(48)
        buf = ReplayBuffer(
            64, host_budget="256KiB", tier="remote", remote=pool, spill_dir=tmp_path, seed=1
        )
        keys = buf.extend(items[:24]).tolist() + buf.extend(items[24:]).tolist()
        remote = buf.stats["remote_items"]
        assert remote > 0
        c.remove_node(doomed, allow_graceful=False)
        seen = set()
        for _ in range(30):  # draws that hit lost items drop them and draw again, never hang
            seen.update(g["i"] for g in buf.sample(16).items)
        st = buf.stats
        assert st["lost_items"] > 0 and len(buf) == 48 - st["lost_items"]
        assert st["remote_items"] == remote - st["lost_items"]
        alive = set(buf.indices().tolist())
        for k, it in zip(keys, items):
            if k in alive:
                assert _same(buf[k], it)
            else:
                with pytest.raises(KeyError):
                    buf[k]
        buf.close()
    finally:
        pool.close()


def test_memory_bank_spills_to_the_pool_and_reports_a_lost_node(cluster, tmp_path):
    c, _ = cluster
    doomed = c.add_node(num_cpus=0, object_store_memory=_STORE)
    pool = RemoteStore("8MiB", nodes=[doomed.node_id], timeout=30)
    try:
        bank = MemoryBank(40, host_budget="64KiB", tier=["remote"], remote=pool)
        items = _items(30)
        keys = bank.extend(items).tolist()
        assert bank.stats["remote_items"] > 0
        # (no read before the loss: a read leaves a copy on this node, which Ray then serves)
        far = [k for k in keys if k % 40 in bank._store.rspill.loc]
        c.remove_node(doomed, allow_graceful=False)
        with pytest.raises(NodeLostError, match=doomed.node_id):
            bank.get_many(far)
        assert bank.stats["lost_items"] > 0 and len(bank) == 30 - bank.stats["lost_items"]
        bank.close()
    finally:
        pool.close()


def test_remote_only_spill_with_a_full_pool_is_tier_full_and_loses_nothing(cluster):
    with RemoteStore("100KiB", timeout=30) as pool:
        bank = MemoryBank(40, host_budget="64KiB", tier=["remote"], remote=pool)
        items = _items(30)
        keys = [bank.append(it) for it in items[:3]]
        with pytest.raises(TierFullError, match="remote"):
            for it in items[3:]:
                keys.append(bank.append(it))
        assert all(_same(bank[k], it) for k, it in zip(keys, items))
        bank.close()


def test_bad_tier_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="remote=tt.tiers.RemoteStore"):
        ReplayBuffer(8, tier="remote")
    with pytest.raises(ConfigError, match="tier must be"):
        ReplayBuffer(8, tier=["disk", "remote"])
    with pytest.raises(ConfigError, match="remote= is given"):
        MemoryBank(8, remote=object())


class _Nodes:
    """A store putting object i on node ``node-{i % 3}``; gets of a lost node's objects fail."""

    def __init__(self):
        self.held: dict[int, tuple[str, torch.Tensor]] = {}
        self.lost: set[str] = set()

    def put(self, t: torch.Tensor) -> Future:
        h = len(self.held)
        self.held[h] = (f"node-{h % 3}", t.clone())
        return _done(h)

    def get(self, h: int) -> Future:
        node, t = self.held[h]
        if node in self.lost:
            return _done(exc=NodeLostError(f"{node} was lost", node=node))
        return _done(t)

    def free(self, h: int) -> None:
        del self.held[h]


def _done(value=None, exc: BaseException | None = None) -> Future:
    f: Future = Future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(value)
    return f


def test_a_read_from_two_lost_nodes_names_both():
    # The error named only the first lost node, though items on both were dropped.
    store = _Nodes()
    spill = RemoteSpill(store, group_bytes=4)  # one 4-byte item per object: objects 0, 1, 2
    assert spill.put([10, 11, 12], [b"aaaa", b"bbbb", b"cccc"]) == []
    store.lost = {"node-0", "node-2"}
    with pytest.raises(NodeLostError, match=r"node-0.*node-2") as err:
        spill.read([10, 11, 12])
    assert sorted(err.value.lost) == [10, 12] and err.value.nodes == ("node-0", "node-2")
    assert spill.read([11]) == [b"bbbb"]


def test_a_closed_pool_drops_its_items_once_and_the_buffer_goes_on(cluster, tmp_path):
    # Every sample raised ClosedError forever once the caller closed the pool under the buffer.
    pool = RemoteStore("4MiB", timeout=30)
    items = _items(24)
    anneal = Prioritized(beta=0.0, beta_final=1.0, beta_steps=100)
    buf = ReplayBuffer(
        64, host_budget="64KiB", tier="remote", remote=pool, spill_dir=tmp_path, sampler=anneal
    )
    keys = buf.extend(items).tolist()
    far = {k for k in keys if k % 64 in buf._store.rspill.loc}
    remote = buf.stats["remote_items"]
    assert 0 < remote == len(far) < 24
    pool.close()
    with pytest.warns(RuntimeWarning, match="Close the ReplayBuffer before its RemoteStore"):
        buf.sample(8)
    st = buf.stats
    assert st["lost_items"] == remote and st["remote_items"] == 0 and len(buf) == 24 - remote
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per sample
        for _ in range(3):
            assert not far & set(buf.sample(8).indices.tolist())
        more = buf.extend(_items(24, seed=1)).tolist()  # later spills go to disk
    assert buf.beta == pytest.approx(0.04)  # four sample() calls: the failed draw not counted
    assert buf.stats["disk_items"] > 0 and len(buf) == 48 - remote
    alive = set(buf.indices().tolist())
    assert alive == (set(keys) - far) | set(more)
    assert all(_same(buf[k], it) for k, it in zip(keys, items) if k in alive)
    buf.close()


def test_a_closed_pool_is_named_by_bank_reads_and_remote_only_spills(cluster):
    pool = RemoteStore("4MiB", timeout=30)
    bank = MemoryBank(64, host_budget="64KiB", tier=["remote"], remote=pool)
    items = _items(24)
    keys = bank.extend(items).tolist()
    far = [k for k in keys if k % 64 in bank._store.rspill.loc]
    pool.close()
    with pytest.warns(RuntimeWarning), pytest.raises(NodeLostError, match="RemoteStore was closed"):
        bank.get_many(far)
    with pytest.raises(KeyError):  # dropped, as items of a lost node
        bank.get_many(far[:1])
    assert bank.stats["lost_items"] == len(far)
    with pytest.raises(TierFullError, match="been closed"):
        bank.extend(_items(24, seed=1))
    bank.close()


def test_sequence_sampling_after_a_loss_draws_again(cluster, tmp_path):
    # sample(seq_len=) raised the NodeLostError of the items it met (plain sample() drew again).
    pool = RemoteStore("4MiB", timeout=30)
    items = _items(24)
    anneal = Prioritized(beta=0.0, beta_final=1.0, beta_steps=100)
    buf = ReplayBuffer(
        64, host_budget="64KiB", tier="remote", remote=pool, spill_dir=tmp_path, sampler=anneal
    )
    for i, it in enumerate(items):
        buf.add(it, episode=i // 6, step=i % 6, version=1)
    assert buf.stats["remote_items"] > 0
    pool.close()  # every item in the pool is lost
    with pytest.warns(RuntimeWarning, match="are lost"):
        batch = buf.sample(4, seq_len=2)
    assert batch.indices.shape == (4, 2) and buf.stats["lost_items"] > 0
    assert buf.beta == pytest.approx(0.01)  # one sample() call
    alive = set(buf.indices().tolist())
    assert set(batch.indices.ravel().tolist()) <= alive
    buf.close()
