import numpy as np
import pytest

from tensortier.errors import ConfigError
from tensortier.rl import MemoryBank


def test_fifo_index_access_and_variable_sizes_on_ram_and_disk(spill_dir):
    bank = MemoryBank(50, host_budget="8KiB", spill_dir=spill_dir, segment_size="8KiB")
    rng = np.random.default_rng(0)
    items = {}
    for i in range(80):
        it = {
            "e": rng.standard_normal(rng.integers(1, 400)).astype(np.float32),
            "t": bytes([i]) * i,
        }
        items[bank.append(it)] = it
    assert len(bank) == 50 and bank.stats["disk_items"] > 0
    keys = bank.indices().tolist()
    assert keys == sorted(items)[30:]
    for k in keys:
        got = bank[k]
        assert got["e"].tobytes() == items[k]["e"].tobytes() and got["t"] == items[k]["t"]
    assert [g["t"] for g in bank.get_many(keys[::-7])] == [items[k]["t"] for k in keys[::-7]]
    bank[keys[0]] = {"e": np.zeros(2), "t": b"new"}
    assert bank[keys[0]]["t"] == b"new"
    del bank[keys[1]]
    assert keys[1] not in bank and len(bank) == 49
    with pytest.raises(KeyError):
        bank[keys[1]]
    assert [it["t"] for it in bank][:2] == [b"new", items[keys[2]]["t"]]
    bank.close()


def test_bad_max_items():
    with pytest.raises(ConfigError, match="MemoryBank: max_items must be an int >= 1"):
        MemoryBank(0)


def test_indexing_with_many_indices_returns_their_items(spill_dir):
    """bank[[i, j]] (a MoCo-style read of negatives) raised TypeError ("must be ... a 1-D
    sequence") although it is one; it now returns a list, as ReplayBuffer and a served bank do."""
    torch = pytest.importorskip("torch")
    keys = torch.randn(12, 16, dtype=torch.bfloat16)
    with MemoryBank(8, host_budget="256B", spill_dir=spill_dir) as bank:
        bank.extend(keys[:4])  # one item per row; evicted by the next 8
        live = bank.extend(keys[4:])
        for many in (live.tolist(), live, torch.from_numpy(live)):
            got = bank[many]
            assert isinstance(got, list) and len(got) == 8
            assert all(torch.equal(g, keys[4 + i]) for i, g in enumerate(got))
        for one in (int(live[0]), live[0], torch.tensor(int(live[0]))):
            assert torch.equal(bank[one], keys[4])
        with pytest.raises(TypeError, match="indices"):
            bank[[[int(live[0])]]]


def test_extend_refuses_a_dict_or_text_instead_of_storing_its_keys(spill_dir):
    """extend({"obs": batch, ...}) (a TorchRL-style batch) stored one item per key, the str
    "obs" and so on, and returned their indices as if the batch had been added."""
    from tensortier.rl import ReplayBuffer

    batch = {"obs": np.zeros((4, 3), np.float32), "action": np.arange(4)}
    with (
        MemoryBank(10, spill_dir=spill_dir) as bank,
        ReplayBuffer(10, spill_dir=spill_dir) as buf,
    ):
        for store in (bank, buf):
            for wrong in (batch, "obs", b"obs"):
                with pytest.raises(TypeError, match=r"extend takes a list .* add\(item\)"):
                    store.extend(wrong)
            assert len(store) == 0
            rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]  # the batch's items
            keys = store.extend(iter(rows))
            assert [int(store[int(k)]["action"]) for k in keys] == [0, 1, 2, 3]
