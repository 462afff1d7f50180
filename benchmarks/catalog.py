"""`python -m benchmarks catalog`: the dataset catalog against `dd`, Hugging Face datasets and LMDB.

One run, same disk (``--dir``), same records (random bytes of ``--min-size``..``--max-size``,
uniform), same read order (the catalog's seeded full shuffle, then its block shuffle), the page
cache dropped before every read run (``sync; echo 3 > /proc/sys/vm/drop_caches`` when permitted,
else ``posix_fadvise(DONTNEED)`` on every file of the store read next; the JSON says which).

Measured: build throughput (tensortier with its final fsyncs; Hugging Face ``Dataset.from_generator``
to Arrow and LMDB ``put`` in 1000-record transactions, each followed by an fsync of its files) next
to the disk tier's ``O_DIRECT`` write bandwidth and ``dd`` writes; epoch read throughput next to
``dd iflag=direct bs=8M`` over the catalog's own segment files; random single-record reads; open
time and RSS growth of a 10M-record catalog (a synthetic sparse index by default, a real one with
``--real-index``), measured in a fresh process. The record count is scaled to the free disk (three
copies must fit in 40% of it) and to ``--max-gb`` per copy; the JSON records the scale.
Run: ``python -m benchmarks catalog --json benchmarks/results/catalog-cpu.json [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks import _harness as harness
from benchmarks._common import PeakRSS, child_env, write_json
from benchmarks.tiers import dd_bandwidth, tier_bandwidth
from tensortier._units import format_size, parse_size, print_table

ISSUE_RECORDS = 1_000_000  # the issue's scale: 1M records of 1-100 KB


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory on the disk")
    p.add_argument("--records", type=int, default=None, help="records (default: scaled, see doc)")
    p.add_argument("--max-gb", type=float, default=8.0, help="largest store to write, in GB")
    p.add_argument("--min-size", default="1KB", help="smallest record")
    p.add_argument("--max-size", default="100KB", help="largest record")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--io-threads", type=int, default=16, help="read threads (the epochs')")
    p.add_argument("--prefetch-budget", default="512MiB", help="bytes read ahead")
    p.add_argument(
        "--build-io-threads", type=int, default=2, help="threads writing segments (the build's)"
    )
    p.add_argument("--orders", default="full,block", help="read orders to measure")
    p.add_argument("--skip", default="", help="comma list of peers to skip: datasets,lmdb")
    p.add_argument("--index-records", type=int, default=10_000_000, help="records of the open test")
    p.add_argument(
        "--real-index", action="store_true", help="build a real catalog for the open test"
    )
    p.add_argument("--keep", action="store_true", help="keep the stores (default: removed)")
    p.add_argument("--quick", action="store_true", help="2000 records, small sizes: a smoke run")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    harness.add_args(p, rounds=3)


# --------------------------------------------------------------------------- helpers
def drop_caches(paths: list[str]) -> str:
    """Empty the page cache before a read run; returns how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise"


def fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


class Records:
    """N random-size records of incompressible bytes, reproducible (sizes seeded)."""

    def __init__(self, n: int, low: int, high: int):
        self.sizes = np.random.default_rng(0).integers(low, high + 1, n)
        self.pool = np.random.default_rng(1).bytes(2 * high + 4096)
        self.high = high

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        pool, high = self.pool, self.high
        for i, size in enumerate(self.sizes.tolist()):
            o = (i * 7919) % high
            yield pool[o : o + size]

    @property
    def total(self) -> int:
        return int(self.sizes.sum())

    def match(self, indices, got: list) -> bool:
        """Whether ``got`` holds exactly records ``indices``, byte for byte (not only their
        lengths: a store returning another record of the same size must not pass)."""
        pool, high, sizes = self.pool, self.high, self.sizes
        return len(got) == len(indices) and all(
            len(g) == sizes[i] and g == pool[(i * 7919) % high : (i * 7919) % high + sizes[i]]
            for i, g in zip(np.asarray(indices).tolist(), got)
        )


