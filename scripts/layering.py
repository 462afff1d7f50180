"""The import graph of tensortier by layer: who imports whom, upward imports, cycles in folders.

    python scripts/layering.py [--root DIR]      # DIR: a checkout (default: this one)

Prints, per layer from the top, each unit (a folder of ``src/tensortier`` or a top-level module,
and ``benchmarks/``) with the units it imports, marking an import that points up a layer; then
the import cycles among the modules of one folder. ``tests/test_layering.py`` asserts on the same
analysis (no upward import, no cycle beyond :data:`ALLOWED_CYCLES`, nothing in ``src`` importing
``benchmarks``). Every import counts, also one inside a function: a lazy import is still a
dependency, it only moves the failure to the first call.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Top to bottom; a unit may import units of its own layer or below. Differences from the picture
# in DESIGN.md (issue 26 note): the planner sits above the clients, since it drives the
# activations mechanism (planner/runtime.py wraps activations.Offloader) while no client imports
# it; the public API (the package __init__ and the verbs) sits above the planner.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "user-facing",
        (
            "benchmarks/",
            "tensortier/bench/",
            "tensortier/__main__.py",
            "tensortier/cli.py",
            "tensortier/demo.py",
        ),
    ),
    ("public API", ("tensortier/__init__.py", "tensortier/_verbs.py")),
    ("planner", ("tensortier/planner/",)),
    (
        "clients",
        (
            "tensortier/activations/",
            "tensortier/optim/",
            "tensortier/checkpoint/",
            "tensortier/rl/",
            "tensortier/data/",
        ),
    ),
    ("transfer", ("tensortier/transfer/",)),
    ("tiers", ("tensortier/tiers/",)),
    (
        "foundation",
        (
            "tensortier/_units.py",
            "tensortier/_backward_end.py",
            "tensortier/_device.py",
            "tensortier/_dist.py",
            "tensortier/_lifetime.py",
            "tensortier/_memory.py",
            "tensortier/_modes.py",
            "tensortier/_ray.py",
            "tensortier/_stats.py",
            "tensortier/_renamed.py",
            "tensortier/_saved_hooks.py",
            "tensortier/errors.py",
            "tensortier/models/",  # reference models: torch only
        ),
    ),
]

# Import cycles among the modules of one folder that stay until a later phase of issue 26 moves
# the shared piece down. Each entry: the folder, the modules of the cycle, and why it stays.
ALLOWED_CYCLES: dict[str, tuple[frozenset[str], str]] = {}  # none left (issue 26 A3)


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of ``src/tensortier`` and ``benchmarks`` in ``root``."""
    out = {}
    for base, pkg in ((root / "src", "tensortier"), (root, "benchmarks")):
        for path in sorted((base / pkg).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported_names(tree: ast.AST, modules: dict) -> set[str]:
    """Dotted names imported anywhere in ``tree``; ``from a import b`` gives ``a.b`` (a module
    or a name in ``a``: :func:`import_graph` resolves which). A module that imports by name
    (``importlib.import_module``, as ``cli.py`` does for its subcommands) also imports every
    module a string constant of it names."""
    names: set[str] = set()
    strings: set[str] = set()
    by_name = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            by_name = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    return names | (strings & modules.keys() if by_name else set())


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``tensortier``/``benchmarks`` it imports (itself excluded)."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for name in _imported_names(ast.parse(path.read_text(), str(path)), files):
            if name.split(".")[0] not in ("tensortier", "benchmarks"):
                continue
            while name not in files and "." in name:  # a name inside a module: the module
                name = name.rsplit(".", 1)[0]
            if name in files and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def unit_of(module: str, root: pathlib.Path = ROOT) -> str:
    """The layering unit of ``module``: its top folder (``tensortier/rl/``) or top-level file."""
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks/"
    if len(parts) == 1:
        return "tensortier/__init__.py"
    if (root / "src" / "tensortier" / parts[1]).is_dir():
        return f"tensortier/{parts[1]}/"
    return f"tensortier/{parts[1]}.py"


def layer_of(unit: str) -> int:
    """Index into :data:`LAYERS` (0 is the top); ValueError for a unit no layer names."""
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise ValueError(f"{unit} is in no layer of scripts/layering.py: add it to LAYERS")


def upward_imports(graph: dict[str, set[str]], root: pathlib.Path = ROOT) -> list[str]:
    """``"a -> b"`` for every import of a module of a higher layer (a smaller index)."""
    out = []
    for mod, deps in sorted(graph.items()):
        here = layer_of(unit_of(mod, root))
        for dep in sorted(deps):
            there = layer_of(unit_of(dep, root))
            if there < here:
                out.append(f"{mod} ({LAYERS[here][0]}) -> {dep} ({LAYERS[there][0]})")
    return out


def _strongly_connected(nodes: set[str], graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's components of more than one node among ``nodes`` (edges leaving ``nodes`` are
    ignored)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def folder_cycles(graph: dict[str, set[str]], root: pathlib.Path = ROOT) -> dict[str, list]:
    """Folder (dotted package) -> the import cycles among its own modules."""
    folders: dict[str, set[str]] = collections.defaultdict(set)
    for mod, path in module_files(root).items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        folders[package].add(mod)
    found = {f: _strongly_connected(mods, graph) for f, mods in folders.items()}
    return {f: cycles for f, cycles in sorted(found.items()) if cycles}


def picture(root: pathlib.Path = ROOT) -> list[str]:
    """The layer graph as text lines: per layer its units and what each imports."""
    graph = import_graph(root)
    files = module_files(root)
    edges: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    count: collections.Counter = collections.Counter(unit_of(m, root) for m in files)
    for mod, deps in graph.items():
        for dep in deps:
            if unit_of(dep, root) != unit_of(mod, root):
                edges[unit_of(mod, root)][unit_of(dep, root)] += 1
    lines = []
    for i, (name, units) in enumerate(LAYERS):
        present = [u for u in units if count[u]]
        if not present:
            continue
        lines.append(f"[{i}] {name}")
        for unit in present:
            targets = []
            for dep, n in sorted(edges[unit].items(), key=lambda kv: (layer_of(kv[0]), kv[0])):
                mark = " UP!" if layer_of(dep) < i else ""
                targets.append(f"{_short(dep)}{mark}" + (f" x{n}" if n > 1 else ""))
            head = f"    {_short(unit)} ({count[unit]} modules)"
            lines.append(f"{head} -> {', '.join(targets) if targets else '(nothing)'}")
    lines.append("upward imports:")
    lines += [f"    {line}" for line in upward_imports(graph, root)] or ["    none"]
    lines.append("import cycles inside a folder:")
    cycles = folder_cycles(graph, root)
    for folder, comps in cycles.items():
        for comp in comps:
            allowed = ALLOWED_CYCLES.get(folder, (frozenset(), ""))[0] == comp
            names = " <-> ".join(sorted(m.rpartition(".")[2] for m in comp))
            lines.append(f"    {folder}: {names}" + ("  (allowed, see ALLOWED_CYCLES)" * allowed))
    if not cycles:
        lines.append("    none")
    return lines


def _short(unit: str) -> str:
    return unit.removeprefix("tensortier/")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=pathlib.Path, default=ROOT, help="a checkout (default: this)")
    args = p.parse_args(argv)
    print("\n".join(picture(args.root.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
