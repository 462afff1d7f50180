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
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from tensortier._lifetime import private_dir, remove_private_dir
from tensortier.errors import ClosedError, ConfigError
from tensortier.rl import param_nodes
from tensortier.rl._actors import (
    START_TIMEOUT,
    BufferActor,
    actor_class,
    call,
    check_local_tiers,
    check_num_cpus,
    check_resources,
    end_actor,
    import_ray,
    kill_quietly,
    wait_started,
)
from tensortier.rl._api import DEFAULT, Batch, check_batch_size, check_timeout
from tensortier.rl._backoff import poll
from tensortier.rl._store import as_index_array, check_items
from tensortier.rl.memory_bank import MemoryBank
from tensortier.rl.param_store import Params, ParamStore, check_version, deadline_of
from tensortier.rl.rate_limiter import RateLimit
from tensortier.rl.replay import NOT_ITERABLE, ReplayBuffer
from tensortier.tiers import itemcodec as _codec

_WAIT_CHUNK = 1.0  # longest one parameter wait holds an actor thread (seconds)
_PARAM_THREADS = 64  # concurrent calls a parameter actor serves


# ---------------------------------------------------------------------- the parameter actor
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
        return call(getattr(self.actor, method).remote(*args), self._what)

    def add(self, item: Any, *, timeout: float | None = DEFAULT) -> int:
        return int(self.extend([item], timeout=timeout)[0])

    append = add

    def _limited(self, op: str, n: int, timeout: Any, *args):
        """A rate-limited call: the actor answers at once, this side retries until ``timeout``
        (default: the RateLimit's) and then raises RateLimitTimeout."""
        assert self.rate_limit is not None
        wait = self.rate_limit.timeout if timeout is DEFAULT else check_timeout(timeout)
        tries = iter(range(1 << 62))
        return poll(
            lambda: self._do(f"try_{op}", *args, next(tries) == 0),
            wait,
            lambda: self._do("limit_timeout", "insert" if op == "extend" else op, n, wait),
        )

    def extend(self, items, *, timeout: float | None = DEFAULT) -> np.ndarray:
        blobs = [_codec.encode(it) for it in check_items(items, self._what)]
        if self.rate_limit is not None:
            return self._limited("extend", len(blobs), timeout, blobs)
        return self._do("extend", blobs)

    def sample(self, batch_size: int, *, timeout: float | None = DEFAULT) -> Batch:
        """Draw a batch. Empty buffer: waits on this side up to ``timeout`` seconds (default 0;
        ``None``: until an add) for collectors, then raises IndexError, as ReplayBuffer.sample.
        With a rate limit, waits up to ``timeout`` (default: the RateLimit's) while inserting is
        behind, then raises RateLimitTimeout. The actor never waits: adds go on meanwhile."""
        n = check_batch_size(batch_size)  # before the remote call: a typed error, no round trip
        if self.kind != "replay":
            raise TypeError("a served MemoryBank has no sample(); read items by index (bank[i])")
        if self.rate_limit is not None:
            blobs, keys, weights = self._limited("sample", n, timeout, n)
        else:
            wait = 0.0 if timeout is DEFAULT else check_timeout(timeout)
            blobs, keys, weights = poll(
                lambda: self._do("try_sample", n, False),
                wait,
                lambda: self._do("empty_error", wait),
            )
        items, collated = _codec.decode_batch(blobs)
        return Batch(items, keys, weights, collated)

    def update_priorities(self, indices, priorities) -> None:
        if hasattr(priorities, "detach"):
            priorities = priorities.detach().cpu().double().numpy()  # as one buffer does
        keys = as_index_array(indices)  # typed errors here, not wrapped by Ray
        self._do("update_priorities", keys, np.asarray(priorities))

    def __getitem__(self, index):
        single = isinstance(index, (int, np.integer)) and not isinstance(index, bool)
        items = self._get(as_index_array(index, "index"))
        return items[0] if single else items

    def get_many(self, indices) -> list[Any]:
        """Items at ``indices``, in order (a repeated index gives its item again), as
        ``MemoryBank.get_many``: one call to the actor."""
        return self._get(as_index_array(indices, "indices"))

    def _get(self, keys: np.ndarray) -> list[Any]:
        return [_codec.decode(b) for b in self._do("get_blobs", keys)]

    def __contains__(self, index: object) -> bool:
        return bool(self._do("contains", index))

    def indices(self) -> np.ndarray:
        """Indices of the stored items, oldest first."""
        return self._do("indices")

    def __iter__(self) -> Iterator[Any]:
        """A served bank's items, oldest first, as ``MemoryBank``'s (one call per item)."""
        if self.kind == "replay":
            raise TypeError(NOT_ITERABLE)
        return self._items()

    def _items(self) -> Iterator[Any]:
        for key in self.indices().tolist():
            try:
                yield self[key]
            except KeyError:  # deleted or evicted since the snapshot of the indices
                continue

    def update(self, index: int, item: Any) -> None:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"update: index must be an int returned by add(), got {index!r}")
        self._do("update", int(index), _codec.encode(item))

    __setitem__ = update

    def __delitem__(self, index) -> None:
        self._do("delete", as_index_array(index, "index"))

    def __len__(self) -> int:
        return self._do("length")

    @property
    def stats(self) -> dict:
        return self._do("stats")

    def save(self, directory: str) -> None:
        self._do("save", os.fspath(directory))

    def close(self) -> None:
        """Close the store (deleting its spill files) and end the actor. Idempotent."""
        if self._closed:
            return
        try:
            with contextlib.suppress(ClosedError):  # already gone: nothing left to close
                self._do("close")
        finally:
            self._closed = True
            end_actor(self.actor)


