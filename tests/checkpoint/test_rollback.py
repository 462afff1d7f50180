"""Rolling back (restore an older step, then save) retires the abandoned run's checkpoints.

Issue 18 #12: a crash after a rollback must never resume the run that was rolled back. The crash
points of the retirement are in PROTOCOL.md ("Rollback"); they are killed here one by one.
"""

import multiprocessing
import os
import shutil
import signal
import warnings

import pytest
import torch

from tensortier.checkpoint import Checkpointer
from tensortier.errors import ConfigError
from tests.checkpoint import _crash_child


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def _run_a(directory, steps=5, keep=3):
    m = _linear()
    with Checkpointer(directory, every=1, keep=keep) as ck:
        for step in range(steps):
            ck.before_optimizer_step()  # an in-place change that is not an optimizer step
            with torch.no_grad():
                m.weight.add_(1.0)
            ck.maybe_save(step, model=m, extra={"run": "A", "step": step})
    return m


def _complete(directory):
    return sorted(
        int(n.split("-")[1])
        for n in os.listdir(directory)
        if n.startswith("step-") and "." not in n
    )


def test_saving_after_a_rollback_retires_the_abandoned_checkpoints(tmp_path):
    _run_a(tmp_path)  # run A: steps 2, 3, 4 kept
    m = _linear()
    with Checkpointer(tmp_path, every=1, keep=3) as ck:
        state = ck.restore(model=m, step=2)  # roll back, e.g. past a loss spike
        assert _complete(tmp_path) == [2, 3, 4]  # restoring alone changes nothing on disk
        ck.maybe_save(state.step, model=m, extra={"run": "B", "step": 3})  # then "crash"
    assert _complete(tmp_path) == [2, 3]
    with Checkpointer(tmp_path) as ck:
        state = ck.restore(model=_linear())
    assert state.extra == {"run": "B", "step": 3}  # before the fix: run A's step 4


def test_a_rollback_retires_every_step_after_the_restored_one(tmp_path):
    _run_a(tmp_path)  # steps 2, 3, 4
    with Checkpointer(tmp_path, every=1, keep=3) as ck:
        ck.restore(model=_linear(), step=2)
        ck.save(4, model=_linear(), extra={"run": "B", "step": 4})  # B skips step 3
    assert _complete(tmp_path) == [2, 4]  # A's step 3 is not part of run B either
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(model=_linear(), step=4).extra["run"] == "B"


def test_falling_back_past_damaged_checkpoints_retires_them_too(tmp_path):
    _run_a(tmp_path, steps=6, keep=4)  # steps 2..5
    for s in (4, 5):
        (tmp_path / f"step-{s}" / "manifest.json").write_text("{damaged")
    with Checkpointer(tmp_path, every=1, keep=4) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = ck.restore(model=_linear())
        assert state.saved_step == 3
        ck.save(4, model=_linear(), extra={"run": "B", "step": 4})
    assert _complete(tmp_path) == [2, 3, 4]  # the damaged step 5 is gone, step 4 rewritten
    with Checkpointer(tmp_path) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing damaged is left to warn about
        assert ck.restore(model=_linear()).extra == {"run": "B", "step": 4}


def test_saving_below_another_runs_checkpoints_without_restoring_is_refused(tmp_path):
    _run_a(tmp_path)
    with Checkpointer(tmp_path, every=1) as ck:
        with pytest.raises(ConfigError, match=r"later steps \(2, 3, 4\).*restore\(step=k\)"):
            ck.maybe_save(0, model=_linear())
        with pytest.raises(ConfigError, match="later steps"):
            ck.save(3, model=_linear())
    assert _complete(tmp_path) == [2, 3, 4]  # nothing written, nothing removed
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(model=_linear()).extra == {"run": "A", "step": 4}


def test_a_run_may_not_save_below_its_own_newest_step(tmp_path):
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(5, model=_linear())
        ck.wait()
        with pytest.raises(ConfigError, match=r"later steps \(5\)"):
            ck.save(4, model=_linear())


# (kill point during the first save after restore(step=2), what an automatic restore returns)
ROLLBACK_POINTS = [
    ("rollback-renamed@1:1", ("A", 5)),  # step 3 renamed: A's newest (5) still there
    ("rollback-renamed@1:2", ("A", 5)),
    ("rollback-renamed@1:3", ("A", 2)),  # A's newest gone: the rollback is visible
    ("rollback-synced@1", ("A", 2)),
    ("before-rename@1", ("A", 2)),  # B's checkpoint written, not yet committed
    ("after-rename@1", ("B", 3)),
]


@pytest.mark.slow
@pytest.mark.parametrize("point, expected", ROLLBACK_POINTS, ids=[p for p, _ in ROLLBACK_POINTS])
def test_sigkill_while_retiring_never_mixes_the_two_runs(tmp_path, point, expected):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.checkpoint._crash_child"])
    proc = ctx.Process(target=_crash_child.rollback, args=(str(tmp_path), point))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL, f"{point}: child was not killed ({proc.exitcode})"
    with Checkpointer(tmp_path) as ck:
        assert not [n for n in os.listdir(tmp_path) if n.startswith("step-") and "." in n]
        state = ck.restore(model=_crash_child.rollback_model())
    assert (state.extra["run"], state.saved_step) == expected
    assert state.extra["step"] == state.saved_step


def test_a_folder_named_like_a_step_but_not_written_by_us_is_ignored(tmp_path):
    model = _linear()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(5, model=model)
    shutil.copytree(tmp_path / "step-5", tmp_path / "step-007")  # a user's renamed copy
    shutil.copytree(tmp_path / "step-5", tmp_path / "step-007.incomplete")  # not our debris
    with Checkpointer(tmp_path, every=1) as ck:
        assert ck.restore(model=_linear()).saved_step == 5
        ck.save(6, model=model)  # before the fix: FileNotFoundError retiring "step-7"
        ck.wait()
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-007", "step-007.incomplete", "step-5", "step-6"]
