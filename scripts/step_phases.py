"""Diagnostic (not a benchmark): where ``opt.step()`` spends its time, DDP + fused AdamW against
DDP + sharded ``OffloadedAdamW(defer_gather=True)``, on 2 gloo ranks.

Each iteration runs both variants in turn (interleaved, a barrier before each), on the GPT of
``python -m benchmarks distributed``. Per rank: median wall time of ``step()`` + ``zero_grad()``,
the calling thread's CPU time (``time.thread_time``) and the process's (``time.process_time``:
the difference is other threads running during the step), and with ``--phases`` the thread CPU
and wall time of the optimizer's phases. Wall times on a shared machine are relative indications
only; the CPU times are what survives load.

    PYTHONPATH=src python scripts/step_phases.py [--steps 14] [--phases] [--floor]

``--floor``: also the fused kernel alone, on all parameters (what each DDP + fused rank runs)
and on half of each (one of 2 ranks' shards), one thread, in this process.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ACC: dict[str, list[float]] = {}  # phase -> [thread CPU s, wall s, calls], reset per step


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            e = ACC.setdefault(name, [0.0, 0.0, 0])
            e[0] += time.thread_time() - c0
            e[1] += time.perf_counter() - t0
            e[2] += 1

    return wrapper


def _instrument() -> None:
    from tensortier.optim import _update, _zero

    for cls, names in [
        (_zero.ShardedStep, ["_update_inline", "_conclude", "_hand_over"]),
        (_zero.DeferredWrites, ["check", "synchronize"]),
        (_update.Updater, ["submit_now", "_update"]),
    ]:
        for n in names:
            setattr(cls, n, _timed(f"{cls.__name__}.{n}", cls.__dict__[n]))
    _update.adamw_ = _timed("kernel", _update.adamw_)


def _model():
    from tensortier.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=384, block_size=64, vocab_size=8192))


def _rank(rank: int, world: int, port: int, out: str, steps: int, phases: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensortier.models.gpt import random_batch
    from tensortier.optim import OffloadedAdamW

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    if phases:
        _instrument()
    runs = {}
    for v in ("fused", "defer"):
        m = _model()
        if v == "fused":
            opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        else:
            opt = OffloadedAdamW(
                m.parameters(), lr=3e-4, weight_decay=0.1, bucket_size="4MiB", defer_gather=True
            )
        runs[v] = (DDP(m), opt)
    cfg = runs["fused"][0].module.cfg
    res = {v: {"wall": [], "cpu": [], "proc": [], "phases": []} for v in runs}
    for i in range(steps):
        x, y = random_batch(cfg, 4, seed=1000 * rank + i)
        for v, (ddp, opt) in runs.items():
            dist.barrier()
            ddp(x, y).backward()
            ACC.clear()
            t, c, p = time.perf_counter(), time.thread_time(), time.process_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 2:  # warm-up: lazy state, DDP's bucket rebuild
                r = res[v]
                r["wall"].append(time.perf_counter() - t)
                r["cpu"].append(time.thread_time() - c)
                r["proc"].append(time.process_time() - p)
                r["phases"].append({k: list(e) for k, e in ACC.items()})
    runs["defer"][1].close()
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)


def _floor(reps: int = 30) -> None:
    torch.set_num_threads(1)
    ps = list(_model().parameters())
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.1, fused=True)
    opt.step()

    def half(t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        return flat[: flat.numel() // 2 // 16 * 16].clone()

    hp, hg = [half(p) for p in ps], [half(p.grad) for p in ps]
    hm, hv = [torch.zeros_like(t) for t in hp], [torch.zeros_like(t) for t in hp]
    hs = [torch.zeros(()) for _ in hp]

    def kernel_half() -> None:
        torch._foreach_add_(hs, 1)
        torch._fused_adamw_(
            hp, hg, hm, hv, [], hs, lr=3e-4, beta1=0.9, beta2=0.999, weight_decay=0.1,
            eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    times: dict[str, list[float]] = {"fused AdamW, all": [], "kernel, half": []}
    for _ in range(reps):  # interleaved
        for name, fn in zip(times, (opt.step, kernel_half)):
            c = time.thread_time()
            fn()
            times[name].append(time.thread_time() - c)
    for name, t in times.items():
        print(f"floor: {name:18s} thread CPU median {1e3 * np.median(t):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--phases", action="store_true", help="time the optimizer's phases")
    ap.add_argument("--floor", action="store_true", help="the kernel alone, all vs half")
    args = ap.parse_args()
    out = os.path.join(tempfile.mkdtemp(prefix="tt-step-phases-"), "rank")
    port = 29500 + os.getpid() % 1000
    mp.spawn(_rank, args=(2, port, out, args.steps, args.phases), nprocs=2)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            res = json.load(f)
        for v, r in res.items():
            med = {k: 1e3 * float(np.median(r[k])) for k in ("wall", "cpu", "proc")}
            print(
                f"rank {rank} {v:6s} step+zero_grad wall {med['wall']:6.2f} ms, thread CPU "
                f"{med['cpu']:5.2f}, process CPU {med['proc']:5.2f}"
            )
            for k in sorted({k for ph in r["phases"] for k in ph}):
                cpu, wall = ([ph.get(k, [0, 0, 0])[j] for ph in r["phases"]] for j in (0, 1))
                print(
                    f"    {k:30s} CPU {1e3 * np.median(cpu):5.2f} wall {1e3 * np.median(wall):5.2f}"
                )
    if args.floor:
        _floor()


if __name__ == "__main__":
    main()
