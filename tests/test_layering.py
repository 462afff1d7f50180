"""Layering: ``activations/`` is a mechanism that never imports the planner (issue 17 #5)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import tensortier as tt
from tensortier.errors import ConfigError

SRC = pathlib.Path(tt.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_activations_sources_never_import_the_planner():
    for path in (SRC / "activations").rglob("*.py"):
        bad = {m for m in _imports(path) if m.startswith("tensortier.planner")}
        assert not bad, f"{path.name} imports {bad}"


def test_importing_activations_loads_no_planner_module():
    code = (
        "import sys, tensortier.activations as a; a.offload('disk', min_bytes='1MiB').close(); "
        "print([m for m in sys.modules if m.startswith('tensortier.planner')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_budget_is_the_top_level_verbs_and_the_mechanism_refuses_it(tmp_path):
    from tensortier.activations import offload as mechanism
    from tensortier.planner.runtime import PlannedOffload

    with pytest.raises(ConfigError, match="budget='1GiB'.*tt.offload"):
        mechanism("disk", budget="1GiB")
    planned = tt.offload(budget="1GiB", spill_dir=str(tmp_path))
    try:
        assert isinstance(planned, PlannedOffload)
    finally:
        planned.close()
    plain = tt.offload("disk", spill_dir=str(tmp_path), budget=None)
    assert isinstance(plain, tt.Offloader)
    plain.close()


def test_the_demo_never_imports_the_benchmarks():
    """``tensortier demo`` is a user's first command: it must not break when a benchmark's
    private options change (issue 23 #1), nor need the benchmarks at all."""
    bad = {m for m in _imports(SRC / "demo.py") if m.split(".")[0] == "benchmarks"}
    assert not bad, f"demo.py imports {bad}"
    code = "import sys, tensortier.demo; print([m for m in sys.modules if 'benchmarks' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
