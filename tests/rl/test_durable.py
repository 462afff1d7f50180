import errno
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import weakref
import zlib

import numpy as np
import pytest

from tensortier._lifetime import quiesce
from tensortier.errors import ConfigError, CorruptDataError, SpillDirError
from tensortier.rl import MemoryBank, Prioritized, ReplayBuffer
from tensortier.tiers import itemcodec as _codec
from tensortier.tiers.segments import MAGIC_V1, REC

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tensortier.rl import ReplayBuffer
    buf = ReplayBuffer(100_000, host_budget="64KiB", spill_dir=sys.argv[1], durable=True,
                       segment_size="256KiB")
    i = 0
    while True:
        k = buf.add({"obs": np.full(1000 + i % 7, i, np.int32), "i": i})
        print(i, k, flush=True)   # acknowledged: add() has returned
        i += 1
    """
)


def item(i: int) -> dict:
    return {"obs": np.full(50, i, np.float32), "i": i}


def test_sigkill_during_add_keeps_every_acknowledged_record(tmp_path):
    d = str(tmp_path / "rb")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, d], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    acked = {}
    try:
        for line in proc.stdout:
            i, k = map(int, line.split())
            acked[k] = i
            if i >= 2500:  # several segments written, the process is mid-add when killed
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        rest = proc.stdout.read()  # acknowledgements still in the pipe were acknowledged too
        proc.stdout.close()
    for line in rest.split("\n")[:-1]:  # the last piece may be a half-printed line
        i, k = map(int, line.split())
        acked[k] = i
    buf = ReplayBuffer(100_000, host_budget="64KiB", spill_dir=d, durable=True)
    assert len(buf) >= len(acked)
    for k, i in acked.items():
        got = buf[k]
        assert got["i"] == i and got["obs"].shape == (1000 + i % 7,) and (got["obs"] == i).all()
    extra = set(buf.indices().tolist()) - set(acked)
    assert len(extra) <= 1  # at most the add in flight, complete or not at all
    k = buf.add(item(-1))  # keeps working, keys never reused
    assert k > max(acked) and buf[k]["i"] == -1
    buf.close()


def test_torn_tail_is_truncated_and_earlier_records_survive(tmp_path):
    d = tmp_path / "rb"
    buf = ReplayBuffer(100, spill_dir=d, durable=True, sampler=Prioritized())
    keys = buf.extend(item(i) for i in range(10))
    buf.update_priorities(keys, np.arange(1, 11, dtype=float))
    buf.checkpoint()
    del buf[int(keys[4])]
    buf._store.segments.fsync = False
    seg = buf._store.segments.path(buf._store.segments.active)
    buf._closed = True  # simulate a crash: no close(), no checkpoint; the kernel drops the lock
    buf._store._files.close()
    with open(seg, "ab") as f:
        f.write(b"TTR1\x10\x00")  # half a record header
    again = ReplayBuffer(100, spill_dir=d, durable=True, sampler=Prioritized())
    assert sorted(again.indices().tolist()) == sorted(set(keys.tolist()) - {int(keys[4])})
    assert again[int(keys[9])]["i"] == 9
    # priorities come from the checkpoint
    np.testing.assert_allclose(again.priorities(keys[[0, 9]]), np.array([1.0, 10.0]) ** 0.6)
    again.close()


def test_damaged_sealed_segment_is_reported(tmp_path):
    d = tmp_path / "rb"
    buf = ReplayBuffer(1000, spill_dir=d, durable=True, segment_size="4KiB")
    buf.extend(item(i) for i in range(100))
    first = buf._store.segments.path(buf._store.segments.segments[0])
    buf.close()
    with open(first, "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(CorruptDataError, match="damaged"):
        ReplayBuffer(1000, spill_dir=d, durable=True)


def test_reopen_with_other_max_items_is_refused(tmp_path):
    buf = ReplayBuffer(10, spill_dir=tmp_path / "rb", durable=True)
    buf.add(item(0))
    buf.close()
    with pytest.raises(ConfigError, match="max_items=10"):
        ReplayBuffer(20, spill_dir=tmp_path / "rb", durable=True)


def test_durable_deletes_evictions_and_updates_survive_restart(tmp_path):
    d = tmp_path / "rb"
    buf = ReplayBuffer(20, spill_dir=d, durable=True, segment_size="2KiB", host_budget="1KiB")
    keys = [buf.add(item(i)) for i in range(50)]  # 30 evicted
    del buf[keys[40]]
    buf.update(keys[45], {"obs": np.arange(3), "i": 450})
    for k in keys[30:38]:
        del buf[k]  # compaction runs underneath; tombstones must survive it
    expect = {k: (450 if k == keys[45] else i) for i, k in enumerate(keys)}
    live = buf.indices().tolist()
    buf.close()
    os.sync()
    again = ReplayBuffer(20, spill_dir=d, durable=True)
    assert again.indices().tolist() == live
    for k in live:
        assert again[k]["i"] == expect[k]
    assert keys[40] not in again and keys[10] not in again
    again.close()


@pytest.mark.parametrize("cls", [ReplayBuffer, MemoryBank])
def test_one_owner_per_durable_directory(tmp_path, cls):
    # two owners used to be accepted and overwrote each other's acknowledged adds
    d = tmp_path / "rb"
    first = cls(100, spill_dir=d, durable=True)
    add = first.add if cls is ReplayBuffer else first.append
    k = add(item(1))
    with pytest.raises(ConfigError, match="close it first"):
        cls(100, spill_dir=d, durable=True)
    assert first[k]["i"] == 1  # the refused owner changed nothing
    first.close()
    second = cls(100, spill_dir=d, durable=True)  # closing released the directory
    assert second[k]["i"] == 1
    ref = weakref.ref(second)
    del second  # dropped without close(): garbage collection releases it too
    gc.collect()
    quiesce()
    assert ref() is None
    third = cls(100, spill_dir=d, durable=True)
    assert third[k]["i"] == 1
    third.close()


def test_durable_directory_lock_dies_with_its_process(tmp_path):
    d = str(tmp_path / "rb")
    code = (
        "import os, signal, sys, numpy as np\n"
        "from tensortier.rl import ReplayBuffer\n"
        "b = ReplayBuffer(10, spill_dir=sys.argv[1], durable=True)\n"
        "b.add({'x': np.ones(3)})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, d], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-500:]
    again = ReplayBuffer(10, spill_dir=d, durable=True)
    assert len(again) == 1
    again.close()


@pytest.mark.parametrize("at,mask", [(12, 0x01), (16, 0x04)])  # flags, key
def test_damaged_record_header_is_reported_on_reopen(tmp_path, at, mask):
    d = tmp_path / "rb"
    buf = ReplayBuffer(100, spill_dir=d, durable=True)
    keys = [buf.add(item(i)) for i in range(10)]
    buf.close()
    seg = d / "seg-00000000.ttr"
    data = seg.read_bytes()
    off = 0
    for _ in range(3):
        off += REC.size + REC.unpack_from(data, off)[1]
    data = bytearray(data)
    data[off + at] ^= mask
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="damaged"):
        ReplayBuffer(100, spill_dir=d, durable=True)
    data[off + at] ^= mask  # repaired: everything is back, and the failed open left no lock
    seg.write_bytes(bytes(data))
    again = ReplayBuffer(100, spill_dir=d, durable=True)
    assert [again[k]["i"] for k in keys] == list(range(10))
    again.close()


def test_durable_directory_written_by_format_1_reopens(tmp_path):
    d = tmp_path / "rb"
    d.mkdir()
    blobs = [_codec.encode(item(i)) for i in range(3)]
    recs = b"".join(
        REC.pack(MAGIC_V1, len(b), zlib.crc32(b), 0, i * 10 + i) + b for i, b in enumerate(blobs)
    )
    (d / "seg-00000000.ttr").write_bytes(recs)
    (d / "store.json").write_text(
        json.dumps({"format": "tensortier-rl-segments", "version": 1, "capacity": 10})
    )
    buf = ReplayBuffer(10, spill_dir=d, durable=True)
    assert [buf[k]["i"] for k in buf.indices().tolist()] == [0, 1, 2]
    k = buf.add(item(3))
    buf.close()
    assert json.loads((d / "store.json").read_text())["version"] == 2
    again = ReplayBuffer(10, spill_dir=d, durable=True)
    assert again[k]["i"] == 3 and len(again) == 4
    again.close()


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2]", '{"format": "other", "capacity": 10}', '{"version": 9}']
)
def test_damaged_store_meta_is_corrupt_data_error(tmp_path, text):
    d = tmp_path / "rb"
    ReplayBuffer(10, spill_dir=d, durable=True).close()
    (d / "store.json").write_text(text)
    with pytest.raises(CorruptDataError, match="store.json"):
        ReplayBuffer(10, spill_dir=d, durable=True)


@pytest.mark.parametrize("damage", ["json", "npz", "sampler_state"])
def test_damaged_checkpoint_state_is_corrupt_data_error_naming_the_fix(tmp_path, damage):
    d = tmp_path / "rb"
    buf = ReplayBuffer(10, spill_dir=d, durable=True, sampler=Prioritized())
    buf.add(item(0))
    buf.close()
    if damage == "json":
        (d / "buffer.json").write_text('{"format": "tensortier-replay", "ver')
    elif damage == "npz":
        (d / "state.npz").write_bytes(b"PK\x03\x04 not a zip")
    else:
        meta = json.loads((d / "buffer.json").read_text())
        meta["sampler_state"]["max_priority"] = "high"
        (d / "buffer.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptDataError, match="remove state.npz and buffer.json"):
        ReplayBuffer(10, spill_dir=d, durable=True, sampler=Prioritized())
    os.remove(d / "state.npz")
    os.remove(d / "buffer.json")
    again = ReplayBuffer(10, spill_dir=d, durable=True, sampler=Prioritized())
    assert len(again) == 1  # the items were never at risk
    again.close()


def test_durable_dir_that_cannot_be_written_is_a_spill_dir_error(tmp_path, monkeypatch):
    import tensortier._lifetime as lifetime

    real_open = os.open

    def read_only_fs(path, flags, *a):  # what a read-only mount answers (root ignores chmod)
        if str(path).endswith(".tensortier.lock"):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(lifetime.os, "open", read_only_fs)
    with pytest.raises(SpillDirError, match="spill_dir=.*not writable.*Read-only"):
        ReplayBuffer(10, spill_dir=tmp_path, durable=True)
    assert os.listdir(tmp_path) == []


def test_durable_spill_dir_under_a_file_is_a_spill_dir_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpillDirError, match="spill_dir"):
        ReplayBuffer(10, spill_dir=tmp_path / "file" / "rb", durable=True)


FD_CHILD = textwrap.dedent(
    """
    import os, resource, sys
    import numpy as np
    from tensortier.errors import TierFullError
    from tensortier.rl import ReplayBuffer
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    for durable in (True, False):
        d = os.path.join(sys.argv[1], "durable" if durable else "spill")
        os.mkdir(d)
        buf = ReplayBuffer(100_000, host_budget=0, spill_dir=d, segment_size="4KiB",
                           durable=durable)
        keys = [buf.add({"v": np.full(1000, i, np.int64)}) for i in range(300)]  # 300 files
        assert all(int(buf[k]["v"][0]) == i for i, k in enumerate(keys))
        # a process with no descriptor left at all (not even the store's cached ones): a typed
        # error naming the fix, and the store stays usable
        buf._store.segments._shrink(0)
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            buf.add({"v": np.full(1000, -1, np.int64)})
            print("accepted")
        except TierFullError as exc:
            print("typed:", "ulimit" in str(exc), len(buf))
        for fd in held:
            os.close(fd)
        k = buf.add({"v": np.full(1000, -2, np.int64)})
        assert int(buf[k]["v"][0]) == -2 and int(buf[keys[0]]["v"][0]) == 0
        buf.close()
        print("ok", os.listdir(d) if not durable else "")
    """
)


def test_many_segments_stay_under_the_open_file_limit(tmp_path):
    # one descriptor per segment used to fail with a raw EMFILE past the limit
    proc = subprocess.run(
        [sys.executable, "-c", FD_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n") == ["typed: True 300", "ok ", "typed: True 300", "ok []", ""]


def test_crash_between_the_two_checkpoint_files_still_reopens(tmp_path):
    d = tmp_path / "rb"
    buf = ReplayBuffer(10, spill_dir=d, durable=True, sampler=Prioritized(alpha=1.0))
    keys = buf.extend(item(i) for i in range(3))
    buf.update_priorities(keys, [1.0, 2.0, 3.0])
    buf.checkpoint()
    old_npz = (d / "state.npz").read_bytes()
    more = buf.extend(item(i) for i in range(3, 6))
    buf.close()  # the second checkpoint: buffer.json first, then state.npz
    (d / "state.npz").write_bytes(old_npz)  # as if the crash came between the two replaces
    again = ReplayBuffer(10, spill_dir=d, durable=True, sampler=Prioritized(alpha=1.0))
    np.testing.assert_allclose(again.priorities(keys), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(again.priorities(more), [3.0, 3.0, 3.0])  # newer: max priority
    again.close()
    os.remove(d / "state.npz")  # a crash during the very first checkpoint
    third = ReplayBuffer(10, spill_dir=d, durable=True, sampler=Prioritized(alpha=1.0))
    assert len(third) == 6
    third.close()


def test_reopen_with_another_alpha_keeps_the_checkpointed_priorities(tmp_path):
    """The checkpoint holds p**alpha; reopening with another alpha used those weights as if
    they were p**alpha_new (priorities() gave 2**0.5 for a priority of 2) while new items got
    max_priority**alpha_new: a silent mix of two distributions."""
    d = str(tmp_path / "rb")
    buf = ReplayBuffer(8, spill_dir=d, durable=True, sampler=Prioritized(alpha=0.5))
    keys = buf.extend(item(i) for i in range(3))
    buf.update_priorities(keys, [2.0, 0.0, 8.0])
    buf.close()
    again = ReplayBuffer(8, spill_dir=d, durable=True, sampler=Prioritized(alpha=1.0))
    np.testing.assert_allclose(again.priorities(keys), [2.0, 0.0, 8.0], rtol=1e-14)
    assert again.priorities([again.add(item(3))])[0] == 8.0  # the max priority, alpha 1
    again.close()
    # from a uniform buffer's checkpoint (no priorities): every item gets the max priority
    d2 = str(tmp_path / "uniform")
    with ReplayBuffer(8, spill_dir=d2, durable=True) as uni:
        uni.extend(item(i) for i in range(2))
    cfg = Prioritized(alpha=1.0, initial_priority=3.0)
    with ReplayBuffer(8, spill_dir=d2, durable=True, sampler=cfg) as pri:
        np.testing.assert_array_equal(pri.priorities(pri.indices()), [3.0, 3.0])


def test_reopen_with_an_alpha_too_large_for_the_checkpoint_names_the_alpha(tmp_path):
    """It was CorruptDataError "sampler_state is not valid", asking to delete the checkpoint."""
    d = str(tmp_path / "rb")
    with ReplayBuffer(8, spill_dir=d, durable=True, sampler=Prioritized(alpha=0.5)) as buf:
        buf.update_priorities(buf.extend(item(i) for i in range(2)), [1e200, 1.0])
    with pytest.raises(ConfigError, match=r"max priority.*reopen with alpha=0.5"):
        ReplayBuffer(8, spill_dir=d, durable=True, sampler=Prioritized(alpha=2.0))
    with ReplayBuffer(8, spill_dir=d, durable=True, sampler=Prioritized(alpha=0.5)) as buf:
        np.testing.assert_array_equal(buf.priorities(buf.indices()), [1e100, 1.0])  # kept
