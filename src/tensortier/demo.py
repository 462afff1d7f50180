"""`tensortier demo`: train a small GPT four ways and compare peak memory, step time and gradients.

The ways: ``plain`` keeps every activation; ``checkpoint`` recomputes each block in backward
(``torch.utils.checkpoint``); ``tt.offload(tier="host")`` and ``tt.offload(tier="disk")`` move saved
activations to pinned host RAM or to spill files and prefetch them for backward. Each way runs in
a fresh Python process (``python -m tensortier.demo --worker WAY``), so its peak memory is its
own. The peak of a step is what the step adds to the memory in use before the first step (CUDA:
allocated device memory; CPU-only: RSS, where host RAM *is* the device memory, so ``tier="host"``
cannot lower it there). Gradients of the first step are compared bit for bit with ``plain``'s.

Self-contained on purpose: only the public ``tt.offload`` verb, the package's GPT and
``tensortier._memory``'s RSS high-water mark; never the benchmarks (``benchmarks/``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from tensortier._memory import reset_peak_rss, status_bytes
from tensortier._units import format_size

WAYS = {  # worker name -> what the table calls it
    "plain": "plain",
    "checkpoint": "torch.utils.checkpoint",
    "tt-host": 'tt.offload(tier="host")',
    "tt-disk": 'tt.offload(tier="disk")',
}
QUICK = dict(layers=2, d_model=128, heads=4, seq=64, batch=4, steps=2)  # seconds per way
MIN_BYTES = "64KiB"  # smaller saved tensors stay where they are


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8, help="GPT blocks (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=512, help="width (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default: %(default)s)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="samples per step (default: %(default)s)")
    p.add_argument(
        "--steps", type=int, default=2, help="timed steps after one warm-up (default: %(default)s)"
    )
    p.add_argument(
        "--spill-dir",
        default=tempfile.gettempdir(),
        help="where tier='disk' spills (default: %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny GPT (seconds per way)")
    p.add_argument("--worker", choices=sorted(WAYS), default=None, help=argparse.SUPPRESS)


def _sizes(args: argparse.Namespace) -> dict:
    if args.quick:
        return dict(QUICK)
    keys = ("layers", "d_model", "heads", "seq", "batch", "steps")
    return {k: getattr(args, k) for k in keys}


def run(args: argparse.Namespace) -> int:
    """Runs every way in its own process, prints the table; 0 when every gradient is identical."""
    if args.worker:
        print(json.dumps(_worker(args.worker, _sizes(args), args.spill_dir)))
        return 0
    sizes = _sizes(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"GPT {sizes['layers']} layers x {sizes['d_model']}, seq {sizes['seq']}, batch "
        f"{sizes['batch']} on {device}: {sizes['steps']} timed steps after one warm-up"
    )
    rows = {}
    for way in WAYS:
        print(f"  running {WAYS[way]} ...", flush=True)
        rows[way] = _spawn(way, sizes, args.spill_dir)
    for line in _table(rows, device):
        print(line)
    same = all(r["grad_sha256"] == rows["plain"]["grad_sha256"] for r in rows.values())
    print("gradients of every way bit-identical to plain" if same else "GRADIENTS DIFFER")
    return 0 if same else 1


def _table(rows: dict[str, dict], device: str) -> Iterator[str]:
    what = "device memory" if device == "cuda" else "RSS (CPU-only: host RAM is the device memory)"
    yield ""
    yield f"peak: the most memory a step adds, {what}; step: median of the timed steps"
    yield f"{'way':24s} {'peak':>10s} {'vs plain':>9s} {'step':>9s} {'vs plain':>9s}  gradients"
    plain = rows["plain"]
    for way, r in rows.items():
        grads = "reference" if way == "plain" else _same(r, plain)
        yield (
            f"{WAYS[way]:24s} {format_size(r['peak_bytes']):>10s} "
            f"{r['peak_bytes'] / max(plain['peak_bytes'], 1):>9.0%} "
            f"{_seconds(r['step_s']):>9s} {r['step_s'] / plain['step_s']:>8.2f}x  {grads}"
        )
    if device != "cuda" and "tt-host" in rows:  # a newcomer reads the host row as a saving
        yield f"{WAYS['tt-host']} on a CPU-only machine copies each saved tensor into RAM it"
        yield "  already uses (host pool, copies in flight): the mechanics, not a saving; on a GPU"
        yield "  the copies leave device memory, and the disk tier frees RAM here"


def _seconds(s: float) -> str:
    return f"{s:.2f}s" if s >= 1 else f"{s * 1e3:.1f}ms"


def _same(row: dict, plain: dict) -> str:
    return "identical" if row["grad_sha256"] == plain["grad_sha256"] else "DIFFER"


def _spawn(way: str, sizes: dict, spill_dir: str) -> dict:
    cmd = [sys.executable, "-m", "tensortier.demo", "--worker", way, "--spill-dir", spill_dir]
    for key, value in sizes.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"the demo's {WAYS[way]} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _context(way: str, spill_dir: str) -> AbstractContextManager:
    import tensortier as tt

    if way == "tt-host":
        return tt.offload(tier="host", min_bytes=MIN_BYTES)
    if way == "tt-disk":
        return tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=MIN_BYTES)
    return nullcontext()


def _worker(way: str, sizes: dict, spill_dir: str) -> dict:
    """Trains ``sizes['steps'] + 1`` steps one way in this (fresh) process; returns measurements."""
    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(
        n_layer=sizes["layers"],
        n_head=sizes["heads"],
        n_embd=sizes["d_model"],
        block_size=sizes["seq"],
        vocab_size=4096,
    )
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = GPT(cfg, checkpoint=(way == "checkpoint")).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = random_batch(cfg, sizes["batch"], device=device)
    base = _memory_now(cuda)  # model, optimizer and data: every step's peak is on top of it
    peaks, times, grad_hash = [], [], ""
    for step in range(sizes["steps"] + 1):
        _reset_peak(cuda)
        t0 = time.perf_counter()
        with _context(way, spill_dir):
            loss = model(x, y)
        loss.backward()
        if step == 0:
            grad_hash = _grad_sha256(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - t0)
        peaks.append(max(0, _peak(cuda) - base))
    return {"peak_bytes": max(peaks), "step_s": statistics.median(times), "grad_sha256": grad_hash}


def _memory_now(cuda: bool) -> int:
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return status_bytes("VmRSS")


def _reset_peak(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()


def _peak(cuda: bool) -> int:
    return torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM")


def _grad_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.grad.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensortier demo", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
