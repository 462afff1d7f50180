"""A Checkpointer's threads, lock and waits (issue 18 #5, #6 and "every wait has a timeout").

A Checkpointer dropped without ``close()`` is finalized wherever its last reference goes: often on
its own persist thread (the persist job holds it). Cleanup joins its threads, so it runs on the
reaper thread; the directory lock is released only after those threads stopped.
"""

import gc
import logging
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from tensortier._lifetime import quiesce
from tensortier.checkpoint import Checkpointer, checkpointer
from tensortier.errors import ConfigError


@pytest.fixture
def held_persist(monkeypatch):
    """Persists wait for ``gate`` before writing; ``started`` is set when one is waiting."""
    gate, started = threading.Event(), threading.Event()
    real = checkpointer.persist

    def persist(*args, **kwargs):
        started.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "persist", persist)
    yield gate, started
    gate.set()


def test_dropped_while_persisting_releases_the_lock_after_its_threads_stopped(
    tmp_path, held_persist
):
    gate, started = held_persist
    ck = Checkpointer(tmp_path, every=1)
    ck.save(0, model=torch.nn.Linear(64, 64))
    assert started.wait(30)
    threads = list(ck._worker._threads) + list(ck._copier._threads)
    alive = weakref.ref(ck)
    del ck  # the persist job still holds it: the last reference goes on the persist thread
    with pytest.raises(ConfigError, match="another Checkpointer"):
        Checkpointer(tmp_path)  # still writing: still locked
    gate.set()
    for _ in range(300):  # until the persist has finished and dropped the object
        gc.collect()
        if alive() is None:
            break
        threading.Event().wait(0.01)
    assert alive() is None
    assert quiesce()
    assert not any(t.is_alive() for t in threads)  # joined before the lock went
    with Checkpointer(tmp_path) as ck:  # before the fix: "another Checkpointer is writing"
        assert ck.restore(model=torch.nn.Linear(64, 64)).saved_step == 0


def test_collected_under_threading_locks_does_not_deadlock(tmp_path):
    child = r"""
import gc, sys, threading, torch
from tensortier import Checkpointer
from tensortier._lifetime import quiesce
ck = Checkpointer(sys.argv[1], every=1)
ck.save(0, model=torch.nn.Linear(8, 8)); ck.wait()
cycle = [ck]; cycle.append(cycle)
del ck, cycle
gc.disable()
with threading._shutdown_locks_lock:   # GC inside threading's own bookkeeping
    gc.collect()
assert quiesce(20)
Checkpointer(sys.argv[1]).close()      # the lock was released
print("OK", flush=True)
"""
    try:
        r = subprocess.run(
            [sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a Checkpointer collected under threading's locks deadlocked the process")
    assert "OK" in r.stdout, r.stderr


def test_wait_and_close_take_a_timeout_and_stay_usable(tmp_path, held_persist):
    gate, started = held_persist
    ck = Checkpointer(tmp_path, every=1)
    ck.save(3, model=torch.nn.Linear(8, 8))
    assert started.wait(30)
    with pytest.raises(TimeoutError, match="step 3 is still being written"):
        ck.wait(timeout=0.05)
    with pytest.raises(TimeoutError):
        ck.close(timeout=0.05)
    assert not ck.closed  # still in flight: nothing was torn down under it
    gate.set()
    ck.close(timeout=30)
    assert ck.closed and (tmp_path / "step-3").is_dir()


def test_a_long_wait_logs_what_it_waits_for(tmp_path, held_persist, monkeypatch, caplog):
    gate, started = held_persist
    monkeypatch.setattr(checkpointer, "PROGRESS_SECONDS", 0.02)
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(7, model=torch.nn.Linear(8, 8))
        assert started.wait(30)
        threading.Timer(0.2, gate.set).start()
        with caplog.at_level(logging.WARNING, logger="tensortier.checkpoint"):
            ck.wait()
    assert any("still waiting for the checkpoint of step 7" in r.message for r in caplog.records)
