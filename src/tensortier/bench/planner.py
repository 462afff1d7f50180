"""`tensortier bench planner`: the planner's predictions against measurement, per policy.

For each GPT shape: a fresh subprocess runs plain training (the reference peak); another warms up
and profiles one iteration (every saved tensor to disk) and writes the profile; the planner then
builds every policy's plan for a budget of ``--budget-frac`` x the plain peak, and each plan runs
in its own fresh subprocess. Per policy: predicted and measured peak memory (CPU: the RSS
high-water mark of the measured steps minus RSS before them, after one warm-up step, so memory
held across iterations such as the offloader's staging buffers is excluded, as CUDA's max
allocated excludes host memory; CUDA: max allocated) and step time (median of
the measured steps), the errors, whether the budget was met, and whether gradients match plain
(lossless plans must match exactly). ``auto`` is compared with the better of ``swap_all`` and
``recompute_all``, the two plans a user would otherwise pick.

Subprocesses run with ``MALLOC_MMAP_THRESHOLD_`` fixed so that RSS follows live bytes (glibc's
adaptive threshold otherwise keeps freed activations in the heap), the same for every variant.
Run: ``tensortier bench planner --json benchmarks/results/planner-cpu.json [--quick]``.
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

from tqdm import tqdm

from tensortier._units import format_size
from tensortier.bench._common import print_table, write_json

VARIANTS = ("keep", "swap_all", "recompute_all", "flashneuron", "capuchin", "search", "auto")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="4x256x8,6x192x8", help="LAYERSxEMBDxBATCH,... GPT shapes")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--budget-frac", type=float, default=0.25, help="budget / plain peak")
    p.add_argument(
        "--steps", type=int, default=3, help="measured steps per variant (after 1 warm-up)"
    )
    p.add_argument("--policies", default=",".join(VARIANTS))
    p.add_argument("--spill-dir", default=tempfile.gettempdir())
    p.add_argument("--threads", type=int, default=0, help="torch threads in workers (0: default)")
    p.add_argument("--quick", action="store_true", help="one small shape, 2 measured steps")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prefetch", type=int, default=None, help=argparse.SUPPRESS)


# ------------------------------------------------------------------ worker side
def _model(args):
    import torch

    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    layers, embd, batch = (int(v) for v in args.shape.split("x"))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=layers, n_head=args.heads, n_embd=embd, block_size=args.seq, vocab_size=args.vocab
    )
    model = GPT(cfg)
    x, y = random_batch(cfg, batch, args.seq, seed=1)
    return model, x, y


def _grad_digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.grad is not None:
            h.update(name.encode())
            h.update(p.grad.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(args) -> dict:
    import torch

    from tensortier.planner.profiler import PeakMeter

    model, x, y = _model(args)
    device = torch.device("cpu")
    times: list[float] = []
    if args.worker == "profile":
        from tensortier._device import rss_bytes
        from tensortier.activations import Offloader
        from tensortier.planner.profiler import Profiler

        rss0 = rss_bytes()
        warm = Offloader(
            "disk", spill_dir=args.spill_dir, decide=lambda info: "disk", prefetch=args.prefetch
        )
        with warm:
            loss = model(x, y)
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
        overhead = max(0, rss_bytes() - rss0)  # the offloader's buffers and threads stay
        prof = Profiler(
            spill_dir=args.spill_dir, device=device, prefetch=args.prefetch, offloader=warm
        )
        with prof.forward():
            loss = model(x, y)
        loss.backward()
        profile = prof.finish(
            meta={"shape": args.shape, "seq": args.seq}, offload_overhead=overhead
        )
        warm.close()
        profile.save(args.profile_out)
        return {"step_s": profile.measured_step_s, "peak_bytes": profile.measured_peak_bytes}
    ctx = None
    recompute = None
    if args.worker == "plan":
        from tensortier.activations import Offloader
        from tensortier.planner.profile import Profile
        from tensortier.planner.runtime import Recompute, make_decide
        from tensortier.planner.simulator import Plan

        with open(args.plan) as f:
            spec = json.load(f)
        profile = Profile.from_dict(spec["profile"])
        plan = Plan.from_dict(spec["plan"])
        recompute = Recompute(model, plan.recomputed())
        ctx = Offloader(
            "auto",
            spill_dir=args.spill_dir,
            decide=make_decide(profile, plan),
            prefetch=profile.prefetch_bytes,
        )
    meter = None
    for i in range(1 + args.steps):
        model.zero_grad(set_to_none=True)
        if i == 1:  # steady state: after one warm-up step (lazy init, the offloader's buffers)
            meter = PeakMeter(device).__enter__()
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx:
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        del loss
        if i:
            times.append(time.perf_counter() - t0)
    meter.__exit__(None, None, None)
    digest = _grad_digest(model)
    if recompute is not None:
        recompute.remove()
    if ctx is not None:
        ctx.close()
    return {"step_s": statistics.median(times), "peak_bytes": meter.delta, "grads": digest}


def _spawn(args, worker: str, **extra) -> dict:
    cmd = [sys.executable, "-m", "tensortier.bench.planner", "--worker", worker]
    for k in ("seq", "heads", "vocab", "steps", "spill_dir", "threads"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{worker} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ driver
def run(args) -> list[dict]:
    if args.worker:
        print(json.dumps(_worker(args)))
        return []
    from tensortier.planner.policies import HEURISTICS, Options, choose, search
    from tensortier.planner.profile import Profile
    from tensortier.planner.profiler import calibrate
    from tensortier.planner.runtime import default_prefetch

    shapes = ["2x192x8"] if args.quick else args.shapes.split(",")
    if args.quick:
        args.steps = min(args.steps, 2)
    policies = [p for p in args.policies.split(",") if p]
    rows: list[dict] = []
    summary: list[dict] = []
    bar = tqdm(total=len(shapes) * (2 + len(policies)), desc="bench planner")
    with tempfile.TemporaryDirectory(prefix="tt-bench-plan-") as tmp:
        for shape in shapes:
            plain = _spawn(args, "plain", shape=shape)
            bar.update()
            budget = int(args.budget_frac * plain["peak_bytes"])
            prof_path = os.path.join(tmp, f"profile-{shape}.json")
            prefetch = default_prefetch(budget)
            _spawn(args, "profile", shape=shape, profile_out=prof_path, prefetch=prefetch)
            bar.update()
            profile = calibrate(Profile.load(prof_path))
            opts = Options(seed=0)
            shape_rows = {}
            for policy in policies:
                t0 = time.perf_counter()
                if policy == "auto":
                    try:
                        choice = choose(profile, budget, "auto", opts)
                    except Exception as e:  # BudgetError: report it, run nothing
                        shape_rows[policy] = {"shape": shape, "policy": policy, "error": str(e)}
                        rows.append(shape_rows[policy])
                        bar.update()
                        continue
                elif policy == "search":
                    choice = search(profile, budget, opts)
                else:
                    choice = HEURISTICS[policy](profile, budget, opts)
                plan_s = time.perf_counter() - t0
                spec = os.path.join(tmp, f"plan-{shape}-{policy}.json")
                with open(spec, "w") as f:
                    json.dump({"profile": profile.to_dict(), "plan": choice.plan.to_dict()}, f)
                measured = _spawn(args, "plan", shape=shape, plan=spec)
                bar.update()
                pred = choice.result
                lossless = all(profile.codecs[c].lossless for c in choice.plan.codecs.values() if c)
                row = {
                    "shape": shape,
                    "policy": policy,
                    "plan": choice.plan.policy,
                    "budget_bytes": budget,
                    "pred_peak_bytes": pred.peak_bytes,
                    "peak_bytes": measured["peak_bytes"],
                    "peak_err_pct": 100
                    * (pred.peak_bytes - measured["peak_bytes"])
                    / max(1, measured["peak_bytes"]),
                    "pred_step_s": pred.step_s,
                    "step_s": measured["step_s"],
                    "step_err_pct": 100 * (pred.step_s - measured["step_s"]) / measured["step_s"],
                    "meets_budget": measured["peak_bytes"] <= budget,
                    "grads_match": measured["grads"] == plain["grads"] if lossless else None,
                    "plan_s": plan_s,
                    "actions": choice.plan.to_dict()["actions"],
                }
                shape_rows[policy] = row
                rows.append(row)
            best_peer = [
                shape_rows[p]["step_s"]
                for p in ("swap_all", "recompute_all")
                if p in shape_rows and shape_rows[p].get("meets_budget")
            ] or [shape_rows[p]["step_s"] for p in ("swap_all", "recompute_all") if p in shape_rows]
            auto = shape_rows.get("auto", {})
            summary.append(
                {
                    "shape": shape,
                    "plain_peak_bytes": plain["peak_bytes"],
                    "plain_step_s": plain["step_s"],
                    "budget_bytes": budget,
                    "saved_bytes": profile.saved_bytes,
                    "auto_meets_budget": auto.get("meets_budget"),
                    "auto_speedup_vs_best_peer": (min(best_peer) / auto["step_s"])
                    if best_peer and "step_s" in auto
                    else None,
                }
            )
    bar.close()
    print_table(
        [
            {
                **{k: r.get(k) for k in ("shape", "policy")},
                "pred_peak": format_size(r["pred_peak_bytes"]) if "pred_peak_bytes" in r else "-",
                "peak": format_size(r["peak_bytes"]) if "peak_bytes" in r else "-",
                "peak_err%": r.get("peak_err_pct"),
                "pred_step_s": r.get("pred_step_s"),
                "step_s": r.get("step_s"),
                "step_err%": r.get("step_err_pct"),
                "budget": r.get("meets_budget"),
                "grads": r.get("grads_match"),
            }
            for r in rows
        ],
        [
            "shape",
            "policy",
            "pred_peak",
            "peak",
            "peak_err%",
            "pred_step_s",
            "step_s",
            "step_err%",
            "budget",
            "grads",
        ],
    )
    for s in summary:
        print(
            f"{s['shape']}: plain peak {format_size(s['plain_peak_bytes'])}, budget "
            f"{format_size(s['budget_bytes'])}; auto meets budget: {s['auto_meets_budget']}; "
            f"auto speed-up vs best of swap_all/recompute_all: {s['auto_speedup_vs_best_peer']}"
        )
    write_json(args.json, "planner", rows, summary=summary, budget_frac=args.budget_frac)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tensortier.bench.planner", description=__doc__)
    add_args(p)
    run(p.parse_args())


if __name__ == "__main__":
    main()
