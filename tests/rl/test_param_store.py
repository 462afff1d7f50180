import errno
import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tensortier._lifetime import quiesce
from tensortier.errors import ClosedError, ConfigError, TierFullError
from tensortier.rl import ParamStore
from tensortier.rl.param_store import ParamReader
from tests.conftest import bit_equal, in_thread


def _reader(path: str, seconds: float, out) -> None:
    import time

    from tensortier.rl import ParamStore

    reader = ParamStore.attach(path)
    seen, torn, versions = 0, 0, set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p = reader.get(min_version=1, timeout=10)
        v = float(p.version)
        for t in p.values():  # every tensor of a version is filled with that version number
            arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
            want = (
                torch.tensor(v, dtype=t.dtype).view(torch.int16).item()
                if t.dtype == torch.bfloat16
                else v
            )
            if not bool((arr == want).all()):  # numpy: no torch thread pool in a forked child
                torn += 1
        versions.add(p.version)
        seen += 1
        del p
    out.put((seen, torn, len(versions)))


def state(v: int) -> dict:
    return {
        "w": torch.full((256, 1024), float(v)),  # 1 MiB
        "b": torch.full((1000,), float(v), dtype=torch.bfloat16),
        "step": torch.tensor(float(v), dtype=torch.float64),
    }


def test_round_trip_versions_and_zero_copy():
    with ParamStore() as ps:
        sd = {"a": torch.randn(3, 4), "i": torch.arange(5), "bf": torch.randn(7).bfloat16()}
        assert ps.version == 0
        v = ps.publish(sd)
        p = ps.get(min_version=v)
        assert p.version == v == 1 and set(p) == set(sd)
        assert all(bit_equal(p[k], sd[k]) for k in sd)
        p["a"].add_(1)  # copy-on-write: a reader's writes stay private
        assert bit_equal(ps.get()["a"], sd["a"])
        with pytest.raises(TimeoutError):
            ps.wait_for(5, timeout=0.05)


def test_old_versions_freed_unless_a_reader_holds_them():
    with ParamStore(keep=1) as ps:
        ps.publish(state(1))
        held = ps.get()
        for v in range(2, 6):
            ps.publish(state(v))
        assert ps.versions() == [1, 5]  # 1 is held; 2-4 were freed
        assert (held["w"] == 1).all()
        del held
        gc.collect()
        ps.publish(state(6))
        assert ps.versions() == [6]
    assert not os.path.exists(ps.directory)


def test_bad_input():
    with ParamStore() as ps:
        with pytest.raises(TypeError):
            ps.publish({"x": [1, 2]})
        assert ps.version == 0


@pytest.mark.slow
def test_readers_in_other_processes_never_see_a_torn_version():
    ctx = mp.get_context("fork")  # the child only reads shared memory with numpy
    with ParamStore(keep=2) as ps:
        ps.publish(state(1))
        out = ctx.Queue()
        readers = [ctx.Process(target=_reader, args=(ps.directory, 1.5, out)) for _ in range(2)]
        for r in readers:
            r.start()
        results = []
        v = 1
        while len(results) < len(readers):
            v += 1
            ps.publish(state(v))
            try:
                results.append(out.get(timeout=0.001))
            except Exception:
                pass
        for r in readers:
            r.join(timeout=30)
        assert all(torn == 0 for _, torn, _ in results), results
        assert all(seen > 10 and nver > 2 for seen, _, nver in results), results
        assert v > 10


# ---------------------------------------------------------------------- faults (issue 18)


def test_get_before_first_publish_honours_timeout_and_sleeps(monkeypatch):
    polls = []
    real = getattr(ParamReader, "_read", None)
    monkeypatch.setattr(
        ParamReader, "_read", lambda self: polls.append(1) or real(self), raising=False
    )
    with ParamStore() as ps:
        for call in (lambda: ps.get(min_version=0, timeout=0.3), lambda: ps.get(timeout=0.3)):
            polls.clear()
            assert isinstance(in_thread(call), TimeoutError)
            # back-off polling: ~40 reads in 0.3 s; a busy spin makes hundreds of thousands
            assert len(polls) < 1000, len(polls)


