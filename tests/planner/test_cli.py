from __future__ import annotations

import pytest

from tensortier.cli import main

GB = 10**9


def test_plan_from_a_saved_profile_prints_the_plan_and_writes_a_report(
    make_profile, tmp_path, capsys
):
    pytest.importorskip("matplotlib")
    p = make_profile(n_units=4, per_unit=2, zero_frac=0.5)
    path = tmp_path / "prof.json"
    p.save(path)
    report = tmp_path / "plan.html"
    rc = main(["plan", "--profile", str(path), "--budget", "6GB", "--report", str(report)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "h.3" in out and "predicted peak" in out
    assert report.exists() and (tmp_path / "plan.png").exists()


def test_plan_with_an_impossible_budget_states_the_minimum(make_profile, tmp_path, capsys):
    p = make_profile(n_units=2, per_unit=1)
    path = tmp_path / "prof.json"
    p.save(path)
    rc = main(["plan", "--profile", str(path), "--budget", "100MB"])
    err = capsys.readouterr().err
    assert rc == 2 and "at least" in err
