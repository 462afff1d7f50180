from __future__ import annotations

import contextlib
import html
import os
import re

import pytest

pytest.importorskip("matplotlib")

from tensortier._units import format_size, parse_size  # noqa: E402
from tensortier.planner.policies import (  # noqa: E402
    Choice,
    Options,
    choose,
    plan_all,
    planning_budget,
)
from tensortier.planner.report import LEGEND, legend, write_report  # noqa: E402
from tensortier.planner.simulator import Mode, Plan, UnitAction, simulate  # noqa: E402

GB = 10**9


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


def _page_text(path) -> str:
    with open(path) as f:
        return html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<img[^>]*>", "", f.read())))


def _policy_table(path) -> dict[str, dict[str, str]]:
    """The "Every policy" table of a report: policy -> column -> cell."""
    with open(path) as f:
        page = f.read()
    table = page.split("Every policy")[1].split("</table>")[0]
    rows = [re.findall(r"<t[dh]>(.*?)</t[dh]>", r) for r in table.split("</tr>")[:-1]]
    head = [html.unescape(c) for c in rows[0]]
    return {r[0]: dict(zip(head, map(html.unescape, r))) for r in rows[1:]}


@pytest.mark.parametrize("policy", ["auto", "capuchin"])
def test_the_header_and_the_policy_table_give_the_same_peak(make_profile, tmp_path, policy):
    """Issue 23 #6: the header showed the plan made for the budget less the margin, the table
    every policy re-planned for the whole budget (114 vs 120 MiB for one plan)."""
    p = make_profile(n_units=6, per_unit=2, zero_frac=0.6)
    budget = int(1.05 * simulate(p, Plan("keep", {})).peak_bytes)  # keep fits only without margin
    opts = Options(search_iters=50)  # the default 10% margin
    choice = choose(p, budget, policy, opts)
    goal = planning_budget(budget, opts)
    others = plan_all(p, goal, opts)
    path, _ = write_report(
        tmp_path / "plan.html", p, choice, others, budget=budget, planned_for=goal
    )
    text = _page_text(path)
    header = re.search(r"predicted peak (\S+),", text).group(1)
    assert header == format_size(choice.result.peak_bytes)
    rows = _policy_table(path)
    (chosen,) = [name for name, row in rows.items() if row["chosen"]]
    assert chosen == choice.plan.policy.split(":")[-1]
    assert rows[chosen]["peak"] == header
    assert rows[chosen][f"under {format_size(goal)}"] == "yes"
    assert f"planned for {format_size(goal)}" in text
    assert rows["keep"][f"under {format_size(goal)}"] == "no"  # the margin is in the table too


def test_a_plan_without_codec_or_recompute_reports_no_such_cost(make_profile, tmp_path):
    """Issue 23 #6: a swap-only plan was shown with a "codec/recompute" cost (its copies')."""
    p = make_profile(n_units=4, per_unit=2, zero_frac=0.0)
    p.move_s_per_byte = 1e-10
    budget = 10 * p.saved_bytes
    opts = Options(search_iters=20, margin=0.0)
    choice = choose(p, budget, "swap_all", opts)
    assert not any(a.compress for a in choice.plan.actions.values())
    path, _ = write_report(tmp_path / "plan.html", p, choice, budget=budget)
    text = _page_text(path)
    assert re.search(r"copies [\d.e-]+s, codecs 0s, recompute 0s", text), text[:600]
    row = _policy_table(path)["swap_all"]
    assert row["codecs_s"] == row["recompute_s"] == "0" and float(row["copies_s"]) > 0


