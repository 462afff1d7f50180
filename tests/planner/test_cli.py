from __future__ import annotations

import re
import textwrap

import pytest

from tensortier.cli import main
from tensortier.planner.simulator import Plan, simulate

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


@pytest.mark.parametrize(
    "budget", ["1000MB", "2GiB", "1.5GB", "1234567", "3000000000", "700MiB", "2.5KiB"]
)
def test_the_printed_snippet_runs_the_budget_that_was_planned(budget):
    from tensortier import parse_size
    from tensortier.planner.report import apply_hint

    printed = re.search(r'budget="([^"]+)"', apply_hint(parse_size(budget))).group(1)
    assert parse_size(printed) == parse_size(budget), printed


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_an_impossible_budget_names_only_fixes_that_exist(make_profile, tmp_path, capsys):
    """Issue 23 #6: the error said "allow more tiers", which no flag does; the budget it names
    must be one that works."""
    path = tmp_path / "prof.json"
    make_profile(n_units=3, per_unit=2).save(path)
    for policy in ("auto", "capuchin"):
        rc, _, err = _cli(["--profile", str(path), "--budget", "100MB", "--policy", policy], capsys)
        assert rc == 2 and "more tiers" not in err, err
        suggested = re.search(r"--budget (\S+)", err).group(1)
        assert ("policy='auto'" in err) == (policy != "auto")
        rc, out, _ = _cli(
            ["--profile", str(path), "--budget", suggested, "--policy", policy], capsys
        )
        assert rc == 0 and "predicted peak" in out


def test_the_printed_plan_explains_its_notation_and_how_to_apply_it(make_profile, tmp_path, capsys):
    """Issue 23 #6: a person should understand the plan without reading the source."""
    path = tmp_path / "prof.json"
    p = make_profile(n_units=4, per_unit=3, zero_frac=0.9)
    p.save(path)
    rc, out, _ = _cli(["--profile", str(path), "--budget", "7GB"], capsys)
    assert rc == 0
    labels = re.findall(r"^h\.\d\s+(\S+)", out, re.M)
    assert labels and any(lab != "keep" for lab in labels), out
    for lab in labels:
        head = lab.split("[")[0].split("+")[0]
        assert re.search(rf"^\s+.*\b{head}\b.*:", out, re.M), (lab, out)
        if "[" in lab:
            assert "counted from 0" in out
        if "+codec" in lab:
            assert "+codec: compressed" in out
    code = out.split("to run your model under this budget:\n")[1]
    code = textwrap.dedent(code.split("\n\n")[0].rstrip())
    # the budget planned, exactly: 7GB, not format_size's 6.52GiB (7000796692 bytes)
    assert 'tt.offload(budget="7GB"' in code and 'plan_cache="plans/"' in code
    assert code.startswith("import tensortier as tt\n")
    compile(code, "apply", "exec")


def test_the_printed_peak_the_report_header_and_its_table_agree(make_profile, tmp_path, capsys):
    """Issue 23 #6: the header and the policy table gave different peaks for one plan (the
    table re-planned every policy for the budget without the margin)."""
    pytest.importorskip("matplotlib")
    p = make_profile(n_units=6, per_unit=2, zero_frac=0.6)
    path = tmp_path / "prof.json"
    p.save(path)
    budget = int(1.05 * simulate(p, Plan("keep", {})).peak_bytes)  # keep fits only without margin
    report = tmp_path / "plan.html"
    rc, out, _ = _cli(
        ["--profile", str(path), "--budget", str(budget), "--report", str(report)], capsys
    )
    assert rc == 0
    policy, printed = re.search(r"plan auto:(\w+): predicted peak (\S+) ", out).groups()
    page = report.read_text()
    assert re.search(rf"predicted peak {re.escape(printed)},", page)
    table = page.split("Every policy")[1].split("</table>")[0]
    row = next(r for r in table.split("</tr>") if f"<td>{policy}</td>" in r)
    assert re.findall(r"<td>(.*?)</td>", row)[1] == printed


@pytest.mark.parametrize(
    "case, named",
    [
        ("policy", "--policy 'capucin'"),
        ("report", "directory"),
        ("save", "--save-profile"),
        ("missing", "cannot be read"),
        ("foreign", "not a tensortier profile"),
        ("truncated", "not a tensortier profile"),
        ("folder", "cannot be read"),
        ("report-folder", "is a directory"),
    ],
)
def test_a_bad_flag_or_profile_is_one_line_and_exit_code_2(
    make_profile, tmp_path, capsys, case, named
):
    """Each of these raised a traceback (ConfigError, FileNotFoundError, KeyError,
    JSONDecodeError, IsADirectoryError) out of `tensortier plan`."""
    good = tmp_path / "prof.json"
    make_profile(n_units=2, per_unit=1).save(good)
    (tmp_path / "foreign.json").write_text('{"model": "gpt"}')
    (tmp_path / "truncated.json").write_text(good.read_text()[:100])
    profile = {"missing": "nope.json", "foreign": "foreign.json", "truncated": "truncated.json"}
    path = str(tmp_path / profile[case]) if case in profile else str(good)
    path = str(tmp_path) if case == "folder" else path
    extra = {
        "policy": ["--policy", "capucin"],
        "report": ["--report", str(tmp_path / "no" / "plan.html")],
        "save": ["--save-profile", str(tmp_path / "no" / "prof.json")],
        "report-folder": ["--report", str(tmp_path)],
    }.get(case, [])
    rc, _, err = _cli(["--profile", path, "--budget", "6GB", *extra], capsys)
    assert rc == 2 and err.startswith("tensortier plan: error: ") and named in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--layers", "0"], "--layers: must be an int >= 1, got 0"),
        (["--batch", "-1"], "--batch: must be an int >= 1, got -1"),
        (["--heads", "5"], "not a multiple of --heads 5"),
        (["--model", "llama", "--embd", "60", "--heads", "4"], "even head size"),
    ],
)
def test_a_model_size_that_cannot_be_profiled_is_refused_before_profiling(args, named, capsys):
    """--layers 0 or --batch -1 profiled an empty model and printed a plan; --heads that do not
    divide --embd (or give Llama an odd head size) raised a RuntimeError traceback from torch."""
    small = ["--embd", "64", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64"]
    try:
        rc = main(["plan", *small, "--budget", "64MiB", *args])
    except SystemExit as exc:  # argparse's own error: usage, one line, exit code 2
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and named in err and "Traceback" not in err, err
