import builtins
import errno
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from tensortier._device import rss_bytes
from tensortier._lifetime import quiesce
from tensortier.errors import ClosedError, ConfigError, CorruptDataError, SpillDirError
from tensortier.rl import MemoryBank, Prioritized, ReplayBuffer


def item(i: int, size: int = 100) -> dict:
    return {"obs": np.full(size, i, np.float32), "i": i}


def spilled(spill_dir: str, **kw) -> ReplayBuffer:
    """A buffer whose RAM holds only a handful of items, so most live on disk."""
    kw.setdefault("host_budget", "4KiB")
    kw.setdefault("segment_size", "16KiB")
    return ReplayBuffer(kw.pop("max_items", 64), spill_dir=spill_dir, **kw)


def test_fifo_eviction_order(spill_dir):
    buf = spilled(spill_dir, max_items=10)
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
    buf = spilled(spill_dir, host_budget="4KiB" if where == "disk" else "1MiB")
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
    buf = spilled(spill_dir, max_items=200)
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
    buf = spilled(spill_dir, max_items=100, seed=1)
    keys = np.array([buf.add(item(i)) for i in range(100)])
    batch = buf.sample(64)
    assert batch.collated and batch.items["obs"].shape == (64, 100)
    ids = batch.items["i"]
    assert (batch.items["obs"][:, 0] == ids).all()
    assert (keys[ids] == batch.indices).all()
    assert buf.stats["disk_reads"] > 0
    buf.close()


def test_compaction_gives_space_back(spill_dir):
    buf = spilled(spill_dir, max_items=400)
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


def test_an_empty_buffer_names_the_fix_that_applies():
    """After waiting ``timeout`` seconds the error still said "pass sample(..., timeout=seconds)",
    the argument the caller had just passed."""
    buf = ReplayBuffer(10)
    with pytest.raises(IndexError, match=r"pass sample\(\.\.\., timeout=seconds\)"):
        buf.sample(1)
    with pytest.raises(IndexError, match="after waiting 0.05 s; .*pass a longer timeout") as e:
        buf.sample(1, timeout=0.05)
    assert "timeout=seconds" not in str(e.value)
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
    with pytest.raises(ConfigError, match="max_items"):
        ReplayBuffer(0)
    with pytest.raises(ConfigError, match="host_budget"):
        ReplayBuffer(4, host_budget="lots")
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
    buf = ReplayBuffer(2, host_budget="1KiB", spill_dir=tmp_path / "missing", sampler=Prioritized())
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
    buf = spilled(spill_dir, max_items=64, sampler=Prioritized(alpha=0.8), max_uses=100, seed=3)
    keys = np.array([buf.add(item(i)) for i in range(80)])[16:]
    buf.update_priorities(keys, np.arange(1, 65, dtype=float))
    buf.sample(8)
    buf.save(tmp_path / "saved")
    assert not any(f.endswith(".pkl") for f in os.listdir(tmp_path / "saved"))
    new = ReplayBuffer.load(tmp_path / "saved", spill_dir=spill_dir, host_budget="8KiB")
    assert len(new) == len(buf) == 64
    np.testing.assert_array_equal(new.indices(), buf.indices())
    np.testing.assert_allclose(new.priorities(keys), buf.priorities(keys))
    np.testing.assert_array_equal(new._meta.uses, buf._meta.uses)
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
    buf = ReplayBuffer(100_000, host_budget=budget, spill_dir=spill_dir, segment_size="32MiB")
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