class RemoteParamStore:
    """A parameter store behind a Ray actor: one ``ray.put`` per version, any number of readers."""

    def __init__(self, actor):
        self.actor = actor
        self._closed = False

    def _do(self, method: str, *args):
        if self._closed:
            raise ClosedError("this served ParamStore is closed; serve a ParamStore again")
        return call(getattr(self.actor, method).remote(*args), "ParamStore")

    def publish(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        payload = param_nodes.encode(state_dict)
        if self._closed:
            raise ClosedError("this served ParamStore is closed; serve a ParamStore again")
        ref = import_ray().put(payload)  # once per version, shared by every reader
        return self._do("publish", [ref])

    @property
    def version(self) -> int:
        return self._do("latest")

    def _wait(self, min_version: object, timeout: object) -> tuple[int, list]:
        want = check_version(min_version, "min_version")
        deadline = deadline_of(timeout)
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
        deadline = deadline_of(timeout)
        v, boxed = self._wait(min_version, timeout)
        payload = param_nodes.fetch(import_ray(), boxed[0], v, deadline)
        tensors, shared = param_nodes.views(payload, boxed[0], v)
        return Params(v, tensors, shared=shared)

    def close(self) -> None:
        """End the actor; readers' later calls raise ClosedError. Idempotent."""
        if not self._closed:
            self._closed = True
            end_actor(self.actor)


# ---------------------------------------------------------------------- serve
def serve(
    obj: ReplayBuffer | MemoryBank | ParamStore,
    *,
    num_cpus: float = 0,
    name: str | None = None,
    start_timeout: float | None = START_TIMEOUT,
    shards: int | None = None,
    **actor_options: Any,
) -> Any:
    """Run a store like ``obj`` as a Ray actor and return a picklable handle to it, once it runs.

    A ReplayBuffer's items, priorities and indices are carried over (through ``save``/``load`` on
    this machine; the temporary copy is deleted whatever happens) and ``obj`` stays usable and
    independent. A durable buffer or MemoryBank is closed here and reopened by the actor from its
    directory (items, ``fsync`` and all); any other MemoryBank must be empty. A store that spills
    to a RemoteStore pool (``tier="remote"``) is refused: the pool belongs to this process.

    The actor reserves no CPU by default (``num_cpus=0``, as Ray advises for actors that mostly
    wait on I/O), so stores never take the CPUs their collectors need. A request no node of the
    cluster can hold raises :class:`ConfigError` at once; an actor that has not started after
    ``start_timeout`` seconds (resources busy) is cancelled with ``TimeoutError``. Extra
    ``actor_options`` go to ``ray.remote`` (e.g. ``resources``, ``scheduling_strategy``).

    ``shards=K`` (a ReplayBuffer only): K buffer actors spread over the cluster's nodes behind
    one :class:`~tensortier.rl.sharded.ShardedReplayBuffer` handle (see ``sharded.py``).
    """
    if shards is not None:
        from tensortier.rl.sharded import serve_sharded  # asyncio and friends only when used

        return serve_sharded(
            obj, shards, num_cpus=num_cpus, name=name, start_timeout=start_timeout, **actor_options
        )
    ray = import_ray()
    _check_serve_args(obj, num_cpus, start_timeout, name)
    what = type(obj).__name__
    opts = {"num_cpus": num_cpus, **actor_options}
    if name is not None:
        opts["name"] = name
    if isinstance(obj, ParamStore):
        opts.setdefault("max_concurrency", _PARAM_THREADS)
    actor_cls = actor_class(ray, _ParamActor if isinstance(obj, ParamStore) else BufferActor, opts)
    if not ray.is_initialized():
        ray.init()  # what the first .remote() would do; the resource check needs the cluster
    req = check_resources(ray, opts, what)
    limit = None
    if isinstance(obj, ReplayBuffer) and obj._limiter is not None:
        limit = obj._limiter.cfg
    copy_dir = actor = None
    try:
        args, copy_dir = _actor_args(obj, limit)
        try:
            actor = actor_cls.remote(*args)
        except ValueError as exc:  # e.g. the name is taken
            raise ConfigError(f"serve: Ray could not create the {what} actor: {exc}") from exc
        wait_started(ray, actor, start_timeout, what, req)
    except BaseException:
        kill_quietly(ray, [actor])  # never starts later, holding resources
        raise
    finally:
        if copy_dir is not None:
            remove_private_dir(copy_dir)  # loaded by the actor, or not needed any more
    if isinstance(obj, ParamStore):
        return RemoteParamStore(actor)
    if isinstance(obj, ReplayBuffer):
        return RemoteReplayBuffer(actor, "replay", limit)
    return RemoteReplayBuffer(actor, "bank")


def _check_serve_args(obj: object, num_cpus: object, start_timeout: object, name: object) -> None:
    if not isinstance(obj, (ReplayBuffer, MemoryBank, ParamStore)):
        raise ConfigError(
            f"serve takes a ReplayBuffer, MemoryBank or ParamStore, got {type(obj).__name__}"
        )
    check_num_cpus(num_cpus)
    if start_timeout is not None:
        deadline_of(start_timeout)  # validates: None or seconds >= 0
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"name must be a str (the Ray actor's name) or None, got {name!r}")
    if isinstance(obj, (ReplayBuffer, MemoryBank)):
        check_local_tiers(obj, "serve")
    if isinstance(obj, MemoryBank) and len(obj) and not obj._store.durable:
        raise ConfigError(
            f"serve an empty MemoryBank (the {len(obj)} items of this one are not carried over), "
            f"or a durable one (MemoryBank(durable=True, spill_dir=...)): its actor reopens the "
            f"directory with every item"
        )


