"""What tensortier owns beyond one call: cleanup of dropped owners, private directories, locks.

Two rules every module follows (see ``LIFETIME.md``):

1. **A finalizer never blocks, joins a thread or takes a lock.** The cyclic GC runs finalizers on
   whatever thread allocates at that moment: an I/O worker of the object being collected (joining
   it raises "cannot join current thread"), or code inside ``threading`` that holds its own locks
   (joining there deadlocks the process). :class:`Finalizer` therefore runs the cleanup *now* when
   called explicitly (``close()``), and hands it to one reaper thread per process when the owner
   is garbage collected. Finalizers that must act at once (returning a host block to its pool)
   push onto a lock-free queue that the owner drains at its next call, instead of taking its lock.
2. **Every private directory names a live owner.** :func:`private_dir` puts an owner file in each
   directory it makes and holds an exclusive ``flock`` on it for the owner's life; the kernel drops
   the lock when the process dies, even by SIGKILL. The first private directory a process makes
   under a parent removes the directories there whose owner lock nobody holds.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable

from tensortier.errors import ConfigError, SpillDirError

log = logging.getLogger(__name__)

OWNER_FILE = ".tt-owner"
# names tensortier gives private directories: "<owner>-<mkdtemp suffix>"
_PRIVATE = re.compile(r"^(tensortier|tt)(-[A-Za-z0-9]+)*-[A-Za-z0-9_]{8}$")


# --------------------------------------------------------------------------- the reaper
class _Reaper:
    """One daemon thread that runs cleanup jobs handed over by finalizers, in order."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # put() is reentrant: safe inside GC
        self.thread: threading.Thread | None = None
        self.start_lock = threading.Lock()
        self.exiting = False

    def start(self) -> None:
        """Start the thread (from ordinary code: starting a thread inside GC can deadlock)."""
        if self.thread is not None and self.thread.is_alive():
            return
        with self.start_lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="tt-reaper", daemon=True)
                self.thread.start()

    def put(self, fn: Callable, args: tuple) -> None:
        if self.exiting:  # interpreter shutdown: nothing will run later, so run it here
            _run_job(fn, args)
            return
        self.jobs.put((fn, args))

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            _run_job(*job)

    def drain(self) -> None:
        """Run every queued job on this thread (interpreter exit)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _run_job(*job)


def _run_job(fn: Callable, args: tuple) -> None:
    try:
        fn(*args)
    except BaseException:  # a failed cleanup must not kill the reaper or the caller
        log.warning("tensortier: cleanup %r failed", fn, exc_info=True)


_reaper = _Reaper()


def defer(fn: Callable, *args) -> None:
    """Run ``fn(*args)`` on the reaper thread. Never blocks: safe in finalizers and on any thread."""
    _reaper.put(fn, args)


def quiesce(timeout: float = 30.0) -> bool:
    """Wait until every deferred cleanup has run (tests, and code that wants its files gone now).

    Returns False if jobs are still pending after ``timeout`` seconds, or when called from the
    reaper thread itself (which would wait for its own job).
    """
    if threading.current_thread() is _reaper.thread:
        return False
    if _reaper.exiting:
        return True  # jobs run inline now
    _reaper.start()
    marker = threading.Event()
    _reaper.jobs.put((marker.set, ()))  # the queue is FIFO: every earlier job has run when it fires
    return marker.wait(timeout)


@atexit.register
def _at_exit() -> None:
    # From here on, finalizers run their cleanup inline (weakref.finalize calls them at exit).
    _reaper.exiting = True
    thread = _reaper.thread
    if thread is not None and thread.is_alive():
        _reaper.jobs.put(None)
        thread.join(timeout=10.0)  # an explicit bound: a stuck cleanup must not hang exit
    _reaper.drain()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing collector) owns none of the parent's
    resources: it drops its copies of the parent's lock descriptors, so the locks go away when
    the parent releases them (closing a copy does not release the parent's lock), and it never
    runs the parent's cleanups (``Finalizer`` checks the pid)."""
    global _reaper
    _reaper = _Reaper()  # the parent's thread does not exist here; its queue is the parent's
    for fd in _owned.values():
        _close_quietly(fd)
    _owned.clear()
    for lock in list(_dir_locks):
        if lock._finalize.detach() is not None:
            _close_quietly(lock._fd)
    _dir_locks.clear()
    _reclaimed.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _defer_in(pid: int, fn: Callable, *args) -> None:
    if os.getpid() == pid:
        defer(fn, *args)


class Finalizer:
    """Like ``weakref.finalize``, but garbage collection only *schedules* the cleanup.

    ``f()`` runs ``fn(*args)`` on the calling thread, once (later calls return None), which is what
    ``close()`` wants: the files are gone when it returns. If the owner is collected first, the
    cleanup runs on the reaper thread. ``args`` must not refer to the owner. Only the process that
    made the Finalizer runs it: a forked child's copy of the owner never deletes the parent's
    files or closes its resources.
    """

    __slots__ = ("_finalize", "_fn", "_args", "_pid")

    def __init__(self, owner: object, fn: Callable, *args):
        _reaper.start()
        self._fn, self._args, self._pid = fn, args, os.getpid()
        self._finalize = weakref.finalize(owner, _defer_in, self._pid, fn, *args)

    def __call__(self):
        if self._finalize.detach() is not None and os.getpid() == self._pid:
            return self._fn(*self._args)
        return None

    @property
    def alive(self) -> bool:
        return self._finalize.alive


# --------------------------------------------------------------------------- private directories
_owned: dict[str, int] = {}  # private directory -> fd holding its owner lock
_dir_locks: weakref.WeakSet = weakref.WeakSet()  # DirLocks held by this process
_owned_lock = threading.Lock()
_reclaimed: set[str] = set()  # parents already swept by this process