def run_with_deadline(fn, seconds: float = 30.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it has not returned."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return out


@pytest.mark.parametrize("prefetch", [0, 2])
def test_sample_of_an_empty_or_drained_buffer_raises_with_and_without_prefetch(prefetch):
    # with prefetch, sample() used to block forever where prefetch=0 raised IndexError
    buf = ReplayBuffer(10, prefetch=prefetch, max_uses=1, seed=0)
    assert isinstance(run_with_deadline(lambda: buf.sample(1))["error"], IndexError)
    k = buf.add(item(0))
    assert run_with_deadline(lambda: buf.sample(1))["value"].indices.tolist() == [k]
    got = run_with_deadline(lambda: buf.sample(1))  # drained by max_uses
    assert isinstance(got["error"], IndexError) and "max_uses" in str(got["error"])
    got = run_with_deadline(lambda: buf.sample(1, timeout=0.2))
    assert isinstance(got["error"], IndexError) and "waiting" in str(got["error"])
    buf.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_sample_with_timeout_waits_for_an_add(prefetch):
    buf = ReplayBuffer(10, prefetch=prefetch, seed=0)
    adder = threading.Timer(0.2, lambda: buf.add(item(7)))
    adder.start()
    got = run_with_deadline(lambda: buf.sample(3, timeout=30))
    adder.join()
    assert got["value"].items["i"].tolist() == [7, 7, 7]
    buf.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_wakes_a_sampler_waiting_without_timeout(prefetch):
    buf = ReplayBuffer(10, prefetch=prefetch)
    closer = threading.Timer(0.2, buf.close)
    closer.start()
    got = run_with_deadline(lambda: buf.sample(1, timeout=None))
    closer.join()
    assert isinstance(got["error"], ClosedError)


def test_dropped_prefetching_buffer_is_collected_and_its_thread_ends(spill_dir):
    buf = ReplayBuffer(100, prefetch=2, host_budget="2KiB", spill_dir=spill_dir, seed=0)
    buf.extend(item(i) for i in range(50))
    buf.sample(4)
    thread = buf._prefetcher.thread
    ref = weakref.ref(buf)
    del buf  # no close(): the prefetch thread must not keep it alive
    deadline = time.monotonic() + 30  # a draw in progress holds it until that batch is queued
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        quiesce()
        time.sleep(0.01)
    assert ref() is None
    thread.join(10)
    assert not thread.is_alive()  # and the spill_dir fixture checks the files are gone


def test_prefetch_hands_errors_to_the_caller():
    buf = ReplayBuffer(10, prefetch=1, seed=0)
    buf.add(item(0))
    real = buf._sample_locked

    def broken(*args, **kwargs):
        raise CorruptDataError("disk said no")

    buf._sample_locked = broken
    got = run_with_deadline(lambda: buf.sample(1))
    assert isinstance(got["error"], CorruptDataError)
    buf._sample_locked = real
    assert len(buf.sample(2)) == 2
    buf.close()


@pytest.mark.parametrize("max_items", [10, 2])  # not full: an empty slot; full: infinite weights
def test_all_zero_priorities_draw_live_items_uniformly_with_unit_weights(max_items):
    buf = ReplayBuffer(max_items, sampler=Prioritized(), seed=0)
    keys = [buf.add(item(i)) for i in range(2)]
    buf.update_priorities(keys, [0.0, 0.0])
    batch = buf.sample(400)
    assert set(batch.indices.tolist()) == set(keys)
    assert (batch.weights == 1).all()
    counts = np.bincount(batch.items["i"], minlength=2)
    assert counts.min() > 120  # 200 expected each; p < 1e-9 under uniform draws
    buf.update_priorities(keys[:1], [3.0])  # one positive priority: zero is never drawn again
    assert set(buf.sample(50).indices.tolist()) == {keys[0]}
    buf.close()


def test_update_priorities_refuses_indices_add_never_returned():
    buf = ReplayBuffer(4, sampler=Prioritized(alpha=1.0), seed=0)
    keys = [buf.add(item(i)) for i in range(4)]
    assert keys == [0, 5, 10, 15]
    before = buf.priorities(keys).copy()
    for bad in ([1, 2, 3], [keys[0], 7], [-1], [10**9]):
        with pytest.raises(KeyError, match="never returned"):
            buf.update_priorities(bad, np.full(len(bad), 100.0))
    np.testing.assert_array_equal(buf.priorities(keys), before)
    with pytest.raises(KeyError, match="never returned"):
        buf[2]
    sampled = buf.sample(4).indices
    buf.extend(item(i) for i in range(4))  # evicts all four: stale, not never issued
    buf.update_priorities(sampled, np.ones(4))
    assert buf.stats["stale_updates"] == 4
    buf.close()


def test_index_minus_one_never_touches_the_empty_slots_of_a_buffer_not_full():
    """-1 % max_items names an empty slot whose stored key is also -1: accepting it gave that
    slot a priority, and every later sample() drew it (FileNotFoundError)."""
    buf = ReplayBuffer(10, sampler=Prioritized(alpha=1.0), seed=0)
    keys = [buf.add(item(i)) for i in range(5)]
    before = buf.priorities(keys).copy()
    with pytest.raises(KeyError, match="index -1 was never returned"):
        buf.update_priorities([-1], [1e6])
    with pytest.raises(KeyError, match="never returned"):
        buf.update_priorities([keys[0], -1], [1.0, 1e6])  # all or nothing
    np.testing.assert_array_equal(buf.priorities(keys), before)
    assert buf.stats["stale_updates"] == 0
    for _ in range(5):
        batch = buf.sample(32)
        assert set(batch.indices.tolist()) <= set(keys)
        assert sorted(set(batch.items["i"].tolist())) == [0, 1, 2, 3, 4]
    buf.close()


def test_update_priorities_knows_indices_after_a_reload(tmp_path):
    buf = ReplayBuffer(8, sampler=Prioritized(), seed=0)
    keys = buf.extend(item(i) for i in range(6))
    del buf[int(keys[1])]
    buf.save(tmp_path / "saved")
    buf.close()
    new = ReplayBuffer.load(tmp_path / "saved")
    with pytest.raises(KeyError, match="never returned"):
        new.update_priorities([int(keys[0]) + 1], [1.0])  # same add as keys[0], another slot
    new.update_priorities([int(keys[1])], [1.0])  # deleted before the save: stale
    assert new.stats["stale_updates"] == 1
    k = new.add(item(9))
    assert k > keys.max()
    new.close()


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"max_items": 10**12}, "max_items"),
        ({"max_items": 10, "spill_dir": 123}, "spill_dir"),
        ({"max_items": 10, "durable": "yes", "spill_dir": "/tmp"}, "durable"),
        ({"max_items": 10, "fsync": 1}, "fsync"),
        ({"max_items": 10, "durable": True}, "spill_dir"),
        ({"max_items": 10, "seed": "x"}, "seed"),
        ({"max_items": 10, "seed": -1}, "seed"),
        ({"max_items": 10, "max_uses": True}, "max_uses"),
        ({"max_items": 10, "prefetch": True}, "prefetch"),
        ({"max_items": 10, "sampler": Prioritized}, "sampler"),
        ({"max_items": 10, "segment_size": 0}, "segment_size"),
    ],
)
def test_bad_arguments_are_config_errors_naming_them(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        ReplayBuffer(**kwargs)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda d: ReplayBuffer(capacity=8), "capacity= is now max_items="),
        (lambda d: ReplayBuffer(8, ram_budget="1MiB"), "ram_budget= is now host_budget="),
        (lambda d: ReplayBuffer(8, spill="disk", spill_dir=d), "spill= is now tier="),
        (lambda d: MemoryBank(capacity=8), "capacity= is now max_items="),
        (lambda d: MemoryBank(8, ram_budget="1MiB"), "ram_budget= is now host_budget="),
        (lambda d: MemoryBank(8, spill="disk", spill_dir=d), "spill= is now tier="),
    ],
)
def test_old_keywords_still_work_with_a_warning(make, name, tmp_path):
    """One vocabulary (issue 26): max_items, host_budget, tier, directory; the old names map to
    them with a DeprecationWarning for 0.1 (the review reproducers use them)."""
    with pytest.warns(DeprecationWarning, match=name):
        obj = make(str(tmp_path))
    assert obj.max_items == 8
    obj.close()


