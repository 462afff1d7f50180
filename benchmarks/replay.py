"""`python -m benchmarks replay`: prioritized replay against TorchRL and a deque, spill, Ray, params.

Every peer runs in its own process so its peak RSS is its own. TorchRL's C++ segment tree does not
load with torch 2.13.0 (its wheels are built against another torch), so the TorchRL peer runs in a
virtual environment under ``--cache-dir`` with the torch release its wheel was built for, pinned in
``benchmarks/requirements-torchrl.txt`` (``make bench-peers`` creates it, or this benchmark on
first use; torch 2.14.1 is a CUDA build of several GB). RLlib's ``PrioritizedEpisodeReplayBuffer``
runs in this environment (the ``bench-rl`` extra, ``make bench-peers``); DI-engine is reported as not measured (its ``gym==0.25.1`` dependency does not
build).

Sections: (1) 100k x 10 KB items (``--quick``: 10k): add, ``extend`` (1000 items a call, the
items built first), prioritized sample (batch 256, collated into one array per field as a
learner consumes it: peers whose sample returns a list collate it inside its time) and priority
update throughput, peak RSS, alike for every peer; (1b) the rate-limited
path: a collector thread and a learner held to ``samples_per_insert=8``; (2) sample latency with 10k vs 1M items (small items, so the
sampler and index are what scale); (3) a spill run: 1M x 10 KB with a 2 GiB RAM budget
(``--spill-items`` to scale it down at the same RAM/total ratio); (4) Ray: 4 collector tasks adding,
1 learner sampling; (5) parameter store: publish 100 MB to 8 reader processes; (6) parameters to readers on
simulated nodes (``benchmarks/params_nodes.py``).
Run: ``python -m benchmarks replay --json benchmarks/results/replay-cpu.json [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks import _harness as harness
from benchmarks import params_nodes
from benchmarks._common import environment, one_ray_node, write_json
from tensortier._units import format_size, parse_size, print_table

PEERS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_replay_peers.py")
TORCHRL_REQUIREMENTS = os.path.join(os.path.dirname(PEERS_SCRIPT), "requirements-torchrl.txt")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=tempfile.gettempdir(), help="spill / scratch directory")
    p.add_argument(
        "--items", type=int, default=None, help="items in the main run (100k; 10k quick)"
    )
    p.add_argument("--item-bytes", default="10KB", help="bytes of each item's observation")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--batches", type=int, default=None, help="sample/update batches per peer (200; 50 quick)"
    )
    p.add_argument(
        "--spill-items", type=int, default=None, help="items in the spill run (1M; 0 skips)"
    )
    p.add_argument(
        "--spill-budget", default=None, help="RAM budget of the spill run (2GiB, scaled)"
    )
    p.add_argument(
        "--skip",
        default="",
        help="comma list of sections to skip: torchrl,rllib,ratelimit,ray,sharded,params,nodes",
    )
    p.add_argument(
        "--cache-dir",
        default=os.path.join(os.path.expanduser("~"), ".cache", "tensortier"),
        help="where the TorchRL virtual environment is created",
    )
    p.add_argument("--quick", action="store_true", help="small sizes")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    harness.add_args(p, rounds=3)


# ---------------------------------------------------------------------- peers in subprocesses
def _run_peer(
    python: str,
    peer: str,
    n: int,
    item_bytes: int,
    batch: int,
    rounds: int,
    directory: str,
    budget: int | None = None,
    env: dict | None = None,
) -> dict:
    scratch = tempfile.mkdtemp(prefix=f"tt-bench-{peer}-", dir=directory)
    cmd = [python, PEERS_SCRIPT, peer, str(n), str(item_bytes), str(batch), str(rounds), scratch]
    if budget is not None:
        cmd.append(str(budget))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout)[-600:]
    return {"error": f"exit {proc.returncode}: {tail.strip()}"}


def _torchrl_python(cache_dir: str) -> tuple[str | None, str]:
    """A python that can run TorchRL's PrioritizedSampler, creating its venv on first use."""
    probe = (
        "import torch, torchrl; from torchrl.data import PrioritizedSampler; "
        "PrioritizedSampler(8, 0.6, 0.4); print(torch.__version__, torchrl.__version__)"
    )
    here = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if here.returncode == 0:
        return sys.executable, f"this environment ({here.stdout.strip()})"
    venv = os.path.join(cache_dir, "torchrl-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"creating {venv} for TorchRL ({TORCHRL_REQUIREMENTS}; several GB)")
        os.makedirs(cache_dir, exist_ok=True)
        made = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
        if made.returncode == 0:
            pip = [python, "-m", "pip", "install", "-q", "-r", TORCHRL_REQUIREMENTS]
            made = subprocess.run(pip, capture_output=True, text=True)
        if made.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            why = (made.stderr or made.stdout).strip()[-400:]
            return None, f"could not create the TorchRL virtual environment: {why}"
    there = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if there.returncode != 0:
        return None, f"TorchRL venv cannot load its segment tree: {there.stderr[-300:]}"
    return python, f"{venv} ({there.stdout.strip()})"


# ---------------------------------------------------------------------- Ray section
def _ray_section(directory: str, item_bytes: int, batch: int, seconds: float) -> list[dict]:
    """Section 4 on one local Ray node: a served buffer under 4 collectors and 1 learner, then
    the parameter store through Ray's object store."""
    with one_ray_node(2) as ray:
        return [
            _ray_replay_row(ray, directory, item_bytes, batch, seconds),
            _ray_params_row(ray),
        ]


def _ray_replay_row(ray, directory: str, item_bytes: int, batch: int, seconds: float) -> dict:
    """4 collector tasks extend a served buffer while this process samples and updates."""
    from tensortier.rl import Prioritized, ReplayBuffer, serve

    local = ReplayBuffer(200_000, host_budget="1GiB", spill_dir=directory, sampler=Prioritized())
    remote = serve(local, num_cpus=0.5)

    @ray.remote(num_cpus=0.25)
    def collector(buf, seconds: float, item_bytes: int) -> int:
        payload = np.random.default_rng(0).integers(0, 255, item_bytes, dtype=np.uint8)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            buf.extend({"obs": payload, "i": n + k} for k in range(32))  # rollout chunks
            n += 32
        return n

    remote.add({"obs": np.zeros(item_bytes, np.uint8), "i": -1})
    ray.get(collector.remote(remote, 0.5, item_bytes))  # start workers before timing
    futures = [collector.remote(remote, seconds, item_bytes) for _ in range(4)]
    t0 = time.perf_counter()
    samples = 0
    while time.perf_counter() - t0 < seconds:
        b = remote.sample(batch)
        remote.update_priorities(b.indices, np.random.rand(len(b)) + 0.01)
        samples += len(b)
    added = sum(ray.get(futures))
    wall = time.perf_counter() - t0
    row = {
        "section": "ray",
        "peer": "tensortier serve (4 collectors, 1 learner)",
        "add_per_s": added / wall,
        "sample_items_per_s": samples / wall,
    }
    remote.close()
    local.close()
    return row


def _ray_params_row(ray) -> dict:
    """The parameter store through Ray's object store: one ray.put per version, 8 readers."""
    from tensortier.rl import ParamStore, serve

    pstore = serve(ParamStore(), num_cpus=0)
    state = {f"layer{i}.weight": torch.randn(100_000_000 // 4 // 4) for i in range(4)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    @ray.remote(num_cpus=0.1)
    class Reader:
        def read(self, store, version: int) -> float:
            p = store.get(min_version=version, timeout=300)
            for t in p.values():
                float(t.view(-1)[::1024].sum())  # touch every 4 KiB page
            return time.monotonic()

    readers = [Reader.remote() for _ in range(8)]
    pstore.publish(state)
    ray.get([r.read.remote(pstore, 1) for r in readers])  # readers started and warm
    pending = [r.read.remote(pstore, 2) for r in readers]
    time.sleep(1.0)  # every reader is waiting inside get()
    t0 = time.monotonic()
    pstore.publish(state)
    done = max(ray.get(pending))
    row = {
        "section": "params",
        "peer": "tensortier serve(ParamStore) via Ray",
        "bytes": nbytes,
        "publish_to_8_readers_s": done - t0,
    }
    pstore.close()
    return row


# ---------------------------------------------------------------------- parameter store section
def _shm_reader(path: str, versions: int, q) -> None:
    from tensortier.rl import ParamStore

    r = ParamStore.attach(path)
    for v in range(1, versions + 1):
        p = r.get(min_version=v, timeout=120)
        for t in p.values():
            t.view(torch.uint8).numpy()[::4096].sum()  # touch every page
        q.put((p.version, time.monotonic()))
        del p


def _queue_reader(inq, outq, versions: int) -> None:
    for _ in range(versions):
        state = inq.get()
        for a in state.values():
            a[::1024].sum()
        outq.put(time.monotonic())


def _params_section(nbytes: int, readers: int = 8) -> list[dict]:
    from tensortier.rl import ParamStore

    per = nbytes // 4 // 4
    state = {f"layer{i}.weight": torch.randn(per) for i in range(4)}
    ctx = mp.get_context("fork")
    rows = []
    with ParamStore(keep=2) as ps:
        q = ctx.Queue()
        procs = [ctx.Process(target=_shm_reader, args=(ps.directory, 3, q)) for _ in range(readers)]
        for p in procs:
            p.start()
        ps.publish(state)
        [q.get() for _ in procs]  # version 1 read by all: warm
        lat = []
        for _ in range(2):
            t0 = time.monotonic()
            ps.publish(state)
            t_pub = time.monotonic() - t0
            lat.append((t_pub, max(q.get()[1] for _ in procs) - t0))
        for p in procs:
            p.join()
        rows.append(
            {
                "section": "params",
                "peer": "tensortier ParamStore (shm)",
                "bytes": nbytes,
                "publish_s": min(x for x, _ in lat),
                "publish_to_8_readers_s": min(y for _, y in lat),
            }
        )
    # baseline: a multiprocessing.Queue per reader (each reader gets a pickled copy)
    arrays = {k: v.numpy() for k, v in state.items()}
    inqs = [ctx.Queue() for _ in range(readers)]
    outq = ctx.Queue()
    procs = [ctx.Process(target=_queue_reader, args=(iq, outq, 2)) for iq in inqs]
    for p in procs:
        p.start()
    for iq in inqs:
        iq.put(arrays)
    [outq.get() for _ in procs]
    t0 = time.monotonic()
    for iq in inqs:
        iq.put(arrays)
    done = max(outq.get() for _ in procs)
    for p in procs:
        p.join()
    rows.append(
        {
            "section": "params",
            "peer": "multiprocessing.Queue per reader (copies)",
            "bytes": nbytes,
            "publish_to_8_readers_s": done - t0,
        }
    )
    return rows


MAIN_TIMED = ("add_per_s", "extend_items_per_s", "sample_items_per_s", "update_items_per_s")


def _main_rows(session: harness.Session, per_round: list[dict], peers: list[str], n: int):
    """Section 1's rows (per peer: its timed rates are medians over the rounds, the rest its
    median round by sampling rate) and its ratios, each taken within a round."""
    rows, timed = [], {}
    for peer in peers:
        runs = [got[peer] for got in per_round]
        row = dict(harness.median_run(runs, "sample_items_per_s"))
        if "error" not in row:
            timed[peer] = harness.variant_stats(per_round, peer, MAIN_TIMED)
            row.update({k: s["median"] for k, s in timed[peer].items()})
            row.update(session.row_fields(timed[peer]))
        rows.append({"section": "main", "peer": peer, "items": n, **row})
    ratios, stats = {}, {}
    for peer in ("torchrl", "deque", "rllib"):
        if peer in timed and "tensortier" in timed:
            for k in MAIN_TIMED:
                stats[f"vs_{peer}_{k}"] = harness.round_ratios(per_round, "tensortier", peer, k)
                ratios[f"vs_{peer}_{k}"] = stats[f"vs_{peer}_{k}"]["median"]
    base = {r["peer"]: r for r in rows if "error" not in r}
    for k in ("extend_gb_per_s", "extend_steady_gb_per_s"):
        if k in base.get("tensortier", {}):
            ratios[k] = base["tensortier"][k]
    return rows, ratios, timed, stats


def _other_sections(args, skip, n, item_bytes, rounds, spill_n, spill_budget, rows, ratios):
    """Sections 1b-6, each run once (their rows and ratios appended in place)."""
    if "ratelimit" not in skip:
        print("[1b/5] rate-limited: 1 collector thread + 1 learner, samples_per_insert=8")
        res = _run_peer(
            sys.executable, "tensortier-ratelimited", n, item_bytes, args.batch, rounds, args.dir
        )
        rows.append({"section": "ratelimit", "peer": "tensortier", "items": n, **res})
        if "error" not in res:
            ratios["ratelimit_samples_per_insert"] = res["samples_per_insert"]
            ratios["ratelimit_drift_within_buffer"] = float(
                res["max_drift_items"] <= res["allowed_drift_items"]
            )

    print("[2/5] sample latency vs buffer size (100-byte items)")
    lat = {}
    for size in (10_000, 100_000 if args.quick else 1_000_000):
        res = _run_peer(sys.executable, "latency", size, 100, args.batch, 100, args.dir)
        lat[size] = res.get("sample_ms")
        rows.append({"section": "latency", "peer": "tensortier", "items": size, **res})
    sizes = sorted(lat)
    if all(lat.values()):
        ratios["latency_ratio_large_vs_10k"] = lat[sizes[-1]] / lat[sizes[0]]

    if spill_n:
        print(
            f"[3/5] spill run: {spill_n} x {format_size(item_bytes)}, budget "
            f"{format_size(spill_budget)} (needs {format_size(spill_n * item_bytes)} of disk)"
        )
        res = _run_peer(
            sys.executable,
            "tensortier-spill",
            spill_n,
            item_bytes,
            args.batch,
            rounds,
            args.dir,
            spill_budget,
        )
        rows.append(
            {
                "section": "spill",
                "peer": "tensortier",
                "items": spill_n,
                "scaled_down": spill_n < 1_000_000,
                **res,
            }
        )
        # the disk tier's write bandwidth on the same directory, in the same run (16 MiB tensors)
        from benchmarks.tiers import tier_bandwidth

        size = min(max(res.get("spill_bytes", 0), 64 << 20), 1 << 30)
        disk_w, _, intact, _ = tier_bandwidth(args.dir, size, 16 << 20)
        rows.append(
            {
                "section": "spill",
                "peer": "disk tier write (DiskStore.put)",
                "bytes": size,
                "write_gb_per_s": disk_w,
                "intact": intact,
            }
        )
        if "spill_gb_per_s" in res:
            # end to end (the add loop's rate of items leaving RAM) and the write path alone
            ratios["spill_vs_disk_tier_write"] = res["spill_gb_per_s"] / disk_w
            ratios["spill_write_path_vs_disk_tier_write"] = res["spill_write_gb_per_s"] / disk_w

    _ray_sections(args, skip, item_bytes, rows, ratios)


def _ray_sections(args, skip, item_bytes, rows, ratios) -> None:
    """Sections 4-6: Ray, shards, the parameter store (rows and ratios appended in place)."""
    if "ray" not in skip:
        print("[4/5] Ray: 4 collectors + 1 learner; ParamStore through the object store")
        try:
            rows += _ray_section(args.dir, item_bytes, args.batch, 5.0 if args.quick else 15.0)
        except Exception as exc:  # reported, not hidden
            rows.append({"section": "ray", "peer": "tensortier serve", "error": repr(exc)})
    if "sharded" not in skip:  # K=1 vs K=2 shards, rate limiter across shards
        from benchmarks.replay_sharded import sharded_section

        print("[4b/5] sharded: K=1 vs K=2 shards (2 collectors, 2 learners); rate-limited K=2")
        try:
            more, more_ratios = sharded_section(args.dir, item_bytes, args.batch, 5.0)
            rows += more
            ratios.update(more_ratios)
        except Exception as exc:  # reported, not hidden
            rows.append({"section": "sharded", "peer": "tensortier shards", "error": repr(exc)})
    if "params" not in skip:
        print("[5/5] parameter store: publish 100 MB to 8 readers")
        rows += _params_section(parse_size("100MB"))
    if "nodes" not in skip:  # 500 MB too: python -m benchmarks.params_nodes (module doc)
        print("[6/6] parameters to 3 readers on 2 simulated nodes: 5 MB, 50 MB")
        rows += params_nodes.section([parse_size("5MB"), parse_size("50MB")])


# ---------------------------------------------------------------------- driver
NOTES: dict[str, str] = {
    "di-engine": "not measured: DI-engine 0.5.3 needs gym==0.25.1, whose setup fails to build "
    "with current setuptools ('extras_require must be a dictionary ...')",
    "rllib": "PrioritizedEpisodeReplayBuffer (ray[rllib]) in this environment, fed 100-step "
    "episodes (extend: 10 of them per add call); its sample's one-step episodes are collated "
    "into arrays in its sample time; its update_priorities applies to the last sampled batch only",
}
COLUMNS = [
    "section",
    "peer",
    "items",
    "add_per_s",
    "extend_items_per_s",
    "spill_gb_per_s",
    "spill_write_gb_per_s",
    "write_gb_per_s",
    "sample_items_per_s",
    "sample_ms",
    "update_items_per_s",
    "peak_rss",
    "rss_growth",
    "publish_to_8_readers_s",
    "latency_s",
    "error",
]


def _sizes(args: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """``(item_bytes, items, batches, spill_items, spill_budget)``: ``--quick`` scales the
    defaults down, and a smaller spill run keeps the full run's 2 GiB-per-1M-items RAM ratio."""
    item_bytes = parse_size(args.item_bytes, name="--item-bytes")
    n = args.items or (10_000 if args.quick else 100_000)
    rounds = args.batches or (50 if args.quick else 200)
    spill_n = (
        args.spill_items if args.spill_items is not None else (50_000 if args.quick else 1_000_000)
    )
    full_spill_bytes = 1_000_000 * item_bytes
    spill_budget = (
        parse_size(args.spill_budget, name="--spill-budget")
        if args.spill_budget
        else int((2 << 30) * spill_n * item_bytes / full_spill_bytes)
    )
    return item_bytes, n, rounds, spill_n, spill_budget


def _main_peers(args: argparse.Namespace, skip: set[str], notes: dict[str, str]) -> dict:
    """Section 1's peers and the Python each runs under: TorchRL's own venv, when it loads
    (where it came from, or why it did not, goes into ``notes``; a TorchRL that does not load
    runs under None: its row says it is not installed)."""
    main_peers = [("tensortier", sys.executable), ("deque", sys.executable)]
    if "rllib" not in skip:
        main_peers.append(("rllib", sys.executable))
    if "torchrl" not in skip:
        py, where = _torchrl_python(args.cache_dir)
        notes["torchrl"] = where
        main_peers.insert(1, ("torchrl", py))
    return dict(main_peers)


def _print_results(rows: list[dict], ratios: dict, measurement: dict) -> None:
    """The table (RSS as sizes), every ratio and the measurement's one-line summary."""
    printable = []
    for r in rows:
        r2 = dict(r)
        for k in ("peak_rss", "rss_growth"):
            if isinstance(r2.get(k), int):
                r2[k] = format_size(r2[k])
        printable.append(r2)
    print_table(printable, COLUMNS)
    for k, v in ratios.items():
        print(f"{k}: {v:.3g}")
    print(harness.summary_line(measurement))


def run(args: argparse.Namespace) -> list[dict]:
    item_bytes, n, rounds, spill_n, spill_budget = _sizes(args)
    skip = set(filter(None, args.skip.split(",")))
    rows: list[dict] = []
    notes = dict(NOTES)

    session = harness.Session.from_args("replay", args)
    print(
        f"[1/5] main run: {n} items x {format_size(item_bytes)}, batch {args.batch}, "
        f"{session.rounds} interleaved rounds"
    )
    python = _main_peers(args, skip, notes)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # TorchRL's own venv

    def measure(peer: str, r: int) -> dict:
        if python[peer] is None:  # nothing measured, nothing made up
            return {"error": f"not installed: {notes[peer]}", "not_installed": True}
        env = clean if peer == "torchrl" else None
        res = _run_peer(python[peer], peer, n, item_bytes, args.batch, rounds, args.dir, env=env)
        print(f"  round {r + 1}: {peer}: {res.get('error') or 'ok'}")
        return res

    with session:
        per_round = session.run(list(python), measure)
        main_rows, ratios, timed, ratio_stats = _main_rows(session, per_round, list(python), n)
        rows += main_rows
        _other_sections(args, skip, n, item_bytes, rounds, spill_n, spill_budget, rows, ratios)
    measurement = session.report(timed, ratio_stats)
    _print_results(rows, ratios, measurement)
    write_json(
        args.json,
        "replay",
        rows,
        ratios=ratios,
        peers=notes,
        measurement=measurement,
        settings={
            "items": n,
            "item_bytes": item_bytes,
            "batch": args.batch,
            "batches": rounds,
            "rounds": session.rounds,
            "spill_items": spill_n,
            "spill_budget": spill_budget,
            "env": environment(),
        },
    )
    harness.require(_checks(rows, ratios))
    return rows


def _checks(rows: list[dict], ratios: dict) -> dict[str, bool]:
    """The run's correctness checks (those of the sections that ran), for
    :func:`harness.require`: a limiter that drifted out of its buffer or a disk tier that read
    back other bytes did not do the work its figures claim."""
    from benchmarks.replay_sharded import checks

    out = {**checks(ratios), **params_nodes.checks(rows)}
    if "ratelimit_drift_within_buffer" in ratios:
        name = "the rate-limited buffer's drift stayed inside its error buffer"
        out[name] = bool(ratios["ratelimit_drift_within_buffer"])
    for r in rows:
        if r.get("peer") == "disk tier write (DiskStore.put)":
            out["the disk tier read back every byte it wrote"] = bool(r["intact"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
