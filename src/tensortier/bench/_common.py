"""Shared plumbing for benchmark scripts: result rows, the table printer and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from tensortier._device import device_name


def environment() -> dict:
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str | None, benchmark: str, rows: list[dict], **extra) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"benchmark": benchmark, "env": environment(), **extra, "rows": rows}, f, indent=2
        )
    print(f"wrote {path}")
