"""RAM copies of items as slices of arena chunks: one copy in, freed slices reused, bit-exact."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.rl import MemoryBank, Prioritized, ReplayBuffer, _store
from tensortier.rl._arena import Arena
from tensortier.tiers import itemcodec as _codec


@pytest.fixture(autouse=True)
def _arena_on(monkeypatch):
    monkeypatch.setattr(_store, "USE_ARENA", True)


def test_arena_off_keeps_bytes_objects(monkeypatch):
    monkeypatch.setattr(_store, "USE_ARENA", False)
    buf = ReplayBuffer(4, ram_budget="1MiB")
    k = buf.add({"x": np.arange(10)})
    assert buf._store.addr[k % 4] < 0 and type(buf._store.ram[k % 4]) is bytes
    assert buf[k]["x"].tolist() == list(range(10))
    buf.close()


def test_arena_reuses_freed_slices_of_the_same_size_lifo():
    a = Arena(4096, 8192)
    x, y = a.alloc(100), a.alloc(100)
    assert (x, y) == (0, 128)  # rounded to 64 bytes
    a.release(x, 100)
    a.release(y, 100)
    assert a.alloc(110) == y  # same rounded size: the last freed comes back first
    assert a.alloc(200) == 256  # another size: new space
    assert a.alloc(5000) == -1  # larger than a chunk
    assert a.alloc(4000) == 4096 and a.footprint == 8192
    assert a.alloc(4000) == -1  # a third chunk would pass the limit


def test_pinned_arena_defers_reuse_until_unpinned():
    a = Arena(4096, 8192)
    addr, view = a.put([b"abc", b"def"], 6)
    a.pin()
    a.release(addr, 6)
    other = a.alloc(6)
    assert other != addr and bytes(view) == b"abcdef"  # a save still reading it sees its bytes
    a.unpin()
    assert a.alloc(6) == addr


def test_blobs_handed_out_are_copies_not_views_of_reused_slices():
    """``blobs`` is read after the lock is released: a slot reused meanwhile must not change it."""
    buf = ReplayBuffer(4, ram_budget="1MiB")
    keys = [buf.add(np.full(100, i, np.uint8)) for i in range(4)]
    store = buf._store
    assert (store.addr[np.asarray(keys) % 4] >= 0).all()  # in the arena
    got = store.blobs(np.asarray(keys) % 4)
    before = [bytes(b) for b in got]
    for i in range(4):  # evicts all four; their slices are reused by the new items
        buf.add(np.full(100, 50 + i, np.uint8))
    assert [bytes(b) for b in got] == before
    assert [int(_codec.decode(b)[0]) for b in got] == [0, 1, 2, 3]
    buf.close()


def test_buffer_at_capacity_writes_into_reused_slices():
    """Steady state: FIFO eviction frees slices, new items of the same size reuse them, so the
    arena does not grow past what capacity items need."""
    buf = ReplayBuffer(16, ram_budget="1MiB", sampler=Prioritized())
    rng = np.random.default_rng(0)
    for i in range(16):
        buf.add({"obs": rng.integers(0, 255, 1000, dtype=np.uint8), "i": i})
    arena = buf._store.arena
    top, chunks = arena.top, len(arena.chunks)
    items = [{"obs": rng.integers(0, 255, 1000, dtype=np.uint8), "i": 100 + i} for i in range(64)]
    for i in range(0, 64, 8):
        buf.extend(items[i : i + 8])
    for i in range(64, 80):
        buf.add({"obs": items[i % 64]["obs"], "i": 100 + i})
    assert (arena.top, len(arena.chunks)) == (top, chunks)
    got = buf[buf.indices()]
    assert [g["i"] for g in got] == list(range(164, 180))
    assert all(
        g["obs"].tobytes() == items[i % 64]["obs"].tobytes() for i, g in zip(range(64, 80), got)
    )
    st = buf.stats
    assert st["ram_items"] == 16 and st["ram_bytes"] == 16 * Arena.cost(len(_codec.encode(got[0])))
    buf.close()


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_extend_equals_repeated_add_in_the_arena_with_eviction_and_spill(spill_dir, chunk):
    rng = np.random.default_rng(1)
    items = [
        {"obs": rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32), "i": i}
        for i in range(200)
    ]
    kw = dict(ram_budget="64KiB", spill_dir=spill_dir, sampler=Prioritized(alpha=0.7), seed=1)
    a, b = ReplayBuffer(96, **kw), ReplayBuffer(96, **kw)
    ka = [a.add(it) for it in items]
    kb = []
    for i in range(0, len(items), chunk):
        kb += b.extend(items[i : i + chunk]).tolist()
    assert ka == kb
    for buf in (a, b):
        st = buf.stats
        assert st["spilled_items"] > 0 and st["evicted_items"] == 200 - 96
        assert st["ram_bytes"] <= buf.config.ram_budget
        assert buf._store.arena.footprint <= buf.config.ram_budget
        got = buf[buf.indices()]
        assert [g["i"] for g in got] == list(range(104, 200))
        assert all(g["obs"].tobytes() == items[g["i"]]["obs"].tobytes() for g in got)
    a.close()
    b.close()


def test_durable_round_trip_with_arena(tmp_path):
    """Durable buffers keep their format (items are joined and written through; their RAM copies
    stay bytes objects), next to a non-durable buffer's arena."""
    d = str(tmp_path / "rb")
    items = [{"obs": np.arange(i, i + 64, dtype=np.int64), "r": float(i)} for i in range(40)]
    buf = ReplayBuffer(32, durable=True, spill_dir=d, ram_budget="64KiB")
    keys = [buf.add(it) for it in items[:20]] + buf.extend(items[20:]).tolist()
    assert buf.stats["disk_items"] == 32
    buf.close()
    back = ReplayBuffer(32, durable=True, spill_dir=d, ram_budget="64KiB")
    assert back.indices().tolist() == keys[-32:]
    for it, got in zip(items[8:], back[keys[-32:]]):
        assert got["obs"].tobytes() == it["obs"].tobytes() and got["r"] == it["r"]
    back.close()


