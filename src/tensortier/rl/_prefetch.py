"""The thread behind ``ReplayBuffer(prefetch=k)``: batches drawn ahead into a bounded queue.

Owns one prefetch run's queue, stop flag and thread. The thread calls the buffer's draw through a
weak method reference, so it never keeps a dropped buffer alive: the buffer is collected and the
thread ends (``LIFETIME.md``); ``close()`` (or the reaper, after GC) stops and joins it with a
bound. The draw itself, and what a drawn batch means for ``max_uses`` and the rate limiter, belong
to the buffer (``replay.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from tensortier._lifetime import Finalizer

log = logging.getLogger(__name__)
STOP_WAIT = 5.0  # seconds close() waits for the thread (it checks its stop flag every 0.1 s)
STOP: Any = object()  # what a draw returns once the buffer is closed: the thread ends


class Prefetcher:
    """The queue, stop flag and thread of one prefetch run of batches of ``n`` items.

    ``draw_one(prefetcher)`` (a bound method of the buffer) returns a batch, None when there is
    nothing to draw yet, or :data:`STOP`; an exception it raises is queued for ``sample``.
    """

    def __init__(self, draw_one: Callable[[Prefetcher], Any], n: int, depth: int):
        self.n = n
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        self.pending = 0  # batches drawn (or failed) and not yet queued; written by the thread only
        self.thread = threading.Thread(
            target=_run,
            args=(weakref.WeakMethod(draw_one), self),
            daemon=True,
            name="tt-replay-prefetch",
        )
        self.finalizer = Finalizer(draw_one.__self__, _stop_thread, self.stop, self.thread)
        self.thread.start()


def _stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread() and thread.ident is not None:
        thread.join(STOP_WAIT)  # bounded: the loop looks at `stop` at least every 0.1 s
        if thread.is_alive():
            log.warning("tensortier: replay prefetch thread still busy after %.0f s", STOP_WAIT)


def _run(ref: weakref.WeakMethod, p: Prefetcher) -> None:
    """Draw batches ahead into ``p.queue`` until stopped, closed, or the buffer is collected."""
    while not p.stop.is_set():
        draw = ref()
        if draw is None:
            return
        try:
            got = draw(p)
        except BaseException as exc:  # handed to the caller of sample()
            traceback.clear_frames(exc.__traceback__)  # its frames must not keep the buffer alive
            got = exc
        del draw  # hold no strong reference while waiting below
        if got is None:
            continue
        if got is STOP:
            return
        while not p.stop.is_set():
            try:
                p.queue.put(got, timeout=0.1)
                break
            except queue.Full:
                continue
        p.pending -= 1