def scale(args, free: int, mean: float) -> tuple[int, str]:
    if args.records:
        return args.records, "--records"
    if args.quick:
        return 2000, "--quick"
    by_disk = int(0.4 * free / 3 / mean)
    by_cap = int(args.max_gb * 1e9 / mean)
    n = min(ISSUE_RECORDS, by_disk, by_cap)
    why = (
        f"scaled from {ISSUE_RECORDS} to {n} records: "
        f"{'--max-gb' if by_cap <= by_disk else 'free disk'} limit "
        f"({format_size(free)} free; 3 copies in 40% of it; --max-gb {args.max_gb})"
    )
    return n, why


def dd_read_files(files: list[str]) -> float:
    """GB/s of dd iflag=direct bs=8M over ``files`` (one after the other)."""
    total, seconds = 0, 0.0
    for path in files:
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"],
            capture_output=True,
            check=True,
        )
        seconds += time.perf_counter() - t0
        total += os.path.getsize(path)
    return total / seconds / 1e9


# --------------------------------------------------------------------------- stores
def build_tt(root: str, recs: Records, io_threads: int) -> dict:
    from tensortier.data import Catalog

    t0 = time.perf_counter()
    cat = Catalog.build(root, recs, io_threads=io_threads)
    seconds = time.perf_counter() - t0
    cat.close()
    return {"seconds": seconds, "bytes": tree_bytes(root)}


def build_hf(root: str, recs: Records) -> dict:
    from datasets import Dataset, Features, Value, disable_progress_bars

    disable_progress_bars()

    def gen():
        for r in recs:
            yield {"data": r}

    t0 = time.perf_counter()
    ds = Dataset.from_generator(gen, features=Features({"data": Value("binary")}), cache_dir=root)
    fsync_tree(root)
    seconds = time.perf_counter() - t0
    del ds
    return {"seconds": seconds, "bytes": tree_bytes(root)}


def _load_hf(root: str):
    """The Arrow files ``from_generator`` wrote, memory-mapped (as ``load_from_disk`` would)."""
    from datasets import Dataset, concatenate_datasets

    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".arrow")
    )
    parts = [Dataset.from_file(f) for f in files]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def build_lmdb(root: str, recs: Records) -> dict:
    import lmdb

    t0 = time.perf_counter()
    env = lmdb.open(root, map_size=int(recs.total * 1.6) + (1 << 30), sync=False, lock=True)
    txn = env.begin(write=True)
    for i, r in enumerate(recs):
        txn.put(struct.pack(">Q", i), r, append=True)
        if i % 1000 == 999:
            txn.commit()
            txn = env.begin(write=True)
    txn.commit()
    env.sync(True)
    env.close()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": tree_bytes(root)}


# --------------------------------------------------------------------------- reads
def read_tt(root: str, args, order: str, recs: Records) -> dict:
    from tensortier.data import Catalog

    cat = Catalog.open(root)
    loader = cat.epochs(
        batch=args.batch,
        seed=0,
        shuffle=order,
        io_threads=args.io_threads,
        prefetch_budget=args.prefetch_budget,
    )
    total = n = 0
    ok = True
    t0 = time.perf_counter()
    for b in loader:
        ok = ok and recs.match(b.indices, b.data)
        total += sum(len(r) for r in b.data)
        n += len(b.data)
    seconds = time.perf_counter() - t0
    stats = loader.stats().as_dict()
    loader.close()
    cat.close()
    return {"seconds": seconds, "records": n, "bytes": total, "intact": ok, "stats": stats}


def epoch_order(root: str, args, order: str) -> np.ndarray:
    from tensortier.data import Catalog
    from tensortier.data._order import Order

    cat = Catalog.open(root)
    loader = cat.epochs(batch=args.batch, seed=0, shuffle=order)
    idx = Order(loader.dataset.spec, 0, 0).indices(0, len(cat))
    cat.close()
    return idx


def _load_hf_cold(root: str):
    """The Arrow files mapped, then the page cache emptied again: ``Dataset.from_file`` reads
    every page of the file when it loads (fincore: 100% resident right after), so without this
    the reads that follow, timed without the load, were warm-cache reads."""
    ds = _load_hf(root)
    drop_caches([root])
    return ds


