"""Deterministic records of mixed types and sizes shared by the catalog tests."""

from __future__ import annotations

import numpy as np
import torch

from tests.conftest import same_item as same  # noqa: F401 - the catalog tests import it here

KINDS = 7


def record(i: int):
    """Record ``i``: bytes, str, arrays, tensors, numbers and dicts, 0 B to ~6 KB."""
    r = np.random.default_rng(i)
    k = i % KINDS
    n = int(r.integers(0, 1500))
    if k == 0:
        return r.bytes(n)
    if k == 1:
        return f"images/{i:08d}.jpg " + "é" * (n % 40)
    if k == 2:
        return r.standard_normal(n % 300).astype(np.float32)
    if k == 3:
        return torch.arange(n % 100, dtype=torch.int64) * i
    if k == 4:
        return {
            "name": f"file-{i}",
            "label": i % 10,
            "box": r.random((n % 5, 4)),
            "raw": r.bytes(n % 700),
        }
    if k == 5:
        return {"t": torch.full((2, n % 9), float(i), dtype=torch.bfloat16), "ok": bool(i % 2)}
    return float(i) / 3
