from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from tensortier.planner.policies import Options, choose, plan_all  # noqa: E402
from tensortier.planner.report import write_report  # noqa: E402


def test_report_writes_html_and_a_png(make_profile, tmp_path):
    p = make_profile(n_units=6, per_unit=2, zero_frac=0.6)
    budget = int(0.4 * p.saved_bytes)
    opts = Options(search_iters=50, margin=0.0)
    choice = choose(p, budget, "auto", opts)
    html_path, png_path = write_report(
        tmp_path / "plan.html", p, choice, plan_all(p, budget, opts), budget=budget
    )
    with open(html_path) as f:
        page = f.read()
    assert "Per-module actions" in page and "h.5" in page and "data:image/png;base64," in page
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_sweep_report_draws_every_policy_against_the_budget(tmp_path):
    from tensortier.planner.report import write_sweep_report

    rows, summary = [], []
    for frac in (0.2, 0.5):
        budget = int(frac * 100e6)
        for policy, peak, step in (("auto", 0.9, 1.0), ("recompute_all", 0.8, 1.3)):
            rows.append({"model": "gpt:2x8x1", "frac": frac, "policy": policy,
                         "budget_bytes": budget, "peak_bytes": int(peak * budget),
                         "pred_peak_bytes": int(peak * budget), "step_s": step,
                         "pred_step_s": step, "meets_budget": True,
                         "actions": {"h.0": "selective[1,2]", "h.1": "disk"},
                         "op_actions": [{"unit": "h.0", "op": "gelu.default", "recomputed": 1,
                                         "cached": 0}]})  # fmt: skip
        summary.append({"model": "gpt:2x8x1", "frac": frac, "budget_bytes": budget,
                        "fastest_meeting": "auto", "auto_meets_budget": True,
                        "auto_vs_fastest": 1.0, "best_global": "recompute_all",
                        "auto_speedup_vs_best_global": 1.3, "max_pred_err_pct": 0.0})  # fmt: skip
    path = write_sweep_report(tmp_path / "sweep.html", rows, summary)
    with open(path) as f:
        page = f.read()
    assert "gpt:2x8x1" in page and "selective[1,2]" in page and "gelu.default" in page
    assert page.count("data:image/png;base64,") == 1 and "1.300" in page
