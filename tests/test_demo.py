"""`make demo` works: the command its recipe runs, at the tiny ``--quick`` size, end to end in a
subprocess, as a user types it (issue 23 #1: it crashed on a benchmark's private Namespace)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
WAYS = ("plain", "torch.utils.checkpoint", 'tt.offload(tier="host")', 'tt.offload(tier="disk")')


def _make_demo_command() -> list[str]:
    """The recipe of the Makefile's ``demo`` target with ``$(VENV)`` set to this interpreter's
    venv; ``python -m tensortier.cli`` where this interpreter has no console script."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n\t(.+)$", text, re.M)
    assert recipe, "the Makefile has no demo target"
    words = recipe.group(1).split()
    assert words[0] == "$(VENV)/bin/tensortier", f"make demo runs {words}: update this test"
    script = pathlib.Path(sys.executable).parent / "tensortier"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "tensortier.cli"]
    return head + words[1:]


def test_make_demo_prints_the_table_with_identical_gradients(tmp_path):
    cmd = _make_demo_command() + ["--quick", "--spill-dir", str(tmp_path)]
    path = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("way "))
    rows = lines[header + 1 : header + 1 + len(WAYS)]
    assert [r[:24].strip() for r in rows] == list(WAYS), proc.stdout
    assert rows[0].endswith("reference")
    assert all(r.endswith("identical") for r in rows[1:]), proc.stdout
    for row in rows:  # a size, a ratio, a time in ms and a ratio in every row
        assert re.search(r"\d(\.\d+)?[KMG]?i?B +\d+% +\d+\.\d+m?s +\d+\.\d\dx", row), row
    assert "gradients of every way bit-identical to plain" in proc.stdout
    if "on cpu:" in proc.stdout:  # the host row explained where it cannot save anything
        assert "on a CPU-only machine copies each saved tensor" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # the disk way's spill files are gone
