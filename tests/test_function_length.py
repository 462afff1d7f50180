"""No function over 80 lines outside tests (issue 26 item 3): a long function hides its phases,
so the library, the benchmarks, the scripts and the examples are checked here, with ``ast``."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("src", "benchmarks", "scripts", "examples")
LIMIT = 80


def long_functions(root: pathlib.Path, limit: int = LIMIT) -> list[str]:
    """``path:line name (n lines)`` for every function (nested ones too) longer than ``limit``."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        where = path.relative_to(root)
                        found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines_outside_tests():
    assert long_functions(ROOT) == [], "split these along their phases:\n" + "\n".join(
        long_functions(ROOT)
    )


def test_the_check_sees_a_long_function(tmp_path):
    """The walk finds a function the moment it passes the limit, a method too."""
    lines = [f"x{i} = {i}" for i in range(LIMIT - 1)]
    ok = "def ok():\n" + "".join(f"    {s}\n" for s in lines)
    long = "class C:\n    def long(self):\n" + "".join(f"        {s}\n" for s in [*lines, "y = 0"])
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "scripts" / "m.py").write_text(ok + "\n\n" + long)
    assert long_functions(tmp_path) == [f"scripts/m.py:{LIMIT + 4} long ({LIMIT + 1} lines)"]
