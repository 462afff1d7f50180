"""Items through the RAM tier (bytes objects joined once from their encoded parts): extend ==
repeated add under eviction and spill, durable and saved copies, bit-exact for any dtype/shape."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.rl import MemoryBank, Prioritized, ReplayBuffer


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_extend_equals_repeated_add_with_eviction_and_spill(spill_dir, chunk):
    rng = np.random.default_rng(1)
    items = [
        {"obs": rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32), "i": i}
        for i in range(200)
    ]
    kw = dict(host_budget="64KiB", spill_dir=spill_dir, sampler=Prioritized(alpha=0.7), seed=1)
    a, b = ReplayBuffer(96, **kw), ReplayBuffer(96, **kw)
    ka = [a.add(it) for it in items]
    kb = []
    for i in range(0, len(items), chunk):
        kb += b.extend(items[i : i + chunk]).tolist()
    assert ka == kb
    for buf in (a, b):
        st = buf.stats
        assert st["spilled_items"] > 0 and st["evicted_items"] == 200 - 96
        assert st["ram_bytes"] <= buf.config.host_budget
        got = buf[buf.indices()]
        assert [g["i"] for g in got] == list(range(104, 200))
        assert all(g["obs"].tobytes() == items[g["i"]]["obs"].tobytes() for g in got)
    a.close()
    b.close()


def test_durable_round_trip(tmp_path):
    """Durable buffers keep their format: items added one by one or by extend (as encoded
    parts) are joined and written through, and come back after a reopen."""
    d = str(tmp_path / "rb")
    items = [{"obs": np.arange(i, i + 64, dtype=np.int64), "r": float(i)} for i in range(40)]
    buf = ReplayBuffer(32, durable=True, spill_dir=d, host_budget="64KiB")
    keys = [buf.add(it) for it in items[:20]] + buf.extend(items[20:]).tolist()
    assert buf.stats["disk_items"] == 32
    buf.close()
    back = ReplayBuffer(32, durable=True, spill_dir=d, host_budget="64KiB")
    assert back.indices().tolist() == keys[-32:]
    for it, got in zip(items[8:], back[keys[-32:]]):
        assert got["obs"].tobytes() == it["obs"].tobytes() and got["r"] == it["r"]
    back.close()


def test_save_then_reuse_every_slot_keeps_the_saved_copy(tmp_path):
    buf = ReplayBuffer(8, host_budget="64KiB")
    for i in range(8):
        buf.add({"x": np.full(50, i, np.int16)})
    buf.save(tmp_path / "s")
    for i in range(8, 16):  # evict and reuse every slot after the save
        buf.add({"x": np.full(50, i, np.int16)})
    back = ReplayBuffer.load(tmp_path / "s")
    assert [int(g["x"][0]) for g in back[back.indices()]] == list(range(8))
    back.close()
    buf.close()


def test_memory_bank_items_round_trip_through_ram_and_spill(spill_dir):
    bank = MemoryBank(30, host_budget="16KiB", spill_dir=spill_dir)
    items = [{"e": np.full(128, i, np.float32), "t": b"x" * i} for i in range(50)]
    keys = [bank.append(it) for it in items[:25]] + bank.extend(items[25:]).tolist()
    assert bank.stats["ram_items"] > 0 and bank.stats["spilled_items"] > 0
    for k, it in zip(keys[-30:], items[-30:]):
        got = bank[k]
        assert got["e"].tobytes() == it["e"].tobytes() and got["t"] == it["t"]
    bank[keys[-1]] = {"e": np.zeros(3, np.float32), "t": b""}  # replace an item in RAM
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
    """Arrays of every shape (0-d, empty, multi-d), byte order and a tensor field, through RAM
    (add and extend, the plan and the general path)."""
    rng = np.random.default_rng(0)
    items = []
    for i, shape in enumerate(shapes * 2):  # each shape twice: the second takes the plan
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        arr = np.frombuffer(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), dtype).reshape(shape)
        item = {"a": arr, "i": i}
        if torch_field:
            item["t"] = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        items.append(item)
    buf = ReplayBuffer(len(items), host_budget="256KiB")
    keys = buf.extend(items).tolist() if batched else [buf.add(it) for it in items]
    assert buf.stats["ram_items"] == len(items)
    for it, got in zip(items, buf[keys]):
        assert got["a"].dtype == it["a"].dtype and got["a"].shape == it["a"].shape
        assert got["a"].tobytes() == it["a"].tobytes() and got["i"] == it["i"]
        if torch_field:
            assert torch.equal(got["t"], it["t"])
    buf.close()
