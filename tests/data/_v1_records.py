"""The records of ``tests/data/fixtures/catalog-v1``, a catalog written by format version 1.

Made once by the code before format 2 (commit 9299566) with
``Catalog.build("tests/data/fixtures/catalog-v1", v1_records(), mode=0o644)``; the files are
kept as that code wrote them, so the test reads what an old build left on disk.
"""

from __future__ import annotations

import numpy as np
import torch


def v1_records() -> list:
    """Numpy scalars (which version 1 stored as 0-d arrays), a 0-d array and the other kinds."""
    return [
        {"reward": np.float32(0.5), "step": np.int64(3), "done": np.bool_(True)},
        np.float64(-0.0),
        np.array(7, np.int16),
        {"name": "é", "raw": b"\x00\xff", "n": 3, "x": 2.5, "ok": False},
        np.arange(5, dtype=np.int32),
        torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
        np.uint64(2**64 - 1),
    ]
