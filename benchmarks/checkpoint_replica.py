"""`python -m benchmarks checkpoint --replica`: restore from an in-memory replica vs from disk.

A Ray cluster of two simulated nodes on this machine (``ray.cluster_utils.Cluster``, under a
private temporary directory): the driver's node and one replica node. An MLP whose parameters plus
AdamW state make about ``--state-size`` is checkpointed with ``Checkpointer(replicas=1)``; then,
in the same run and alternating, the training state is restored into a fresh model and optimizer
from the disk checkpoint (cold: every file's pages are dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` first) and from the replica (``source == "replica"``).
Each round saves a new step first, so neither read is served from a copy a previous round left
(Ray caches a fetched object on the reader's node). Both restores are end to end: manifest,
transfer, CRC32C of every tensor, ``load_state_dict``. Results must be bit-identical.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from benchmarks import _harness as harness
from benchmarks._common import PeakRSS, environment, two_ray_nodes, write_json
from tensortier._units import format_size, parse_size, print_table
from tensortier.checkpoint import Checkpointer


def drop_cache(path: str) -> int:
    """Drop the page cache of every file under ``path``; returns the bytes they hold."""
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return a == b


@dataclass
class _Seconds:
    """Every round's timings, one list per measurement, the rounds aligned."""

    disk: list[float] = field(default_factory=list)
    replica: list[float] = field(default_factory=list)
    push: list[float] = field(default_factory=list)
    persist: list[float] = field(default_factory=list)
    wire: list[float] = field(default_factory=list)
    push_phases: list[dict] = field(default_factory=list)  # where each push's time went
    restore_phases: list[dict] = field(default_factory=list)  # each replica restore's
    peaks: dict[str, list[int]] = field(default_factory=dict)  # source -> each restore's peak


def _save(ckdir: str, r: int, model, opt, sec: _Seconds) -> int:
    """Round ``r``'s checkpoint, persisted and pushed to the replica node; its bytes. Each
    round saves a newer step, so no read is served from a copy an earlier round left."""
    with Checkpointer(ckdir, keep=2, replicas=1, replica_timeout=300) as ck:
        if r:
            ck.restore()  # continue the run: the next step is newer
        ck.save(r, model=model, optimizer=opt)
        ck.wait()
        if ck.stats().last_replica_error:
            raise RuntimeError(f"replica push failed: {ck.stats().last_replica_error}")
        sec.persist.append(ck.stats().last_persist_seconds)
        sec.push.append(ck.stats().last_replica_seconds)
        sec.push_phases.append(ck.stats().last_replica_phases)
        return ck.stats().last_persist_bytes


def _restore_both(ckdir: str, r: int, target, target_opt, sec: _Seconds) -> dict:
    """Restore from the cold disk checkpoint and from the replica, the first alternating by
    round; each source's model and optimizer state, cloned for the bit-for-bit comparison."""
    got = {}
    for source in ("disk", "replica") if r % 2 == 0 else ("replica", "disk"):
        cached = drop_cache(ckdir) if source == "disk" else 0
        rss = PeakRSS()
        start = rss.reset()  # each source's own peak: what its restore holds beyond the target
        t0 = time.perf_counter()
        with Checkpointer(ckdir, keep=2, replicas=int(source == "replica")) as ck:
            st = ck.restore(model=target, optimizer=target_opt)
            phases = ck.stats().last_replica_restore_phases
        seconds = time.perf_counter() - t0
        sec.peaks.setdefault(source, []).append(max(0, rss.peak() - start))
        if st.source != source:
            raise RuntimeError(f"restore read from {st.source}: {st.fallback}")
        (sec.disk if source == "disk" else sec.replica).append(seconds)
        if source == "replica":
            sec.restore_phases.append({**phases, "total_s": seconds})
        got[source] = {
            "model": {k: v.clone() for k, v in target.state_dict().items()},
            "optimizer": target_opt.state_dict(),
        }
        got[source]["optimizer"] = _clone(got[source]["optimizer"])
        del cached
    return got


def _wire_seconds(ray, peer, nbytes: int) -> float:
    """The engine's limit: one object of the same size made on that node, pulled here."""
    ref = peer.make.remote(nbytes)
    ray.wait([ref], fetch_local=False, timeout=300)
    t0 = time.perf_counter()
    arr = ray.get(ref, timeout=300)
    seconds = time.perf_counter() - t0
    del arr, ref
    return seconds


