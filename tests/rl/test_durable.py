import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tensortier.errors import ConfigError, CorruptDataError
from tensortier.rl import Prioritized, ReplayBuffer

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tensortier.rl import ReplayBuffer
    buf = ReplayBuffer(100_000, ram_budget="64KiB", spill_dir=sys.argv[1], durable=True,
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
    buf = ReplayBuffer(100_000, ram_budget="64KiB", spill_dir=d, durable=True)
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
    buf._closed = True  # simulate a crash: no close(), no checkpoint
    buf._store.segments.close(remove=False)
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
    first = buf._store.segments.path(min(buf._store.segments.fds))
    buf.close()
    with open(first, "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(CorruptDataError, match="damaged"):
        ReplayBuffer(1000, spill_dir=d, durable=True)


def test_reopen_with_other_capacity_is_refused(tmp_path):
    buf = ReplayBuffer(10, spill_dir=tmp_path / "rb", durable=True)
    buf.add(item(0))
    buf.close()
    with pytest.raises(ConfigError, match="capacity=10"):
        ReplayBuffer(20, spill_dir=tmp_path / "rb", durable=True)


def test_durable_deletes_evictions_and_updates_survive_restart(tmp_path):
    d = tmp_path / "rb"
    buf = ReplayBuffer(20, spill_dir=d, durable=True, segment_size="2KiB", ram_budget="1KiB")
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