def test_save_and_load_take_the_old_directory_keyword_with_a_warning(tmp_path):
    with ReplayBuffer(8) as buf:
        buf.add(item(0))
        with pytest.warns(DeprecationWarning, match="dirname= is now directory="):
            buf.save(dirname=tmp_path / "s")
    with (
        pytest.warns(DeprecationWarning, match="ram_budget= is now host_budget="),
        ReplayBuffer.load(tmp_path / "s", ram_budget="1MiB") as back,
    ):
        assert len(back) == 1


def test_max_items_property_and_repr():
    with ReplayBuffer(8, host_budget="1MiB") as buf:
        assert buf.max_items == 8 and not hasattr(buf, "capacity")
        assert "max_items=8" in repr(buf) and "host_budget=1048576" in repr(buf)
    with MemoryBank(8) as bank:
        assert bank.max_items == 8


def test_bad_memory_bank_arguments_are_config_errors_naming_them():
    for kwargs, name in [
        ({"max_items": 10**12}, "max_items"),
        ({"max_items": 10, "durable": True}, "spill_dir"),
        ({"max_items": 10, "spill_dir": 1.5}, "spill_dir"),
    ]:
        with pytest.raises(ConfigError, match=name):
            MemoryBank(**kwargs)


@pytest.mark.parametrize("n", [0, -1, 2.0, True, "4", None])
def test_bad_batch_size_is_a_config_error_naming_the_fix(n):
    buf = ReplayBuffer(10, sampler=Prioritized())
    buf.add(item(0))
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1"):
        buf.sample(n)
    with pytest.raises(ConfigError, match="batch_size"):
        buf._sample_blobs(n)  # what tt.rl.serve's actor calls
    with pytest.raises(ConfigError, match="timeout"):
        buf.sample(1, timeout=-1)
    buf.close()


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-2] ^= 1
    path.write_bytes(bytes(data))


