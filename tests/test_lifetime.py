import gc
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import tensortier as tt
from tensortier import _lifetime
from tensortier._device import normalize_device
from tensortier._lifetime import DirLock, Finalizer, private_dir, quiesce, reclaim_stale
from tensortier.errors import ConfigError, SpillDirError


class _Owner:
    pass


def test_explicit_call_runs_now_and_once():
    ran = []
    owner = _Owner()
    f = Finalizer(owner, ran.append, 1)
    assert f.alive
    f()
    f()
    assert ran == [1] and not f.alive
    del owner
    gc.collect()
    assert quiesce()
    assert ran == [1]


def test_collection_hands_cleanup_to_the_reaper_thread():
    seen = []
    owner = _Owner()
    Finalizer(owner, lambda: seen.append(threading.current_thread().name))
    cycle = [owner]
    cycle.append(cycle)
    del owner, cycle
    gc.collect()
    assert quiesce()
    assert seen == ["tt-reaper"]


def test_finalizer_never_blocks_under_threading_locks():
    """GC inside threading's bookkeeping must not join threads (the reliability repro's deadlock)."""
    child = r"""
import gc, threading
from tensortier._lifetime import Finalizer, quiesce
class O: pass
o = O()
t = threading.Thread(target=lambda: None); t.start()
Finalizer(o, t.join)
c = [o]; c.append(c); del o, c
gc.disable()
with threading._shutdown_locks_lock:
    gc.collect()
assert quiesce(10)
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert "OK" in r.stdout, r.stderr


def test_cleanup_runs_at_interpreter_exit(tmp_path):
    marker = tmp_path / "ran"
    child = f"""
from tensortier._lifetime import Finalizer
class O: pass
o = O()
Finalizer(o, open, {str(marker)!r}, "w")
"""
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    assert marker.exists()


def test_private_dir_is_0700_owned_and_removed(tmp_path):
    root = private_dir(tmp_path, "tt-test")
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    assert os.path.exists(os.path.join(root, _lifetime.OWNER_FILE))
    assert reclaim_stale(tmp_path) == []  # our own live directory is never reclaimed
    _lifetime.remove_private_dir(root)
    assert not os.path.exists(root)


def test_dead_owners_directories_are_reclaimed(tmp_path):
    child = f"""
import os, signal
from tensortier._lifetime import private_dir
print(private_dir({str(tmp_path)!r}, "tt-test"), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL
    dead = r.stdout.strip()
    assert os.path.isdir(dead)
    foreign = tmp_path / "tt-test-notours1"  # no owner file: not ours to delete
    foreign.mkdir()
    live = private_dir(tmp_path, "tt-test")  # the first directory under a parent sweeps it
    assert not os.path.exists(dead)
    assert foreign.exists() and os.path.exists(live)
    _lifetime.remove_private_dir(live)


def test_private_dir_errors_name_the_fix(tmp_path):
    with pytest.raises(SpillDirError, match="does not exist"):
        private_dir(tmp_path / "missing", "tt-test")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpillDirError, match="not a directory"):
        private_dir(f, "tt-test")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(SpillDirError, match="writable"):
            private_dir(ro, "tt-test")


def test_dir_lock_excludes_and_is_released_by_gc(tmp_path):
    a = DirLock(tmp_path, what="test writer")
    with pytest.raises(ConfigError, match=f"another test writer.*pid {os.getpid()}"):
        DirLock(tmp_path, what="test writer")
    del a
    gc.collect()
    b = DirLock(tmp_path, what="test writer")
    b.release()
    assert not b.held
    DirLock(tmp_path, what="test writer").release()


@pytest.mark.parametrize(
    "make",
    [
        lambda d: DirLock(d, what="test writer").release(),
        lambda d: tt.Checkpointer(d).close(),
        lambda d: tt.rl.ReplayBuffer(10, spill_dir=d, durable=True).close(),
    ],
    ids=["DirLock", "Checkpointer", "durable ReplayBuffer"],
)
def test_dir_lock_never_follows_a_symlink_at_its_path(tmp_path, make):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    d = tmp_path / "shared"
    d.mkdir()
    names = (".tensortier.lock", ".tensortier-checkpoint.lock")
    for name in names:
        os.symlink(victim, d / name)
    with pytest.raises(SpillDirError, match="symbolic link"):
        make(d)
    assert victim.read_text() == "precious data\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's file")
def test_dir_lock_refuses_another_users_lock_file(tmp_path):
    lock = tmp_path / ".tensortier.lock"
    lock.write_text("")
    os.chown(lock, 65534, 65534)
    with pytest.raises(SpillDirError, match="owned by uid 65534"):
        DirLock(tmp_path, what="test writer")
    os.unlink(lock)
    os.mkfifo(lock)
    with pytest.raises(SpillDirError, match="not a regular file"):
        DirLock(tmp_path, what="test writer")


def test_normalize_device():
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device(torch.device("cpu", 0)) == torch.ones(1).device
    assert normalize_device(None).type in ("cpu", "cuda")


def test_forked_child_does_not_keep_the_parents_locks(tmp_path):
    """A DataLoader-style forked worker drops its copies of our lock descriptors (review finding 9):
    the parent can reopen a directory it closed, and a dead owner's directory is reclaimable
    although its forked worker still lives."""
    lock = DirLock(tmp_path, what="test writer")
    pid = os.fork()
    if pid == 0:  # the child sleeps holding nothing
        import time

        time.sleep(1.5)
        os._exit(0)
    try:
        lock.release()
        DirLock(tmp_path, what="test writer").release()  # before the fix: held by the child
    finally:
        os.waitpid(pid, 0)

    child = f"""
import os, signal, time
from tensortier._lifetime import private_dir
print(private_dir({str(tmp_path)!r}, "tt-test"), flush=True)
if os.fork() == 0:  # an orphaned worker: lets go of the test's pipes, lives on a while
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1); os.dup2(null, 2)
    time.sleep(10); os._exit(0)
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    dead = r.stdout.strip()
    assert os.path.isdir(dead)
    assert dead in reclaim_stale(tmp_path)  # its orphaned worker does not hold the owner lock


def test_a_forked_child_never_runs_the_parents_cleanup(tmp_path):
    marker = tmp_path / "cleaned"
    owner = _Owner()
    f = Finalizer(owner, marker.write_text, "x")
    pid = os.fork()
    if pid == 0:
        f()  # e.g. a worker closing its copy of a store: must not delete the parent's files
        os._exit(0 if not marker.exists() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and not marker.exists()
    f()
    assert marker.read_text() == "x"