def _rows(session: harness.Session, sec: _Seconds, nbytes: int):
    """``(rows, timed, ratios)``: disk, replica and the bare transfer, medians over the rounds,
    and the replica's and the transfer's time against the disk's, within each round."""
    disk, replica = statistics.median(sec.disk), statistics.median(sec.replica)
    rows = [
        {
            "source": "disk (cold: posix_fadvise DONTNEED)",
            "restore_s": disk,
            "gbps": nbytes / disk / 1e9,
            "all_s": sec.disk,
        },
        {
            "source": "in-memory replica (other node)",
            "restore_s": replica,
            "gbps": nbytes / replica / 1e9,
            "all_s": sec.replica,
            "vs_disk": replica / disk,
        },
    ]
    wire = statistics.median(sec.wire)
    rows.append(
        {
            "source": "ray.get of one object of that size from the other node (transfer only)",
            "restore_s": wire,
            "gbps": nbytes / wire / 1e9,
            "all_s": sec.wire,
            "vs_disk": wire / disk,
        }
    )
    per_round = [
        {"disk": {"restore_s": d}, "replica": {"restore_s": r}, "wire": {"restore_s": w}}
        for d, r, w in zip(sec.disk, sec.replica, sec.wire)
    ]
    timed = {k: harness.variant_stats(per_round, k, ["restore_s"]) for k in per_round[0]}
    for row, key in zip(rows, ("disk", "replica", "wire")):
        row.update(session.row_fields(timed[key]))
        if key in sec.peaks:  # the wire's transfer lands in the other node's store
            row["peak_extra_rss"] = max(sec.peaks[key])
    ratios = {
        "replica_vs_disk": harness.round_ratios(per_round, "replica", "disk", "restore_s"),
        "wire_vs_disk": harness.round_ratios(per_round, "wire", "disk", "restore_s"),
    }
    return rows, timed, ratios


def rounds_of(args: argparse.Namespace) -> int:
    """Rounds of save + both restores: ``--rounds`` (every area's option; it was ignored here),
    else ``--checkpoints``, else 3 (2 with ``--quick``)."""
    return args.rounds or args.checkpoints or (2 if args.quick else 3)


def run(args: argparse.Namespace) -> list[dict]:
    import ray

    from benchmarks._mlp import build, train

    state = parse_size(args.state_size or ("64MiB" if args.quick else "1GiB"), name="--state-size")
    rounds = rounds_of(args)
    device = torch.device("cpu")
    model, opt, width = build(state, device)
    train(model, opt, width, args.batch, 2, device)  # the optimizer state exists
    target, target_opt, _ = build(state, device)
    train(target, target_opt, width, args.batch, 1, device)
    store = int(state * 1.3) + (128 << 20)  # one replica (or one fetched copy) plus slack
    ckdir = tempfile.mkdtemp(prefix="tt-bench-replica-", dir=args.dir)
    sec = _Seconds()
    intact = True
    print(
        f"state {format_size(state)} (MLP width {width}), {rounds} rounds, checkpoints in {ckdir}"
    )
    session = harness.Session("checkpoint-replica", rounds, args.quiet_wait, args.quiet_load)
    try:
        with session, two_ray_nodes(store) as (_, peer, _):
            for r in range(rounds):
                nbytes = _save(ckdir, r, model, opt, sec)
                got = _restore_both(ckdir, r, target, target_opt, sec)
                sec.wire.append(_wire_seconds(ray, peer, nbytes))
                intact &= _same(got["disk"], got["replica"])
                intact &= _same(got["disk"]["model"], model.state_dict())
                del got
            Checkpointer(ckdir, replicas=1).drop_replicas()
    finally:
        shutil.rmtree(ckdir, ignore_errors=True)
    rows, timed, ratios = _rows(session, sec, nbytes)
    disk, replica = rows[0]["restore_s"], rows[1]["restore_s"]
    measurement = session.report(timed, ratios)
    print_table(rows, ["source", "restore_s", "gbps", "vs_disk", "peak_extra_rss", "noisy"])
    print(harness.summary_line(measurement))
    print(
        f"replica/disk restore time: {replica / disk:.3f}x (target <= 0.3x); push "
        f"{statistics.median(sec.push):.3f}s after a {statistics.median(sec.persist):.3f}s "
        f"persist; bit-identical: {intact}"
    )
    write_json(
        args.json,
        "checkpoint-replica",
        rows,
        measurement=measurement,
        state_size=state,
        checkpoint_bytes=nbytes,
        rounds=rounds,
        replica_vs_disk=replica / disk,
        target_replica_vs_disk=0.3,
        replica_push_s=sec.push,
        replica_push_phases=sec.push_phases,
        replica_restore_phases=sec.restore_phases,
        persist_s=sec.persist,
        cold_disk="posix_fadvise(POSIX_FADV_DONTNEED) on every checkpoint file before the read",
        intact=intact,
        dir=args.dir,
        cpus=environment()["cpus"],
    )
    harness.require({"the replica and the disk restored the same bits as were saved": intact})
    return rows


def _clone(obj):
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return obj
