"""Checkpointer(replicas=): the newest checkpoint in other nodes' RAM, restored after the writer
process is killed, with a fallback to disk when the replica is gone or incomplete.

A Ray cluster of simulated nodes on this machine (``ray.cluster_utils.Cluster``): a head node
(no CPUs) that the drivers attach to, and worker nodes that hold the replicas.
"""

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier.checkpoint import Checkpointer, _faults, _replica  # noqa: E402
from tensortier.errors import ConfigError  # noqa: E402
from tests.checkpoint._replica_child import make  # noqa: E402
from tests.ray_cluster import cluster_fixture  # noqa: E402

_STORE = 80 << 20  # object store of each simulated node
_ROOT = pathlib.Path(__file__).resolve().parents[2]


# the nodes' workers (and the writer process) import this checkout's tensortier
cluster = cluster_fixture("cluster", "nodes", "tmp", checkout_path=True)


def _flat(obj, prefix=""):
    """(path, tensor or value) pairs of a nested state dict, in a fixed order."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _flat(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def _state(model, opt) -> list:
    return list(_flat({"model": model.state_dict(), "optimizer": opt.state_dict()}))


def _assert_same(a: list, b: list) -> None:
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        else:
            assert x == y, path


def _restore(directory, replicas):
    model, opt = make()
    for p in model.parameters():  # differ from the saved state, so a no-op restore fails
        p.data.add_(1.0)
    with Checkpointer(directory, keep=2, replicas=replicas, replica_timeout=10) as ck:
        state = ck.restore(model=model, optimizer=opt)
        stats = ck.stats()
    return state, stats, _state(model, opt)


@pytest.fixture(scope="module")
def killed_writer(cluster, tmp_path_factory):
    """A writer process that trained 6 steps, checkpointed steps 1, 3, 5 with replicas=1, and
    was killed with SIGKILL."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.checkpoint._replica_child",
            cluster[0].address,
            directory,
            "6",
        ],
        stdout=subprocess.PIPE,
        cwd=_ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        line = b""
        while not line.endswith(b"\n") and child.poll() is None and time.monotonic() < deadline:
            if select.select([child.stdout], [], [], 1.0)[0]:
                line += child.stdout.readline()
        assert line.endswith(b"\n"), f"writer did not report (exit {child.poll()})"
        report = json.loads(line)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert report["committed"] == 5 and report["replica_error"] is None, report
    assert report["replica_pushes"] == 3 and len(report["replica_nodes"]) == 1, report
    return directory, report["replica_nodes"][0]


def test_restore_from_replica_after_the_writer_is_killed(killed_writer):
    directory, node = killed_writer
    state, stats, got = _restore(directory, replicas=1)
    assert state.source == "replica" and state.fallback is None, state.fallback
    assert state.saved_step == 5 and state.step == 6 and state.extra == {"step": 5}
    assert stats.replica_restores == 1 and stats.replica_fallbacks == 0
    disk, _, expected = _restore(directory, replicas=0)
    assert disk.source == "disk" and disk.saved_step == 5
    _assert_same(got, expected)  # bit for bit: model, optimizer state (and its step counts)


def test_only_the_newest_replica_is_kept(killed_writer):
    directory, node = killed_writer
    holders, problems = _replica._describe_all(ray, _replica.namespace(directory), 10)
    assert problems == [] and len(holders) == 1
    assert holders[0]["node"] == node and holders[0]["step"] == 5 and holders[0]["complete"]
    files = holders[0]["files"]
    assert set(files) == {p.name for p in pathlib.Path(directory, "step-5").glob("shard-*")}


def test_read_only_reader_restores_from_the_replica_and_writes_nothing(killed_writer):
    directory, _ = killed_writer
    before = {e.name: e.stat().st_mtime_ns for e in os.scandir(directory)}
    model, opt = make()
    with Checkpointer(directory, read_only=True, replicas=1, replica_timeout=10) as ck:
        state = ck.restore(model=model, optimizer=opt)
    assert state.source == "replica" and state.saved_step == 5, state.fallback
    assert {e.name: e.stat().st_mtime_ns for e in os.scandir(directory)} == before
    _, _, expected = _restore(directory, replicas=0)  # a writer: it takes the lock
    _assert_same(_state(model, opt), expected)