def read_hf(root: str, args, idx: np.ndarray, recs: Records) -> dict:
    ds = _load_hf_cold(root)
    total, ok = 0, True
    t0 = time.perf_counter()
    for a in range(0, len(idx), args.batch):
        part = idx[a : a + args.batch]
        got = ds[part.tolist()]["data"]
        ok = ok and recs.match(part, got)
        total += sum(len(r) for r in got)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "records": len(idx), "bytes": total, "intact": ok}


def read_lmdb(root: str, args, idx: np.ndarray, recs: Records) -> dict:
    import lmdb

    env = lmdb.open(root, readonly=True, lock=False)
    total, ok = 0, True
    t0 = time.perf_counter()
    with env.begin() as txn:
        for a in range(0, len(idx), args.batch):
            part = idx[a : a + args.batch].tolist()
            got = [txn.get(struct.pack(">Q", i)) for i in part]
            ok = ok and recs.match(part, got)
            total += sum(len(r) for r in got)
    seconds = time.perf_counter() - t0
    env.close()
    return {"seconds": seconds, "records": len(idx), "bytes": total, "intact": ok}


def random_reads(kind: str, root: str, recs: Records, count: int = 2000) -> dict:
    """Single records read at random indices: per second (page cache dropped by the caller),
    and whether each was the right record, byte for byte (checked after the clock stops)."""
    picks = np.random.default_rng(5).integers(0, len(recs), count).tolist()
    if kind == "tensortier":
        from tensortier.data import Catalog

        cat = Catalog.open(root)
        t0 = time.perf_counter()
        got = [cat[i] for i in picks]
        dt = time.perf_counter() - t0
        cat.close()
    elif kind == "datasets":
        ds = _load_hf_cold(root)
        t0 = time.perf_counter()
        got = [ds[i]["data"] for i in picks]
        dt = time.perf_counter() - t0
    else:
        import lmdb

        env = lmdb.open(root, readonly=True, lock=False)
        t0 = time.perf_counter()
        with env.begin() as txn:
            got = [txn.get(struct.pack(">Q", i)) for i in picks]
        dt = time.perf_counter() - t0
        env.close()
    return {"records_per_s": count / dt, "intact": recs.match(picks, got)}


_OPEN_PROBE = r"""
import json, os, sys, time, psutil
import tensortier.data as d
proc = psutil.Process()
rss = proc.memory_info().rss
t0 = time.perf_counter()
cat = d.Catalog.open(sys.argv[1])
opened = time.perf_counter() - t0
n = len(cat)
last = cat[n - 1]
print(json.dumps({"open_ms": opened * 1e3, "rss_growth_mib": (proc.memory_info().rss - rss) / 2**20,
                  "records": n, "last_record_bytes": len(last)}))
"""


def open_test(root: str, n: int, real: bool, runs_wanted: int = 3) -> dict:
    if real:
        from tensortier.data import Catalog

        t0 = time.perf_counter()
        Catalog.build(root, (i.to_bytes(8, "little") for i in range(n)), io_threads=2).close()
        built = time.perf_counter() - t0
    else:
        _synthetic_index(root, n)
        built = None
    runs = []
    for _ in range(runs_wanted):
        drop_caches([root])
        out = subprocess.run(
            [sys.executable, "-c", _OPEN_PROBE, root],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "records": n,
        "index": "real" if real else "synthetic (sparse index file, last row a real record)",
        "build_seconds": built,
        "open_ms": statistics.median(r["open_ms"] for r in runs),
        "rss_growth_mib": max(r["rss_growth_mib"] for r in runs),
        "runs": runs,
    }


