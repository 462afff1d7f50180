"""Waiting on the caller's side for a Ray actor that must never block (polls with backoff).

A served buffer's actor runs one call at a time, so a rate-limited call cannot wait inside it (the
call that would release it could never run). The actor answers "not now" at once; the caller
retries after a short sleep that doubles up to ``_MAX_SLEEP``, until its own deadline. Each retry
holds only the caller's own batch: nothing queues in front of the actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_FIRST_SLEEP = 0.001  # seconds before the first retry
_MAX_SLEEP = 0.05  # longest sleep between retries (bounds the extra latency after a release)

NOT_NOW: Any = None  # what a try_ call returns when it was not admitted


def poll(try_once: Callable[[], Any], timeout: float | None, on_timeout: Callable[[], Exception]):
    """Call ``try_once()`` until it returns something other than ``None``; raise ``on_timeout()``
    once ``timeout`` seconds have passed (``None``: retry until admitted, the caller's choice;
    ``0``: one try)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    sleep = _FIRST_SLEEP
    while True:
        got = try_once()
        if got is not NOT_NOW:
            return got
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise on_timeout()
        time.sleep(sleep if left is None else min(sleep, left))
        sleep = min(2 * sleep, _MAX_SLEEP)