def tree_digest(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def saved_copy(tmp_path, n: int = 5):
    buf = ReplayBuffer(10, sampler=Prioritized(), seed=0)
    buf.extend(item(i) for i in range(n))
    buf.save(tmp_path / "saved")
    buf.close()
    return tmp_path / "saved"


def test_load_never_modifies_the_saved_copy(tmp_path, spill_dir):
    saved = saved_copy(tmp_path)
    flip_last_byte(saved / "seg-00000000.ttr")  # the last record: a "torn tail" to a recovery
    before = tree_digest(saved)
    with pytest.raises(CorruptDataError, match="left unchanged"):
        ReplayBuffer.load(saved, spill_dir=spill_dir, host_budget=0)
    assert tree_digest(saved) == before  # and the spill_dir fixture checks nothing is left


def test_load_only_reads(tmp_path, monkeypatch):
    # a read-only copy (read-only mount, archive, another user's files) must load: nothing in
    # the saved directory may be opened for writing or created
    saved = saved_copy(tmp_path)
    real_open, real_os_open = builtins.open, os.open
    inside = str(saved)

    def spy_open(file, mode="r", *a, **k):
        if str(file).startswith(inside) and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", file)
        return real_open(file, mode, *a, **k)

    def spy_os_open(path, flags, *a, **k):
        if str(path).startswith(inside) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    new = ReplayBuffer.load(saved)
    assert len(new) == 5 and new[int(new.indices()[4])]["i"] == 4
    new.close()


class _Evil:
    def __reduce__(self):
        return (open, (_Evil.marker, "w"))


def _damage(kind: str, d) -> None:
    meta_path, npz = d / "buffer.json", d / "state.npz"
    meta = json.loads(meta_path.read_text())
    z = dict(np.load(npz))
    if kind == "truncated json":
        os.truncate(meta_path, 20)
    elif kind == "npz bit flip":
        data = bytearray(npz.read_bytes())
        data[len(data) // 2] ^= 1
        npz.write_bytes(bytes(data))
    elif kind == "no config":
        meta.pop("config")
        meta_path.write_text(json.dumps(meta))
    elif kind == "capacity string":
        meta["config"]["capacity"] = "10"
        meta_path.write_text(json.dumps(meta))
    elif kind == "unknown sampler":
        meta["config"]["sampler"] = {"kind": "prioritized", "gamma": 2}
        meta_path.write_text(json.dumps(meta))
    elif kind == "keys out of order":
        z["keys"] = z["keys"][::-1].copy()
        np.savez(npz, **z)
    elif kind == "NaN priority":
        z["leaves"][0] = np.nan
        np.savez(npz, **z)
    elif kind == "key beyond seq":
        z["keys"][-1] += 10**6
        np.savez(npz, **z)
    elif kind == "pickled object array":
        z["keys"] = np.array([_Evil()], dtype=object)
        np.savez(npz, **z)  # savez pickles object arrays; load must never unpickle them
    elif kind == "bad sampler state":
        meta["sampler_state"] = {"max_priority": -1}
        meta_path.write_text(json.dumps(meta))
    elif kind == "missing npz":
        os.remove(npz)


@pytest.mark.parametrize(
    "kind",
    [
        "truncated json",
        "npz bit flip",
        "no config",
        "capacity string",
        "unknown sampler",
        "keys out of order",
        "NaN priority",
        "key beyond seq",
        "pickled object array",
        "bad sampler state",
        "missing npz",
    ],
)
def test_damaged_saved_state_is_corrupt_data_error(tmp_path, spill_dir, kind):
    saved = saved_copy(tmp_path)
    _Evil.marker = str(tmp_path / "unpickled")
    _damage(kind, saved)
    with pytest.raises(CorruptDataError):
        ReplayBuffer.load(saved, spill_dir=spill_dir, host_budget=0)
    assert not os.path.exists(_Evil.marker)


def test_load_refuses_a_priority_weight_past_the_limit_add_and_update_refuse(tmp_path, spill_dir):
    """A saved weight p**alpha above 1e290 (which update_priorities would have refused: the
    weight sum could overflow to inf and sampling would silently pick one item) is invalid saved
    state; a weight exactly at the limit loads and samples."""
    saved = saved_copy(tmp_path)
    npz = saved / "state.npz"
    z = dict(np.load(npz))
    z["leaves"][0] = 1e291
    np.savez(npz, **z)
    with pytest.raises(CorruptDataError, match=r"at most 1e\+290.*got 1e\+291"):
        ReplayBuffer.load(saved, spill_dir=spill_dir, host_budget=0)
    z["leaves"][:] = 1e290
    np.savez(npz, **z)
    buf = ReplayBuffer.load(saved, spill_dir=spill_dir, host_budget=0)
    assert np.array_equal(buf.priorities(buf.indices()), np.full(5, 1e290))
    assert len(buf.sample(8).indices) == 8
    buf.close()


def test_a_save_after_one_that_saw_the_first_spill_still_pins_the_files(
    tmp_path, monkeypatch, spill_dir
):
    """A save pins the segment files while it copies outside the lock. When the buffer spilled
    for the first time during one save's copy, that save used to unpin files it never pinned:
    the next save's pin then held nothing, and a delete during its copy removed files it was
    reading."""
    from tensortier.tiers.segments import Segments

    buf = ReplayBuffer(256, host_budget="16KiB", spill_dir=spill_dir, segment_size="8KiB")
    buf.extend([np.zeros(100, np.uint8)] * 4)  # in RAM: no segment files yet
    write = __import__("tensortier.rl._saved", fromlist=["write"]).write

    def spill_then_write(*args, **kwargs):  # runs outside the buffer's lock
        buf.extend([np.full(1000, i, np.uint8) for i in range(40)])  # the first spill
        return write(*args, **kwargs)

    monkeypatch.setattr("tensortier.rl._saved.write", spill_then_write)
    buf.save(tmp_path / "first")
    monkeypatch.undo()
    expected = buf[buf.indices()]
    read_many = Segments.read_many
    deleted = []

    def delete_then_read(self, locs):  # the second save's reader, outside the lock
        if self.readonly and not deleted:
            deleted.extend(buf.indices().tolist())
            del buf[deleted]  # every file emptied: deleted now unless the save pinned it
        return read_many(self, locs)

    monkeypatch.setattr(Segments, "read_many", delete_then_read)
    try:
        buf.save(tmp_path / "second")
    finally:
        monkeypatch.undo()
        buf.close()
    assert len(deleted) == 44
    loaded = ReplayBuffer.load(tmp_path / "second", spill_dir=spill_dir)
    got = loaded[loaded.indices()]
    assert len(got) == 44 and all(np.array_equal(a, b) for a, b in zip(got, expected))
    loaded.close()


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch, spill_dir):
    buf = spilled(spill_dir, max_items=50)
    buf.extend(item(i) for i in range(50))

    def disk_full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("tensortier.rl._saved.write", disk_full)
    with pytest.raises(SpillDirError, match="No space left"):
        buf.save(tmp_path / "saved")
    assert not os.path.exists(tmp_path / "saved")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpillDirError):
        buf.save(tmp_path / "empty")
    assert os.listdir(tmp_path / "empty") == []  # a directory it did not make stays, empty
    monkeypatch.undo()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpillDirError, match="save"):
        buf.save(tmp_path / "file")
    buf.save(tmp_path / "saved")  # the buffer is unharmed
    assert len(ReplayBuffer.load(tmp_path / "saved")) == 50
    buf.close()


