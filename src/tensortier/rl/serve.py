"""Run a replay buffer, memory bank or parameter store as a Ray actor shared by many processes.

Ray is the transport (no home-made RPC): ``serve`` starts an actor that owns the store; the handle it
returns is picklable, so collectors in Ray tasks/actors on any node add and sample through it.
Collectors encode items to blobs on their side and the learner decodes sampled blobs on its side, so
the actor only moves bytes and updates indexes. A parameter store publishes each version with one
``ray.put``; each node pulls it once and its readers get copy-on-write views of that copy
(``param_nodes.py``).

Waits: ``serve`` checks the request against the cluster's nodes up front and waits at most
``start_timeout`` for the actor. Once it runs, a handle's calls end with the actor's answer, or with
:class:`ClosedError` when the actor is gone (Ray fails calls to a dead actor); a parameter wait is
split into calls of at most ``_WAIT_CHUNK`` seconds, so waiting readers never hold all the actor's
threads and a publish always gets through. Errors tensortier raises inside the actor reach the
caller as themselves (``ConfigError``, not ``RayTaskError``).

Ray is imported here only when ``serve`` or a handle method runs, never by ``import tensortier``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tensortier._lifetime import private_dir, remove_private_dir
from tensortier._ray import end_actors, require_ray
from tensortier._units import check_int, is_int
from tensortier.errors import ClosedError, ConfigError, TensortierError
from tensortier.rl import param_nodes
from tensortier.rl._backoff import poll
from tensortier.rl.memory_bank import MemoryBank
from tensortier.rl.param_store import Params, ParamStore, _check_version, _deadline
from tensortier.rl.rate_limiter import RateLimit
from tensortier.rl.replay import _DEFAULT, Batch, ReplayBuffer, _as_index_array, _check_timeout
from tensortier.tiers import itemcodec as _codec

_START_TIMEOUT = 120.0  # seconds serve() waits for the actor to be scheduled and built
_WAIT_CHUNK = 1.0  # longest one parameter wait holds an actor thread (seconds)
_PARAM_THREADS = 64  # concurrent calls a parameter actor serves


def _check_batch_size(batch_size: object) -> int:
    msg = f"batch_size must be an int >= 1, got {batch_size!r}"
    return check_int(batch_size, msg, minimum=1, numpy=True)


def _end(actor) -> None:
    """Kill ``actor`` and wait (at most 10 s) until Ray reports it dead, so that no call made
    after ``close()`` returns, from any handle, still reaches it."""
    require_ray("tt.rl.serve")
    end_actors([actor], lambda a: a.ready.remote())


def _call(ref, what: str):
    """``ray.get`` that raises tensortier's errors from the actor as themselves.

    Cannot hang on a dead actor: Ray fails its pending calls (ActorDiedError -> ClosedError).
    """
    ray = require_ray("tt.rl.serve")
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, TensortierError):
            raise exc.cause from exc
        raise
    except ray.exceptions.ActorDiedError as exc:
        raise ClosedError(
            f"the Ray actor serving this {what} is gone (closed, killed, or its process died); "
            f"serve the store again"
        ) from exc


# ---------------------------------------------------------------------- actors (plain classes)
class _BufferActor:
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
        return self.obj._sample_blobs(_check_batch_size(n))

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
        buf, lim = self.obj, self.obj._limiter
        with buf._cond:
            buf._check()
            lim.check_sample(n)
            if not lim.can_sample(n, len(buf)):
                lim.stats.sample_waits += first
                return None
            return buf._draw(n, 0.0)

    def limit_timeout(self, op: str, n: int, timeout: float | None):
        """The RateLimitTimeout a caller raises after polling ``timeout`` seconds (counted)."""
        return self.obj._limiter._timeout(op, n, len(self.obj), timeout)

    def update_priorities(self, indices, priorities) -> None:
        self.obj.update_priorities(indices, priorities)

    def get_blobs(self, indices) -> list[bytes]:
        keys = np.asarray(indices, np.int64).reshape(-1)
        with self.obj._lock:
            return self.obj._store.blobs(self.obj._slots(keys))

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

    def save(self, dirname: str) -> None:
        self.obj.save(dirname)

    def close(self) -> None:
        self.obj.close()


class _ParamActor:
    """Keeps the newest ``keep`` versions as object refs; readers wait on a condition (threaded actor)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.refs: dict[int, Any] = {}
        self.version = 0
        self.cond = threading.Condition()

    def ready(self) -> bool:
        return True

    def publish(self, boxed: list) -> int:
        with self.cond:
            self.version += 1
            self.refs[self.version] = boxed[0]  # boxed: Ray passes the ref itself, not its value
            for v in [v for v in self.refs if v <= self.version - self.keep]:
                del self.refs[v]  # Ray frees the object once no reader holds it
            self.cond.notify_all()
            return self.version

    def get(self, min_version: int, timeout: float | None):
        # At most _WAIT_CHUNK per call: a thread is free again soon, so publish always gets one.
        chunk = _WAIT_CHUNK if timeout is None else min(timeout, _WAIT_CHUNK)
        with self.cond:
            if not self.cond.wait_for(lambda: self.version >= min_version, chunk):
                return self.version, None
            return self.version, [self.refs[self.version]]

    def latest(self) -> int:
        return self.version


