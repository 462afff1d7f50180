"""`python -m benchmarks activations`: a GPT trained with each activation-memory strategy side by side.

Variants: ``plain``, ``checkpoint`` (torch.utils.checkpoint per block), ``save_on_cpu``
(PyTorch's), ``tt-host`` and ``tt-disk``. Each runs in a fresh subprocess (peaks cannot leak
between them), and the variants run in ``--rounds`` rounds, every variant once per round, so the
slow minutes of a shared host hit all of them alike; time ratios are taken within a round.

Peaks are honest per step: the high-water mark is reset at the start of every step (CPU:
``/proc/self/clear_refs``, CUDA: ``reset_peak_memory_stats``) and read at its end, always against
the memory in use *before the first step* (model, optimizer, data), so a step's peak includes
whatever earlier steps left behind (glibc's retained heap, an offloader's buffers).
``peak_bytes`` is the highest step (the first included), ``peak_first_bytes`` the first step,
``peak_steady_bytes`` the highest after it. Allocator settings are each variant's own: glibc
defaults, except that a tensortier offloader with a disk tier on a CPU-only machine fixes
glibc's mmap threshold itself (``tensortier._memory``); ``--malloc-release`` starts every
variant with that setting instead (``MALLOC_MMAP_THRESHOLD_``), to compare like with like.
Step time: the median over measured steps (after one warm-up step); gradients of the first step
are compared bit for bit with ``plain``'s (SHA-256 of the gradient bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from benchmarks import _harness as harness
from benchmarks._common import PeakRSS, child_env, environment, write_json
from tensortier._units import print_table

VARIANTS = ("plain", "checkpoint", "save_on_cpu", "tt-host", "tt-disk")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--spill-dir", default=tempfile.gettempdir())
    p.add_argument("--prefetch-budget", default="128MiB", help="tensortier bytes read ahead")
    p.add_argument(
        "--inflight-budget", default="128MiB", help="tensortier bytes in flight to a tier"
    )
    p.add_argument(
        "--malloc-release",
        action="store_true",
        help="start every variant with glibc's mmap threshold fixed (like tt-disk sets it)",
    )
    p.add_argument("--quick", action="store_true", help="a small model, one measured step")
    p.add_argument("--json", default=None)
    harness.add_args(p, rounds=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _config(args: argparse.Namespace) -> dict:
    if args.quick:
        return dict(
            n_layer=4, n_embd=256, n_head=4, block_size=128, vocab_size=1024, batch=8, steps=1
        )
    return dict(
        n_layer=args.layers,
        n_embd=args.d_model,
        n_head=args.heads,
        block_size=args.seq,
        vocab_size=args.vocab,
        batch=args.batch,
        steps=args.steps,
    )


def _worker(args: argparse.Namespace) -> dict:
    """Runs one variant in this (fresh) process and returns its measurements."""
    import tensortier as tt
    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    variant = args.worker
    cfg_d = _config(args)
    batch, steps = cfg_d.pop("batch"), cfg_d.pop("steps")
    cfg = GPTConfig(**cfg_d)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = GPT(cfg, checkpoint=(variant == "checkpoint")).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = random_batch(cfg, batch, device=device)
    offloader = None
    if variant.startswith("tt-"):
        offloader = tt.Offloader(
            variant[3:],
            spill_dir=args.spill_dir,
            prefetch_budget=args.prefetch_budget,
            inflight_budget=args.inflight_budget,
            min_bytes="256KiB",
            host_budget="16GiB" if cuda else "64GiB",
        )

    def context():
        if variant == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
        return offloader if offloader is not None else _null()

    rss = PeakRSS()
    times, grad_hash, peaks = [], None, []
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    else:
        base = rss.reset()  # memory before the first step: every step's peak is against it
    for step in range(steps + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            rss.reset()  # the high-water mark of this step alone
        t0 = time.perf_counter()
        with context():
            loss = model(x, y)
        loss.backward()
        if step == 0:
            h = hashlib.sha256()
            for p in model.parameters():
                h.update(p.grad.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            grad_hash = h.hexdigest()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= 1:
            times.append(time.perf_counter() - t0)
        high = torch.cuda.max_memory_allocated() if cuda else rss.peak()
        peaks.append(max(0, high - base))
    peak, first, steady = max(peaks), peaks[0], max(peaks[1:], default=peaks[0])
    out = {
        "variant": variant,
        "peak_bytes": int(peak),
        "peak_first_bytes": int(first),
        "peak_steady_bytes": int(steady),
        "step_peaks_bytes": [int(p) for p in peaks],
        "step_times_s": times,
        "step_s": statistics.median(times),
        "grad_sha256": grad_hash,
        "loss": float(loss),
    }
    if offloader is not None:
        out["offload"] = offloader.stats.as_dict()
        offloader.close()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def run(args: argparse.Namespace) -> list[dict]:
    if args.worker:
        print(json.dumps(_worker(args)))
        return []
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if "plain" in variants:  # the reference for gradients and ratios runs first
        variants.remove("plain")
    variants.insert(0, "plain")
    cfg = _config(args)
    print(f"GPT {cfg} on {environment()['device']}")
    env = child_env()
    if args.malloc_release:
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    session = harness.Session.from_args("activations", args)
    bar = tqdm(total=session.rounds * len(variants), desc="variants", unit="run")

    def measure(variant: str, _round: int) -> dict:
        out = _spawn(args, variant, env)
        bar.update()
        return out

    with session:
        rounds = session.run(variants, measure)
    bar.close()
    failed = [(v, got[v]["error"]) for got in rounds for v in variants if "error" in got[v]]
    if failed:
        raise RuntimeError(f"variant {failed[0][0]} failed: {failed[0][1]}")
    rows, ratios = _rows(session, rounds, variants)
    measurement = session.report(
        {r["variant"]: {"step_s": r["step_s_stats"]} for r in rows}, ratios
    )
    print_table(
        rows,
        [
            "variant",
            "peak_bytes",
            "peak_vs_plain",
            "first_vs_plain",
            "steady_vs_plain",
            "step_s",
            "time_vs_plain",
            "grads_match",
            "noisy",
        ],
    )
    print(harness.summary_line(measurement))
    write_json(
        args.json,
        "activations",
        rows,
        config=cfg,
        rounds=session.rounds,
        measurement=measurement,
        malloc="release (MALLOC_MMAP_THRESHOLD_=131072)" if args.malloc_release else "default",
    )
    harness.require(
        {f"{r['variant']}: gradients bit-identical to plain's": r["grads_match"] for r in rows}
    )
    return rows


def _rows(
    session: harness.Session, rounds: list[dict[str, dict]], variants: list[str]
) -> tuple[list[dict], dict]:
    """One row per variant (peaks: the worst round; times: medians, ratios within a round)."""
    device = environment()["device"]
    ref_hash = rounds[0]["plain"]["grad_sha256"]
    rows, ratios = [], {}
    for variant in variants:
        runs = [r[variant] for r in rounds]
        plain = [r["plain"] for r in rounds]

        def ratio(key: str, runs=runs, plain=plain) -> float:  # the worst round: a promise
            return max(a[key] / max(b[key], 1) for a, b in zip(runs, plain))

        # within a round (the same minutes of the host), then the median over rounds
        ratios[f"{variant}_time_vs_plain"] = harness.round_ratios(
            rounds, variant, "plain", "step_s"
        )
        timed = harness.variant_stats(rounds, variant, ["step_s"])
        rows.append(
            {
                "variant": variant,
                "peak_bytes": max(r["peak_bytes"] for r in runs),
                "peak_first_bytes": max(r["peak_first_bytes"] for r in runs),
                "peak_steady_bytes": max(r["peak_steady_bytes"] for r in runs),
                "peak_vs_plain": ratio("peak_bytes"),
                "first_vs_plain": ratio("peak_first_bytes"),
                "steady_vs_plain": ratio("peak_steady_bytes"),
                "step_s": statistics.median(t for r in runs for t in r["step_times_s"]),
                "time_vs_plain": ratios[f"{variant}_time_vs_plain"]["median"],
                "time_vs_plain_spread": ratios[f"{variant}_time_vs_plain"]["spread"],
                "grads_match": all(r["grad_sha256"] == ref_hash for r in runs),
                "device": device,
                "rounds": [
                    {k: r[k] for k in ("peak_bytes", "step_peaks_bytes", "step_times_s")}
                    for r in runs
                ],
                **session.row_fields(timed),
                **({"offload": runs[-1]["offload"]} if "offload" in runs[-1] else {}),
            }
        )
    return rows, ratios


def _spawn(args: argparse.Namespace, variant: str, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.activations", "--worker", variant]
    for flag in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps", "spill_dir"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--prefetch-budget", args.prefetch_budget, "--inflight-budget", args.inflight_budget]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