SIGKILLED = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from tensortier.rl import MemoryBank, ReplayBuffer
    rb = ReplayBuffer(10, host_budget=0, spill_dir=sys.argv[1])
    rb.add({"x": np.ones(100)})
    mb = MemoryBank(10, host_budget=0, spill_dir=sys.argv[1])
    mb.append({"x": np.ones(100)})
    print(sorted(os.listdir(sys.argv[1])), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_spill_areas_of_a_killed_process_are_reclaimed_on_restart(spill_dir):
    proc = subprocess.run(
        [sys.executable, "-c", SIGKILLED, spill_dir], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-1000:]
    left = os.listdir(spill_dir)
    assert len(left) == 2 and all(n.startswith(("tt-replay-", "tt-membank-")) for n in left)
    # the restarted job's store reclaims them when it starts, before it spills anything
    # (MemoryBank runs the same ItemStore code)
    with ReplayBuffer(10, spill_dir=spill_dir) as restarted:
        assert os.listdir(spill_dir) == []
        restarted.add(item(1))


def test_reclaiming_leaves_a_live_owners_spill_area_alone(spill_dir):
    live = ReplayBuffer(10, host_budget=0, spill_dir=spill_dir)
    live.add(item(0))
    mine = os.listdir(spill_dir)
    assert len(mine) == 1
    with ReplayBuffer(10, spill_dir=spill_dir), MemoryBank(10, spill_dir=spill_dir):
        assert os.listdir(spill_dir) == mine
    assert live[int(live.indices()[0])]["i"] == 0
    live.close()


def _run_on(buf: ReplayBuffer, start: int) -> list:
    """What a training loop sees after a resume: samples, priority updates, adds that evict."""
    out = []
    for step in range(4):
        b = buf.sample(16)
        out.append((b.indices.tolist(), b.weights.tolist(), b.items["obs"].tobytes()))
        if isinstance(buf.config.sampler, Prioritized):
            buf.update_priorities(b.indices, (b.indices % 7 + 1) / 3)
        else:
            del buf[int(b.indices[0])]
        buf.add(item(start + step))
    return out


@pytest.mark.parametrize("sampler", [Prioritized(alpha=0.7, beta=0.5, beta_steps=10), None])
def test_a_loaded_seeded_buffer_samples_exactly_as_the_original_goes_on(
    sampler, spill_dir, tmp_path
):
    """TorchRL's state_dict keeps the generator's state: a resumed run draws what the original
    would have. Here the loaded buffer started a fresh stream (and the uniform sampler's draw
    order, permuted by evictions and deletes, was rebuilt in key order)."""
    buf = spilled(spill_dir, max_items=24, sampler=sampler, seed=5)
    for i in range(40):  # 16 evicted; most of the rest on disk
        buf.add(item(i))
    _run_on(buf, 100)  # mid-run: priorities, deletes, draws already taken
    buf.save(tmp_path / "saved")
    new = ReplayBuffer.load(tmp_path / "saved", spill_dir=spill_dir)
    reseeded = ReplayBuffer.load(tmp_path / "saved", seed=6)  # an explicit seed starts afresh
    try:
        assert _run_on(new, 200) == _run_on(buf, 200)
        assert _run_on(reseeded, 200)[0][0] != _run_on(buf, 300)[0][0]
    finally:
        for b in (buf, new, reseeded):
            b.close()


def test_load_refuses_a_damaged_generator_state(tmp_path):
    buf = ReplayBuffer(8, seed=1)
    buf.extend(item(i) for i in range(4))
    buf.save(tmp_path / "saved")
    path = tmp_path / "saved" / "buffer.json"
    meta = json.loads(path.read_text())
    for bad in ("x", -1, 2**128, None):
        meta["rng"]["state"]["state"]["state"] = bad
        path.write_text(json.dumps(meta))
        with pytest.raises(CorruptDataError, match="rng"):
            ReplayBuffer.load(tmp_path / "saved")
    buf.close()


def test_iterating_a_replay_buffer_names_sample_and_indices():
    # Python iterated through buf[0], buf[1], ...: a KeyError at the first index add() never
    # returned (keys are not positions), for local, served and sharded buffers alike.
    from tensortier.rl.sharded import ShardedReplayBuffer

    with ReplayBuffer(4) as buf:
        buf.extend([{"i": i} for i in range(3)])
        for obj in (buf, ShardedReplayBuffer.__new__(ShardedReplayBuffer)):
            with pytest.raises(TypeError, match=r"not iterable: draw batches with sample.*indices"):
                iter(obj)
        assert [it["i"] for it in buf[buf.indices()]] == [0, 1, 2]  # what the message offers
