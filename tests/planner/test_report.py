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