def _synthetic_index(root: str, n: int) -> None:
    from tensortier.data._format import INDEX, INDEX_DTYPE, Manifest, write_manifest
    from tensortier.tiers import itemcodec
    from tensortier.tiers.segments import Segments

    os.makedirs(root)
    segs = Segments(root, segment_size=1 << 20)
    crcs: list[int] = []
    [(seg, off, length)] = segs.append([(n - 1, 0, itemcodec.encode(b"last", align=8))], crcs)
    sizes = dict(segs.size)
    segs.close(remove=False)
    row = np.zeros(1, INDEX_DTYPE)
    row["seg"], row["off"], row["len"], row["crc"] = seg, off, length, crcs[0]
    with open(os.path.join(root, INDEX), "wb") as f:
        f.truncate(n * INDEX_DTYPE.itemsize)
        f.seek((n - 1) * INDEX_DTYPE.itemsize)
        f.write(row.tobytes())
    write_manifest(root, Manifest(n, length - 24, sizes, 0, 1, "synthetic"))


# --------------------------------------------------------------------------- jobs
def job(spec: dict) -> dict:
    """One measurement, run in a fresh process (``--job``): no mapping, cache or thread of another
    store's build survives into it, and its peak RSS is its own."""
    import resource

    recs = Records(spec["n"], spec["low"], spec["high"])
    args = argparse.Namespace(**spec["args"])
    kind, peer, root = spec["kind"], spec["peer"], spec["root"]
    if peer == "datasets":
        import datasets  # noqa: F401  (imports are not what is measured)
    elif peer == "lmdb":
        import lmdb  # noqa: F401
    else:
        import tensortier.data  # noqa: F401
    before = resource.getrusage(resource.RUSAGE_SELF)
    if kind == "build":
        if peer == "tensortier":
            out = build_tt(root, recs, args.build_io_threads)
        elif peer == "datasets":
            out = build_hf(root, recs)
        else:
            os.makedirs(root)
            out = build_lmdb(root, recs)
    elif kind == "read":
        if peer == "tensortier":
            out = read_tt(root, args, spec["order"], recs)
        else:
            idx = np.load(spec["order_file"])
            out = (read_hf if peer == "datasets" else read_lmdb)(root, args, idx, recs)
    else:
        out = random_reads(peer, root, recs)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss"] = PeakRSS().peak()  # this fresh process's own high-water mark
    # CPU of the measured phase (user + system): what the machine's load cannot change
    out["cpu_seconds"] = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
    return out


def run_job(**spec) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.catalog", "--job", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench job {spec['kind']} {spec['peer']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- rounds
@dataclass
class _Ctx:
    """What the phases of one run share (the stores, the records, the harness session)."""

    args: argparse.Namespace
    recs: Records
    roots: dict[str, str]
    work: str
    peers: list[str]
    n: int
    low: int
    high: int
    session: harness.Session
    methods: set[str] = field(default_factory=set)
    timed: dict[str, dict] = field(default_factory=dict)
    ratios: dict[str, dict] = field(default_factory=dict)

    @property
    def common(self) -> dict:
        return {"n": self.n, "low": self.low, "high": self.high, "args": vars(self.args)}

    def stats(self, phase: str, per_round: list[dict], peer: str, metric: str) -> dict:
        """The harness fields of one row; the stats also go into the run's verdict."""
        stats = harness.variant_stats(per_round, peer, [metric])
        self.timed[f"{phase} {peer}"] = stats
        return self.session.row_fields(stats)

    def ratio(self, name: str, per_round: list[dict], num: str, den: str, metric: str) -> float:
        self.ratios[name] = harness.round_ratios(per_round, num, den, metric)
        return self.ratios[name]["median"]


def _check(per_round: list[dict]) -> None:
    for got in per_round:
        for peer, out in got.items():
            if "error" in out:
                raise RuntimeError(f"{peer}: {out['error']}")


