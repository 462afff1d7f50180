"""`python -m benchmarks planner`: a budget sweep; every policy's measured peak and step time.

Each model runs in one fresh subprocess, the way a user's job would. Plain training gives the
reference peak. Then, for every budget (``--budget-fracs`` x the plain peak), ``auto`` runs as a
user runs it, ``tt.offload(budget=...)`` from its very first step (warm-up, probe, timing
passes, then its plan), and every other policy plans from the profile ``auto`` measured, for the
same budget, and runs its plan through its own offloader. All of them then run in rounds, one
step of every policy per round (the first round warms each one up), so the slow minutes of a
shared host hit every policy alike.

The model trains on the machine's device (a GPU when there is one, else the CPU). Peaks are
honest over every step, the first included: each step's high-water mark (reset at its start:
the CUDA allocator's allocated bytes on a GPU, the RSS on the CPU) above what was in use at its
start, plus whatever that policy's earlier steps left resident (its
offloader's staging and read buffers), so a policy's buffers count against its budget the way
they would if it ran alone. The step time is the fastest round (a shared host's CPU steal
only adds time; the median is reported beside it). Gradients are compared with plain training's
bit for bit (lossless plans must match exactly).

Per budget: the fastest policy that meets it, whether ``auto`` meets it over all of its steps
and is within 3% and within 5% (issue 27's bar, :data:`TARGET`) of that fastest one, and
``auto``'s speed-up over the best *global* policy that meets it (``keep``, ``swap_all``,
``recompute_all``, ``flashneuron``, ``capuchin``). The run's ``target`` counts the cells (model x
budget) where ``auto`` is within 5%; a cell where ``auto`` found no plan counts as a miss.
``auto``'s steps before the rounds include its measured trials (``planner/trials.py``): the
rounds run the plan it settled on.

The subprocess runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``), the setting
tensortier's offloader makes itself on a CPU-only machine, for every policy alike.
Run: ``python -m benchmarks planner --json benchmarks/results/planner-sweep-cpu.json [--quick]``.
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

from tqdm import tqdm

from benchmarks import _harness as harness
from benchmarks._common import child_env, write_json
from tensortier._units import format_size, print_table
from tensortier.planner.trials import REPEATS

VARIANTS = (
    "keep",
    "swap_all",
    "recompute_all",
    "flashneuron",
    "capuchin",
    "fine",
    "search",
    "auto",
)
GLOBAL = ("keep", "swap_all", "recompute_all", "flashneuron", "capuchin")
TARGET = 1.05  # issue 27 target 5: auto within 5% of the fastest plan that meets the budget
DEFAULT_MODELS = "gpt:12x192x8,gpt:12x128x8,llama:8x192x8"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default=DEFAULT_MODELS, help="KIND:LAYERSxEMBDxBATCH,... (gpt, llama)"
    )
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--budget-fracs", default="0.2,0.35,0.5,0.7", help="budgets / plain peak")
    p.add_argument("--timing-iters", type=int, default=2, help="timing passes of the profile")
    p.add_argument("--plan-seconds", type=float, default=30.0, help="bound on planning time")
    p.add_argument("--policies", default=",".join(VARIANTS))
    p.add_argument("--spill-dir", default=tempfile.gettempdir())
    p.add_argument("--quick", action="store_true", help="one small model, two budgets, 1 round")
    # one step of every policy per round, after 1 warm-up round (--steps: the older name)
    harness.add_args(p, rounds=5, aliases=("--steps",), dest="steps")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument("--report", default=None, help="write an HTML report of the sweep here")
    p.add_argument(
        "--from-json", default=None, help="only draw --report from this earlier --json file"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)


# ------------------------------------------------------------------ worker side
def _build(args):
    """The model and its batch on the machine's device (a lent GPU, else the CPU), where a
    user's job trains it: a sweep on the CPU of a GPU machine measured the wrong memory."""
    import torch

    from tensortier._device import default_device
    from tensortier.models import GPT, GPTConfig, Llama, LlamaConfig, random_batch

    kind, _, shape = args.model.partition(":")
    layers, embd, batch = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    common = dict(
        n_layer=layers, n_head=args.heads, n_embd=embd, block_size=args.seq, vocab_size=args.vocab
    )
    if kind == "llama":
        cfg = LlamaConfig(**common)
        model = Llama(cfg)
    else:
        cfg = GPTConfig(**common)
        model = GPT(cfg)
    device = default_device()
    x, y = random_batch(cfg, batch, args.seq, seed=1, device=device)
    return model.to(device), x, y


