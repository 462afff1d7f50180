"""Run a function on N gloo ranks spawned from pytest, with a deadline (never a hang).

``run(fn, world, *args)`` spawns ``world`` processes, each initialising a gloo process group
(timeout 60 s: a collective some rank never joins fails instead of hanging), calls
``fn(rank, world, *args)`` and returns the JSON-able results in rank order. A worker's exception
fails the test with its traceback; a run past ``timeout`` seconds is killed and fails.

Ranks start from multiprocessing's forkserver, which has imported torch and tensortier once: a
rank costs a fork instead of a fresh interpreter importing torch (1.5 CPU seconds each, four
ranks of a test on two cores). Each rank takes the parent's environment of the moment of the
call, as a spawned process would (a forked one would have the forkserver's).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

# imported by the forkserver before it forks ranks (if it is not running already: a module that
# started it first with its own list still works, its ranks then import what they miss)
PRELOAD = ["torch", "torch.distributed", "tensortier", "tests.distributed"]


def _entry(
    rank: int, fn, world: int, store: str, out: str, args: tuple, backend: str, env: dict
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, as a spawned rank would see it
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist = torch.distributed
    dist.init_process_group(  # a file store: no TCP port to race other test runs for
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = fn(rank, world, *args)
        payload = {"ok": True, "result": result}
    except BaseException as exc:  # reported by the parent with the worker's traceback
        payload = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(payload, f)


def run(
    fn,
    world: int,
    *args,
    timeout: float = 120.0,
    expect_errors: bool = False,
    backend: str = "gloo",
) -> list:
    """Results of ``fn`` per rank; with ``expect_errors`` the per-rank payloads (ok/error).
    ``backend="nccl"``: rank r uses GPU r."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="tt-dist-") as tmp:
        out = os.path.join(tmp, "result")
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, os.path.join(tmp, "store"), out, args, backend, env),
            nprocs=world,
            join=False,
            start_method="spawn" if backend == "nccl" else "forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in ctx.processes):  # a killed rank must not stop the rest
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world} ranks still running after {timeout:.0f}s")
                for p in ctx.processes:
                    p.join(timeout=0.2)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        payloads = []
        for rank, proc in enumerate(ctx.processes):
            try:
                with open(f"{out}.{rank}") as f:
                    payloads.append(json.load(f))
            except FileNotFoundError:  # killed (e.g. by a fault point) before reporting
                payloads.append({"ok": False, "error": f"exit code {proc.exitcode}"})
    if expect_errors:
        return payloads
    failed = [(r, p) for r, p in enumerate(payloads) if not p["ok"]]
    assert not failed, "\n".join(
        f"rank {r} failed:\n{p.get('traceback', p['error'])}" for r, p in failed
    )
    return [p["result"] for p in payloads]
