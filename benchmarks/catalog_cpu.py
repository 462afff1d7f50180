"""CPU seconds per GB of the catalog's phases: a figure a loaded machine does not change much.

``python -m benchmarks.catalog_cpu --dir /tmp/x [--records 6000]`` builds a catalog of random
bytes records (1 KB..100 KB, as ``benchmarks/catalog.py``), then reports, for the build and for
full/block-shuffle epochs read with ``O_DIRECT``: the process's CPU (user + system) per GB, and
the CPU of one thread reading every piece of the epoch by itself (``_pipeline._read_piece``:
read, check, decode, no consumer and no other thread), user and system apart; and the CPU per
record of random single-record reads (warm cache). Medians of ``--reps`` runs. Wall-clock
throughput is ``python -m benchmarks catalog``'s job, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics

import numpy as np

from benchmarks.catalog import Records


def _cpu(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def _per_gb(f, nbytes: int, who: int = resource.RUSAGE_SELF) -> tuple[float, float]:
    u0, s0 = _cpu(who)
    f()
    u1, s1 = _cpu(who)
    return (u1 - u0) / nbytes * 1e9, (s1 - s0) / nbytes * 1e9


def main() -> None:
    from tensortier.data import Catalog, _pipeline
    from tensortier.data._order import Order

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--records", type=int, default=6000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--io-threads", type=int, default=16)
    args = p.parse_args()
    recs = Records(args.records, 1000, 100_000)
    total = recs.total
    root = os.path.join(args.dir, "cat")
    out: dict[str, list] = {}

    def build() -> None:
        shutil.rmtree(root, ignore_errors=True)
        Catalog.build(root, recs, io_threads=2).close()

    for _ in range(args.reps):
        t0 = _cpu(resource.RUSAGE_THREAD)
        out.setdefault("build process", []).append(sum(_per_gb(build, total)))
        t1 = _cpu(resource.RUSAGE_THREAD)
        out.setdefault("build calling thread", []).append((sum(t1) - sum(t0)) / total * 1e9)
    cat = Catalog.open(root, direct=True)
    for order in ("full", "block"):
        for rep in range(args.reps):
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
    picks = np.random.default_rng(5).integers(0, len(cat), 2000).tolist()
    for _ in range(args.reps):
        us = sum(_per_gb(lambda: [cat[i] for i in picks], len(picks) * 1_000_000_000 // 10**6))
        out.setdefault("random us/record", []).append(us)
    cat.close()
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: round(statistics.median(v), 3) for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
