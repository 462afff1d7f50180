"""Layering: imports point down the layers of ``scripts/layering.py`` (DESIGN.md's, with the
planner above the clients), no import cycle inside a folder beyond its commented allow-list,
nothing in the library imports ``benchmarks`` (issue 26); ``activations/`` is a mechanism that
never imports the planner (issue 17 #5). ``python scripts/layering.py`` prints the picture."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import tensortier as tt
from tensortier.errors import ConfigError

SRC = pathlib.Path(tt.__file__).parent
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _layering():
    spec = importlib.util.spec_from_file_location("layering", ROOT / "scripts" / "layering.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layering = _layering()


def _picture() -> str:
    return "\n".join(layering.picture(ROOT))


def test_every_import_points_down_the_layers():
    graph = layering.import_graph(ROOT)
    up = layering.upward_imports(graph, ROOT)
    assert up == [], "upward imports:\n" + "\n".join(up) + "\n\n" + _picture()


def test_no_import_cycle_inside_a_folder_but_the_allowed_ones():
    """An allowed cycle that is gone must leave the allow-list too, so the list stays true."""
    found = layering.folder_cycles(layering.import_graph(ROOT), ROOT)
    found = {folder: set(cycles) for folder, cycles in found.items()}
    allowed = {folder: {cycle} for folder, (cycle, _) in layering.ALLOWED_CYCLES.items()}
    assert found == allowed, _picture()


def test_nothing_in_the_library_imports_the_benchmarks():
    graph = layering.import_graph(ROOT)
    bench = ("benchmarks", "tensortier.bench")
    bad = [
        f"{m} -> {d}"
        for m in graph
        if m.startswith("tensortier")
        for d in graph[m]
        if d.startswith(bench)
    ]
    assert not bad, bad
    code = (
        "import sys, tensortier, tensortier.cli, tensortier.planner.cli, tensortier.data.cli; "
        "print([m for m in sys.modules if m.startswith(('benchmarks', 'tensortier.bench'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_library_loads_no_compiler():
    """``import tensortier`` (every package) leaves ``torch._dynamo`` unloaded: it costs ~0.9 s
    per process (a ``torch.compiler.disable`` decorator at module level once pulled it in)."""
    code = (
        "import sys, tensortier, tensortier.rl, tensortier.optim, tensortier.data, "
        "tensortier.checkpoint, tensortier.activations, tensortier.planner; "
        "print([m for m in sys.modules if m.startswith('torch._dynamo')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tensortier_help_imports_no_subcommand():
    """``tensortier --help`` (or a typo) pays for no subcommand's imports: each is imported
    only when it runs."""
    code = (
        "import sys, contextlib, io, tensortier.cli as c\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    c.main(['--help'])\n"
        "subcommands = ('tensortier.demo', 'tensortier.planner.cli', 'tensortier.data.cli')\n"
        "print(sorted(m for m in sys.modules if m in subcommands))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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


# constructing a CUDA stream or event (by any spelling torch offers), or ordering a copy with
# ``wait_stream`` / ``record_stream``
_STREAM_OR_EVENT = re.compile(
    r"\bcuda\.(Stream|Event)\s*\(|\.record_event\s*\(|\bwait_stream\s*\(|\.record_stream\s*\("
    r"|from\s+torch\.cuda\s+import[^\n]*\b(Stream|Event)\b"
)
_ENGINE = SRC / "transfer"


def test_cuda_streams_and_events_are_made_in_the_transfer_engine():
    """Issue 26: every CUDA stream and event is constructed, and every copy is ordered with
    ``wait_stream``/``record_stream``, in the transfer engine's modules (``tensortier/transfer/``),
    so one folder says which streams exist, what threads sleep on and what a copy waits for."""
    sites = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if _ENGINE not in path.parents
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _STREAM_OR_EVENT.search(line)
    ]
    assert sites == [], "CUDA streams/events/ordering outside tensortier/transfer/:\n" + "\n".join(
        sites
    )
    assert not (SRC / "_cuda.py").exists()  # the old home is gone, not a second one
    for spelling in ("torch.cuda.Stream(", "torch.cuda.Event(", ".record_stream(", "wait_stream("):
        assert _STREAM_OR_EVENT.search(spelling), spelling  # the pattern still matches each
    assert _STREAM_OR_EVENT.search((_ENGINE / "streams.py").read_text())
