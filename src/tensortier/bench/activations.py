"""`tensortier bench activations`: a GPT trained with each activation-memory strategy side by side.

Variants, each in a fresh subprocess so peaks do not leak between them:
``plain``, ``checkpoint`` (torch.utils.checkpoint per block), ``save_on_cpu`` (PyTorch's),
``tt-host`` and ``tt-disk``. Per variant: peak memory (CUDA: max_memory_allocated; CPU: the
kernel's peak RSS of the subprocess over all steps, reset just before the first forward, minus the
RSS at that moment; ``peak_steady_bytes`` is the same measure over the steps after warm-up, which
glibc's retained heap can make look smaller), median step seconds over the measured steps (after one warm-up step), and whether the first step's gradients are
bit-identical to ``plain``'s (compared by SHA-256 of the gradient bytes).
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

import torch
from tqdm import tqdm

from tensortier.bench._common import environment, print_table, write_json

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
    p.add_argument("--prefetch", default="128MiB", help="tensortier prefetch window")
    p.add_argument("--max-inflight", default="128MiB", help="tensortier bytes in flight to a tier")
    p.add_argument("--quick", action="store_true", help="a small model, one measured step")
    p.add_argument("--json", default=None)
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


class _PeakRSS:
    """Kernel-tracked peak RSS (VmHWM), reset on demand through /proc/self/clear_refs."""

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    def reset(self) -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS to the current RSS
        return self._status("VmRSS")

    def peak(self) -> int:
        return self._status("VmHWM")


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
            prefetch=args.prefetch,
            max_inflight=args.max_inflight,
            min_bytes="256KiB",
            host_budget="16GiB" if cuda else "64GiB",
        )

    def context():
        if variant == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
        return offloader if offloader is not None else _null()

    rss = _PeakRSS()
    times, grad_hash = [], None
    # peak over every step, from the moment before the first forward: later steps alone could hide
    # memory that the allocator kept from the first one
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss.reset()
    first_peak = steady_base = 0
    for step in range(steps + 1):
        if step == 1 and not cuda:  # also report the steady state, after the warm-up step
            first_peak = rss.peak()
            steady_base = rss.reset()
        if cuda:
            torch.cuda.synchronize()
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
    if cuda:
        peak = steady = torch.cuda.max_memory_allocated() - base
    else:
        steady_peak = rss.peak()
        peak = max(first_peak, steady_peak) - base
        steady = steady_peak - steady_base
    out = {
        "variant": variant,
        "peak_bytes": int(peak),
        "peak_steady_bytes": int(steady),
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
    results = []
    for variant in tqdm(variants, desc="variants", unit="variant"):
        cmd = [
            sys.executable,
            "-m",
            "tensortier.bench.activations",
            "--worker",
            variant,
            "--layers",
            str(args.layers),
            "--d-model",
            str(args.d_model),
            "--heads",
            str(args.heads),
            "--seq",
            str(args.seq),
            "--batch",
            str(args.batch),
            "--vocab",
            str(args.vocab),
            "--steps",
            str(args.steps),
            "--spill-dir",
            args.spill_dir,
            "--prefetch",
            args.prefetch,
            "--max-inflight",
            args.max_inflight,
        ]
        if args.quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if proc.returncode != 0:
            raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    ref = results[0]
    device = environment()["device"]
    rows = []
    for r in results:
        rows.append(
            {
                "variant": r["variant"],
                "peak_bytes": r["peak_bytes"],
                "peak_steady_bytes": r["peak_steady_bytes"],
                "steady_vs_plain": r["peak_steady_bytes"] / max(ref["peak_steady_bytes"], 1),
                "step_s": r["step_s"],
                "grads_match": r["grad_sha256"] == ref["grad_sha256"],
                "device": device,
                "peak_vs_plain": r["peak_bytes"] / ref["peak_bytes"],
                "time_vs_plain": r["step_s"] / ref["step_s"],
                **({"offload": r["offload"]} if "offload" in r else {}),
            }
        )
    print_table(
        rows,
        [
            "variant",
            "peak_bytes",
            "peak_vs_plain",
            "steady_vs_plain",
            "step_s",
            "time_vs_plain",
            "grads_match",
        ],
    )
    write_json(args.json, "activations", rows, config=cfg)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
