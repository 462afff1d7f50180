import os

import pytest
import torch

from tests._helpers import run_benchmark


@pytest.mark.slow
def test_bench_checkpoint_runs_the_three_variants_side_by_side(tmp_path):
    data = run_benchmark(
        tmp_path / "checkpoint.json",
        "checkpoint --quick --state-size 8MiB --every 2 --checkpoints 2 --auto-steps 12 --batch 4",
        tmp_path,
    )
    assert data["measurement"]["order"] == ["dd", "none", "torch.save", "dcp", "tensortier"]
    assert data["benchmark"] == "checkpoint" and "device" in data["env"]
    rows = {r["variant"]: r for r in data["rows"]}
    assert {"torch.save (sync)", "tensortier Checkpointer"} <= set(rows)
    assert "torch DCP async_save" in rows or "dcp" in rows  # measured, or its error reported
    tt_row = rows["tensortier Checkpointer"]
    assert tt_row["state_bytes"] > 8e6 * 0.9 and tt_row["persist_gbps"] > 0
    assert rows["torch.save (sync)"]["stall_vs_torch_save"] == 1
    assert data["auto"]["steps"] == 12 and data["disk_limit_gbps"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]  # scratch removed


@pytest.mark.slow
def test_bench_checkpoint_replica_restores_from_both_sources(tmp_path):
    pytest.importorskip("ray")
    data = run_benchmark(
        tmp_path / "replica.json",
        "checkpoint --replica --quick --state-size 8MiB --checkpoints 2",
        tmp_path,
    )
    assert data["benchmark"] == "checkpoint-replica" and data["intact"] is True
    disk, replica, wire = data["rows"]
    assert disk["source"].startswith("disk (cold") and replica["source"].startswith("in-memory")
    assert len(disk["all_s"]) == len(replica["all_s"]) == len(wire["all_s"]) == 2
    assert data["replica_vs_disk"] == replica["restore_s"] / disk["restore_s"]
    assert disk["peak_extra_rss"] > 0 and replica["peak_extra_rss"] > 0  # each source's own
    assert data["checkpoint_bytes"] > 8e6 * 0.9 and "POSIX_FADV_DONTNEED" in data["cold_disk"]
    assert [list(p) for p in data["replica_push_phases"]] == [
        ["choose", "start", "send", "commit"]
    ] * 2
    assert [sorted(p) for p in data["replica_restore_phases"]] == [
        ["copy_verify", "fetch", "find", "total_s"]
    ] * 2
    assert [p.name for p in tmp_path.iterdir()] == ["replica.json"]  # scratch removed


def test_the_replica_run_takes_its_rounds_from_rounds():
    """``checkpoint --replica --rounds 5`` ran 3 rounds: only ``--checkpoints`` was read."""
    import argparse

    from benchmarks import checkpoint, checkpoint_replica

    p = argparse.ArgumentParser()
    checkpoint.add_args(p)
    rounds = lambda *argv: checkpoint_replica.rounds_of(p.parse_args(["--replica", *argv]))  # noqa: E731
    assert rounds("--rounds", "5") == 5 and rounds("--checkpoints", "4") == 4
    assert rounds() == 3 and rounds("--quick") == 2


