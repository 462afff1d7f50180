"""Child process of the catalog crash tests: builds a catalog until a kill point or a SIGKILL.

Started through a forkserver that has imported tensortier.data once, so each child costs a fork.
"""

from __future__ import annotations

import os

import tensortier.data  # noqa: F401  (preloaded by the forkserver)
from tensortier.data import Catalog
from tensortier.data._build import FAULT_ENV
from tests.data._records import record


def main(path: str, n: int, fault: str | None) -> None:
    if fault:
        os.environ[FAULT_ENV] = fault
    else:
        os.environ.pop(FAULT_ENV, None)
    Catalog.build(
        path, (record(i) for i in range(n)), segment_size="64KiB", io_threads=2, batch_bytes="16KiB"
    )
