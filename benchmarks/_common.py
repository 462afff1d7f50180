"""Shared plumbing for benchmark scripts: the environment row, the JSON file, worker processes.

The table printer lives in the library (:func:`tensortier._units.print_table`): ``tensortier
plan`` prints its tables too, and nothing in ``src`` may import ``benchmarks``.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from tensortier._device import device_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def environment() -> dict:
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def child_env(**extra: str) -> dict:
    """This process's environment for a worker ``python -m benchmarks.X``, plus ``extra``.

    Why: ``benchmarks`` is a plain folder of the repository, not an installed package, so a
    worker finds it only through ``PYTHONPATH``, from any working directory; the worker also
    imports the same ``tensortier`` as this process (a checkout's ``src`` before an install).
    """
    import tensortier

    src = os.path.dirname(os.path.dirname(os.path.abspath(tensortier.__file__)))
    path = [ROOT, src, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def write_json(path: str | None, benchmark: str, rows: list[dict], **extra) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"benchmark": benchmark, "env": environment(), **extra, "rows": rows}, f, indent=2
        )
    print(f"wrote {path}")
