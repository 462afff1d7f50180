"""`tensortier demo`: train a small GPT three ways and compare memory, time and gradients.

``plain`` keeps every activation; ``checkpoint`` recomputes each block in backward
(torch.utils.checkpoint); ``tensortier`` offloads saved activations to disk (CPU) or pinned host
RAM (CUDA) and prefetches them for backward. Each way runs in a fresh subprocess so its peak memory
is its own; gradients of the first step are compared bit for bit with ``plain``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from tensortier._units import format_size
from tensortier.bench import activations


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--spill-dir", default=tempfile.gettempdir())


def run(args: argparse.Namespace) -> None:
    tier = "tt-host" if torch.cuda.is_available() else "tt-disk"
    bench_args = argparse.Namespace(
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        vocab=4096,
        steps=args.steps,
        variants=f"plain,checkpoint,{tier}",
        spill_dir=args.spill_dir,
        prefetch="128MiB",
        max_inflight="128MiB",
        quick=False,
        json=None,
        worker=None,
    )
    rows = activations.run(bench_args)
    plain = rows[0]
    print()
    for r in rows:
        name = {"tt-disk": "tensortier (disk)", "tt-host": "tensortier (host)"}.get(
            r["variant"], r["variant"]
        )
        print(
            f"{name:20s} peak {format_size(r['peak_bytes']):>9s} ({r['peak_bytes'] / plain['peak_bytes']:5.0%})"
            f"  step {r['step_s']:6.2f}s ({r['step_s'] / plain['step_s']:4.2f}x)"
            f"  gradients {'identical' if r['grads_match'] else 'DIFFER'}"
        )
