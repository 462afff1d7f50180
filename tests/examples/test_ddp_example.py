"""The DDP example runs as users launch it (spawned ranks), checkpoints, and resumes on another
world size."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp, nproc: int, steps: int) -> str:
    # src/ ahead of the caller's path, which may carry the dependencies (gpu_check.sh's site dirs)
    path = [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ddp_offload.py"), "--nproc", str(nproc)]
    cmd += ["--steps", str(steps), "--every", "3", "--ckpt", str(tmp / "ck")]
    cmd += ["--spill-dir", str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_ddp_example_trains_checkpoints_and_resumes_on_fewer_ranks(tmp_path):
    out = _run(tmp_path, 2, 6)
    assert "2 ranks, starting at step 0" in out
    assert sorted(os.listdir(tmp_path / "ck"))[-1] == "step-5"
    out = _run(tmp_path, 1, 8)  # the 2-rank checkpoint restores in one process
    assert "1 ranks, starting at step 6" in out
    leftovers = [d for d in os.listdir(tmp_path) if d.startswith(("tt-", "tensortier-"))]
    assert leftovers == []  # private spill directories removed