# ---------------------------------------------------------------------- client handles
class RemoteReplayBuffer:
    """A ReplayBuffer (or MemoryBank) living in a Ray actor; picklable, so pass it to collectors."""

    def __init__(self, actor, kind: str, rate_limit: RateLimit | None = None):
        self.actor = actor
        self.kind = kind
        self.rate_limit = rate_limit  # then add/extend/sample wait on this side (see _backoff)
        self._closed = False

    @property
    def _what(self) -> str:
        return "ReplayBuffer" if self.kind == "replay" else "MemoryBank"

    def _do(self, method: str, *args):
        if self._closed:
            raise ClosedError(f"this served {self._what} is closed; serve a store again")
        return _call(getattr(self.actor, method).remote(*args), self._what)

    def add(self, item: Any, *, timeout: float | None = _DEFAULT) -> int:
        return int(self.extend([item], timeout=timeout)[0])

    append = add

    def _limited(self, op: str, n: int, timeout: Any, *args):
        """A rate-limited call: the actor answers at once, this side retries until ``timeout``
        (default: the RateLimit's) and then raises RateLimitTimeout."""
        assert self.rate_limit is not None
        wait = self.rate_limit.timeout if timeout is _DEFAULT else _check_timeout(timeout)
        tries = iter(range(1 << 62))
        return poll(
            lambda: self._do(f"try_{op}", *args, next(tries) == 0),
            wait,
            lambda: self._do("limit_timeout", "insert" if op == "extend" else op, n, wait),
        )

    def extend(self, items, *, timeout: float | None = _DEFAULT) -> np.ndarray:
        blobs = [_codec.encode(it) for it in items]
        if self.rate_limit is not None:
            return self._limited("extend", len(blobs), timeout, blobs)
        return self._do("extend", blobs)

    def sample(self, batch_size: int, *, timeout: float | None = _DEFAULT) -> Batch:
        """Draw a batch; with a rate limit, waits on this side up to ``timeout`` (default: the
        RateLimit's) while inserting is behind, then raises RateLimitTimeout."""
        n = _check_batch_size(batch_size)  # before the remote call: a typed error, no round trip
        if self.kind != "replay":
            raise TypeError("a served MemoryBank has no sample(); read items by index (bank[i])")
        if self.rate_limit is not None:
            blobs, keys, weights = self._limited("sample", n, timeout, n)
        else:
            blobs, keys, weights = self._do("sample", n)
        items, collated = _codec.decode_batch(blobs)
        return Batch(items, keys, weights, collated)

    def update_priorities(self, indices, priorities) -> None:
        if hasattr(priorities, "detach"):
            priorities = priorities.detach().float().cpu().numpy()
        keys = _as_index_array(indices)  # typed errors here, not wrapped by Ray
        self._do("update_priorities", keys, np.asarray(priorities))

    def __getitem__(self, index):
        single = is_int(index, numpy=True)
        keys = _as_index_array(index, "index")
        items = [_codec.decode(b) for b in self._do("get_blobs", keys)]
        return items[0] if single else items

    def update(self, index: int, item: Any) -> None:
        if not is_int(index, numpy=True):
            raise TypeError(f"update: index must be an int returned by add(), got {index!r}")
        self._do("update", int(index), _codec.encode(item))

    __setitem__ = update

    def __delitem__(self, index) -> None:
        self._do("delete", _as_index_array(index, "index"))

    def __len__(self) -> int:
        return self._do("length")

    @property
    def stats(self) -> dict:
        return self._do("stats")

    def save(self, dirname: str) -> None:
        self._do("save", os.fspath(dirname))

    def close(self) -> None:
        """Close the store (deleting its spill files) and end the actor. Idempotent."""
        if self._closed:
            return
        try:
            with contextlib.suppress(ClosedError):  # already gone: nothing left to close
                self._do("close")
        finally:
            self._closed = True
            _end(self.actor)


