"""Ray helpers shared by every Ray client in tensortier (``rl.serve``, ``tiers.remote``,
``checkpoint`` replicas): importing Ray with a message that says how to install it, and ending
actors for certain.

Ray is an optional dependency: ``import tensortier`` never imports it; a client gets it from
:func:`require_ray` when it first needs it (code that runs inside a Ray actor imports it plainly).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def require_ray(what: str) -> ModuleType:
    """The ``ray`` module; without Ray installed, an ImportError naming ``what`` needs it and
    how to install it."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{what} needs Ray: pip install 'tensortier[rl]' (or pip install ray)"
        ) from exc
    return ray


def end_actors(actors: Sequence[Any], ping: Callable[[Any], Any], timeout: float = 10.0) -> None:
    """Kill ``actors`` and return once Ray reports each one dead, or after ``timeout`` seconds.

    Why a loop: ``ray.kill`` is asynchronous, so a ping sent right after it can still be served
    by the actor (seen in CI: a second handle's call after ``close()`` got an answer). Each
    actor is pinged until the ping fails (``ActorDiedError``), so that no call made after this
    returns, from any handle, still reaches one. ``ping(actor)`` submits a cheap method call.
    """
    import ray

    if not ray.is_initialized():
        # Ray shut down first (its atexit hook ran before a finalizer's at interpreter exit): the
        # driver's actors went with it, and a Ray call here would connect again and then crash
        # the exiting process (SIGSEGV in Ray's teardown, seen running the README's RemoteStore)
        return
    for actor in actors:
        with contextlib.suppress(Exception):  # already dead, or Ray shut down first
            ray.kill(actor)
    deadline = time.monotonic() + timeout
    alive = list(actors)
    while alive:
        answered = []
        for actor in alive:
            left = deadline - time.monotonic()
            if left <= 0:
                return  # the bound: callers document at most ``timeout`` seconds
            try:
                ray.get(ping(actor), timeout=left)
            except ray.exceptions.GetTimeoutError:
                return
            except Exception:  # ActorDiedError (or Ray gone): dead
                continue
            answered.append(actor)  # served after the kill: not dead yet
        alive = answered
        if alive:
            time.sleep(0.02)