def test_save_and_load_while_arena_slices_are_reused(tmp_path):
    buf = ReplayBuffer(8, ram_budget="64KiB")
    for i in range(8):
        buf.add({"x": np.full(50, i, np.int16)})
    buf.save(tmp_path / "s")
    for i in range(8, 16):  # evict and reuse every slice after the save
        buf.add({"x": np.full(50, i, np.int16)})
    back = ReplayBuffer.load(tmp_path / "s")
    assert [int(g["x"][0]) for g in back[back.indices()]] == list(range(8))
    back.close()
    buf.close()


def test_memory_bank_items_in_the_arena_round_trip(spill_dir):
    bank = MemoryBank(30, ram_budget="16KiB", spill_dir=spill_dir)
    items = [{"e": np.full(128, i, np.float32), "t": b"x" * i} for i in range(50)]
    keys = [bank.append(it) for it in items[:25]] + bank.extend(items[25:]).tolist()
    assert (bank._store.addr >= 0).any() and bank.stats["spilled_items"] > 0
    for k, it in zip(keys[-30:], items[-30:]):
        got = bank[k]
        assert got["e"].tobytes() == it["e"].tobytes() and got["t"] == it["t"]
    bank[keys[-1]] = {"e": np.zeros(3, np.float32), "t": b""}  # replace an arena item
    assert bank[keys[-1]]["e"].tolist() == [0, 0, 0]
    bank.close()


_DTYPES = [np.float32, np.float16, np.int64, np.uint8, np.bool_, np.complex64, ">f4"]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=1, max_size=6),
    dtype=st.sampled_from(_DTYPES),
    torch_field=st.booleans(),
    batched=st.booleans(),
)
def test_items_of_any_shape_come_back_bit_exact(shapes, dtype, torch_field, batched):
    """Arrays of every shape (0-d, empty, multi-d), byte order and a tensor field, through the
    arena (add and extend, the plan and the general path)."""
    rng = np.random.default_rng(0)
    items = []
    for i, shape in enumerate(shapes * 2):  # each shape twice: the second takes the plan
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        arr = np.frombuffer(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), dtype).reshape(shape)
        item = {"a": arr, "i": i}
        if torch_field:
            item["t"] = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        items.append(item)
    buf = ReplayBuffer(len(items), ram_budget="256KiB")
    keys = buf.extend(items).tolist() if batched else [buf.add(it) for it in items]
    assert buf.stats["ram_items"] == len(items)
    for it, got in zip(items, buf[keys]):
        assert got["a"].dtype == it["a"].dtype and got["a"].shape == it["a"].shape
        assert got["a"].tobytes() == it["a"].tobytes() and got["i"] == it["i"]
        if torch_field:
            assert torch.equal(got["t"], it["t"])
    buf.close()
