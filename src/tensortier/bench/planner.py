"""`tensortier bench planner`: the planner's predictions against measurement, per policy.

Each GPT shape runs in one fresh subprocess, the way a user's job would: plain training gives
the reference peak; one warm-up iteration, the probe pass and ``--timing-iters`` clean timing
passes give the profile; every policy plans for a budget of ``--budget-frac`` x the plain peak;
then the plans run in rounds, one step of every plan per round (the first round warms each up).
Interleaving matters on a shared host: its slow minutes (CPU steal) then hit every plan alike.

Per policy: predicted and measured peak memory (CPU: the RSS high-water mark of a step minus
RSS before it, the highest over the rounds, so memory held across iterations such as the
offloader's staging buffers is excluded, as CUDA's max allocated excludes host memory) and step
time (the fastest round, as the profile keeps each unit's fastest time: steal only adds time;
the median is reported beside it), the errors, whether the budget was met, and whether gradients
match plain (lossless plans must match exactly). ``auto`` is compared with the better of
``swap_all`` and ``recompute_all`` that meets the budget, the plans a user would otherwise pick.

The subprocess runs with ``MALLOC_MMAP_THRESHOLD_`` fixed so that RSS follows live bytes (glibc's
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
    p.add_argument("--steps", type=int, default=4, help="measured rounds (after 1 warm-up round)")
    p.add_argument(
        "--timing-iters", type=int, default=4, help="clean timing iterations in the profile"
    )
    p.add_argument("--policies", default=",".join(VARIANTS))
    p.add_argument("--spill-dir", default=tempfile.gettempdir())
    p.add_argument("--threads", type=int, default=0, help="torch threads in workers (0: default)")
    p.add_argument("--quick", action="store_true", help="one small shape, 2 measured steps")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument("--save-profiles", default=None, help="write each shape's profile JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)


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


def _plan_for(profile, policy: str, budget: int):
    from tensortier.planner.policies import HEURISTICS, Options, choose, search

    opts = Options(seed=0)
    if policy == "auto":
        return choose(profile, budget, "auto", opts)
    if policy == "search":
        return search(profile, budget, opts)
    return HEURISTICS[policy](profile, budget, opts)


def _worker(args) -> dict:
    """One shape in one process: plain, profile, every policy's plan, measured in rounds."""
    import torch

    from tensortier.activations import Offloader
    from tensortier.errors import BudgetError
    from tensortier.planner.profiler import PeakMeter, Profiler, calibrate
    from tensortier.planner.runtime import Recompute, default_prefetch, make_decide

    model, x, y = _model(args)
    device = torch.device("cpu")

    def step(ctx=None, recompute=()) -> tuple[float, int]:
        model.zero_grad(set_to_none=True)
        wrap = Recompute(model, list(recompute)) if recompute else None
        try:
            with PeakMeter(device) as meter:
                t0 = time.perf_counter()
                if ctx is not None:
                    with ctx:
                        loss = model(x, y)
                else:
                    loss = model(x, y)
                loss.backward()
                del loss
                dt = time.perf_counter() - t0
        finally:
            if wrap is not None:
                wrap.remove()
        return dt, meter.delta

    step()  # warm-up: lazy initialisation, first-touch of the allocator
    plain_peak = min(step()[1] for _ in range(2))
    plain_grads = _grad_digest(model)
    budget = int(args.budget_frac * plain_peak)
    prefetch = default_prefetch(budget)

    warm = Offloader(
        "disk", spill_dir=args.spill_dir, decide=lambda info: "disk", prefetch=prefetch
    )
    step(warm)
    prof = Profiler(spill_dir=args.spill_dir, device=device, prefetch=prefetch, offloader=warm)
    model.zero_grad(set_to_none=True)
    with prof.forward():
        loss = model(x, y)
    loss.backward()
    del loss
    for _ in range(args.timing_iters):
        model.zero_grad(set_to_none=True)
        with prof.timing():
            loss = model(x, y)
        loss.backward()
        del loss
    t0 = time.perf_counter()
    profile = calibrate(prof.finish(meta={"shape": args.shape, "seq": args.seq}))
    profile_s = time.perf_counter() - t0
    warm.close()
    if args.save_profiles:
        profile.save(os.path.join(args.save_profiles, f"profile-{args.shape}.json"))

    variants: dict[str, dict] = {}
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        try:
            choice = _plan_for(profile, policy, budget)
        except BudgetError as e:  # report it, run nothing
            variants[policy] = {"error": str(e)}
            continue
        plan = choice.plan
        ctx = None
        if any(a.mode.value in ("host", "disk") for a in plan.actions.values()):
            ctx = Offloader(
                "auto",
                spill_dir=args.spill_dir,
                decide=make_decide(profile, plan),
                prefetch=prefetch,
            )
        variants[policy] = {
            "choice": choice,
            "ctx": ctx,
            "plan_s": time.perf_counter() - t0,
            "times": [],
            "peaks": [],
        }
    runnable = {k: v for k, v in variants.items() if "choice" in v}
    # rounds: every variant runs one step per round (round 0 warms each variant up), so slow
    # minutes of a shared host spread over all variants instead of hitting one
    for r in range(1 + args.steps):
        for v in runnable.values():
            dt, peak = step(v["ctx"], v["choice"].plan.recomputed())
            if r:
                v["times"].append(dt)
                v["peaks"].append(peak)
    rows = []
    for policy, v in variants.items():
        if "error" in v:
            rows.append({"shape": args.shape, "policy": policy, "error": v["error"]})
            continue
        choice, pred = v["choice"], v["choice"].result
        step(v["ctx"], choice.plan.recomputed())
        grads = _grad_digest(model)
        if v["ctx"] is not None:
            v["ctx"].close()
        lossless = all(profile.codecs[c].lossless for c in choice.plan.codecs.values() if c)
        measured_step, measured_peak = min(v["times"]), max(v["peaks"])
        rows.append(
            {
                "shape": args.shape,
                "policy": policy,
                "plan": choice.plan.policy,
                "budget_bytes": budget,
                "pred_peak_bytes": pred.peak_bytes,
                "peak_bytes": measured_peak,
                "peak_err_pct": 100 * (pred.peak_bytes - measured_peak) / max(1, measured_peak),
                "pred_step_s": pred.step_s,
                "step_s": measured_step,
                "step_median_s": statistics.median(v["times"]),
                "step_err_pct": 100 * (pred.step_s - measured_step) / measured_step,
                "meets_budget": measured_peak <= budget,
                "grads_match": grads == plain_grads if lossless else None,
                "plan_s": v["plan_s"],
                "actions": choice.plan.to_dict()["actions"],
            }
        )
    return {
        "rows": rows,
        "plain_peak_bytes": plain_peak,
        "budget_bytes": budget,
        "saved_bytes": profile.saved_bytes,
        "transient_factor": profile.transient_factor,
        "profile_s": profile_s,
        "timing": profile.meta.get("timing"),
    }


