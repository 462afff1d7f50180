"""`python -m benchmarks tiers`: disk tier bandwidth against `dd` direct I/O on the same directory.

`dd` with O_DIRECT and a large block is the physical limit of the disk behind ``--dir``; the disk
tier should reach >= 90% of it. On CUDA, the transfer engine's device<->host copies are compared
with a plain pinned ``copy_``. Run: ``python -m benchmarks tiers --json out.json [--quick]``.
``--remote`` measures the remote tier instead (:mod:`benchmarks.remote`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import torch
from tqdm import tqdm

from benchmarks import _harness as harness
from benchmarks._common import PeakRSS, environment, write_json
from tensortier._units import format_size, parse_size, print_table
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import HostPool
from tensortier.transfer import TransferEngine

_DD_RATE = re.compile(r"(\d+) bytes .* copied, ([0-9.]+) s")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    p.add_argument(
        "--size", default=None, help="bytes per measurement (default 2GiB, 512MiB with --quick)"
    )
    p.add_argument("--tensor-size", default="64MiB", help="size of each tensor written by the tier")
    p.add_argument(
        "--repeat", type=int, default=None, help="--remote: repetitions; else as --rounds"
    )
    p.add_argument("--quick", action="store_true", help="small sizes, one round")
    harness.add_args(p, rounds=3)
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument(
        "--remote",
        action="store_true",
        help="measure the remote tier (RemoteStore) against ray.put/ray.get between two simulated "
        "Ray nodes instead of the disk (default size 256MiB, 64MiB with --quick)",
    )


def _dd(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    match = _DD_RATE.search(out)
    if match is None:
        raise RuntimeError(f"cannot parse dd output: {out!r}")
    return int(match.group(1)) / float(match.group(2)) / 1e9


def dd_bandwidth(directory: str, nbytes: int) -> tuple[float, float]:
    """(write, read) GB/s of dd with O_DIRECT, 8 MiB blocks, on a scratch file in ``directory``."""
    path = os.path.join(directory, f".tt-dd-{os.getpid()}")
    count = max(1, nbytes // (8 << 20))
    try:
        write = _dd(
            ["if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "oflag=direct", "conv=fsync"]
        )
        read = _dd([f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return write, read


def tier_bandwidth(
    directory: str, nbytes: int, tensor_bytes: int
) -> tuple[float, float, bool, bool]:
    """``(write, read, intact, direct)``: GB/s of the disk tier putting ``nbytes`` in tensors,
    then getting them all back; whether every byte came back and whether it used O_DIRECT."""
    n = max(1, nbytes // tensor_bytes)
    tensors = [torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8) for _ in range(n)]
    with DiskStore(directory, owner="tt-bench") as store, HostPool(nbytes * 2, pin=False) as pool:
        blocks = [pool.alloc(tensor_bytes) for _ in range(n)]  # read targets, like the engine's
        for b in blocks:  # steady state: the pool hands out cached blocks whose pages are mapped
            b.buffer.fill_(0)
        t0 = time.perf_counter()
        handles = [f.result() for f in [store.put(t) for t in tensors]]
        write = n * tensor_bytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        outs = [f.result() for f in [store.get(h, into=b.buffer) for h, b in zip(handles, blocks)]]
        read = n * tensor_bytes / (time.perf_counter() - t0) / 1e9
        intact = all(torch.equal(a, b) for a, b in zip(tensors, outs))
        direct = store.direct
    return write, read, intact, direct


CUDA_PATHS = (  # (metric, row path, the metric it is compared with)
    ("d2h_torch_gbps", "device->host pinned copy_ (torch)", "d2h_torch_gbps"),
    ("d2h_tt_gbps", "device->host (tensortier)", "d2h_torch_gbps"),
    ("h2d_torch_gbps", "host->device pinned copy_ (torch)", "h2d_torch_gbps"),
    ("h2d_tt_gbps", "host->device (tensortier)", "h2d_torch_gbps"),
)


def cuda_bandwidth(nbytes: int) -> dict:
    """One round of the engine's device<->host copies against a plain pinned ``copy_``: GB/s,
    each the best of 3 back-to-back copies (the metrics of :data:`CUDA_PATHS`)."""
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9

    with TransferEngine(host=HostPool(nbytes * 4)) as engine:
        for _ in range(2):  # warm the pool and the streams
            engine.to_host(dev).result().free()
        out = {
            "d2h_torch_gbps": max(timed(lambda: pinned.copy_(dev, non_blocking=True)) for _ in range(3)),
            "h2d_torch_gbps": max(timed(lambda: dev.copy_(pinned, non_blocking=True)) for _ in range(3)),
        }  # fmt: skip
        held = []
        out["d2h_tt_gbps"] = max(
            timed(lambda: held.append(engine.to_host(dev).result())) for _ in range(3)
        )
        host = held[-1]
        out["h2d_tt_gbps"] = max(timed(lambda: engine.to_device(host).result()) for _ in range(3))
        for h in held:
            h.free()
    return out


def _cuda_rows(session: harness.Session, per_round: list[dict], nbytes: int, timed, ratios):
    """The CUDA rows: per path its median over the rounds with the harness fields, and the
    engine's ratio to the plain copy taken within each round (as the disk rows')."""
    rows = []
    for metric, path, limit in CUDA_PATHS:
        stats = harness.variant_stats(per_round, "cuda", [metric])
        timed.setdefault("cuda", {}).update(stats)
        row = {
            "path": path,
            "bytes": nbytes,
            "gbps": stats[metric]["median"],
            "ratio_vs_limit": 1.0,
        }
        if metric != limit:
            vs = harness.round_ratios(per_round, "cuda", "cuda", metric, limit)
            ratios[metric.replace("_gbps", "_vs_torch")] = vs
            row.update(ratio_vs_limit=vs["median"], ratio_vs_limit_spread=vs["spread"])
        rows.append({**row, **session.row_fields({"gbps": stats[metric]})})
    return rows


def run_remote(args: argparse.Namespace) -> list[dict]:
    from benchmarks.remote import remote_bandwidth

    size = parse_size(args.size or ("64MiB" if args.quick else "256MiB"), name="--size")
    repeat = args.repeat or (3 if args.quick else 5)
    print(f"measuring remote put/get of {format_size(size)}, best of {repeat}, two Ray nodes")
    # best of ``repeat`` inside one Ray session: the load envelope only (README, Measurement)
    session = harness.Session("tiers-remote", 1, args.quiet_wait, args.quiet_load)
    with session:
        rows, ok = remote_bandwidth(size, repeat)
    measurement = session.report({})
    print_table(
        rows, ["path", "bytes", "gbps", "ratio_vs_limit", "remote_vs_spilling", "speedup_vs_each"]
    )
    print(harness.summary_line(measurement))
    write_json(args.json, "tiers-remote", rows, intact=ok, repeat=repeat, measurement=measurement)
    harness.require({"the remote tier read back every byte it wrote": ok})
    return rows


def _disk_rounds(args, session: harness.Session, size: int, tensor_bytes: int) -> list[dict]:
    """``dd`` and the disk tier, interleaved in rounds, each write then read; on CUDA the
    device<->host copies too, in the same rounds."""
    variants = ["dd", "tensortier", *(["cuda"] if torch.cuda.is_available() else [])]
    bar = tqdm(total=session.rounds * len(variants), desc="tiers", unit="run")

    def measure(variant: str, _round: int) -> dict:
        if variant == "cuda":
            out = cuda_bandwidth(min(size, 1 << 30))
        elif variant == "dd":
            w, r = dd_bandwidth(args.dir, size)
            out = {"write_gbps": w, "read_gbps": r}
        else:
            rss = PeakRSS()
            start = rss.reset()  # the tensors written, the read targets, the tier's buffers
            w, r, intact, direct = tier_bandwidth(args.dir, size, tensor_bytes)
            out = {"write_gbps": w, "read_gbps": r, "intact": intact, "direct_io": direct,
                   "peak_extra_rss": max(0, rss.peak() - start)}  # fmt: skip
        bar.update()
        return out

    with session:
        per_round = session.run(variants, measure)
    bar.close()
    return per_round


def run(args: argparse.Namespace) -> list[dict]:
    if getattr(args, "remote", False):
        return run_remote(args)
    size = parse_size(args.size or ("512MiB" if args.quick else "2GiB"), name="--size")
    tensor_bytes = parse_size(args.tensor_size, name="--tensor-size")
    args.rounds = args.rounds or args.repeat
    session = harness.Session.from_args("tiers", args)
    print(
        f"measuring {format_size(size)} x {session.rounds} in {args.dir} ({environment()['device']})"
    )
    per_round = _disk_rounds(args, session, size, tensor_bytes)
    errors = [got[v]["error"] for got in per_round for v in got if "error" in got[v]]
    if errors:
        raise RuntimeError(errors[0])
    intact = all(got["tensortier"]["intact"] for got in per_round)
    direct = all(got["tensortier"]["direct_io"] for got in per_round)
    rows, timed, ratios = [], {}, {}
    for direction, metric, arrow in (("write", "write_gbps", "host->disk"),
                                     ("read", "read_gbps", "disk->host")):  # fmt: skip
        ratio = harness.round_ratios(per_round, "tensortier", "dd", metric)
        ratios[f"{direction}_vs_dd"] = ratio
        for variant, path, vs in (("dd", f"{arrow} dd O_DIRECT (limit)", None),
                                  ("tensortier", f"{arrow} (tensortier)", ratio)):  # fmt: skip
            stats = harness.variant_stats(per_round, variant, [metric])
            timed.setdefault(variant, {}).update(stats)
            row = {"path": path, "bytes": size, "gbps": stats[metric]["median"]}
            if variant == "tensortier":  # dd runs in its own process: its peak is not ours
                row["peak_extra_rss"] = max(g["tensortier"]["peak_extra_rss"] for g in per_round)
            row["ratio_vs_limit"] = 1.0 if vs is None else vs["median"]
            if vs is not None:
                row["ratio_vs_limit_spread"] = vs["spread"]
            rows.append({**row, **session.row_fields({"gbps": stats[metric]})})
    if torch.cuda.is_available():
        rows += _cuda_rows(session, per_round, min(size, 1 << 30), timed, ratios)
    print_table(
        rows,
        [
            "path",
            "bytes",
            "gbps",
            "ratio_vs_limit",
            "remote_vs_spilling",
            "speedup_vs_each",
            "noisy",
        ],
    )
    if not direct:
        print(f"WARNING: O_DIRECT was unavailable in {args.dir}: the tier read the page cache")
    measurement = session.report(timed, ratios)
    print(harness.summary_line(measurement))
    write_json(
        args.json,
        "tiers",
        rows,
        direct_io_and_intact=intact and direct,
        intact=intact,
        direct_io=direct,
        measurement=measurement,
    )
    harness.require({"the disk tier read back every byte it wrote": intact})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