def _builds(ctx: _Ctx, result: dict) -> list[dict]:
    """Every store built once per round (the last round's stores stay for the reads), next to
    the disk tier's write and ``dd`` on the same disk in the same round."""
    args, recs = ctx.args, ctx.recs
    ref_size = 64 << 20 if args.quick else max(min(recs.total, 4 << 30), 256 << 20)

    def measure(peer: str, _round: int) -> dict:
        if peer == "dd":
            w, r = dd_bandwidth(args.dir, ref_size)
            return {"gbps": w, "read_gbps": r}
        if peer == "disk tier write":
            size = min(ref_size, 2 << 30)
            return {"gbps": tier_bandwidth(args.dir, size, min(ref_size, 64 << 20))[0]}
        shutil.rmtree(ctx.roots[peer], ignore_errors=True)
        os.sync()
        b = run_job(kind="build", peer=peer, root=ctx.roots[peer], **ctx.common)
        return {**b, "gbps": recs.total / b["seconds"] / 1e9}

    per_round = ctx.session.run(["dd", "disk tier write", "tensortier", *ctx.peers], measure)
    _check(per_round)
    med = lambda peer, k: harness.spread_stats(g[peer][k] for g in per_round)["median"]  # noqa: E731
    result["disk"] = {"dd_write_gbps": med("dd", "gbps"), "dd_read_gbps": med("dd", "read_gbps"),
                      "tier_write_gbps": med("disk tier write", "gbps")}  # fmt: skip
    rows = []
    for peer in ["tensortier", *ctx.peers]:
        b = harness.median_run([g[peer] for g in per_round], "gbps")
        vs = ctx.ratio(
            f"build_{peer}_vs_disk_tier_write", per_round, peer, "disk tier write", "gbps"
        )
        rows.append({"phase": "build", "peer": peer, "order": "-", "seconds": b["seconds"],
                     "gbps": med(peer, "gbps"), "vs_limit": vs, "limit": "disk tier write",
                     "store_bytes": b["bytes"], "peak_rss": b["peak_rss"],
                     "cpu_seconds": b["cpu_seconds"],
                     **ctx.stats("build", per_round, peer, "gbps")})  # fmt: skip
    ctx.ratios["build_vs_disk_tier_write"] = ctx.ratios.pop("build_tensortier_vs_disk_tier_write")
    return rows


def _reads(ctx: _Ctx, result: dict) -> list[dict]:
    """Per read order: ``dd`` over the catalog's files and every store's epoch, in rounds, the
    page cache dropped before each."""
    args, roots = ctx.args, ctx.roots
    segs = sorted(os.path.join(roots["tensortier"], f)
                  for f in os.listdir(roots["tensortier"]) if f.startswith("seg-"))  # fmt: skip
    rows = []
    for order in [o for o in args.orders.split(",") if o]:
        order_file = os.path.join(ctx.work, f"order-{order}.npy")
        np.save(order_file, epoch_order(roots["tensortier"], args, order))

        def measure(peer: str, _round: int, order=order, order_file=order_file) -> dict:
            if peer == "dd":
                ctx.methods.add(drop_caches([roots["tensortier"]]))
                return {"gbps": dd_read_files(segs)}
            ctx.methods.add(drop_caches([roots[peer]]))
            r = run_job(kind="read", peer=peer, root=roots[peer], order=order,
                        order_file=order_file, **ctx.common)  # fmt: skip
            return {**r, "gbps": r["bytes"] / r["seconds"] / 1e9}

        per_round = ctx.session.run(["dd", "tensortier", *ctx.peers], measure)
        _check(per_round)
        dd = harness.spread_stats(g["dd"]["gbps"] for g in per_round)["median"]
        result["disk"].setdefault("dd_read_catalog_files_gbps", dd)
        for peer in ["tensortier", *ctx.peers]:
            r = harness.median_run([g[peer] for g in per_round], "gbps")
            gbps = harness.spread_stats(g[peer]["gbps"] for g in per_round)["median"]
            vs = ctx.ratio(f"read_{order}_{peer}_vs_dd", per_round, peer, "dd", "gbps")
            rows.append({"phase": "read", "peer": peer, "order": order,
                         "seconds": r["seconds"], "gbps": gbps, "vs_limit": vs,
                         "limit": "dd read of the catalog files",
                         "records_per_s": r["records"] / r["seconds"], "intact": r["intact"],
                         "peak_rss": r["peak_rss"], "cpu_seconds": r["cpu_seconds"],
                         **({"stats": r["stats"]} if "stats" in r else {}),
                         **ctx.stats(f"read {order}", per_round, peer, "gbps")})  # fmt: skip
        ctx.ratios[f"read_{order}_vs_dd"] = ctx.ratios.pop(f"read_{order}_tensortier_vs_dd")
        for peer in ctx.peers:
            ctx.ratio(f"read_{order}_vs_{peer}", per_round, "tensortier", peer, "gbps")
    return rows


