"""Batched ``O_DIRECT`` reads with Linux native AIO: one ``io_submit`` for all runs of a piece.

Why. A full-shuffle piece is ~85 scattered reads of ~47 KB. One blocking ``preadv`` each cost
~0.45 s of kernel time per GB on the VM this was measured on (a sleep, a wake-up and a device
notification per read); submitting them together and waiting once cost ~0.1 s/GB, and one
thread kept more reads in flight than sixteen blocking ones (``notes/issue-27-catalog.md``).

How. The ``io_setup``/``io_submit``/``io_getevents``/``io_destroy`` system calls through
``ctypes`` (no compiled code, no new dependency); control blocks are one numpy structured array,
so building them is array work, not Python per read. Each thread of each process has its own
context (made on first use, destroyed when the thread ends; a forked child makes its own). Only
``O_DIRECT`` descriptors: buffered AIO would read synchronously inside ``io_submit``.

Safety. Reads target memory the caller keeps alive until :func:`read_runs` returns. If anything
interrupts the wait (a signal's exception), the context is destroyed before the exception goes on:
``io_destroy`` cancels or waits for every read in flight, so no read lands in freed memory.
Where the calls are missing (another OS or architecture, a seccomp filter, ``aio-max-nr``
reached) :func:`context` returns None and the caller reads with ``preadv``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
import weakref

import numpy as np

# (io_setup, io_destroy, io_getevents, io_submit) per architecture
_CALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
DEPTH = 128  # reads in flight per context (io_setup's nr_events)
IOCB = np.dtype(
    [
        ("data", "<u8"),
        ("key", "<u4"),
        ("rw_flags", "<u4"),
        ("opcode", "<u2"),
        ("reqprio", "<i2"),
        ("fildes", "<u4"),
        ("buf", "<u8"),
        ("nbytes", "<u8"),
        ("offset", "<i8"),
        ("reserved2", "<u8"),
        ("flags", "<u4"),
        ("resfd", "<u4"),
    ]
)
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
_PREAD = 0  # IOCB_CMD_PREAD

_libc = None
_local = threading.local()
_broken = False  # set once the calls turned out unusable here: every read uses preadv


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


class Context:
    """One AIO context of one thread (see the module docstring)."""

    def __init__(self) -> None:
        self.setup, self.destroy_no, self.getevents, self.submit = _CALLS[platform.machine()]
        self.pid = os.getpid()
        ctx = ctypes.c_ulong(0)
        if _syscall()(self.setup, DEPTH, ctypes.byref(ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self.id = ctx.value
        self._final = weakref.finalize(self, _destroy, self.destroy_no, self.id, self.pid)

    def close(self) -> None:
        self._final()

    def read(self, cbs: np.ndarray) -> np.ndarray:
        """Submit the control blocks ``cbs`` (at most :data:`DEPTH`) and wait for all; the
        result of each (bytes read, or ``-errno``), in the order of ``cbs``."""
        n = len(cbs)
        ptrs = cbs.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(IOCB.itemsize)
        events = np.zeros(n, EVENT)
        call = _syscall()
        done = submitted = 0
        try:
            while submitted < n:
                k = call(self.submit, ctypes.c_ulong(self.id), n - submitted,
                         ctypes.c_void_p(ptrs.ctypes.data + 8 * submitted))  # fmt: skip
                if k < 0:
                    err = ctypes.get_errno()
                    if err in (errno.EINTR, errno.EAGAIN):
                        continue
                    raise OSError(err, os.strerror(err))
                submitted += k
            while done < n:
                k = call(self.getevents, ctypes.c_ulong(self.id), n - done, n - done,
                         ctypes.c_void_p(events.ctypes.data + EVENT.itemsize * done), None)  # fmt: skip
                if k < 0:
                    err = ctypes.get_errno()
                    if err == errno.EINTR:
                        continue
                    raise OSError(err, os.strerror(err))
                done += k
        except BaseException:
            if submitted > done:  # reads in flight: cancel or wait for them before memory goes
                self.close()
                _local.ctx = None
            raise
        out = np.empty(n, np.int64)
        out[events["data"][:n].astype(np.int64)] = events["res"]
        return out


def _destroy(number: int, ctx: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child never owned its parent's context
        _syscall()(number, ctypes.c_ulong(ctx))


def context() -> Context | None:
    """This thread's AIO context, made on first use; None where AIO is not usable."""
    global _broken
    if _broken or platform.machine() not in _CALLS or not hasattr(os, "O_DIRECT"):
        return None
    ctx = getattr(_local, "ctx", None)
    if ctx is not None and ctx.pid == os.getpid():
        return ctx
    try:
        ctx = _local.ctx = Context()
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            _broken = True  # this system refuses the calls: never try again
        return None  # EAGAIN (aio-max-nr reached): preadv this time
    return ctx


def control_blocks(fds: np.ndarray, addrs: np.ndarray, sizes: np.ndarray, offsets: np.ndarray):
    """Read control blocks: read ``sizes[i]`` bytes at ``offsets[i]`` of ``fds[i]`` into memory
    at address ``addrs[i]``; ``data`` holds the position, so results come back in order."""
    cbs = np.zeros(len(fds), IOCB)
    cbs["data"] = np.arange(len(fds))
    cbs["opcode"] = _PREAD
    cbs["fildes"], cbs["buf"], cbs["nbytes"], cbs["offset"] = fds, addrs, sizes, offsets
    return cbs