def private_dir(spill_dir: str | os.PathLike | None, owner: str) -> str:
    """Make a private (0700) directory ``<owner>-XXXXXXXX`` under ``spill_dir`` for this process.

    The directory holds an owner file locked for the life of the process (or until
    :func:`remove_private_dir`). The first call per parent removes directories there whose owner
    died without cleaning up. Raises :class:`SpillDirError` naming the fix when ``spill_dir`` is
    missing, not a directory or not writable.
    """
    if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
        raise TypeError(
            f"spill_dir={spill_dir!r} ({type(spill_dir).__name__}): pass a directory path as a str "
            f"or os.PathLike, e.g. spill_dir='/mnt/nvme/tt', or None for the system's temp dir"
        )
    base = os.path.abspath(os.fspath(spill_dir) if spill_dir is not None else tempfile.gettempdir())
    if not os.path.exists(base):
        raise SpillDirError(
            f"spill directory {base!r} does not exist; create it (mkdir -p {base}) or pass "
            f"another spill_dir",
            path=base,
        )
    if not os.path.isdir(base):
        raise SpillDirError(
            f"spill directory {base!r} is not a directory; pass a directory on a fast local disk "
            f"as spill_dir",
            path=base,
        )
    if base not in _reclaimed:
        _reclaimed.add(base)
        reclaim_stale(base)
    try:
        root = tempfile.mkdtemp(prefix=f"{owner}-", dir=base)  # mode 0700
    except OSError as exc:
        raise SpillDirError(
            f"cannot create files in spill directory {base!r} ({exc.strerror}); make it writable "
            f"or pass another spill_dir",
            path=base,
        ) from exc
    try:
        # Lock first, then give the file its name: a sweeper never sees an unlocked owner file.
        tmp = os.path.join(root, OWNER_FILE + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"pid {os.getpid()}\nowner {owner}\n".encode())
            os.rename(tmp, os.path.join(root, OWNER_FILE))
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise SpillDirError(
            f"cannot create files in spill directory {base!r} ({exc.strerror}); make it writable "
            f"or pass another spill_dir",
            path=base,
        ) from exc
    with _owned_lock:
        _owned[root] = fd
    return root


def remove_private_dir(path: str) -> None:
    """Delete a directory made by :func:`private_dir` and drop its owner lock (idempotent)."""
    shutil.rmtree(path, ignore_errors=True)
    with _owned_lock:
        fd = _owned.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def lock_if_free(path: str, flags: int) -> int | None:
    """``path`` opened with ``flags`` and locked exclusively, or None while another descriptor
    (this process's or another's) holds its lock: the caller leaves a held file alone. An error
    opening or locking it propagates, with nothing left open."""
    fd = os.open(path, flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def reclaim_stale(base: str | os.PathLike) -> list[str]:
    """Remove private directories under ``base`` whose owner process is gone; returns their paths.

    A directory is stale when its owner file exists and nobody holds its lock. Directories
    without an owner file (being created, or not made by :func:`private_dir`) are left alone.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not _PRIVATE.match(entry.name) or entry.path in _owned:
            continue
        try:
            fd = lock_if_free(os.path.join(entry.path, OWNER_FILE), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        if fd is None:
            continue  # a live owner (possibly another process) holds it
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    if removed:
        log.info("tensortier: removed %d stale private directories under %s", len(removed), base)
    return removed


# --------------------------------------------------------------------------- directory locks
class DirLock:
    """An exclusive ``flock`` on ``directory/name``: one writer per directory, across processes.

    Released by :meth:`release`, when the object is collected (closing a descriptor neither
    blocks nor locks), or when the process dies. ``what`` names the owner in the error message.
    """

    def __init__(self, directory: str | os.PathLike, *, name: str = ".tensortier.lock", what: str):
        self.path = os.path.join(os.fspath(directory), name)
        fd = _open_lock_file(self.path, os.fspath(directory))
        try:
            _flock_or_child_copy(fd, self.path)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"another {what} is using {os.fspath(directory)!r}{holder}; close it first, or "
                f"give each one its own directory"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._finalize = weakref.finalize(self, _close_quietly, fd)
        _dir_locks.add(self)

    def release(self) -> None:
        self._finalize()

    @property
    def held(self) -> bool:
        return self._finalize.alive


def _open_lock_file(path: str, directory: str) -> int:
    """Open (or create) the lock file without following a symlink planted at its path (whoever
    can write to the directory could otherwise make us truncate any file we can write), and
    refuse anything but a regular file of our own: another user's file is not our lock."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SpillDirError(
                f"the lock file {path!r} is a symbolic link; tensortier does not follow links "
                f"there (it would overwrite their target): remove it or use another directory",
                path=directory,
            ) from exc
        raise SpillDirError(
            f"cannot create the lock file {path!r} ({exc.strerror}); make the directory "
            f"writable or pass another one",
            path=directory,
        ) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}"
        raise SpillDirError(
            f"the lock file {path!r} is {kind}, not one this user made; remove it or use a "
            f"directory of your own",
            path=directory,
        )
    return fd


def _flock_or_child_copy(fd: int, path: str) -> None:
    """``flock(LOCK_EX | LOCK_NB)``; if the holder recorded in the file is this very process and
    none of our live DirLocks is on ``path``, the lock is a forked child's copy that the child
    is about to drop (``_after_fork_in_child``): retry for up to a second, then give up."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            ours = _read_holder(fd) == f" (held by pid {os.getpid()})"
            mine = any(lock.path == path and lock.held for lock in list(_dir_locks))
            if not ours or mine or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" (held by {text})" if text.startswith("pid ") else ""