def test_the_report_explains_every_action_notation_and_how_to_apply_it(make_profile, tmp_path):
    """Issue 23 #6: ``disk[0,3,7,14,15]`` was never explained, nor how to use the plan."""
    p = make_profile(n_units=5, per_unit=3, zero_frac=0.9)
    actions = {
        "h.0": UnitAction(Mode.DISK, part=frozenset({0, 2})),
        "h.1": UnitAction(Mode.HOST, compress=True),
        "h.2": UnitAction(Mode.RECOMPUTE),
        "h.3": UnitAction(Mode.SELECTIVE, part=frozenset({1})),
    }
    plan = Plan("hand", actions)
    choice = Choice(plan, simulate(p, plan))
    path, _ = write_report(tmp_path / "plan.html", p, choice, budget=p.saved_bytes)
    text = _page_text(path)
    explained = legend(plan)
    for label, key in [
        ("keep", "keep:"),
        ("disk[0,2]", "disk[0,3,7]"),
        ("+codec", "+codec:"),
        ("recompute", "recompute:"),
        ("selective[1]", "selective[2,5]:"),
    ]:
        assert any(line.startswith(key) for line in explained), label
        assert key in text, label
    assert "counted from 0" in text and "moved:" in text
    with open(path) as f:
        code = html.unescape(re.search(r"<pre>(.*?)</pre>", f.read(), re.S).group(1))
    budget = re.search(r'tt\.offload\(budget="([^"]+)"', code).group(1)
    assert parse_size(budget) == p.saved_bytes  # the budget planned, exactly (not 14GiB for 15GB)
    compile(code, "apply", "exec")  # a block a user can paste
    assert legend(Plan("keep", {})) == [LEGEND["keep"]]  # only what the plan uses


@pytest.mark.parametrize("policy", ["auto", "capuchin"])
def test_a_training_runs_report_agrees_with_the_plan_it_runs(spill_dir, tmp_path, policy):
    """``tt.offload(budget=..., report=...)``: the header, the chosen row and the plan that runs
    are one plan (the table used to re-plan every policy for the budget without the margin)."""
    model, x = _four_layers()
    path = tmp_path / "plan.html"
    off = _reported_offload(spill_dir, path, policy)
    try:
        for _ in range(5):  # warm-up, probe, two timing passes, the plan
            model.zero_grad(set_to_none=True)
            with off:
                loss = model(x).sum()
            loss.backward()
        assert off.choice is not None
        peak = format_size(off.choice.result.peak_bytes)
    finally:
        off.close()
    text = _page_text(path)
    assert re.search(rf"predicted peak {re.escape(peak)},", text)
    rows = _policy_table(path)
    (chosen,) = [row for row in rows.values() if row["chosen"]]
    assert chosen["peak"] == peak and "yes" in chosen.values()


def test_the_report_shows_the_plan_the_trials_kept_and_their_measured_steps(
    spill_dir, tmp_path, monkeypatch
):
    """``auto`` runs a short list of plans for real and keeps the fastest measured (issue 27):
    the report shows that plan, not the simulator's first choice, and each trial's steps. The
    clock the trials read makes the simulator's choice the slowest plan, so another is kept."""
    import torch

    import tensortier.planner.trials as trials
    from tensortier.planner import runtime
    from tests.planner.test_trials import _key, _mlp, slow_first_plan

    monkeypatch.setattr(trials, "SPREAD", 10.0)  # every plan that fits is on the short list
    m, x = _mlp(), torch.randn(1024, 512)
    m(x).sum().backward()  # gradients and the heap already there, as in test_trials.py: the
    # first offloaded step then measures the offloader, not the first backward's allocations
    path = tmp_path / "plan.html"
    off = runtime.planned_offload(
        32 << 20,  # room over the fully offloaded first step (28.5 MiB seen inside the suite)
        spill_dir=spill_dir,
        options=Options(search_iters=60, search_seconds=5),
        report=str(path),
    )
    first = slow_first_plan(monkeypatch, off)
    try:
        for _ in range(20):  # warm-up, probe, timing passes, up to 4 plans x 3 trial steps
            m.zero_grad(set_to_none=True)
            with off:
                loss = m(x).sum()
            loss.backward()
            if off.choice is not None and not first:
                first.append(_key(off.choice.plan))
        assert off.settled and _key(off.choice.plan) != first[0]
        kept = off.choice
    finally:
        off.close()
    text = _page_text(path)
    assert f"tensortier plan: {kept.plan.policy} " in text
    assert re.search(rf"predicted peak {re.escape(format_size(kept.result.peak_bytes))},", text)
    with open(path) as f:
        table = f.read().split("Measured trials")[1].split("</table>")[0]
    rows = [re.findall(r"<t[dh]>(.*?)</t[dh]>", r) for r in table.split("</tr>")[:-1]]
    head, body = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]
    assert "measured steps_s" in head and len(body) >= 2
    (mark,) = [r for r in body if r["kept"] == "yes"]
    assert mark["compared_s"] == min((r["compared_s"] for r in body), key=float)
    assert all(r["measured steps_s"] != "-" for r in body)