def _actor_args(
    obj: ReplayBuffer | MemoryBank | ParamStore, limit: RateLimit | None
) -> tuple[tuple, str | None]:
    """The actor's constructor arguments, and the private directory of a buffer's copy (the
    caller removes it once the actor has loaded it)."""
    if isinstance(obj, ParamStore):
        return (obj.keep,), None
    if isinstance(obj, MemoryBank):
        s = obj._store
        kwargs = {
            "max_items": s.cap,
            "host_budget": s.budget,
            "spill_dir": s.spill_dir,
            "durable": s.durable,
            "fsync": s.fsync,
            "segment_size": s.segment_size,
        }
        if s.durable:
            obj.close()  # the actor reopens the same directory, items and all (one owner)
        return ("bank", kwargs, None), None
    c = obj.config
    kwargs = {
        "max_items": c.max_items,
        "host_budget": c.host_budget,
        "spill_dir": c.spill_dir,
        "sampler": c.sampler,
        "max_uses": c.max_uses,
        "durable": c.durable,
        "fsync": c.fsync,
        "seed": c.seed,
        "segment_size": c.segment_size,
        "rate_limit": limit,
    }
    if c.durable:
        obj.close()  # checkpointed; the actor reopens the same directory (one owner at a time)
        return ("replay", kwargs, None), None
    if not len(obj):
        return ("replay", kwargs, None), None
    copy_dir = private_dir(c.spill_dir, "tt-serve")  # reclaimed if we are killed
    saved = os.path.join(copy_dir, "buffer")
    try:
        obj.save(saved)
    except BaseException:
        remove_private_dir(copy_dir)
        raise
    small = {"host_budget": c.host_budget, "spill_dir": c.spill_dir, "seed": c.seed}
    return ("replay", {**small, "rate_limit": limit}, saved), copy_dir
