"""Helpers that several test folders share (issue 26 #6: written once, not per file)."""

from __future__ import annotations

import json
import os
import pathlib


def run_benchmark(out: pathlib.Path, command: str, directory: os.PathLike | None = None) -> dict:
    """``python -m benchmarks <command> [--dir directory] --json <out> --quiet-wait 0`` in this
    process (``command``: words split on spaces); the JSON it wrote. Why: each benchmark test runs
    one as a user does and reads its machine-readable output, and none may wait for a quiet
    machine (``--quiet-wait 0``)."""
    from benchmarks.__main__ import main

    where = [] if directory is None else ["--dir", os.fspath(directory)]
    main([*command.split(), *where, "--json", str(out), "--quiet-wait", "0"])
    return json.loads(out.read_text())