def test_reader_of_a_closed_store_gets_closed_error():
    pub = ParamStore()
    pub.publish({"w": torch.ones(4)})
    reader = ParamStore.attach(pub.directory)
    held = reader.get()
    out: list = []
    waiting = threading.Thread(target=lambda: out.append(in_thread(lambda: reader.wait_for(2))))
    waiting.start()
    pub.close()  # wakes the waiting reader
    waiting.join(30)
    assert isinstance(out[0], ClosedError), out
    for call in (reader.get, lambda: reader.get(timeout=1.0), lambda: reader.wait_for(1)):
        assert isinstance(in_thread(call), ClosedError)
    assert (held["w"] == 1).all()  # mapped pages outlive the store
    reader.close()
    with pytest.raises(ClosedError):
        reader.get()


def test_store_dropped_without_close_is_closed_for_readers():
    ps = ParamStore()
    ps.publish({"w": torch.ones(4)})
    path, reader = ps.directory, ParamStore.attach(ps.directory)
    del ps
    gc.collect()
    assert quiesce()  # the reaper ran the cleanup (a finalizer never deletes files itself)
    assert not os.path.exists(path)
    assert isinstance(in_thread(lambda: reader.get(min_version=2, timeout=5)), ClosedError)


def test_use_after_close_and_bad_arguments_are_typed():
    ps = ParamStore()
    ps.publish({"w": torch.ones(2)})
    with pytest.raises(TypeError, match="state_dict"):
        ps.publish([torch.ones(2)])
    with pytest.raises(TypeError, match="keys"):
        ps.publish({3: torch.ones(2)})
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(ConfigError, match="version"):
            ps.get(min_version=bad)
    for bad in (-1, "1", float("nan")):
        with pytest.raises(ConfigError, match="timeout"):
            ps.wait_for(1, timeout=bad)
    with pytest.raises(ConfigError, match="keep"):
        ParamStore(keep=True)
    with pytest.raises(TypeError, match="spill_dir"):
        ParamStore(spill_dir=3)
    with pytest.raises(TypeError, match="directory"):
        ParamStore.attach(3)
    with pytest.raises(ConfigError, match="no ParamStore"):
        ParamStore.attach(os.path.join(ps.directory, "latest"))  # a file, not a store's directory
    ps.close()
    for call in (ps.get, lambda: ps.get(timeout=0.1), lambda: ps.wait_for(1), ps.versions):
        with pytest.raises(ClosedError):
            call()
    with pytest.raises(ClosedError):
        ps.publish({"w": torch.ones(2)})


def test_full_shm_raises_tier_full_and_the_store_stays_usable(tmp_path, monkeypatch):
    with ParamStore(spill_dir=tmp_path) as ps:
        ps.publish({"w": torch.ones(4)})

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(TierFullError, match="shm-size") as info:
            ps.publish({"w": torch.ones(1 << 20)})
        assert info.value.tier == "shm" and info.value.requested > 4 << 20
        assert "spill_dir" in str(info.value) and "free" in str(info.value)
        assert ps.version == 1 and ps.versions() == [1]
        assert sorted(os.listdir(ps.directory)) == [".tt-owner", "latest", "v-000000000001.ttp"]
        monkeypatch.undo()
        assert ps.publish({"w": torch.full((4,), 2.0)}) == 2
        assert (ps.get()["w"] == 2).all()


