"""Records and settings whose catalog files were fixed by the per-record build (golden digests)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from tests.data._records import record


def golden_records() -> list:
    """Every record type the build lays out, with runs and switches between them: bytes and
    str runs, arrays and tensors of several dtypes (bf16 too), 0-d and empty ones, tensors that
    are not contiguous, dicts, numbers and lists of numbers (stored as arrays)."""
    rng = np.random.default_rng(27)
    recs: list = [record(i) for i in range(300)]
    recs += [rng.bytes(int(n)) for n in rng.integers(0, 9000, 60)]
    recs += ["é\ud800" * int(n) for n in rng.integers(0, 300, 20)]
    recs += [rng.standard_normal((3, int(n))).astype(np.float32) for n in range(40)]
    recs += [torch.full((int(n),), n, dtype=torch.bfloat16) for n in range(30)]
    recs += [np.float64(2.5), np.array(7, np.int16), np.zeros((0, 3)), torch.tensor(3.0)]
    recs += [torch.empty(0, 5, dtype=torch.int32), np.arange(12).reshape(3, 4).T]
    recs += [torch.arange(60, dtype=torch.float16).reshape(6, 10)[:, ::3] for _ in range(5)]
    recs += [b"", "", [1, 2, 3], [0.5, 1.5], 17, True, 2.0]
    recs += [b"x" * 50_000, np.ones(20_000, np.uint8), "y" * 30_000]  # over a batch alone
    return recs


# (io_threads, batch_bytes, segment_size): one writer; several writers with batches over
# segment boundaries; segments smaller than one record
SETTINGS = [(1, "64KiB", "1MiB"), (3, "20KiB", "96KiB"), (2, "8KiB", "4KiB")]


def digests(root) -> dict[str, str]:
    """sha256 of the segment files and the index (the manifest holds the build time)."""
    out = {}
    for name in sorted(os.listdir(root)):
        if name.startswith("seg-") or name == "index.bin":
            with open(os.path.join(root, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def combined(root) -> str:
    """One digest of :func:`digests` (what the golden table keeps)."""
    return hashlib.sha256(repr(sorted(digests(root).items())).encode()).hexdigest()
