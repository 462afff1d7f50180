"""Ray plumbing shared by ``serve.py`` and ``sharded.py``: the buffer actor, checks, start, calls.

Owns what every served store needs from Ray: importing it on demand (``import tensortier`` never
does), checking a request against the cluster before anything starts, waiting a bounded time for
an actor to run, ending one for good, and calls whose errors come back typed (tensortier's errors
raised in an actor reach the caller as themselves; a call to a dead actor fails, never hangs). The
buffer actor (:class:`BufferActor`, subclassed by a shard) is a plain class that Ray wraps.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensortier._ray import end_actors, require_ray
from tensortier.errors import ClosedError, ConfigError, TensortierError
from tensortier.rl._api import check_batch_size
from tensortier.rl.memory_bank import MemoryBank
from tensortier.rl.replay import ReplayBuffer

START_TIMEOUT = 120.0  # seconds serve() waits for an actor to be scheduled and built


def import_ray():
    return require_ray("tt.rl.serve")


def end_actor(actor) -> None:
    """Kill ``actor`` and wait (at most 10 s) until Ray reports it dead, so that no call made
    after ``close()`` returns, from any handle, still reaches it."""
    import_ray()
    end_actors([actor], lambda a: a.ready.remote())


def result(ref, timeout: float | None = None) -> Any:
    """``ray.get`` that raises tensortier's errors from the actor as themselves (Ray's own
    errors, a dead actor's included, propagate)."""
    ray = import_ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, TensortierError):
            raise exc.cause from exc
        raise


def call(ref, what: str) -> Any:
    """:func:`result`, with a dead actor as ClosedError (Ray fails its pending calls, so this
    cannot hang on one)."""
    ray = import_ray()
    try:
        return result(ref)
    except ray.exceptions.ActorDiedError as exc:
        raise ClosedError(
            f"the Ray actor serving this {what} is gone (closed, killed, or its process died); "
            f"serve the store again"
        ) from exc


def actor_class(ray, cls: type, opts: dict):
    """``ray.remote(cls)`` with the actor ``opts``; ConfigError naming options Ray rejects."""
    try:
        return ray.remote(cls).options(**opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"serve: Ray rejected the actor options {opts}: {exc}") from exc


def kill_quietly(ray, actors) -> None:
    """Kill actors that must never start later holding resources (a failed serve)."""
    for a in actors:
        if a is not None:
            with contextlib.suppress(Exception):
                ray.kill(a)


# ---------------------------------------------------------------------- the buffer actor
class BufferActor:
    """Owns a ReplayBuffer or MemoryBank inside the actor process."""

    def __init__(self, kind: str, kwargs: dict, saved: str | None):
        # An error here is kept and raised by ready(): Ray reports a constructor's exception only
        # as text (ActorDiedError), which would lose its type.
        self.error: Exception | None = None
        try:
            if kind == "replay":
                self.obj = ReplayBuffer.load(saved, **kwargs) if saved else ReplayBuffer(**kwargs)
            else:
                self.obj = MemoryBank(**kwargs)
        except Exception as exc:
            self.error = exc

    def ready(self) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def extend(self, blobs: list[bytes]) -> np.ndarray:
        if isinstance(self.obj, ReplayBuffer):
            return self.obj._extend_blobs(blobs)
        with self.obj._lock:
            return self.obj._store.add(blobs)[0]

    def sample(self, n: int):
        return self.obj._sample_blobs(check_batch_size(n))

    # rate-limited calls never wait here (this actor runs one call at a time): the caller polls
    def try_extend(self, blobs: list[bytes], first: bool):
        buf, lim = self.obj, self.obj._limiter
        with buf._cond:
            lim.check_insert(len(blobs))
            if not lim.can_insert(len(blobs), len(buf)):
                lim.stats.insert_waits += first
                return None
            return buf._extend_blobs(blobs)

    def try_sample(self, n: int, first: bool):
        """A batch, or None while nothing can be drawn (empty, or the rate limit says wait)."""
        buf, lim = self.obj, self.obj._limiter
        with buf._cond:
            buf._check()
            if lim is None:
                return buf._draw(n, 0.0) if len(buf) else None
            lim.check_sample(n)
            if not lim.can_sample(n, len(buf)):
                lim.stats.sample_waits += first
                return None
            return buf._draw(n, 0.0)

    def empty_error(self, timeout: float | None) -> IndexError:
        """The IndexError a caller raises after polling an empty buffer ``timeout`` seconds."""
        return self.obj._empty(timeout)

    def limit_timeout(self, op: str, n: int, timeout: float | None):
        """The RateLimitTimeout a caller raises after polling ``timeout`` seconds (counted)."""
        return self.obj._limiter.timeout_error(op, n, len(self.obj), timeout)

    def update_priorities(self, indices, priorities) -> None:
        self.obj.update_priorities(indices, priorities)

    def get_blobs(self, indices) -> list[bytes]:
        keys = np.asarray(indices, np.int64).reshape(-1)
        with self.obj._lock:
            return self.obj._store.blobs(self.obj._slots(keys))

    def indices(self) -> np.ndarray:
        return self.obj.indices()

    def contains(self, index: object) -> bool:
        return index in self.obj

    def update(self, index: int, blob: bytes) -> None:
        with self.obj._lock:
            [slot] = self.obj._slots(np.asarray([index], np.int64))
            self.obj._store.replace(int(slot), blob)

    def delete(self, indices) -> None:
        del self.obj[indices]

    def length(self) -> int:
        return len(self.obj)

    def stats(self) -> dict:
        return self.obj.stats

    def save(self, directory: str) -> None:
        self.obj.save(directory)

    def close(self) -> None:
        self.obj.close()


