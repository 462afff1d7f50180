"""pytest plugin of ``gpu_check.py``: one JSON line per test as it ends (failures with their
text), so a run stopped at its time cap still says which tests failed and why."""

import json
import os


def _write(row: dict) -> None:
    path = os.environ.get("TT_GPU_CHECK_ROWS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


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
