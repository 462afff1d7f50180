"""CPU seconds per GB of the catalog's phases: a figure a loaded machine does not change much.

``python -m benchmarks.catalog_cpu --dir /tmp/x [--records 6000]`` builds a catalog of random
bytes records (1 KB..100 KB, as ``benchmarks/catalog.py``), then reports, for the build and for
full/block-shuffle epochs read with ``O_DIRECT``: the process's CPU (user + system) per GB, and
the CPU of one thread reading every piece of the epoch by itself (``_pipeline._read_piece``:
read, check, decode, no consumer and no other thread), user and system apart; and the CPU per
record of random single-record reads (warm cache). Medians of ``--rounds`` (``--reps``) runs
with their spreads, the load (``measurement``), versions and peak RSS in ``--json``; every
record read is checked byte for byte outside the CPU counted, and a wrong one exits non-zero.
Wall-clock throughput is ``python -m benchmarks catalog``'s job, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil

import numpy as np

from benchmarks import _harness as harness
from benchmarks._common import PeakRSS, write_json
from benchmarks.catalog import Records


def _cpu(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def _per_gb(f, nbytes: int, who: int = resource.RUSAGE_SELF) -> tuple[float, float]:
    u0, s0 = _cpu(who)
    f()
    u1, s1 = _cpu(who)
    return (u1 - u0) / nbytes * 1e9, (s1 - s0) / nbytes * 1e9


def _measure(args, recs: Records, root: str) -> tuple[dict[str, list], bool]:
    """Every phase ``--rounds`` times: its CPU per GB (or per record); and whether every record
    read came back byte for byte (checked outside the CPU counted)."""
    from tensortier.data import Catalog, _pipeline
    from tensortier.data._order import Order

    total, rounds = recs.total, harness.rounds_of(args)
    out: dict[str, list] = {}
    intact = True

    def build() -> None:
        shutil.rmtree(root, ignore_errors=True)
        Catalog.build(root, recs, io_threads=2).close()

    for _ in range(rounds):
        t0 = _cpu(resource.RUSAGE_THREAD)
        out.setdefault("build process", []).append(sum(_per_gb(build, total)))
        t1 = _cpu(resource.RUSAGE_THREAD)
        out.setdefault("build calling thread", []).append((sum(t1) - sum(t0)) / total * 1e9)
    cat = Catalog.open(root, direct=True)
    for order in ("full", "block"):
        for rep in range(rounds):
            loader = cat.epochs(batch=256, seed=rep, shuffle=order, io_threads=args.io_threads)
            out.setdefault(f"{order} process", []).append(
                sum(_per_gb(lambda loader=loader: [len(r) for b in loader for r in b.data], total))
            )
            loader.close()
            spec = loader.dataset.spec
            o = Order(spec, rep, 0)
            pieces = list(_pipeline._pieces(cat._index, o, [(0, o.length)], 4 << 20, 512 << 20))
            one = _per_gb(
                lambda pieces=pieces: [_pipeline._read_piece(cat, x, True, None) for x in pieces],
                total,
                resource.RUSAGE_THREAD,
            )
            out.setdefault(f"{order} one thread user", []).append(one[0])
            out.setdefault(f"{order} one thread sys", []).append(one[1])
        with cat.epochs(batch=256, seed=0, shuffle=order, io_threads=args.io_threads) as check:
            intact = intact and all(recs.match(b.indices, b.data) for b in check)  # untimed
    picks = np.random.default_rng(5).integers(0, len(cat), 2000).tolist()
    for _ in range(rounds):
        us = sum(_per_gb(lambda: [cat[i] for i in picks], len(picks) * 1_000_000_000 // 10**6))
        out.setdefault("random us/record", []).append(us)
    intact = intact and recs.match(picks, [cat[i] for i in picks])
    cat.close()
    return out, intact


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--records", type=int, default=6000)
    p.add_argument("--io-threads", type=int, default=16)
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    harness.add_args(p, rounds=3, quick_rounds=3, aliases=("--reps",), dest="reps")
    args = p.parse_args(argv)
    recs = Records(args.records, 1000, 100_000)
    root = os.path.join(args.dir, "cat")
    rss = PeakRSS()
    rss.reset()
    session = harness.Session.from_args("catalog-cpu", args)
    try:
        with session:
            out, intact = _measure(args, recs, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # CPU seconds, not wall: reported with their spreads, but not judged as timed figures
    stats = {k: harness.spread_stats(v) for k, v in out.items()}
    measurement = session.report({})
    rows = [{"phase": k, **s} for k, s in stats.items()]
    print(json.dumps({k: round(s["median"], 3) for k, s in stats.items()}, indent=1))
    print(harness.summary_line(measurement))
    write_json(args.json, "catalog-cpu", rows, measurement=measurement, intact=intact,
               peak_rss=rss.peak(), records=args.records, bytes=recs.total)  # fmt: skip
    harness.require({"every record read came back byte for byte": intact})


if __name__ == "__main__":
    main()
