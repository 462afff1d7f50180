"""benchmarks/budget.py: the summary counts a run over its budget (the real worker runs in
tests/planner/test_runtime.py::test_every_step_from_the_first_is_under_the_budget)."""

import json
from argparse import Namespace

import pytest

import benchmarks.budget as budget


def test_a_step_over_the_budget_is_counted_and_written(monkeypatch, tmp_path):
    peaks = iter([[50, 90, 101], [40, 60, 80]])

    def fake_spawn(args, model):
        *prof, last = next(peaks)
        row = {"budget_bytes": 100, "peak_bytes": last, "grads_match": True}
        return {"budgets": [{"rows": [row], "profiling_peaks": prof}]}

    monkeypatch.setattr(budget, "_spawn", fake_spawn)
    out = tmp_path / "b.json"
    budget.run(Namespace(runs=1, models="a,b", budget_frac=0.6, json=str(out)))
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["runs"] == 2 and s["over_budget_runs"] == 1 and s["max_over_budget"] == 1.01
    assert "device" in data["env"] and "tensortier" in data["env"]["versions"]


def test_the_run_records_its_load_and_each_models_spread(monkeypatch, tmp_path):
    """Only each run's 1-minute load was kept: no load before and after the run, no highest
    load during it, no spread of a model's runs."""
    peaks = iter([[50, 90], [40, 70], [50, 95], [40, 60]])

    def fake_spawn(args, model):
        *prof, last = next(peaks)
        row = {"budget_bytes": 100, "peak_bytes": last, "grads_match": True}
        return {"budgets": [{"rows": [row], "profiling_peaks": prof}]}

    monkeypatch.setattr(budget, "_spawn", fake_spawn)
    out = tmp_path / "b.json"
    budget.run(Namespace(runs=2, models="a,b", budget_frac=0.6, json=str(out)))
    data = json.loads(out.read_text())
    m = data["measurement"]
    assert m["rounds"] == 2 and m["load_before"]["cpus"] > 0 and m["load_after"]
    stats = data["summary"]["max_over_budget_stats"]
    assert stats["a"]["n"] == 2 and stats["a"]["median"] == 0.925 and stats["b"]["max"] == 0.7


def test_gradients_that_differ_from_plain_fail_the_run_after_the_json(monkeypatch, tmp_path):
    """The JSON had no device or versions, and ``grads_match: false`` passed silently."""
    row = {"budget_bytes": 100, "peak_bytes": 50, "grads_match": False}
    monkeypatch.setattr(
        budget, "_spawn", lambda a, m: {"budgets": [{"rows": [row], "profiling_peaks": [60]}]}
    )
    out = tmp_path / "b.json"
    with pytest.raises(SystemExit, match=r"run 0 \(a\): gradients bit-identical"):
        budget.run(Namespace(runs=1, models="a", budget_frac=0.6, json=str(out)))
    assert json.loads(out.read_text())["rows"][0]["grads_match"] is False