_FULL_SHM_CHILD = r"""
import os, sys, torch
from tensortier.errors import TierFullError
from tensortier.rl import ParamStore
ps = ParamStore(spill_dir=sys.argv[1])
ps.publish({"w": torch.ones(4)})
try:
    ps.publish({"w": torch.ones(8 << 20)})  # 32 MiB into a 16 MiB tmpfs
except TierFullError as e:
    print("FULL", e)
assert sorted(os.listdir(ps.directory)) == [".tt-owner", "latest", "v-000000000001.ttp"]
assert ps.publish({"w": torch.full((4,), 3.0)}) == 2 and (ps.get()["w"] == 3).all()
ps.close()
print("OK")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_publish_into_a_real_small_tmpfs_does_not_sigbus(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        r = subprocess.run(
            [sys.executable, "-c", _FULL_SHM_CHILD, str(mnt)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -7: killed by SIGBUS
    assert "FULL" in r.stdout and "OK" in r.stdout, r.stdout


_KILLED_PUBLISHER = r"""
import os, signal, sys, torch
from tensortier.rl import ParamStore
ps = ParamStore(spill_dir=sys.argv[1])
ps.publish({"w": torch.full((1000,), 7.0)})
print(ps.directory, flush=True)
sys.stdin.readline()  # the test attached and holds version 1
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkilled_publisher_is_detected_and_its_directory_reclaimed(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUBLISHER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        path = child.stdout.readline().strip()
        reader = ParamStore.attach(path)
        held = reader.get()  # holds a shared flock on v-1 while its tensors live
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(60) == -signal.SIGKILL
    finally:
        child.kill()
    assert isinstance(in_thread(lambda: reader.wait_for(2)), ClosedError)
    assert os.path.isdir(path)
    # The next store made there reclaims the dead publisher's directory; the reader's shared
    # locks on version files do not keep it (the owner lock is a different file).
    with ParamStore(spill_dir=tmp_path) as fresh:
        assert not os.path.exists(path)
        assert os.listdir(tmp_path) == [os.path.basename(fresh.directory)]
    assert (held["w"] == 7).all()  # the mapping outlives the files
    assert isinstance(in_thread(lambda: reader.get(timeout=5)), ClosedError)


def _publish_fsdp2(rank: int, world: int) -> dict:
    """A learner under FSDP2 (2 gloo ranks): its state_dict() holds DTensor shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)).bfloat16()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    full = get_model_state_dict(  # what the error names: full tensors on rank 0 (a collective)
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return {}
    with ParamStore() as params:
        try:
            params.publish(model.state_dict())
            refused = ""
        except TypeError as exc:
            refused = str(exc)
        got = params.get(params.publish(full))
        return {"refused": refused, "got": {k: t.float().tolist() for k, t in got.items()}}


def test_an_fsdp2_learner_is_told_to_publish_a_full_state_dict():
    """FSDP2's state_dict() holds DTensors (this rank's shard only): publish raised an untyped
    RuntimeError from inside the copy (uneven shards: a sharding error), now a TypeError that
    names the tensor and the fix, and the fix publishes the whole model bit for bit."""
    from tests import distributed

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)).bfloat16()
    result = distributed.run(_publish_fsdp2, 2)[0]
    assert "'0.weight' is a DTensor" in result["refused"]
    assert "full_state_dict=True" in result["refused"]
    assert result["got"] == {k: t.float().tolist() for k, t in plain.state_dict().items()}


class _TiedPolicy(torch.nn.Module):
    """A small language-model policy whose output layer is its embedding (GPT-2, Qwen, T5)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(tokens)))


def test_tied_weights_are_published_once_and_read_back_tied():
    """Tied weights were written twice per version (twice the shared memory and the copy) and
    read back as two tensors; now once, and a reader's assign=True load stays tied."""
    torch.manual_seed(0)
    learner = _TiedPolicy().bfloat16()
    sd = learner.state_dict()
    untied = {k: t.clone() for k, t in sd.items()}
    tokens = torch.randint(0, 512, (4, 8))
    with ParamStore() as params:
        params.publish(untied)
        one = params.stats["bytes_published"]
        got = params.get(params.publish(sd))
        tied_bytes = params.stats["bytes_published"] - one
        assert one - tied_bytes >= sd["emb.weight"].nbytes  # the embedding's bytes: once
        assert got["emb.weight"].data_ptr() == got["head.weight"].data_ptr()
        collector = _TiedPolicy().bfloat16()
        collector.load_state_dict(got, assign=True)  # zero-copy load into the collector
        assert collector.head.weight.data_ptr() == collector.emb.weight.data_ptr()
        for name, t in sd.items():
            assert bit_equal(got[name], t), name
        with torch.no_grad():
            assert bit_equal(collector(tokens), learner(tokens))
        del got, collector
