"""Sharded replay section of `python -m benchmarks replay`: K=1 vs K=2 shards on one Ray node.

For each K: (a) add throughput: 2 collector tasks ``extend`` 32 x 10 KB items per call for
``seconds``; (b) sample throughput: 2 learner tasks ``sample(256)`` + ``update_priorities`` for
``seconds`` on the filled buffer. Then a rate-limited run with K=2 (``samples_per_insert=8``): 2
collectors and 1 learner for ``seconds``; the coordinator's extremes of ``diff = 8 * inserts -
samples`` must stay inside ``[min_diff, max_diff]`` (the error buffer) over the whole run.

Cores: Ray is started with ``num_cpus=2`` (this machine's count); shards reserve no CPU, each task
0.5. With 2 cores the shard processes, collectors and learners share them, so K=2 can only gain
where one shard process was the bottleneck. Run alone:
``python -m benchmarks.replay_sharded --json benchmarks/results/replay-sharded-cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from benchmarks import _harness as harness
from benchmarks._common import environment, one_ray_node, write_json
from tensortier._units import parse_size, print_table

_CPUS = 2


def _tasks(ray):
    from tensortier.errors import RateLimitTimeout

    @ray.remote(num_cpus=0.5)
    def collect(buf, seconds: float, item_bytes: int, timeout: float | None) -> int:
        payload = np.random.default_rng(0).integers(0, 255, item_bytes, dtype=np.uint8)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                buf.extend([{"obs": payload, "i": n + k} for k in range(32)], timeout=timeout)
            except RateLimitTimeout:
                if time.monotonic() > end:
                    break  # the learner stopped first
                raise
            n += 32
        return n

    @ray.remote(num_cpus=0.5)
    def learn(buf, seconds: float, batch: int, timeout: float | None) -> int:
        rng = np.random.default_rng(1)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                b = buf.sample(batch, timeout=timeout)
            except RateLimitTimeout:
                if time.monotonic() > end:
                    break  # the collectors stopped first
                raise
            buf.update_priorities(b.indices, rng.random(len(b)) + 0.01)
            n += len(b)
        return n

    return collect, learn


def sharded_section(
    directory: str, item_bytes: int, batch: int, seconds: float
) -> tuple[list[dict], dict]:
    """K=1 and K=2 rows, then the rate-limited K=2 row, on one local Ray node; the ratios."""
    with one_ray_node(_CPUS) as ray:
        tasks = _tasks(ray)
        collect = tasks[0]
        ray.get([collect.remote(None, 0, 1, None) for _ in range(2)])  # workers up before timing
        rows = [_shards_row(ray, tasks, k, directory, item_bytes, batch, seconds) for k in (1, 2)]
        one, two = rows
        ratios = {
            "sharded_k2_vs_k1_add": two["add_per_s"] / one["add_per_s"],
            "sharded_k2_vs_k1_sample": two["sample_items_per_s"] / one["sample_items_per_s"],
        }
        row, within = _rate_limited_row(ray, tasks, directory, item_bytes, batch, seconds)
        rows.append(row)
        ratios["sharded_ratelimit_samples_per_insert"] = row["samples_per_insert"]
        ratios["sharded_ratelimit_within_error_buffer"] = float(within)
    return rows, ratios


def checks(ratios: dict) -> dict[str, bool]:
    """The section's correctness check, for :func:`harness.require` (empty where it did not run):
    a rate limiter whose ``diff`` left its error buffer did not limit, whatever its rates."""
    key = "sharded_ratelimit_within_error_buffer"
    if key not in ratios:
        return {}
    return {"the rate-limited shards kept diff inside the error buffer": bool(ratios[key])}


def _shards_row(
    ray, tasks, k: int, directory: str, item_bytes: int, batch: int, seconds: float
) -> dict:
    """K shards: 2 collectors fill the buffer for ``seconds``, then 2 learners sample it."""
    from tensortier.rl import Prioritized, ReplayBuffer, serve

    collect, learn = tasks
    tmpl = ReplayBuffer(200_000, host_budget="1GiB", spill_dir=directory, sampler=Prioritized())
    buf = serve(tmpl, shards=k)
    try:
        t0 = time.perf_counter()
        added = sum(ray.get([collect.remote(buf, seconds, item_bytes, None) for _ in range(2)]))
        add_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sampled = sum(ray.get([learn.remote(buf, seconds, batch, 0) for _ in range(2)]))
        sample_s = time.perf_counter() - t0
        return {
            "section": "sharded",
            "peer": f"tensortier shards={k}",
            "shards": k,
            "items": len(buf),
            "add_per_s": added / add_s,
            "add_mb_per_s": added * item_bytes / add_s / 1e6,
            "sample_items_per_s": sampled / sample_s,
            "collectors": 2,
            "learners": 2,
        }
    finally:
        buf.close()
        tmpl.close()


def _rate_limited_row(
    ray, tasks, directory: str, item_bytes: int, batch: int, seconds: float
) -> tuple[dict, bool]:
    """2 collectors, 1 learner, samples_per_insert 8 held over 2 shards; the row, and whether
    the coordinator's extremes of ``diff`` stayed inside the error buffer."""
    from tensortier.rl import Prioritized, RateLimit, ReplayBuffer, serve

    collect, learn = tasks
    limit = RateLimit(8, min_size_to_sample=1000, error_buffer=2048, timeout=60)
    tmpl = ReplayBuffer(
        200_000,
        host_budget="1GiB",
        spill_dir=directory,
        sampler=Prioritized(),
        rate_limit=limit,
    )
    buf = serve(tmpl, shards=2)
    try:
        t0 = time.perf_counter()
        cols = [collect.remote(buf, seconds, item_bytes, 5.0) for _ in range(2)]
        sampled = ray.get(learn.remote(buf, seconds, batch, 5.0))
        added = sum(ray.get(cols))
        wall = time.perf_counter() - t0
        st = buf.stats["rate_limiter"]
    finally:
        buf.close()
        tmpl.close()
    within = limit.min_diff <= st["diff_low"] and st["diff_high"] <= limit.max_diff
    row = {
        "section": "sharded-ratelimit",
        "peer": "tensortier shards=2, samples_per_insert=8",
        "shards": 2,
        "add_per_s": added / wall,
        "sample_items_per_s": sampled / wall,
        "inserts": st["inserts"],
        "samples": st["samples"],
        "samples_per_insert": st["samples"] / max(st["inserts"], 1),
        "diff_low": st["diff_low"],
        "diff_high": st["diff_high"],
        "min_diff": limit.min_diff,
        "max_diff": limit.max_diff,
        "insert_waits": st["insert_waits"],
        "sample_waits": st["sample_waits"],
    }
    return row, within


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="spill directory")
    p.add_argument("--item-bytes", default="10KB")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each timed phase")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    harness.add_args(p, rounds=1)
    args = p.parse_args(argv)
    item_bytes = parse_size(args.item_bytes, name="--item-bytes")
    # one run of each phase: the load envelope only (as tiers --remote), always noisy
    session = harness.Session("replay-sharded", 1, args.quiet_wait, args.quiet_load)
    with session:
        rows, ratios = sharded_section(args.dir, item_bytes, args.batch, args.seconds)
    measurement = session.report({})
    print(harness.summary_line(measurement))
    cols = ["section", "peer", "add_per_s", "add_mb_per_s", "sample_items_per_s"]
    cols += ["samples_per_insert", "diff_low", "diff_high", "min_diff", "max_diff"]
    print_table(rows, cols)
    for k, v in ratios.items():
        print(f"{k}: {v:.3g}")
    write_json(
        args.json,
        "replay-sharded",
        rows,
        ratios=ratios,
        measurement=measurement,
        settings={
            "item_bytes": item_bytes,
            "batch": args.batch,
            "seconds": args.seconds,
            "ray_num_cpus": _CPUS,
            "machine_cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),  # the cores are shared with other jobs
            "env": environment(),
        },
    )
    harness.require(checks(ratios))


if __name__ == "__main__":
    main()
