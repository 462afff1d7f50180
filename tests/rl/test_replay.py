import os

import numpy as np
import pytest
import torch

from tensortier._device import rss_bytes
from tensortier.errors import ClosedError, ConfigError, SpillDirError
from tensortier.rl import Prioritized, ReplayBuffer


def item(i: int, size: int = 100) -> dict:
    return {"obs": np.full(size, i, np.float32), "i": i}


def spilled(spill_dir: str, **kw) -> ReplayBuffer:
    """A buffer whose RAM holds only a handful of items, so most live on disk."""
    kw.setdefault("ram_budget", "4KiB")
    kw.setdefault("segment_size", "16KiB")
    return ReplayBuffer(kw.pop("capacity", 64), spill_dir=spill_dir, **kw)


def test_fifo_eviction_order(spill_dir):
    buf = spilled(spill_dir, capacity=10)
    keys = [buf.add(item(i)) for i in range(25)]
    assert len(buf) == 10
    assert [buf[k]["i"] for k in buf.indices()] == list(range(15, 25))
    for k in keys[:15]:
        assert k not in buf
        with pytest.raises(KeyError, match="evicted"):
            buf[k]
    assert buf.stats["evicted_items"] == 15
    # deleting frees room: the next add evicts nothing
    del buf[keys[20]]
    buf.add(item(99))
    assert len(buf) == 10 and keys[15] in buf
    buf.close()


def test_indices_are_never_reused():
    buf = ReplayBuffer(2)
    a = buf.add(item(0))
    del buf[a]
    b = buf.add(item(1))
    assert a != b and a not in buf and buf[b]["i"] == 1
    buf.close()


@pytest.mark.parametrize("where", ["ram", "disk"])
def test_get_update_delete_by_index(spill_dir, where):
    buf = spilled(spill_dir, ram_budget="4KiB" if where == "disk" else "1MiB")
    keys = [buf.add(item(i)) for i in range(40)]
    k = keys[3]
    assert (buf._store.ram[k % 64] is None) == (where == "disk")
    got = buf[k]
    assert got["i"] == 3 and (got["obs"] == 3).all()
    buf.update(k, {"obs": np.arange(7, dtype=np.int16), "extra": b"x"})  # another shape
    got = buf[k]
    assert got["obs"].dtype == np.int16 and got["obs"].tolist() == list(range(7))
    assert got["extra"] == b"x"
    many = buf[[keys[0], keys[39], keys[5]]]
    assert [m["i"] for m in many] == [0, 39, 5]
    del buf[k]
    assert k not in buf and len(buf) == 39
    with pytest.raises(KeyError):
        buf[k]
    with pytest.raises(KeyError):
        del buf[k]
    buf.close()


def test_variable_items_round_trip_exactly_through_disk(spill_dir):
    rng = np.random.default_rng(0)
    buf = spilled(spill_dir, capacity=200)
    items = []
    for i in range(120):
        shape = tuple(rng.integers(0, 9, size=rng.integers(0, 4)))
        dt = ["<f4", "<f8", "|u1", "<i8", "|b1", "<f2"][i % 6]
        a = rng.integers(0, 255, size=shape).astype(dt)
        it = {"a": a, "t": torch.randn(i % 5, 3).to(torch.bfloat16), "b": bytes(i % 17), "n": i}
        items.append((buf.add(it), it))
    assert buf.stats["disk_items"] > 100
    for k, it in items:
        got = buf[k]
        assert got["a"].dtype == it["a"].dtype and got["a"].shape == it["a"].shape
        assert got["a"].tobytes() == it["a"].tobytes()
        assert torch.equal(got["t"].view(torch.int16), it["t"].view(torch.int16))
        assert got["b"] == it["b"] and got["n"] == it["n"]
    batch = buf.sample(50)  # mixed shapes: a list, not collated
    assert not batch.collated and len(batch.items) == 50
    buf.close()


def test_sample_reads_ram_and_disk_and_collates(spill_dir):
    buf = spilled(spill_dir, capacity=100, seed=1)
    keys = np.array([buf.add(item(i)) for i in range(100)])
    batch = buf.sample(64)
    assert batch.collated and batch.items["obs"].shape == (64, 100)
    ids = batch.items["i"]
    assert (batch.items["obs"][:, 0] == ids).all()
    assert (keys[ids] == batch.indices).all()
    assert buf.stats["disk_reads"] > 0
    buf.close()


def test_compaction_gives_space_back(spill_dir):
    buf = spilled(spill_dir, capacity=400)
    keys = [buf.add(item(i)) for i in range(400)]
    before = buf.stats["disk_file_bytes"]
    del buf[keys[:300:2]]
    del buf[keys[1:300:2]]
    after = buf.stats
    assert after["disk_file_bytes"] < before / 2
    assert all(buf[k]["i"] == i for i, k in enumerate(keys) if i >= 300)
    buf.close()


def test_max_uses_removes_items_after_n_draws():
    buf = ReplayBuffer(50, max_uses=3, seed=0)
    buf.extend(item(i) for i in range(20))
    seen: dict[int, int] = {}
    while len(buf):
        for k in buf.sample(7).indices.tolist():
            seen[k] = seen.get(k, 0) + 1
    assert len(seen) == 20
    assert all(v >= 3 for v in seen.values())
    # draws within one batch may repeat an item, so at most batch_size - 1 extra uses
    assert all(v <= 3 + 6 for v in seen.values())
    with pytest.raises(IndexError, match="empty"):
        buf.sample(1)
    buf.close()


