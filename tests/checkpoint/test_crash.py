"""Crash consistency: SIGKILL during persist at named points (and at random times) never leaves a
checkpoint that restores partially; restore always yields the newest complete one."""

import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from tensortier.checkpoint import Checkpointer
from tests.checkpoint import _crash_child, _train

STEPS = 8  # checkpoints after steps 1, 3, 5, 7 (every=2); the kill points are in save 1 or 3

# (kill point, newest complete step expected after the kill)
POINTS = [
    ("chunk-written@1:1", None),  # first checkpoint, first data file half written
    ("file-synced@1:2", None),  # between data files of the first checkpoint
    ("after-rename@1", 1),
    ("chunk-written@3:1", 3),  # in the middle of the data files of the third checkpoint
    ("chunk-written@3:3", 3),
    ("file-synced@3:1", 3),  # between data files
    ("file-synced@3:3", 3),
    ("manifest-partial@3", 3),  # between the data files and the (half-written) manifest
    ("manifest-synced@3", 3),
    ("before-rename@3", 3),  # around the rename
    ("after-rename@3", 5),
    ("after-dir-fsync@3", 5),
    ("retention-renamed@3", 5),  # step 1 is being deleted
    ("retention-deleted@3", 5),
]


def _child(directory, fault=None):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.checkpoint._crash_child"])
    proc = ctx.Process(target=_crash_child.main, args=(str(directory), STEPS, fault))
    proc.start()
    return proc


def _check_restores(directory, expected):
    model, opt, sched = _train.make(seed=99, width=64)
    with Checkpointer(directory) as ck:
        leftovers = [n for n in os.listdir(directory) if n.startswith("step-") and "." in n]
        assert leftovers == [], f"debris not cleaned at start: {leftovers}"
        state = ck.restore(model=model, optimizer=opt, scheduler=sched)
    if expected is None:
        assert state is None
        return None
    assert state.saved_step == expected and state.extra == {"step": expected}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the child: CPU matmuls differ in the last bit across threads
    try:
        ref_model, ref_opt, ref_sched, _ = _train.reference(expected + 1, width=64)
    finally:
        torch.set_num_threads(threads)
    assert _train.same_state(model.state_dict(), ref_model.state_dict())
    assert _train.same_state(opt.state_dict(), ref_opt.state_dict())
    assert sched.state_dict() == ref_sched.state_dict()
    return state.saved_step


@pytest.mark.slow
def test_sigkill_at_every_point_of_persist_leaves_the_newest_complete_checkpoint(tmp_path):
    for i, (point, expected) in enumerate(POINTS):
        proc = _child(tmp_path / f"run{i}", point)
        proc.join(timeout=120)
        assert proc.exitcode == -signal.SIGKILL, f"{point}: child was not killed ({proc.exitcode})"
        _check_restores(tmp_path / f"run{i}", expected)


@pytest.mark.slow
def test_sigkill_at_random_times_never_restores_a_partial_checkpoint(tmp_path):
    rng = random.Random(6)
    t0 = time.monotonic()
    probe = _child(tmp_path / "probe")  # how long a whole run takes here
    probe.join(timeout=120)
    assert probe.exitcode == 0
    whole = time.monotonic() - t0
    for i in range(3):
        proc = _child(tmp_path / f"run{i}")
        time.sleep(rng.uniform(0.5, 1.0) * whole)
        proc.kill()
        proc.join(timeout=60)
        _check_restores(tmp_path / f"run{i}", _newest(tmp_path / f"run{i}"))
    assert _check_restores(tmp_path / "probe", 7) == 7


def _newest(directory):
    if not os.path.exists(directory):
        return None
    steps = sorted(
        int(n.split("-")[1])
        for n in os.listdir(directory)
        if n.startswith("step-") and "." not in n
    )
    return steps[-1] if steps else None