def _grad_digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.grad is not None:
            h.update(name.encode())
            grad = p.grad.detach().cpu().contiguous()
            h.update(grad.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _in_use(device) -> int:
    """The memory a budget counts on ``device`` now: CUDA's allocated bytes, else the RSS."""
    import torch

    from tensortier._device import rss_bytes

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()


class _StepPeak:
    """One step's high-water mark on ``device``: the CUDA allocator's allocated bytes (as the
    activations area reads it; its cache is not emptied, which would make every timed step
    allocate afresh), else the RSS's (a ``HighWater``: the planner's own meters nest in it)."""

    def __init__(self, device):
        self.device = device
        self._watch = None

    def start(self) -> int:
        """Resets the mark; the memory in use now."""
        import torch

        from tensortier._memory import HighWater

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        start = _in_use(self.device)
        self._watch = HighWater()
        self._watch.start()
        return start

    def stop(self) -> int:
        """The mark since :meth:`start`, after the step's last kernel."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return self._watch.stop()


class _Runner:
    """Runs one step of a variant and measures its peak honestly (see the module docstring) on
    the batch's device, the step timed to its last kernel."""

    def __init__(self, model, x, y):
        self.model, self.x, self.y = model, x, y

    def step(self, var: dict) -> tuple[float, int, str]:
        import torch

        model, device = self.model, self.x.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        model.zero_grad(set_to_none=True)
        wrap = var.get("wrap")
        meter = _StepPeak(device)
        start = meter.start()
        t0 = time.perf_counter()
        installed = wrap() if wrap is not None else None
        try:
            ctx = var.get("ctx")
            if ctx is not None:
                with ctx:
                    loss = model(self.x, self.y)
            else:
                loss = model(self.x, self.y)
            loss.backward()
            del loss
            sync()
            dt = time.perf_counter() - t0
            high = meter.stop()
        finally:
            if installed is not None:
                installed.remove()
        digest = _grad_digest(model)
        model.zero_grad(set_to_none=True)
        peak = max(0, high - start) + var.get("resident", 0)
        var["resident"] = max(0, var.get("resident", 0) + _in_use(device) - start)
        var["peaks"].append(peak)
        return dt, peak, digest


class _Reinstalled:
    """A planned offload's checkpoint wrappers, installed for one step of it."""

    def __init__(self, planned):
        self.planned = planned
        planned._install(planned._current)

    def remove(self) -> None:
        if self.planned._recompute is not None:
            self.planned._recompute.remove()


def _worker(args) -> dict:
    # the planner's modules load before memory is released and plain training measured, as
    # in a user's job (the helpers below import from them again, for free)
    import tensortier.activations  # noqa: F401
    import tensortier.planner.policies  # noqa: F401
    import tensortier.planner.report  # noqa: F401
    import tensortier.planner.runtime  # noqa: F401
    import tensortier.planner.simulator  # noqa: F401
    from tensortier._memory import release_freed_memory

    release_freed_memory()
    model, x, y = _build(args)
    run = _Runner(model, x, y)
    plain = {"peaks": []}
    run.step(plain)  # warm-up: lazy initialisation, first-touch of the allocator
    plain_peak = max(run.step({"peaks": []})[1] for _ in range(2))
    _, _, plain_grads = run.step({"peaks": []})
    out = {"model": args.model, "plain_peak_bytes": plain_peak, "budgets": []}
    policies = [p for p in args.policies.split(",") if p]
    for frac in (float(f) for f in args.budget_fracs.split(",")):
        out["budgets"].append(_budget_cell(args, run, frac, plain_peak, plain_grads, policies))
    return out


def _budget_cell(
    args, run: _Runner, frac: float, plain_peak: int, plain_grads: str, policies: list[str]
) -> dict:
    """One budget: ``auto`` as a user runs it until it settles, every other policy planned from
    the profile it measured, then all of them in rounds on the one model."""
    from tensortier.errors import BudgetError
    from tensortier.planner.policies import Options, plan_all
    from tensortier.planner.runtime import PlanConfig

    budget = int(frac * plain_peak)
    opts = Options(seed=0, plan_seconds=args.plan_seconds, tiers=("disk",))
    config = PlanConfig(
        budget=budget,
        tier="disk",
        spill_dir=args.spill_dir,
        timing_iters=args.timing_iters,
        options=opts,
    )
    planned, auto, profiling, error, minimum = _settle_auto(args, run, config)
    row = {"frac": frac, "budget_bytes": budget, "profiling_peaks": profiling}
    if error is not None or planned.choice is None:
        row["error"] = error or "no plan"
        row["infeasible"] = error is not None
        row["minimum_bytes"] = minimum
        planned.close()
        return row
    # from here on the policies take turns on one model: auto's wrappers go in for its
    # own steps only (its runtime may plan again and install others: they go too)
    if planned._recompute is not None:
        planned._recompute.remove()
    auto["wrap"] = lambda p=planned: _Reinstalled(p)
    profile = planned.profile
    plan_budget = planned._planning_budget()
    t0 = time.perf_counter()
    inner = Options(**{**opts.__dict__, "margin": 0.0})
    choices = plan_all(profile, plan_budget, inner)
    row["plan_all_s"] = time.perf_counter() - t0
    row["planning_budget_bytes"] = plan_budget
    row["overhead_bytes"] = planned._overhead
    variants = _variants(args, run.model, planned, config, choices, policies, auto)
    try:
        for r in range(1 + args.steps):
            for var in variants.values():
                dt, peak, digest = run.step(var)
                var["digest"] = digest
                if r:
                    var["times"].append(dt)
    except BudgetError as e:  # never from a re-plan (it warns); a bench must not crash
        row["error"] = f"rounds: {e}"
        for var in variants.values():
            if var.get("ctx") is not None:
                var["ctx"].close()
        return row
    row["rows"] = _policy_rows(args, frac, budget, variants, profiling, planned, plain_grads)
    row["timing_groups"] = planned._groups
    row["transient_factor"] = profile.transient_factor
    row["move_s_per_byte"] = profile.move_s_per_byte
    row["auto_measured_peaks"] = planned.measured_peaks
    row["auto_replans"] = planned.replans
    return row


def _settle_auto(args, run: _Runner, config):
    """``(planned, auto, profiling_peaks, error, minimum)``: ``auto`` from its very first step
    (warm-up, probe, timing passes, then the plan's trials and one step of its choice), or the
    budget error it raised."""
    from tensortier.errors import BudgetError
    from tensortier.planner.runtime import PlannedOffload

    auto = {"name": "auto", "peaks": [], "times": []}
    planned = PlannedOffload(config)
    auto["ctx"] = planned
    error = minimum = None
    profiling = []
    try:
        limit = config.warmup + 3 + args.timing_iters + config.trial_plans * (1 + REPEATS)
        while not planned.settled:
            dt, peak, digest = run.step(auto)
            profiling.append(peak)
            if len(profiling) > limit:
                break
    except BudgetError as e:
        error, minimum = str(e), e.minimum
    return planned, auto, profiling, error, minimum


def _variants(args, model, planned, config, choices: dict, policies: list[str], auto: dict):
    """Each policy's step: its plan through its own offloader (when it moves anything) and its
    recompute wrappers, in ``policies`` order; ``auto`` runs its settled plan."""
    from tensortier.activations import Offloader
    from tensortier.planner.runtime import Recompute, make_decide
    from tensortier.planner.simulator import selective_sets

    profile = planned.profile
    variants = {}
    for name in policies:
        if name == "auto":
            auto["choice"] = planned.choice
            variants["auto"] = auto
            continue
        choice = choices.get(name)
        if choice is None:
            continue
        plan = choice.plan
        var = {"name": name, "choice": choice, "peaks": [], "times": []}
        if any(a.mode.value in ("host", "disk") for a in plan.actions.values()):
            var["ctx"] = Offloader(
                "disk",
                spill_dir=args.spill_dir,
                decide=make_decide(profile, plan),
                prefetch_budget=config.prefetch_budget,
                inflight_budget=config.inflight_budget,
                host_budget=planned._pool_budget(),
                io_threads=planned._io_threads(),
            )
        sets = selective_sets(profile, plan)
        recompute = plan.recomputed()
        if recompute or sets:
            var["wrap"] = lambda r=recompute, s=sets: Recompute(model, r, s)
        variants[name] = var
    return variants


def _policy_rows(args, frac, budget, variants, profiling, planned, plain_grads) -> list[dict]:
    """One row per policy: predicted against measured peak and step time, whether it met the
    budget and (lossless plans) matched plain training's gradients bit for bit."""
    from tensortier.planner.report import op_rows

    profile = planned.profile
    rows = []
    for name, var in variants.items():
        choice = var["choice"]
        pred = choice.result
        lossless = all(profile.codecs[c].lossless for c in choice.plan.codecs.values() if c)
        peaks = profiling + var["peaks"] if name == "auto" else var["peaks"]
        step_s = min(var["times"])
        rows.append(
            {
                "model": args.model,
                "frac": frac,
                "policy": name,
                "plan": choice.plan.policy,
                "budget_bytes": budget,
                # the simulator's step peak plus the offloader's resident buffers
                "pred_peak_bytes": pred.peak_bytes
                + (planned._overhead if var.get("ctx") is not None else 0),
                "peak_bytes": max(peaks),
                "first_peak_bytes": peaks[0],
                "pred_step_s": pred.step_s,
                "step_s": step_s,
                "step_median_s": statistics.median(var["times"]),
                "step_times_s": var["times"],  # one per round, the rounds aligned
                "meets_budget": max(peaks) <= budget,
                "grads_match": var["digest"] == plain_grads if lossless else None,
                "plan_s": choice.plan_s,
                "actions": choice.plan.to_dict()["actions"],
                "op_actions": op_rows(profile, choice.plan),
            }
        )
        ctx = var.get("ctx")
        if ctx is not None:
            ctx.close()
    return rows


def _spawn(args, model: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.planner", "--worker", "--model", model]
    for k in (
        "seq",
        "heads",
        "vocab",
        "steps",
        "spill_dir",
        "timing_iters",
        "budget_fracs",
        "policies",
        "plan_seconds",
    ):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = child_env(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"worker for {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ driver
def summarize(rows: list[dict]) -> dict:
    """Per budget: the fastest policy that met it, and how ``auto`` compares."""
    by = {r["policy"]: r for r in rows if "step_s" in r}
    meeting = [r for r in by.values() if r["meets_budget"]]
    fastest = min(meeting, key=lambda r: r["step_s"]) if meeting else None
    glob = [r for r in meeting if r["policy"] in GLOBAL]
    best_global = min(glob, key=lambda r: r["step_s"]) if glob else None
    auto = by.get("auto")
    out = {
        "fastest_meeting": fastest["policy"] if fastest else None,
        "best_global": best_global["policy"] if best_global else None,
        "auto_meets_budget": auto["meets_budget"] if auto else None,
    }
    if auto and fastest:
        out["auto_vs_fastest"] = auto["step_s"] / fastest["step_s"]
        if "step_times_s" in auto and "step_times_s" in fastest:  # the rounds are aligned
            per_round = [
                {"auto": {"t": a}, "fastest": {"t": f}}
                for a, f in zip(auto["step_times_s"], fastest["step_times_s"])
            ]
            out["auto_vs_fastest_rounds"] = harness.round_ratios(per_round, "auto", "fastest", "t")
        # the same plan measured twice in one run: any difference is the host's noise
        out["auto_same_plan_as_fastest"] = auto.get("actions") == fastest.get("actions")
        out["auto_within_3pct"] = (
            auto["meets_budget"] and auto["step_s"] <= 1.03 * fastest["step_s"]
        )
        out["auto_within_5pct"] = (
            auto["meets_budget"] and auto["step_s"] <= TARGET * fastest["step_s"]
        )
    if auto and best_global:
        out["auto_speedup_vs_best_global"] = best_global["step_s"] / auto["step_s"]
    # the host's speed drifts between the profile and the rounds (CPU steal): each plan's
    # slowdown over keep, predicted vs measured in the same rounds, cancels the drift
    keep = by.get("keep")
    for r in by.values():
        if keep is not None:
            r["pred_slowdown"] = r["pred_step_s"] / keep["pred_step_s"]
            r["slowdown"] = r["step_s"] / keep["step_s"]
            r["slowdown_err_pct"] = 100 * (r["pred_slowdown"] - r["slowdown"]) / r["slowdown"]
    if keep is not None:
        out["max_slowdown_err_pct"] = max(abs(r["slowdown_err_pct"]) for r in by.values())
    errors = []
    for r in by.values():
        for k, m in (("peak", "peak_bytes"), ("step", "step_s")):
            pred = r["pred_" + m]
            errors.append(abs(pred - r[m]) / max(r[m], 1e-12))
            r[f"{k}_err_pct"] = 100 * (pred - r[m]) / max(r[m], 1e-12)
    out["max_pred_err_pct"] = 100 * max(errors) if errors else None
    return out


def _sweep(args, models: list[str]) -> tuple[list[dict], list[dict]]:
    """Every model's sweep in its own worker process; its rows and per-budget summaries."""
    rows: list[dict] = []
    summary: list[dict] = []
    for model in tqdm(models, desc="bench planner"):
        out = _spawn(args, model)
        for b in out["budgets"]:
            head = {"model": model, "frac": b["frac"], "budget_bytes": b["budget_bytes"]}
            if "error" in b:
                summary.append({**head, "error": b["error"]})
                rows.append({**head, "policy": "auto", "error": b["error"]})
                continue
            s = summarize(b["rows"])
            summary.append(
                {
                    **head,
                    "plain_peak_bytes": out["plain_peak_bytes"],
                    **{k: v for k, v in b.items() if k not in ("rows", "frac", "budget_bytes")},
                    **s,
                }
            )
            rows += b["rows"]
    return rows, summary


def _measurement(session: harness.Session, rows: list[dict], summary: list[dict]) -> dict:
    """The harness fields of every policy's row (its rounds' step times) and the run's verdict;
    ``auto`` against the fastest plan that met the budget, within each round."""
    timed, ratios = {}, {}
    for r in rows:
        if "step_times_s" not in r:
            continue
        stats = {"step_s": harness.spread_stats(r["step_times_s"])}
        r.update(session.row_fields(stats))
        timed[f"{r['model']}@{r['frac']} {r['policy']}"] = stats
    for s in summary:
        if "auto_vs_fastest_rounds" in s:
            ratios[f"{s['model']}@{s['frac']} auto_vs_fastest"] = s["auto_vs_fastest_rounds"]
    return session.report(timed, ratios)


def target(summary: list[dict]) -> dict:
    """Issue 27 target 5: the cells where ``auto`` is within 5% of the fastest plan that meets
    the budget (min over the rounds, as ``auto_vs_fastest``); a cell without an auto plan is a
    miss."""
    hits = [s for s in summary if s.get("auto_within_5pct")]
    return {
        "bar": TARGET,
        "cells": len(summary),
        "auto_within_5pct": len(hits),
        "misses": [f"{s['model']}@{s['frac']}" for s in summary if s not in hits],
    }


def _print_cells(summary: list[dict]) -> dict:
    """One line per cell and the count against issue 27's bar; returns :func:`target`."""
    for s in summary:
        if "error" in s:
            print(f"{s['model']} @ {s['frac']}: {s['error']}")
            continue
        print(
            f"{s['model']} @ {s['frac']}: fastest meeting {s['fastest_meeting']}; auto meets "
            f"{s['auto_meets_budget']}, x{s.get('auto_vs_fastest', float('nan')):.3f} of the "
            f"fastest, x{s.get('auto_speedup_vs_best_global', float('nan')):.3f} faster than "
            f"{s['best_global']}"
        )
    goal = target(summary)
    print(
        f"auto within 5% of the fastest plan meeting the budget in {goal['auto_within_5pct']} "
        f"of {goal['cells']} cells (misses: {', '.join(goal['misses']) or 'none'})"
    )
    return goal


def run(args) -> list[dict]:
    if args.worker:
        print(json.dumps(_worker(args)))
        return []
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        if args.report:
            from tensortier.planner.report import write_sweep_report

            print(f"wrote {write_sweep_report(args.report, data['rows'], data['summary'])}")
        return data["rows"]
    models = args.models.split(",")
    if args.quick:
        models, args.budget_fracs = ["gpt:4x128x8"], "0.35,0.7"
        args.plan_seconds = min(args.plan_seconds, 10.0)
    args.steps = harness.rounds_of(args)
    session = harness.Session("planner", args.steps, args.quiet_wait, args.quiet_load)
    with session:
        rows, summary = _sweep(args, models)
    measurement = _measurement(session, rows, summary)
    print_table(
        [
            {
                "model": r.get("model"),
                "frac": r.get("frac"),
                "policy": r.get("policy"),
                "pred_peak": format_size(r["pred_peak_bytes"]) if "pred_peak_bytes" in r else "-",
                "peak": format_size(r["peak_bytes"]) if "peak_bytes" in r else "-",
                "budget": format_size(r["budget_bytes"]),
                "meets": r.get("meets_budget"),
                "pred_step_s": r.get("pred_step_s"),
                "step_s": r.get("step_s"),
                "peak_err%": r.get("peak_err_pct"),
                "step_err%": r.get("step_err_pct"),
                "x_keep_err%": r.get("slowdown_err_pct"),
                "grads": r.get("grads_match"),
            }
            for r in rows
        ],
        [
            "model",
            "frac",
            "policy",
            "pred_peak",
            "peak",
            "budget",
            "meets",
            "pred_step_s",
            "step_s",
            "peak_err%",
            "step_err%",
            "x_keep_err%",
            "grads",
        ],
    )
    goal = _print_cells(summary)
    print(harness.summary_line(measurement))
    write_json(
        args.json,
        "planner-sweep",
        rows,
        summary=summary,
        target=goal,
        measurement=measurement,
        args=vars(args),
    )
    if args.report:
        from tensortier.planner.report import write_sweep_report

        print(f"wrote {write_sweep_report(args.report, rows, summary)}")
    harness.require(  # lossless plans only: a lossy codec's grads_match is None
        {
            f"{r['model']}@{r['frac']} {r['policy']}: gradients bit-identical to plain's": False
            for r in rows
            if r.get("grads_match") is False
        }  # fmt: skip
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__)
    add_args(p)
    run(p.parse_args())


if __name__ == "__main__":
    main()
