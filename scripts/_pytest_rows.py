"""pytest plugin of ``gpu_check.py``: one JSON line per test as it ends (failures with their
text), so a run stopped at its time cap still says which tests failed and why; tests that call
``torch.compile`` run last, under a longer timeout."""

import inspect
import json
import os

import pytest

# torch.compile's first use in a process starts the compiler and its worker pool (20-30 s on a
# shared 2-core CPU for a 2-layer GPT): under the kit's 30 s per-test timeout such a test could
# time out, and run first it would eat the phase's cap before the quick tests ran (H100 run 2
# stopped at its cap with 7 tests not reached).
_RAW = os.environ.get("TT_GPU_CHECK_COMPILE_TIMEOUT", "90")
if not _RAW.isdigit() or int(_RAW) == 0:
    raise ValueError(
        f"TT_GPU_CHECK_COMPILE_TIMEOUT={_RAW!r}: give whole seconds above 0, e.g. 90 (or unset it)"
    )
COMPILE_TIMEOUT = int(_RAW)


def _compiles(item) -> bool:
    try:
        return "torch.compile(" in inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return False


def pytest_collection_modifyitems(items) -> None:
    """Quick tests first (in their order), then the compiling ones with ``COMPILE_TIMEOUT``."""
    late = [item for item in items if _compiles(item)]
    for item in late:
        item.add_marker(pytest.mark.timeout(COMPILE_TIMEOUT))
    items[:] = [item for item in items if item not in late] + late


def _write(row: dict, *, every_process: bool = False) -> None:
    """Append one row. Under pytest-xdist each worker's reports reach the controller's hooks
    too: results are written by the controller alone (``every_process`` for the collection,
    which only the workers make)."""
    path = os.environ.get("TT_GPU_CHECK_ROWS")
    if os.environ.get("PYTEST_XDIST_WORKER") and not every_process:
        return
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]}, every_process=True)


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"test": report.nodeid, "when": "collect", "outcome": "error",
                "text": report.longreprtext[-4000:]})  # fmt: skip


def pytest_runtest_logreport(report) -> None:
    if report.when != "call" and not (report.failed or report.skipped):
        return
    outcome = report.outcome if report.when == "call" else ("error" if report.failed else "skipped")
    row = {"test": report.nodeid, "when": report.when, "outcome": outcome,
           "seconds": round(report.duration, 3)}  # fmt: skip
    if report.failed:
        row["text"] = report.longreprtext[-4000:]
    _write(row)