def test_incomplete_replica_is_ignored(cluster, tmp_path, monkeypatch):
    directory = str(tmp_path / "run")
    model, opt = make()
    real_point = _faults.point

    def point(name):  # the writer "dies" after sending the files, before the commit marker
        if name == "replica-sent" and ck.stats().committed == 1:
            raise RuntimeError("killed before the replica's commit")
        real_point(name)

    monkeypatch.setattr(_faults, "point", point)
    with Checkpointer(directory, keep=2, every=1, replicas=1, replica_timeout=10) as ck:
        for i in range(2):
            opt.zero_grad()
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
            ck.save(i, model=model, optimizer=opt)
            ck.wait()
        assert ck.stats().replica_pushes == 1 and ck.stats().replica_push_failures == 1
        assert "killed before" in ck.stats().last_replica_error
    holders, _ = _replica._describe_all(ray, _replica.namespace(directory), 10)
    assert [(h["step"], h["complete"]) for h in holders] == [(1, False)]
    state, stats, got = _restore(directory, replicas=1)
    assert state.source == "disk" and state.saved_step == 1
    assert "incomplete" in state.fallback and stats.replica_fallbacks == 1
    assert stats.last_fallback_reason == state.fallback
    _assert_same(got, _state(model, opt))
    Checkpointer(directory, replicas=1).drop_replicas()


def test_stale_or_damaged_replica_is_not_used(cluster, tmp_path):
    directory = str(tmp_path / "run")
    model, opt = make()
    with Checkpointer(directory, keep=2, replicas=1, replica_timeout=10) as ck:
        ck.save(0, model=model, optimizer=opt)
    opt.zero_grad()
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    with Checkpointer(directory, keep=2) as ck:  # step 1 on disk only: the replica is older
        ck.restore()
        ck.save(1, model=model, optimizer=opt)
    state, stats, got = _restore(directory, replicas=1)
    assert state.source == "disk" and state.saved_step == 1
    assert "no complete replica of step 1" in state.fallback and "step 0" in state.fallback
    _assert_same(got, _state(model, opt))

    # a replica of step 1 whose bytes differ from the manifest's checksums (one byte flipped)
    holders, _ = _replica._describe_all(ray, _replica.namespace(directory), 10)
    actor = ray.get_actor(f"replica-{holders[0]['node']}", namespace=_replica.namespace(directory))
    step_dir = pathlib.Path(directory, "step-1")
    files = {p.name: p.stat().st_size for p in step_dir.glob("shard-*")}
    manifest = (step_dir / "manifest.json").read_bytes()
    ray.get(actor.begin.remote(1, manifest, files), timeout=10)
    for name in files:
        data = bytearray((step_dir / name).read_bytes())
        data[-1] ^= 0xFF
        ray.get(actor.put.remote(1, name, np.frombuffer(bytes(data), np.uint8)), timeout=10)
    assert ray.get(actor.commit.remote(1), timeout=10)
    state, stats, got = _restore(directory, replicas=1)
    assert state.source == "disk" and "checksum mismatch" in state.fallback, state.fallback
    _assert_same(got, _state(model, opt))
    # the holder takes only flat uint8 arrays of the announced sizes (no user objects)
    with pytest.raises(ray.exceptions.RayTaskError, match="flat uint8"):
        ray.get(actor.put.remote(1, next(iter(files)), {"x": 1}), timeout=10)
    assert _replica.drop_replicas(directory) == 1


def test_replica_node_lost_falls_back_to_disk(cluster, killed_writer):
    c, workers, _ = cluster
    directory, node = killed_writer
    c.add_node(num_cpus=0, object_store_memory=_STORE)  # the cluster keeps two worker nodes
    doomed = next(w for w in workers if w.node_id == node)
    c.remove_node(doomed, allow_graceful=False)
    deadline = time.monotonic() + 30
    while any(n["NodeID"] == node and n["Alive"] for n in ray.nodes()):  # until Ray knows
        assert time.monotonic() < deadline, "Ray did not notice the removed node"
        time.sleep(0.1)
    t0 = time.monotonic()
    state, stats, got = _restore(directory, replicas=1)
    assert time.monotonic() - t0 < 30  # bounded by replica_timeout, never a hang
    assert state.source == "disk" and state.saved_step == 5
    assert stats.replica_fallbacks == 1 and stats.last_fallback_reason == state.fallback
    assert "lost" in state.fallback, state.fallback  # holder gone with its node, or found dead
    _, _, expected = _restore(directory, replicas=0)
    _assert_same(got, expected)