def test_max_uses_exact_with_batch_of_one():
    buf = ReplayBuffer(10, max_uses=2, seed=0)
    k = buf.add(item(0))
    assert buf.sample(1).indices[0] == k
    assert k in buf
    buf.sample(1)
    assert k not in buf
    buf.close()


def test_bad_input_is_refused_and_changes_nothing():
    with pytest.raises(ConfigError, match="capacity"):
        ReplayBuffer(0)
    with pytest.raises(ConfigError, match="ram_budget"):
        ReplayBuffer(4, ram_budget="lots")
    buf = ReplayBuffer(8, sampler=Prioritized(), seed=0)
    keys = buf.extend(item(i) for i in range(4))
    before = buf.priorities(keys).copy()
    for prios, err in [
        ([1.0, 2.0], ValueError),  # wrong shape
        ([[1.0], [2.0], [3.0], [4.0]], ValueError),
        ([1.0, -2.0, 1.0, 1.0], ValueError),  # negative
        ([1.0, np.nan, 1.0, 1.0], ValueError),  # NaN
        ([1.0, np.inf, 1.0, 1.0], ValueError),
    ]:
        with pytest.raises(err):
            buf.update_priorities(keys, prios)
    with pytest.raises(KeyError, match="never"):
        buf.update_priorities(np.append(keys[:3], 10**9), [1.0] * 4)  # unknown index
    np.testing.assert_array_equal(buf.priorities(keys), before)
    with pytest.raises(KeyError):
        buf[12345]
    with pytest.raises(KeyError):
        del buf[[int(keys[0]), 777]]  # all or nothing
    assert len(buf) == 4
    with pytest.raises(ConfigError):
        buf.sample(0)
    with pytest.raises(TypeError):
        buf.add({"o": np.array([None])})
    assert len(buf) == 4
    buf.close()
    with pytest.raises(ClosedError):
        buf.add(item(0))


def test_stale_priority_updates_are_skipped():
    buf = ReplayBuffer(4, sampler=Prioritized(), seed=0)
    buf.extend(item(i) for i in range(4))
    batch = buf.sample(4)
    buf.extend(item(i) for i in range(4))  # evicts everything sampled
    buf.update_priorities(batch.indices, np.ones(4))
    assert buf.stats["stale_updates"] == 4
    buf.close()


def test_bad_spill_dir(tmp_path):
    buf = ReplayBuffer(2, ram_budget="1KiB", spill_dir=tmp_path / "missing", sampler=Prioritized())
    small = buf.add(item(0, size=10))  # fits in RAM: no spill directory needed yet
    with pytest.raises(SpillDirError, match="mkdir"):
        buf.add(item(1, size=1000))  # too big for RAM, and the spill directory is missing
    assert len(buf) == 1 and buf.indices().tolist() == [small]  # the failed add left nothing
    assert buf.sample(4).indices.tolist() == [small] * 4
    (tmp_path / "missing").mkdir()
    k = buf.add(item(2, size=1000))  # fixed: the same request now succeeds
    assert buf[k]["i"] == 2 and buf[small]["i"] == 0
    buf.close()


def test_prefetch_delivers_batches():
    buf = ReplayBuffer(100, prefetch=2, sampler=Prioritized(), seed=0)
    buf.extend(item(i) for i in range(50))
    for _ in range(10):
        b = buf.sample(16)
        assert len(b) == 16 and b.collated
        buf.update_priorities(b.indices, np.ones(16) * 2)
    buf.close()


def test_save_load_restores_items_and_distribution(spill_dir, tmp_path):
    buf = spilled(spill_dir, capacity=64, sampler=Prioritized(alpha=0.8), max_uses=100, seed=3)
    keys = np.array([buf.add(item(i)) for i in range(80)])[16:]
    buf.update_priorities(keys, np.arange(1, 65, dtype=float))
    buf.sample(8)
    buf.save(tmp_path / "saved")
    assert not any(f.endswith(".pkl") for f in os.listdir(tmp_path / "saved"))
    new = ReplayBuffer.load(tmp_path / "saved", spill_dir=spill_dir, ram_budget="8KiB")
    assert len(new) == len(buf) == 64
    np.testing.assert_array_equal(new.indices(), buf.indices())
    np.testing.assert_allclose(new.priorities(keys), buf.priorities(keys))
    np.testing.assert_array_equal(new._uses, buf._uses)
    for k in keys[::7]:
        a, b = new[int(k)], buf[int(k)]
        assert a["i"] == b["i"] and a["obs"].tobytes() == b["obs"].tobytes()
    k2 = new.add(item(1000))  # keys continue, no reuse
    assert k2 > keys.max()
    buf.close()
    new.close()


@pytest.mark.slow
def test_rss_stays_under_budget_while_storing_10x(spill_dir):
    budget = 64 << 20
    buf = ReplayBuffer(100_000, ram_budget=budget, spill_dir=spill_dir, segment_size="32MiB")
    payload = np.random.default_rng(0).integers(0, 255, 10_000, dtype=np.uint8)
    base = rss_bytes()
    peak = 0
    for start in range(0, 65_000, 1000):  # 65k x 10 KB = 650 MB, 10x the budget
        buf.extend({"obs": payload, "i": i} for i in range(start, start + 1000))
        peak = max(peak, rss_bytes() - base)
    assert buf.stats["disk_items"] > 55_000
    assert buf.stats["ram_bytes"] <= budget
    # budget + index (~40 B/slot x 100k) + transient batch buffers; far below the 650 MB stored
    assert peak < budget + (32 << 20), f"RSS grew by {peak / 2**20:.0f} MiB"
    got = buf[int(buf.indices()[0])]
    assert got["i"] == 0 and (got["obs"] == payload).all()
    buf.close()