def test_a_report_that_cannot_be_written_warns_and_training_goes_on(spill_dir, tmp_path):
    """``report=`` under a missing directory raised FileNotFoundError out of the fifth step's
    ``with`` (the first plan), ending the run; now one warning, and the gradients are still
    those of plain PyTorch."""
    import torch

    model, x = _four_layers()
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    path = tmp_path / "missing" / "plan.html"
    off = _reported_offload(spill_dir, path, "capuchin")
    try:
        with pytest.warns(UserWarning, match="could not be written"):
            for _ in range(6):  # warm-up, probe, two timing passes, the plan twice
                model.zero_grad(set_to_none=True)
                with off:
                    loss = model(x).sum()
                loss.backward()
        assert off.choice is not None
    finally:
        off.close()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    assert not path.parent.exists()


@pytest.mark.parametrize("slash", ["", "/"])
def test_a_report_path_that_is_a_directory_is_refused_before_anything_is_written(
    make_profile, tmp_path, slash
):
    """It wrote ``<dir>.png`` beside the directory (or ``.png`` inside it), then failed opening
    the directory as the HTML file."""
    p = make_profile(n_units=2, per_unit=1)
    folder = tmp_path / "reports"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="pass a file name"):
        write_report(str(folder) + slash, p, choose(p, 10 * GB, "keep"), budget=10 * GB)
    assert sorted(os.listdir(tmp_path)) == ["reports"] and not os.listdir(folder)


def test_a_replan_mid_training_rewrites_the_report(spill_dir, tmp_path):
    """A checked step over the budget re-plans with a wider margin; the report kept showing the
    first plan (its peak, its margin) while another plan ran."""
    model, x = _four_layers()
    path = tmp_path / "plan.html"
    off = _reported_offload(spill_dir, path, "capuchin")
    try:
        for step in range(6):  # warm-up, probe, two timing passes, the plan, the re-plan
            if step == 5:  # as if the first planned step had peaked at twice the budget
                off.measured_peaks.append(2 * (64 << 20))
                off._over = True
            model.zero_grad(set_to_none=True)
            with pytest.warns(UserWarning) if step == 5 else contextlib.nullcontext(), off:
                loss = model(x).sum()
            loss.backward()
        assert off.replans == 1
        planned_for = format_size(off._planning_budget())
        peak = format_size(off.choice.result.peak_bytes)
    finally:
        off.close()
    text = _page_text(path)
    assert f"planned for {planned_for}" in text  # the wider margin's
    assert re.search(rf"predicted peak {re.escape(peak)},", text)


def _four_layers():
    """The report tests' model (four Linear+ReLU layers of 256) and its input, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)))
    return model, torch.randn(64, 256)


def _reported_offload(spill_dir, path, policy: str):
    """``tt.offload(budget="64MiB", policy=policy, report=path)`` with a short plan search."""
    from tensortier.planner.runtime import planned_offload

    return planned_offload(
        "64MiB",
        spill_dir=spill_dir,
        policy=policy,
        options=Options(search_iters=60, search_seconds=5),
        report=str(path),
    )