def test_dcp_persist_starts_when_its_staging_is_done_like_tensortiers_after_its_snapshot(
    monkeypatch, tmp_path
):
    """DCP's persist time included its staging copy (tensortier's starts after its snapshot),
    so its persist bandwidth was understated; the staging now counts in its durable time."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp

    from benchmarks import checkpoint

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(checkpoint, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    futures = []

    def async_save(state, checkpoint_id, storage_writer):
        clock.now += 2.0  # the staging copy: async_save returns when it is done
        futures.append(Future())
        return futures[-1]

    monkeypatch.setattr(dcp, "async_save", async_save)
    v = checkpoint.DcpAsync(str(tmp_path), every=1)
    model = torch.nn.Linear(2, 2)
    v.after_step(model, torch.optim.AdamW(model.parameters()), 0)
    clock.now += 3.0  # the write
    futures[-1].set_result(None)
    v.finish()
    assert v.stalls == [2.0] and v.persists == [3.0] and v.durables == [5.0]


def test_a_variants_extra_peak_does_not_depend_on_what_ran_before_it(tmp_path):
    """Variants share one process: one that ran after another reused the heap that one freed,
    and its copies did not show in RSS (tensortier after DCP: 33 MiB; first: 129 MiB, for a
    128 MiB state). Its snapshot holds a copy of the whole state, whatever ran before."""
    import argparse

    from benchmarks import _mlp, checkpoint

    dev, state = torch.device("cpu"), 64 << 20
    model, opt, width = _mlp.build(state, dev)
    _mlp.train(model, opt, width, 2, 1, dev)  # the optimizer state exists
    args = argparse.Namespace(dir=str(tmp_path), batch=2)
    for make in (lambda r: checkpoint.DcpAsync(r, 2), lambda r: checkpoint.Tensortier(r, 2)):
        _, _, peak = checkpoint._measure(make, model, opt, width, args, 2, dev, None)
    assert peak > 0.75 * state


def test_dcp_on_a_gpu_keeps_one_caching_writer_as_its_recipe_recommends(monkeypatch, tmp_path):
    """DCP made a fresh staging copy every save; its async recipe keeps one writer with
    ``cache_staged_state_dict=True`` across saves (pinned, so only with an accelerator)."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from benchmarks import checkpoint

    writers = []

    def async_save(state, checkpoint_id, storage_writer):
        writers.append(storage_writer)
        return Future()

    monkeypatch.setattr(dcp, "async_save", async_save)
    assert checkpoint.DcpAsync(str(tmp_path), every=1).writer is None  # CPU: default stager
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    v = checkpoint.DcpAsync(str(tmp_path), every=2)
    model = torch.nn.Linear(2, 2)
    v.after_step(model, torch.optim.AdamW(model.parameters()), 1)
    assert isinstance(writers[0], FileSystemWriter) and writers[0].cache_staged_state_dict


