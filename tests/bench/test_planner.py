"""``python -m benchmarks planner``: what the sweep does with its workers' rows (the worker itself
runs in tests/planner/test_runtime.py)."""

import argparse
import json

import pytest

from benchmarks import planner


def test_a_lossless_plan_whose_gradients_differ_fails_the_run_after_the_json(tmp_path, monkeypatch):
    """``grads_match: false`` was a table cell; a lossy plan (None) is not a failure."""
    rows = [
        {"model": "m", "frac": 0.5, "budget_bytes": 9, "policy": p, "grads_match": g,
         "step_times_s": [1.0, 1.0]}
        for p, g in (("keep", True), ("fine", None), ("swap_all", False))
    ]  # fmt: skip
    summary = [{"model": "m", "frac": 0.5, "error": "no plan"}]
    monkeypatch.setattr(planner, "_sweep", lambda args, models: (rows, summary))
    p = argparse.ArgumentParser()
    planner.add_args(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--models", "m", "--quiet-wait", "0", "--json", str(out)])
    with pytest.raises(SystemExit) as got:
        planner.run(args)
    assert "m@0.5 swap_all: gradients bit-identical" in str(got.value)
    assert "fine" not in str(got.value) and "keep" not in str(got.value)
    assert [r["grads_match"] for r in json.loads(out.read_text())["rows"]] == [True, None, False]