class RemoteParamStore:
    """A parameter store behind a Ray actor: one ``ray.put`` per version, any number of readers."""

    def __init__(self, actor):
        self.actor = actor
        self._closed = False

    def _do(self, method: str, *args):
        if self._closed:
            raise ClosedError("this served ParamStore is closed; serve a ParamStore again")
        return _call(getattr(self.actor, method).remote(*args), "ParamStore")

    def publish(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        payload = param_nodes.encode(state_dict)
        if self._closed:
            raise ClosedError("this served ParamStore is closed; serve a ParamStore again")
        ref = require_ray("tt.rl.serve").put(payload)  # once per version, shared by every reader
        return self._do("publish", [ref])

    @property
    def version(self) -> int:
        return self._do("latest")

    def _wait(self, min_version: object, timeout: object) -> tuple[int, list]:
        want = _check_version(min_version, "min_version")
        deadline = _deadline(timeout)
        while True:
            left = _WAIT_CHUNK if deadline is None else deadline - time.monotonic()
            v, boxed = self._do("get", want, max(0.0, min(left, _WAIT_CHUNK)))
            if boxed is not None:
                return v, boxed
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"ParamStore version {want} not published within {timeout}s (newest is {v})"
                )

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        return self._wait(version, timeout)[0]

    def get(self, min_version: int = 1, timeout: float | None = None) -> Params:
        """Newest version >= ``min_version``: copy-on-write views of this node's copy of it
        (``rl/param_nodes.py``); writing into them changes only this reader's pages."""
        deadline = _deadline(timeout)
        v, boxed = self._wait(min_version, timeout)
        payload = param_nodes.fetch(require_ray("tt.rl.serve"), boxed[0], v, deadline)
        tensors, shared = param_nodes.views(payload, boxed[0], v)
        return Params(v, tensors, shared=shared)

    def close(self) -> None:
        """End the actor; readers' later calls raise ClosedError. Idempotent."""
        if not self._closed:
            self._closed = True
            _end(self.actor)


# ---------------------------------------------------------------------- serve
def _check_num_cpus(num_cpus: object) -> None:
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


def _check_resources(ray, opts: dict, what: str) -> dict[str, float]:
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


def _wait_started(ray, actor, timeout: float | None, what: str, req: dict[str, float]) -> None:
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
    _call(ref, what)  # the constructor's error, typed