def _randoms(ctx: _Ctx) -> list[dict]:
    """Random single-record reads of every store on a cold cache, in rounds."""

    def measure(peer: str, _round: int) -> dict:
        ctx.methods.add(drop_caches([ctx.roots[peer]]))
        return run_job(kind="random", peer=peer, root=ctx.roots[peer], **ctx.common)

    per_round = ctx.session.run(["tensortier", *ctx.peers], measure)
    _check(per_round)
    rows = []
    for peer in ["tensortier", *ctx.peers]:
        rate = harness.spread_stats(g[peer]["records_per_s"] for g in per_round)["median"]
        intact = all(g[peer]["intact"] for g in per_round)
        rows.append({"phase": "random", "peer": peer, "order": "uniform", "records_per_s": rate,
                     "intact": intact,
                     **ctx.stats("random", per_round, peer, "records_per_s")})  # fmt: skip
    for peer in ctx.peers:
        ctx.ratio(f"random_vs_{peer}", per_round, "tensortier", peer, "records_per_s")
    return rows


# --------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict:
    low = parse_size(args.min_size, name="--min-size")
    high = parse_size(args.max_size, name="--max-size")
    if args.quick:
        low, high = min(low, 1000), min(high, 20_000)
    free = shutil.disk_usage(args.dir).free
    n, why = scale(args, free, (low + high) / 2)
    skip = {s for s in args.skip.split(",") if s}
    peers = [p for p in ("datasets", "lmdb") if p not in skip]
    for p in list(peers):
        try:
            __import__(p)
        except ImportError:
            print(f"peer {p} is not installed: skipped")
            peers.remove(p)
    work = tempfile.mkdtemp(prefix="tt-bench-catalog-", dir=args.dir)
    roots = {k: os.path.join(work, k) for k in ("tensortier", "datasets", "lmdb", "open")}
    recs = Records(n, low, high)
    print(f"{n} records of {format_size(low)}..{format_size(high)} ({format_size(recs.total)}) in "
          f"{work}; {why}")  # fmt: skip
    result: dict = {"records": n, "record_bytes": [low, high], "payload_bytes": recs.total}
    result["scale"] = why
    session = harness.Session.from_args("catalog", args)
    ctx = _Ctx(args, recs, roots, work, peers, n, low, high, session)
    try:
        with session:
            rows = _builds(ctx, result)
            rows += _reads(ctx, result)
            rows += _randoms(ctx)
        result["cache_drop"] = sorted(ctx.methods)
        if not args.keep:  # make room for the open test
            for peer in ("tensortier", *peers):
                shutil.rmtree(roots[peer], ignore_errors=True)
        result["open"] = open_test(
            roots["open"], args.index_records, args.real_index, 1 if args.quick else 3
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["ratios"] = {k: r["median"] for k, r in ctx.ratios.items()}
    result["load_average"] = os.getloadavg()
    result["measurement"] = session.report(ctx.timed, ctx.ratios)
    print_table(rows, ["phase", "peer", "order", "seconds", "gbps", "vs_limit", "records_per_s"])
    o = result["open"]
    print(f"open {o['records']} records ({o['index']}): {o['open_ms']:.2f} ms, RSS +"
          f"{o['rss_growth_mib']:.1f} MiB")  # fmt: skip
    print("ratios:", json.dumps({k: v and round(v, 3) for k, v in result["ratios"].items()}))
    print(harness.summary_line(result["measurement"]))
    write_json(args.json, "catalog", rows, **result)
    harness.require(
        {
            f"{r['peer']} {r['phase']} ({r['order']}): every record byte for byte": r["intact"]
            for r in rows
            if "intact" in r
        }  # fmt: skip
    )
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"]:
        print(json.dumps(job(json.loads(argv[1]))))
        return
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