# ---------------------------------------------------------------------- start
def check_local_tiers(obj: ReplayBuffer | MemoryBank, how: str) -> None:
    """ConfigError for a store that spills to a ``RemoteStore`` pool: the pool is this process's
    (its objects are owned here), so an actor could only spill to disk, which is not what the
    store was made for."""
    tiers = obj._store.tiers
    if "remote" in tiers:
        what = type(obj).__name__
        raise ConfigError(
            f"{how} cannot carry tier={list(tiers)!r} over to its actor: the RemoteStore pool "
            f"belongs to this process, and the actor's {what} would spill to disk instead. "
            f"Serve a {what} made with tier='disk' (the default), or keep this one in-process"
        )


def check_num_cpus(num_cpus: object) -> None:
    if (
        isinstance(num_cpus, bool)
        or not isinstance(num_cpus, numbers.Real)
        or not math.isfinite(num_cpus)
        or num_cpus < 0
    ):
        raise ConfigError(
            f"num_cpus must be a number >= 0 (CPUs Ray reserves for the store's actor; the "
            f"default 0 suits a store, which mostly waits on I/O), got {num_cpus!r}"
        )


def _requested(opts: dict) -> dict[str, float]:
    req = {"CPU": opts.get("num_cpus"), "GPU": opts.get("num_gpus"), "memory": opts.get("memory")}
    req.update(opts.get("resources") or {})
    return {k: float(v) for k, v in req.items() if v}


def _fmt(resources: Mapping[str, float], keys) -> str:
    return ", ".join(f"{k}={resources.get(k, 0):g}" for k in keys) or "none"


def check_resources(ray, opts: dict, what: str) -> dict[str, float]:
    """ConfigError when no node can ever hold the actor (Ray would wait forever); a warning when it
    takes the last CPU (tasks that need one, collectors by default, would wait for it)."""
    req = _requested(opts)
    strategy = opts.get("scheduling_strategy")
    if not req or "placement_group" in opts or not (strategy is None or isinstance(strategy, str)):
        return req  # resources come from a bundle or a chosen node: start_timeout bounds the wait
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not any(all(node.get(k, 0.0) >= v for k, v in req.items()) for node in nodes):
        largest = max(nodes, key=lambda n: n.get("CPU", 0.0), default={})
        raise ConfigError(
            f"serve: the {what} actor requests {_fmt(req, req)} but no node of the Ray cluster has "
            f"that much (largest node: {_fmt(largest, req)}; cluster total: "
            f"{_fmt(ray.cluster_resources(), req)}), so it could never start. Pass num_cpus=0 "
            f"(the default) or fewer resources, or start Ray with more (ray.init(num_cpus=...))"
        )
    if req.get("CPU"):
        total = ray.cluster_resources().get("CPU", 0.0)
        left = ray.available_resources().get("CPU", 0.0) - req["CPU"]
        if left < 1:
            warnings.warn(
                f"serve: the {what} actor reserves {req['CPU']:g} CPU, leaving {max(left, 0):g} "
                f"of the cluster's {total:g} CPUs free: Ray tasks that need a CPU (collectors, "
                f"num_cpus=1 by default) wait until one frees up. Pass num_cpus=0 (the default) "
                f"unless the store needs a CPU to itself",
                RuntimeWarning,
                stacklevel=3,
            )
    return req


def wait_started(ray, actor, timeout: float | None, what: str, req: dict[str, float]) -> None:
    """Wait until the actor runs (scheduled and built); ``None`` waits as long as it takes."""
    ref = actor.ready.remote()
    done, _ = ray.wait([ref], timeout=timeout)
    if not done:
        raise TimeoutError(
            f"serve: the {what} actor did not start within {timeout}s; it requests "
            f"{_fmt(req, req)} and the cluster has {_fmt(ray.available_resources(), req)} free "
            f"of {_fmt(ray.cluster_resources(), req)} (other tasks or actors hold the rest). "
            f"Free resources, request fewer (num_cpus=0 is the default), or pass a larger "
            f"start_timeout (None: wait as long as it takes)"
        )
    call(ref, what)  # the constructor's error, typed