def _spawn(args, shape: str) -> dict:
    cmd = [sys.executable, "-m", "tensortier.bench.planner", "--worker", "--shape", shape]
    for k in (
        "seq",
        "heads",
        "vocab",
        "steps",
        "spill_dir",
        "threads",
        "timing_iters",
        "budget_frac",
        "policies",
        "save_profiles",
    ):
        if getattr(args, k) is not None:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"worker for {shape} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ driver
def _relative_to_keep(rows: list[dict]) -> None:
    """Step-time error of each plan's slowdown over ``keep`` (predicted ratio vs measured ratio).

    The profile is taken minutes before the plans run; on a shared host the machine's speed
    drifts in between (the same plain iteration measured 0.83-1.3 s within minutes here). The
    ratio to ``keep`` measured in the same rounds cancels that drift; what remains is the model.
    """
    keep = next((r for r in rows if r["policy"] == "keep" and "step_s" in r), None)
    for r in rows:
        if keep is not None and "step_s" in r:
            pred = r["pred_step_s"] / keep["pred_step_s"]
            meas = r["step_s"] / keep["step_s"]
            r["pred_slowdown"], r["slowdown"] = pred, meas
            r["slowdown_err_pct"] = 100 * (pred - meas) / meas


def run(args) -> list[dict]:
    if args.worker:
        print(json.dumps(_worker(args)))
        return []
    shapes = ["2x192x8"] if args.quick else args.shapes.split(",")
    if args.quick:
        args.steps = min(args.steps, 2)
    rows: list[dict] = []
    summary: list[dict] = []
    bar = tqdm(shapes, desc="bench planner")
    for shape in bar:
        out = _spawn(args, shape)
        _relative_to_keep(out["rows"])
        rows += out["rows"]
        by = {r["policy"]: r for r in out["rows"]}
        peers = [by[p] for p in ("swap_all", "recompute_all") if "step_s" in by.get(p, {})]
        fitting = [r for r in peers if r["meets_budget"]] or peers
        auto = by.get("auto", {})
        summary.append(
            {
                "shape": shape,
                **{k: out[k] for k in out if k != "rows"},
                "auto_meets_budget": auto.get("meets_budget"),
                "best_peer": min(fitting, key=lambda r: r["step_s"])["policy"] if fitting else None,
                "auto_speedup_vs_best_peer": (
                    min(r["step_s"] for r in fitting) / auto["step_s"]
                    if fitting and "step_s" in auto
                    else None
                ),
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
                "pred_x_keep": r.get("pred_slowdown"),
                "x_keep": r.get("slowdown"),
                "x_keep_err%": r.get("slowdown_err_pct"),
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
            "pred_x_keep",
            "x_keep",
            "x_keep_err%",
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