def test_bad_settings(cluster, tmp_path):
    for bad in (-1, 3, True, 1.0, "1"):
        with pytest.raises(ConfigError, match="replicas="):
            Checkpointer(tmp_path / "a", replicas=bad)
    with pytest.raises(ConfigError, match="one process only"):
        _replica.check_replicas(1, many_ranks=True)
    with pytest.raises(ConfigError, match="replica_timeout="):
        Checkpointer(tmp_path / "b", replicas=1, replica_timeout=0)
    c = cluster[0]
    model, opt = make()
    with Checkpointer(tmp_path / "c", replicas=1, replica_timeout=10) as ck:
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        ray.shutdown()  # a process that is not connected to the cluster restores from disk
        try:
            state = ck.restore(model=model, optimizer=opt)
            assert state.source == "disk" and "not initialized" in state.fallback
            with pytest.raises(ConfigError, match="needs a Ray cluster"):
                Checkpointer(tmp_path / "d", replicas=1)
        finally:
            ray.init(address=c.address, log_to_driver=False)
    _replica.drop_replicas(tmp_path / "c")


def _holder_actor(directory):
    holders, problems = _replica._describe_all(ray, _replica.namespace(str(directory)), 10)
    assert problems == [] and holders, problems
    return [
        ray.get_actor(f"replica-{h['node']}", namespace=_replica.namespace(str(directory)))
        for h in holders
    ]


def _push_one(directory, replicas: int = 1):
    """Step 0 checkpointed and pushed to ``replicas`` holders: ``(model, optimizer, stats)``."""
    model, opt = make()
    with Checkpointer(directory, replicas=replicas, replica_timeout=30) as ck:
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        stats = ck.stats()
    assert stats.replica_pushes == 1, stats.last_replica_error
    return model, opt, stats


def test_holder_worker_imports_neither_torch_nor_tensortier(cluster, tmp_path):
    """The holder's worker starts without importing torch (the first push's start-up)."""
    directory = tmp_path / "run"
    model, opt, _ = _push_one(directory)

    def loaded(_holder) -> list:  # defined here: Ray pickles it by value, importing nothing
        import sys

        return sorted(m for m in ("torch", "tensortier") if m in sys.modules)

    try:
        (actor,) = _holder_actor(directory)
        assert ray.get(actor.__ray_call__.remote(loaded), timeout=30) == []
        state, _, got = _restore(directory, replicas=1)  # and it still serves the replica
        assert state.source == "replica", state.fallback
        _assert_same(got, _state(model, opt))
    finally:
        _replica.drop_replicas(directory)


def test_each_file_is_serialized_once_for_two_replicas(cluster, tmp_path, monkeypatch):
    """replicas=2: the writer copies each file into the object store once, not once per holder."""
    from ray._private.serialization import SerializationContext

    serialized: list[int] = []
    real = SerializationContext.serialize

    def counting(self, value):
        if isinstance(value, np.ndarray) and value.nbytes > 1024:
            serialized.append(value.nbytes)
        return real(self, value)

    directory = tmp_path / "run"
    monkeypatch.setattr(SerializationContext, "serialize", counting)
    _, _, stats = _push_one(directory, replicas=2)
    assert len(stats.replica_nodes) == 2
    monkeypatch.undo()
    try:
        files = {p.name: p.stat().st_size for p in (directory / "step-0").glob("shard-*")}
        assert sorted(serialized) == sorted(files.values())
        for actor in _holder_actor(directory):  # both hold every file, bit for bit
            refs = ray.get(actor.fetch.remote(0), timeout=30)
            for name, (ref,) in refs.items():
                got = ray.get(ref, timeout=30)
                assert got.tobytes() == (directory / "step-0" / name).read_bytes()
    finally:
        _replica.drop_replicas(directory)


def test_push_and_restore_say_where_their_time_went(cluster, tmp_path):
    directory = tmp_path / "run"
    model, opt, pushed = _push_one(directory)
    try:
        phases = pushed.last_replica_phases
        assert list(phases) == ["choose", "start", "send", "commit"]
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) <= pushed.last_replica_seconds
        state, stats, got = _restore(directory, replicas=1)
        assert state.source == "replica", state.fallback
        assert list(stats.last_replica_restore_phases) == ["find", "fetch", "copy_verify"]
        assert all(v >= 0 for v in stats.last_replica_restore_phases.values())
        assert stats.as_dict()["last_replica_restore_phases"] == stats.last_replica_restore_phases
        _assert_same(got, _state(model, opt))
        disk, disk_stats, _ = _restore(directory, replicas=0)
        assert disk.source == "disk" and disk_stats.last_replica_restore_phases == {}
    finally:
        _replica.drop_replicas(directory)
