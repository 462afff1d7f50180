"""Does ``tt.offload(budget=...)`` keep its budget from the very first step? N fresh processes.

Each run is the planner benchmark's worker at one budget (a fraction of the model's plain peak):
warm-up, probe, timing passes and the first planned step, each step's RSS high-water mark over
what the steps before it left resident (``profiling_peaks``, then the plan's ``peak_bytes``),
divided by the budget. Memory survives the machine's load (times do not), so this benchmark does
not wait for a quiet machine: it records the load of every run, and runs under load are part of
the evidence (the timing of copies, hence the memory they hold, moves with the load).
"""

from __future__ import annotations

import json
import os
import tempfile
from argparse import Namespace

from benchmarks import _harness as harness
from benchmarks._common import write_json
from benchmarks.planner import _spawn


def add_args(p) -> None:
    p.add_argument("--runs", type=int, default=10, help="fresh processes per model")
    p.add_argument("--models", default="gpt:3x192x16,llama:3x128x16")
    p.add_argument("--budget-frac", type=float, default=0.6, help="budget / plain peak")
    p.add_argument("--json", default=None, help="write the rows and the summary here")


def one_run(model: str, frac: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        args = Namespace(
            seq=128,
            heads=4,
            vocab=512,
            steps=1,
            spill_dir=d,
            timing_iters=2,
            budget_fracs=str(frac),
            policies="auto",
            plan_seconds=10.0,
        )
        load = os.getloadavg()[0]
        (b,) = _spawn(args, model)["budgets"]
    if "error" in b:
        return {"model": model, "error": b["error"], "load_1m": load}
    (row,) = b["rows"]
    budget = row["budget_bytes"]
    peaks = [*b["profiling_peaks"], row["peak_bytes"]]
    return {
        "model": model,
        "budget_bytes": budget,
        "step_peaks_over_budget": [round(p / budget, 4) for p in peaks],
        "max_over_budget": round(max(peaks) / budget, 4),
        "grads_match": row["grads_match"],
        "load_1m": load,
    }


def run(args) -> None:
    rows = []
    models = args.models.split(",")
    # the load envelope of the whole run beside each run's own (memory only: no quiet wait)
    session = harness.Session("budget", args.runs, quiet_wait=0)
    with session:
        for _ in range(args.runs):
            for model in models:
                r = one_run(model, args.budget_frac)
                rows.append(r)
                session.sample()
                print(json.dumps(r), flush=True)
    ok = [r for r in rows if "error" not in r]
    summary = {
        "runs": len(rows),
        "errors": len(rows) - len(ok),
        "max_over_budget": max((r["max_over_budget"] for r in ok), default=None),
        # per model, how far its runs' worst steps spread (the copies' timing moves them)
        "max_over_budget_stats": {
            m: harness.spread_stats(r["max_over_budget"] for r in ok if r["model"] == m)
            for m in models
        },
        "over_budget_runs": sum(r["max_over_budget"] > 1 for r in ok),
        "load_1m_range": [min(r["load_1m"] for r in rows), max(r["load_1m"] for r in rows)],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(summary))
    measurement = session.report({})
    print(harness.summary_line(measurement))
    # with the device and versions
    write_json(args.json, "budget", rows, summary=summary, measurement=measurement)
    harness.require(
        {
            f"run {i} ({r['model']}): gradients bit-identical to plain's": r["grads_match"]
            for i, r in enumerate(rows)
            if "error" not in r
        }  # fmt: skip
    )