def serve(
    obj: ReplayBuffer | MemoryBank | ParamStore,
    *,
    num_cpus: float = 0,
    name: str | None = None,
    start_timeout: float | None = _START_TIMEOUT,
    shards: int | None = None,
    **actor_options: Any,
) -> Any:
    """Run a store like ``obj`` as a Ray actor and return a picklable handle to it, once it runs.

    A ReplayBuffer's items, priorities and indices are carried over (through ``save``/``load`` on
    this machine; the temporary copy is deleted whatever happens) and ``obj`` stays usable and
    independent; a durable buffer is closed here and reopened by the actor from its directory.

    The actor reserves no CPU by default (``num_cpus=0``, as Ray advises for actors that mostly
    wait on I/O), so stores never take the CPUs their collectors need. A request no node of the
    cluster can hold raises :class:`ConfigError` at once; an actor that has not started after
    ``start_timeout`` seconds (resources busy) is cancelled with ``TimeoutError``. Extra
    ``actor_options`` go to ``ray.remote`` (e.g. ``resources``, ``scheduling_strategy``).

    ``shards=K`` (a ReplayBuffer only): K buffer actors spread over the cluster's nodes behind
    one :class:`~tensortier.rl.sharded.ShardedReplayBuffer` handle (see ``sharded.py``).
    """
    if shards is not None:
        from tensortier.rl.sharded import serve_sharded

        return serve_sharded(
            obj, shards, num_cpus=num_cpus, name=name, start_timeout=start_timeout, **actor_options
        )
    ray = require_ray("tt.rl.serve")
    if not isinstance(obj, (ReplayBuffer, MemoryBank, ParamStore)):
        raise ConfigError(
            f"serve takes a ReplayBuffer, MemoryBank or ParamStore, got {type(obj).__name__}"
        )
    _check_num_cpus(num_cpus)
    if start_timeout is not None:
        _deadline(start_timeout)  # validates: None or seconds >= 0
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"name must be a str (the Ray actor's name) or None, got {name!r}")
    if isinstance(obj, MemoryBank) and len(obj):
        raise ConfigError("serve an empty MemoryBank (its items are not carried over)")
    what = type(obj).__name__
    opts = {"num_cpus": num_cpus, **actor_options}
    if name is not None:
        opts["name"] = name
    if isinstance(obj, ParamStore):
        opts.setdefault("max_concurrency", _PARAM_THREADS)
    try:
        actor_cls = ray.remote(_ParamActor if isinstance(obj, ParamStore) else _BufferActor)
        actor_cls = actor_cls.options(**opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"serve: Ray rejected the actor options {opts}: {exc}") from exc
    if not ray.is_initialized():
        ray.init()  # what the first .remote() would do; the resource check needs the cluster
    req = _check_resources(ray, opts, what)

    copy_dir = actor = None
    try:
        if isinstance(obj, ParamStore):
            args: tuple = (obj.keep,)
        elif isinstance(obj, ReplayBuffer):
            c = obj.config
            limit = obj._limiter.cfg if obj._limiter is not None else None
            kwargs = {
                "capacity": c.capacity,
                "ram_budget": c.ram_budget,
                "spill_dir": c.spill_dir,
                "sampler": c.sampler,
                "max_uses": c.max_uses,
                "durable": c.durable,
                "seed": c.seed,
                "segment_size": c.segment_size,
                "rate_limit": limit,
            }
            saved = None
            if c.durable:
                obj.close()  # checkpointed; the actor reopens the same directory (one owner at a time)
            elif len(obj):
                copy_dir = private_dir(c.spill_dir, "tt-serve")  # reclaimed if we are killed
                saved = os.path.join(copy_dir, "buffer")
                obj.save(saved)
                kwargs = {
                    "ram_budget": c.ram_budget,
                    "spill_dir": c.spill_dir,
                    "seed": c.seed,
                    "rate_limit": limit,
                }
            args = ("replay", kwargs, saved)
        else:
            s = obj._store
            kwargs = {
                "capacity": s.cap,
                "ram_budget": s.budget,
                "spill_dir": s._spill_dir,
                "segment_size": s.segment_size,
            }
            args = ("bank", kwargs, None)
        try:
            actor = actor_cls.remote(*args)
        except ValueError as exc:  # e.g. the name is taken
            raise ConfigError(f"serve: Ray could not create the {what} actor: {exc}") from exc
        _wait_started(ray, actor, start_timeout, what, req)
    except BaseException:
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor)  # never starts later, holding resources
        raise
    finally:
        if copy_dir is not None:
            remove_private_dir(copy_dir)  # loaded by the actor, or not needed any more
    if isinstance(obj, ParamStore):
        return RemoteParamStore(actor)
    if isinstance(obj, ReplayBuffer):
        return RemoteReplayBuffer(actor, "replay", limit)
    return RemoteReplayBuffer(actor, "bank")
