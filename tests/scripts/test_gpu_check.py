"""``scripts/gpu_check.sh --dry-run``: every phase of the GPU check at a tiny size on the CPU, so
the first call on a lent GPU machine cannot fail on a typo, an import or an argument."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("transfer", "pytest", "activations", "llama", "optimizer", "checkpoint")
# peers that exist only on CUDA: the dry run imports them and names why they did not run
CUDA_ONLY = {"torchtune", "torchao-cpu-offload"}


@pytest.mark.slow
def test_dry_run_runs_every_phase_and_writes_its_json(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(ROOT, "src"), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "gpu_check-cpu-dry.log").exists()
    # the dry run installs tensortier as the GPU run does (--no-index, a temporary site dir
    # removed at the end), CLI included, so the first GPU call cannot fail on the install
    assert "installing tensortier failed" not in proc.stdout, proc.stdout[-4000:]
    env_ = json.loads((tmp_path / "transfer-cpu-dry.json").read_text())["environment"]
    site = os.path.dirname(os.path.dirname(env_["tensortier_from"]))
    assert site.startswith("/tmp/tt-site.") and not os.path.exists(site), site
    assert env_["tensortier_cli"] == os.path.join(site, "bin", "tensortier")
    for phase in PHASES:
        data = json.loads((tmp_path / f"{phase}-cpu-dry.json").read_text())
        assert data["complete"], phase
        assert data["environment"]["loadavg"] and data["environment"]["loadavg_end"]
        for row in data["rows"]:
            if phase == "pytest":
                continue  # every gpu test skips on the CPU: nothing may fail to collect
            if row.get("variant") in CUDA_ONLY:
                assert "needs CUDA" in row["error"], row
            else:
                assert "error" not in row, (phase, row)
    opt_rows = json.loads((tmp_path / "optimizer-cpu-dry.json").read_text())["rows"]
    assert [r["variant"] for r in opt_rows] == [
        "fused-adamw", "tt-offloaded-adamw", "torchao-cpu-offload",
        "tt-offloaded-adamw-deferred", "tt-offloaded-adamw-bits",
    ]  # fmt: skip
    for r in opt_rows:  # every variant also timed as a loop runs, without a sync per iteration
        assert r.get("pipelined_iteration_s", 0) > 0 or "error" in r, r
    tt_row = next(r for r in opt_rows if r["variant"] == "tt-offloaded-adamw")
    per = tt_row["per_step"]  # issue 25: where step()'s and the worker's time went
    for key in ("spec_wait_seconds", "check_copy_seconds", "compare_seconds", "kernel_seconds",
                "grad_wait_seconds", "prepare_seconds", "writeback_seconds"):  # fmt: skip
        assert per[key] >= 0, key
    assert per["kernel_threads"] >= 1 and tt_row["host_threads"]["torch"] >= 1
    assert tt_row["step_return_s"]["n"] == tt_row["iteration_s"]["n"]
    pytest_data = json.loads((tmp_path / "pytest-cpu-dry.json").read_text())
    assert pytest_data["exit_code"] == 0
    assert pytest_data["counts"].get("skipped", 0) > 30
    assert set(pytest_data["counts"]) == {"skipped"}, pytest_data["counts"]
    acts = json.loads((tmp_path / "activations-cpu-dry.json").read_text())
    names = {row["variant"] for row in acts["rows"]}
    assert {"plain", "tt-host", "budget-0.4", "checkpoint", "save_on_cpu"} <= names
    assert any(n.startswith("tt-disk@") for n in names)
    for row in acts["rows"]:
        if row["variant"] not in ("config", "plain", *CUDA_ONLY) and "@" not in row["variant"]:
            assert row["grads_identical_every_step"], row  # the CPU is deterministic


def test_compiling_gpu_tests_run_last_under_the_longer_timeout(tmp_path):
    (tmp_path / "test_order.py").write_text(
        "import torch\n"
        "def test_compiles(request):\n"
        "    if False:\n"
        "        torch.compile(torch.nn.Linear(1, 1))\n"
        "    assert request.node.get_closest_marker('timeout').args == (90,)\n"
        "def test_quick(request):\n"
        "    assert request.node.get_closest_marker('timeout') is None\n"
    )
    rows = tmp_path / "rows.jsonl"
    env = dict(os.environ, TT_GPU_CHECK_ROWS=str(rows))
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(ROOT, "scripts"), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "_pytest_rows", "-p", "no:cacheprovider",
         "--timeout=30", str(tmp_path / "test_order.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    ran = [row["test"].split("::")[1] for row in lines if "test" in row]
    assert ran == ["test_quick", "test_compiles"]


def test_a_compile_timeout_that_is_not_whole_seconds_is_refused_naming_the_fix():
    env = dict(os.environ, TT_GPU_CHECK_COMPILE_TIMEOUT="90s")
    proc = subprocess.run(
        [sys.executable, "-c", "import _pytest_rows"],
        cwd=os.path.join(ROOT, "scripts"), env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "give whole seconds above 0" in proc.stderr, proc.stderr