def test_dcps_fallback_process_group_needs_no_port_a_parallel_run_may_hold(monkeypatch, tmp_path):
    """The fallback group for a DCP build that needs one listened on port 29533: a second run
    on the machine (or anything else on that port) failed to start it."""
    import socket

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks import checkpoint

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    real, calls = dcp.async_save, []

    def async_save(state, **kw):
        calls.append(dist.is_initialized())
        if not dist.is_initialized():
            raise RuntimeError("needs a process group")
        return real(state, **kw)

    monkeypatch.setattr(dcp, "async_save", async_save)
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 29533))
        held.listen()
    except OSError:
        pass  # already held by someone else: the same situation
    try:
        v = checkpoint.DcpAsync(str(tmp_path), every=1)
        model = torch.nn.Linear(2, 2)
        with pytest.warns(UserWarning, match="using gloo"):
            v.after_step(model, torch.optim.AdamW(model.parameters()), 0)
        v.finish()
        assert calls == [False, True] and v.persists and "MASTER_PORT" not in os.environ
    finally:
        held.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_torch_saves_stall_includes_the_fsync_the_loop_waits_for(monkeypatch, tmp_path):
    """torch.save's fsync ran in the loop (its ``loop_s`` held it) but its stall stopped before
    it, so its stall and the others' ratios to it were not of the same blocked time."""
    from types import SimpleNamespace

    from benchmarks import checkpoint

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(checkpoint, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    def save(obj, path):
        clock.now += 2.0
        open(path, "wb").close()

    def fsync(root):
        clock.now += 3.0

    monkeypatch.setattr(checkpoint.torch, "save", save)
    monkeypatch.setattr(checkpoint, "_fsync_tree", fsync)
    v = checkpoint.TorchSave(str(tmp_path), every=1)
    model = torch.nn.Linear(2, 2)
    v.after_step(model, torch.optim.AdamW(model.parameters()), 0)
    assert v.stalls == v.persists == v.durables == [5.0]


def test_the_disk_limit_is_taken_in_every_round_beside_the_variants(monkeypatch, tmp_path):
    """``dd`` ran once before the rounds, so a persist bandwidth of round 3 was divided by the
    disk's speed of minutes before (the harness's rule: peers interleaved, ratios within a
    round). Here the disk doubles its speed in round 2, and so does every variant's write."""
    import argparse
    import json

    from benchmarks import checkpoint

    rounds = iter([1.0, 2.0, 2.0])  # dd in rounds 1 and 2, then the idle write's dd
    phase = [0]

    def dd(directory, nbytes):
        return next(rounds), 0.0

    def one_variant(variant_fn, model, opt, width, args, steps, device):
        persist = 2.0 if phase[0] == 0 else 1.0  # 1 GB: 0.5 GB/s, then 1 GB/s
        return {"name": variant_fn(str(tmp_path)).name, "nbytes": 10**9, "stall_s": 1.0,
                "persist_s": persist, "persist_gbps": 1 / persist, "durable_s": persist,
                "loop_s": 1.0, "peak": 0}  # fmt: skip

    real_run = checkpoint.harness.Session.run

    def run(self, variants, measure):
        def in_round(v, r):
            phase[0] = r
            return measure(v, r)

        return real_run(self, variants, in_round)

    monkeypatch.setattr(checkpoint, "dd_bandwidth", dd)
    monkeypatch.setattr(checkpoint, "_one_variant", one_variant)
    monkeypatch.setattr(checkpoint.harness.Session, "run", run)
    monkeypatch.setattr(checkpoint, "idle_persist_gbps", lambda *a: (2.0, True))
    monkeypatch.setattr(checkpoint, "_auto_row", lambda *a: {"checkpoints": 0, "steps_saved": [],
        "interval": 1, "slowdown": 0.0, "cpu_slowdown": 0.0})  # fmt: skip
    p = argparse.ArgumentParser()
    checkpoint.add_args(p)
    out = tmp_path / "c.json"
    argv = ["--quick", "--state-size", "1MiB", "--every", "1", "--checkpoints", "1"]
    argv += ["--rounds", "2", "--quiet-wait", "0", "--dir", str(tmp_path), "--json", str(out)]
    checkpoint.run(p.parse_args(argv))
    data = json.loads(out.read_text())
    assert data["measurement"]["order"][:2] == ["dd", "none"]
    for row in data["rows"]:
        assert row["persist_vs_disk_limit"] == 0.5, row
    assert data["tensortier_idle_persist_vs_disk_limit"] == 1.0
    rounds = iter([1.0, 2.0, 2.0])
    monkeypatch.setattr(checkpoint, "idle_persist_gbps", lambda *a: (2.0, False))
    with pytest.raises(SystemExit, match="restored the state it saved"):
        checkpoint.run(p.parse_args(argv))
    assert json.loads(out.read_text())["tensortier_restored_bit_identical"] is False


def test_tensortiers_checkpoint_is_read_back_and_a_wrong_restore_fails_the_run(
    tmp_path, monkeypatch
):
    """Nothing read a checkpoint back: the figures could be of checkpoints that do not restore.
    The idle save is now restored into the cleared model and optimizer and compared bit for
    bit; a restore that loads nothing fails."""
    from benchmarks import _mlp, checkpoint

    dev = torch.device("cpu")
    model, opt, width = _mlp.build(1 << 20, dev)
    _mlp.train(model, opt, width, 2, 2, dev)
    before = [p.clone() for p in model.parameters()]
    assert checkpoint.idle_persist_gbps(model, opt, str(tmp_path))[1] is True
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", lambda self, **kw: None)
    assert checkpoint.idle_persist_gbps(model, opt, str(tmp_path))[1] is False
    assert [p.name for p in tmp_path.iterdir()] == []
