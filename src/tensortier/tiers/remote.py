"""Remote memory tier: tensors held in other machines' RAM, through Ray.

Layout. A store starts one *memory-node* actor on each chosen Ray node (by default every node but
the caller's), pinned there with node-affinity scheduling so the pool is spread over the nodes, and
gives each node an equal share of ``budget``. A tensor goes whole to the live node with the most
free budget; the store keeps the byte accounting on the caller's side, so a put that cannot fit is
refused with :class:`TierFullError` before any byte moves.

Where the bytes live: in the memory node's Ray *object store*, as the return value of a call to its
actor (``hold`` returns the bytes it was sent; the object is created on that node and owned by this
process, so dropping the reference frees it). The other design, bytes copied into buffers the actor
owns, was measured slower (64 MiB, two simulated nodes on one machine, best of 5: object store put
0.69 GB/s, get 0.76 GB/s; actor buffers 0.47 / 0.47 GB/s; ``notes/issue-16.md``): an actor buffer
costs one more copy each way (into the actor's heap on put, back into the object store on get),
while an object-store object is written once on the node and fetched from there directly.

Small payloads. Ray returns a task result under ``max_direct_call_object_size`` (100 KiB by
default) inline to the caller, into *this* process's memory, not the memory node's object store:
such a tensor would neither save local memory nor be lost with its node. So every object is at
least ``MIN_OBJECT`` bytes (a smaller payload is padded, and the padding is charged to the
budget); batch small tensors with ``put_many`` to avoid the padding.

Payloads. Only raw bytes cross the wire: a flat ``uint8`` NumPy array of the tensor's values
(Ray carries it as an out-of-band buffer, not pickled); dtype and shape stay in the handle on the
caller's side. The actor refuses anything but a ``uint8`` array.

Faults and waits. Every remote call waits at most ``timeout`` seconds. A node that dies fails the
handles it held with :class:`NodeLostError` naming the node (at once, once the store knows), its
budget leaves the pool, and the store keeps working on the other nodes: a put whose node dies is
retried on another node. A call that times out on a node Ray still reports alive raises
``TimeoutError``. Puts and gets run on a small thread pool and return futures like
:class:`~tensortier.tiers.disk.DiskStore`; every job ends (result, error or timeout), so ``close()``
joins threads that finish within ``timeout``. ``free`` never blocks (lock-free queue, as the disk
tier). ``close()`` (or GC, through ``_lifetime.Finalizer``) drops every object and ends the actors.

Ray's session. A store lives in the Ray session it was made in: its actors and objects end with
``ray.shutdown()``. A store used after that (or after a new ``ray.init()``) raises
:class:`ClosedError` saying so, instead of letting Ray quietly connect again. Close the store (or
wait for its futures) before ``ray.shutdown()``: Ray 2.60 aborts the process (``Check failed:
... Broken pipe``) when it is shut down while a thread is inside ``ray.get``.

Ray is imported only when a store is made, never by ``import tensortier``.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tensortier._lifetime import Finalizer
from tensortier._ray import end_actors, require_ray
from tensortier._renamed import renamed
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, check_int, format_size, parse_size
from tensortier.errors import ClosedError, ConfigError, NodeLostError, TierFullError
from tensortier.tiers.base import StoreBase, check_many, running, shut_down_io
from tensortier.tiers.disk import as_bytes, check_storable

_TIMEOUT = 60.0  # seconds one remote call may take (a 1 GiB tensor at ~0.5 GB/s takes ~2 s)
_START_TIMEOUT = 120.0  # seconds the memory-node actors may take to start
MAX_IO_THREADS = 64
# Ray's default max_direct_call_object_size is 100 KiB: larger returns go to the node's object
# store. A margin above it, for the serialized array's header.
MIN_OBJECT = 104 << 10
_handle_ids = itertools.count()  # process-wide: a handle of one store never matches another's


@dataclass(frozen=True)
class RemoteHandle:
    """Where one tensor lives: a memory node (Ray node id). Valid until ``free``; never persisted."""

    id: int
    node: str  # "" for an empty tensor (nothing is sent)
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    batch: int = -1  # put_many: id of the one object its bytes share with the batch, else -1
    offset: int = 0  # byte offset of its bytes in that object

    @property
    def length(self) -> int:
        """Bytes a ``get(into=)`` buffer must hold (the data: no padding on this tier)."""
        return self.nbytes

    @property
    def key(self) -> int:
        """Key of the Ray object holding the bytes (shared by the members of one batch)."""
        return self.batch if self.batch >= 0 else self.id


@dataclass
class RemoteStats:
    nodes: int = 0  # memory nodes started
    lost_nodes: int = 0
    lost_tensors: int = 0  # live tensors that were on a node when it was found lost
    budget_bytes: int = 0  # budgets of the nodes still alive
    used_bytes: int = 0
    peak_used_bytes: int = 0
    live_tensors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0  # summed over threads
    read_seconds: float = 0.0
    puts: int = 0
    gets: int = 0
    batches: int = 0  # put_many calls that sent a payload (each one object, one transfer)
    prefetched: int = 0  # gets started by prefetch() ahead of need
    prefetch_hits: int = 0  # gets served by a prefetched copy

    def as_dict(self) -> dict:
        return asdict(self)


class _MemoryNode:
    """The actor on a memory node (a plain class; ``ray.remote`` wraps it when a store starts)."""

    def node_id(self) -> str:
        return require_ray("RemoteStore").get_runtime_context().get_node_id()

    def hold(self, payload):
        """Return the bytes as two objects: a small ack, and the payload, which Ray stores in this
        node's object store (owned by the caller, freed when the caller drops it)."""
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
            raise TypeError(f"a memory node holds flat uint8 arrays only, got {type(payload)}")
        return payload.nbytes, payload


@dataclass
class _Node:
    node_id: str
    actor: object
    budget: int
    used: int = 0  # held plus reserved by puts in flight
    held: int = 0  # bytes of registered objects: what stats.used_bytes counts for this node
    writable: bool = True  # False once its actor failed: no new puts
    lost: bool = False  # its objects are gone: every handle on it fails

    @property
    def free(self) -> int:
        return self.budget - self.used


class _Pool:
    """What cleanup needs, kept apart from the store so GC can collect the store."""

    def __init__(self):
        self.nodes: dict[str, _Node] = {}
        self.refs: dict[int, object] = {}  # handle key -> ObjectRef of its bytes
        self.batches: dict[int, set[int]] = {}  # batch key -> ids of its live handles

    def cleanup(self, executor: ThreadPoolExecutor) -> None:
        # Running jobs end within the timeout; queued ones are cancelled (their futures fail).
        if not shut_down_io(executor, self.cleanup):
            return
        self.refs.clear()  # Ray frees the objects once no reference is left
        self.batches.clear()
        require_ray("RemoteStore")
        # Wait (at most 10 s, on the closing or reaper thread) until Ray reports them dead, so no
        # call made after close() still reaches one.
        end_actors([n.actor for n in self.nodes.values()], lambda a: a.node_id.remote())


class _Prefetch:
    """Read-aheads (``RemoteStore.prefetch``): the order still to start, and the reads started
    and not yet taken by a get (handle id -> (bytes, future of the tensor))."""

    def __init__(self) -> None:
        self.order: collections.deque[RemoteHandle] = collections.deque()
        self.ahead: dict[int, tuple[int, Future]] = {}
        self.window = 0


def _check_handle(handle: object, where: str) -> None:
    if not isinstance(handle, RemoteHandle):
        raise TypeError(
            f"RemoteStore.{where}: expected the RemoteHandle returned by put(), got "
            f"{type(handle).__name__}"
        )


def _landing(handle: RemoteHandle, into: torch.Tensor | None) -> torch.Tensor:
    """Where a get lands: ``into`` (checked), else fresh memory. NumPy's allocator, not torch's:
    it asks the kernel for huge pages on large buffers, which made the copy out of the object
    store 2.2x faster here (64 MiB: 4.4 vs 2.0 GB/s; the get went from 0.57 to ~0.9 GB/s)."""
    if into is None:  # (torch.from_numpy of an empty array has stride 0: no dtype view)
        n = handle.nbytes
        return torch.from_numpy(np.empty(n, np.uint8)) if n else torch.empty(0, dtype=torch.uint8)
    if (
        not isinstance(into, torch.Tensor)
        or into.dtype != torch.uint8
        or into.numel() < handle.nbytes
        or not into.is_contiguous()
        or into.device.type != "cpu"
    ):
        raise ValueError(
            f"`into` must be a contiguous CPU uint8 tensor of >= {handle.nbytes} bytes"
        )
    return into[: handle.nbytes]


def _stored(nbytes: int) -> int:
    """Bytes an object of ``nbytes`` payload takes on its memory node (see MIN_OBJECT)."""
    return max(nbytes, MIN_OBJECT) if nbytes else 0


def _what(nbytes: int, article: str, noun: str) -> str:
    """A payload in a TierFullError: its size, and the size it takes when padded to MIN_OBJECT."""
    if _stored(nbytes) == nbytes:
        return f"{article} {format_size(nbytes)} {noun}"
    return (
        f"{article} {format_size(nbytes)} {noun} ({format_size(_stored(nbytes))} on its node: "
        f"every object is at least {format_size(MIN_OBJECT)}, so batch small tensors with "
        f"put_many)"
    )


def _padded(payload: np.ndarray) -> np.ndarray:
    if payload.nbytes >= MIN_OBJECT:
        return payload
    out = np.zeros(MIN_OBJECT, np.uint8)
    out[: payload.nbytes] = payload
    return out


def _session() -> str | None:
    """This process's Ray connection (its driver or worker id; a new one after ray.shutdown() and
    ray.init()), or None when Ray is not initialized."""
    ray = require_ray("RemoteStore")
    return ray.get_runtime_context().get_worker_id() if ray.is_initialized() else None


def _check_seconds(value: object, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name}={value!r}: pass a number of seconds > 0, e.g. {name}=60")
    return float(value)


class RemoteStore(StoreBase):
    """A tensor store in the RAM of other Ray nodes, with the :class:`DiskStore` interface.

    >>> with RemoteStore(budget="8GiB") as store:    # ray.init(address=...) first
    ...     h = store.put(x).result()      # Future[RemoteHandle]
    ...     y = store.get(h).result()      # bit-identical to x
    ...     store.free(h)

    ``nodes``: Ray node ids to hold memory on; ``None`` takes every alive node but this process's
    own (this node's if it is the only one). Each gets ``budget / len(nodes)``, which must fit in
    that node's object store (beyond it Ray would spill to disk). ``timeout`` bounds every remote
    call; ``start_timeout`` bounds the actors' start. Implements
    :class:`~tensortier.tiers.base.Store`.
    """

    tier = "remote"
    _handle_type = RemoteHandle

    @renamed(capacity="budget")
    def __init__(
        self,
        budget: SizeLike,
        *,
        nodes: list[str] | None = None,
        timeout: float = _TIMEOUT,
        start_timeout: float = _START_TIMEOUT,
        io_threads: int = 4,
    ):
        ray = require_ray("RemoteStore")
        self.budget = parse_size(budget, name="remote budget", allow_zero=False)
        self.timeout = _check_seconds(timeout, "timeout")
        start_timeout = _check_seconds(start_timeout, "start_timeout")
        io_threads = check_int(
            io_threads,
            f"io_threads={io_threads!r}: pass an int from 1 to {MAX_IO_THREADS}, e.g. io_threads=4",
            minimum=1,
            maximum=MAX_IO_THREADS,
        )
        if not ray.is_initialized():
            ray.init()  # what the first .remote() would do; placement needs the cluster
        self._session = _session()
        chosen = self._choose_nodes(ray, nodes)
        per_node = self.budget // len(chosen)
        if per_node < 1:
            raise ConfigError(
                f"remote budget={budget!r} is less than one byte per memory node "
                f"({len(chosen)} nodes); pass a larger budget"
            )
        self._pool = _Pool()
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="tt-remote")
        self._finalizer = Finalizer(self, self._pool.cleanup, self._executor)
        self._lock = threading.Lock()  # bookkeeping only; never held across a remote call
        self._live: dict[int, RemoteHandle] = {}
        # (node, bytes whose object Ray may free now, tensors): appended by free(), drained under
        # the lock by whoever holds it next
        self._freed: collections.deque[tuple[str, int, int]] = collections.deque()
        self._prefetch = _Prefetch()
        try:
            self._start(ray, chosen, per_node, io_threads, start_timeout)
        except BaseException:
            self._finalizer()
            raise
        self.stats = RemoteStats(nodes=len(chosen), budget_bytes=per_node * len(chosen))
        register_stats("remote_store", self)  # tt.stats() lists it while it is open

    # ---------------------------------------------------------------- start
    @staticmethod
    def _choose_nodes(ray, nodes: list[str] | None) -> list[tuple[str, float]]:
        alive = {
            n["NodeID"]: n.get("Resources", {}).get("object_store_memory", 0.0)
            for n in ray.nodes()
            if n.get("Alive")
        }
        if nodes is None:
            here = ray.get_runtime_context().get_node_id()
            others = [n for n in alive if n != here]
            return [(n, alive[n]) for n in sorted(others or alive)]
        if isinstance(nodes, str) or not all(isinstance(n, str) for n in nodes) or not nodes:
            raise ConfigError(
                f"nodes={nodes!r}: pass a non-empty list of Ray node ids (ray.nodes()[i]['NodeID']) "
                f"or None for every node but this one"
            )
        missing = [n for n in nodes if n not in alive]
        if missing or len(set(nodes)) != len(nodes):
            raise ConfigError(
                f"nodes={nodes!r}: {missing or 'duplicates'} are not distinct alive nodes of the "
                f"Ray cluster (alive: {sorted(alive)})"
            )
        return [(n, alive[n]) for n in nodes]

    def _start(self, ray, chosen, budget: int, threads: int, start_timeout: float) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node_id, store_bytes in chosen:
            if budget > store_bytes:
                raise ConfigError(
                    f"remote budget={format_size(self.budget)} gives each of {len(chosen)} "
                    f"memory nodes {format_size(budget)}, more than node {node_id}'s object store "
                    f"({format_size(store_bytes)}); Ray would spill the rest to disk. Pass a "
                    f"budget of at most {format_size(int(store_bytes) * len(chosen))} or add nodes"
                )
        cls = ray.remote(_MemoryNode)
        for node_id, _ in chosen:
            actor = cls.options(
                num_cpus=0,  # it waits on transfers; never takes a CPU a task needs
                max_concurrency=threads,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()
            self._pool.nodes[node_id] = _Node(node_id, actor, budget)
        refs = {n.actor.node_id.remote(): n.node_id for n in self._pool.nodes.values()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=start_timeout)
        if len(done) < len(refs):
            late = [refs[r] for r in refs if r not in done]
            raise TimeoutError(
                f"RemoteStore: the memory-node actors on {late} did not start within "
                f"{start_timeout}s; check that those nodes are alive, or pass a larger start_timeout"
            )
        for ref, node_id in refs.items():
            got = ray.get(ref, timeout=self.timeout)
            assert got == node_id, (got, node_id)  # node affinity is strict

    # ---------------------------------------------------------------- bookkeeping
    def _drain_freed_locked(self) -> None:
        for node_id, nbytes, tensors in self._take_freed():
            node = self._pool.nodes.get(node_id)
            if node is not None:
                node.used -= nbytes
                node.held -= nbytes
                if not node.lost:
                    self.stats.used_bytes -= nbytes
            self.stats.live_tensors -= tensors

    def _reserve(self, nbytes: int, exclude: set[str], what: str = "") -> _Node:
        """Reserve ``nbytes`` on the node with the most room outside ``exclude``.
        ``what``: the payload as the caller sees it, for the message (``nbytes`` is padded)."""
        with self._lock:
            self._check_open()
            self._drain_freed_locked()
            nodes = [n for n in self._pool.nodes.values() if n.writable and not n.lost]
            best = max(
                (n for n in nodes if n.node_id not in exclude), key=lambda n: n.free, default=None
            )
            if best is None or best.free < nbytes:
                most = 0 if best is None else best.free
                what = what or f"a {format_size(nbytes)} tensor"
                raise TierFullError(
                    f"remote tier budget exceeded: {what} needs room on "
                    f"one memory node, but the most free on any of the {len(nodes)} usable nodes "
                    f"is {format_size(most)} ({format_size(self.stats.used_bytes)} of "
                    f"{format_size(self.stats.budget_bytes)} used). Free tensors, raise "
                    f"the budget, or add nodes.{self._unusable_locked()}",
                    tier="remote",
                    requested=nbytes,
                    in_use=self.stats.used_bytes,
                    limit=self.stats.budget_bytes,
                )
            best.used += nbytes
            return best

    def _unusable_locked(self) -> str:
        """Why some memory nodes take no puts, for a TierFullError (lock held)."""
        dead = sum(1 for n in self._pool.nodes.values() if not n.writable and not n.lost)
        lost = sum(1 for n in self._pool.nodes.values() if n.lost)
        if not dead and not lost:
            return ""
        return (
            f" {dead + lost} of the {len(self._pool.nodes)} memory nodes take no more puts "
            f"({dead} whose actor died, killed or crashed; {lost} lost): close this store and "
            f"make a new RemoteStore to use their memory again."
        )

    def _unreserve(self, node: _Node, nbytes: int) -> None:
        with self._lock:
            node.used -= nbytes

    def _node_alive(self, node_id: str) -> bool:
        ray = require_ray("RemoteStore")
        try:
            return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())
        except Exception:  # the GCS did not answer: cannot tell, so do not declare it lost
            return True

    def _mark_lost(self, node: _Node) -> None:
        with self._lock:
            if node.lost:
                return
            node.lost, node.writable = True, False
            on_node = [h for h in self._live.values() if h.node == node.node_id]
            self.stats.lost_nodes += 1
            self.stats.lost_tensors += len(on_node)
            self.stats.budget_bytes -= node.budget
            # only registered bytes: a put in flight to this node (reserved, not yet counted)
            # retries elsewhere and is counted there
            self.stats.used_bytes -= node.held
            for h in on_node:  # the bytes are gone: drop the references now
                self._pool.refs.pop(h.key, None)

    def _lost_error(self, node_id: str, what: str, *more: str) -> NodeLostError:
        """The error for data on lost node ``node_id`` (and on ``more`` lost nodes)."""
        nodes = (node_id, *more)
        where = f"node {node_id} is" if not more else f"nodes {', '.join(nodes)} are"
        return NodeLostError(
            f"remote memory {where} lost (dead or left the Ray cluster): {what}. The "
            f"store keeps working on its other nodes; free this handle and restore the data from "
            f"its source or a slower tier.",
            node=node_id,
            nodes=nodes,
        )

    # ---------------------------------------------------------------- public API
    def put(self, tensor: torch.Tensor) -> Future[RemoteHandle]:
        """Start sending ``tensor`` (CPU, any dtype/shape/strides); returns a future of its handle.

        Do not modify ``tensor`` in place until the future is done. Raises :class:`TierFullError`
        at once when no memory node has room for it.
        """
        data = self._bytes_of(tensor, "put(tensor)")
        self._check_open()
        nbytes = data.numel()
        done = running()
        if nbytes == 0:
            handle = RemoteHandle(next(_handle_ids), "", 0, tensor.dtype, tuple(tensor.shape))
            self._register([handle], None, 0, 0.0)
            done.set_result(handle)
            return done
        what = _what(nbytes, "a", "tensor")
        node = self._reserve(_stored(nbytes), set(), what)  # TierFullError before any byte moves

        def send() -> RemoteHandle:
            node_id, ref, seconds = self._send(data.numpy(), node, what)
            handle = RemoteHandle(
                next(_handle_ids), node_id, nbytes, tensor.dtype, tuple(tensor.shape)
            )
            self._register([handle], ref, _stored(nbytes), seconds)
            return handle

        self._submit_call(send, done)
        return done

    def put_many(self, tensors: Sequence[torch.Tensor]) -> Future[list[RemoteHandle]]:
        """Send many (small) tensors as one object, in one transfer; a future of their handles.

        Why: each remote call costs a round trip (~1 ms here), so a thousand 4 KiB tensors sent
        one by one are bound by calls, not bytes. Their bytes are packed into one flat payload and
        each handle records its offset. A handle of a batch is used like one from :meth:`put`;
        the batch's memory is given back when the last of its handles is freed. The batch goes
        whole to one node: :class:`TierFullError` at once when none has room for the sum. A
        :meth:`get` of one member fetches the batch's object (Ray keeps that copy on this node
        for a while, so members read one after another move the bytes about once);
        :meth:`get_many` reads several members with one fetch per batch.
        """
        check_many(tensors, "RemoteStore.put_many(tensors)", "tensors", torch.Tensor)
        datas = [self._bytes_of(t, f"put_many(tensors[{i}])") for i, t in enumerate(tensors)]
        self._check_open()
        total = sum(d.numel() for d in datas)
        done = running()
        if total == 0:
            handles = [
                RemoteHandle(next(_handle_ids), "", 0, t.dtype, tuple(t.shape)) for t in tensors
            ]
            self._register(handles, None, 0, 0.0)
            done.set_result(handles)
            return done
        what = _what(total, "a", f"batch of {len(datas)} tensors")
        node = self._reserve(_stored(total), set(), what)  # TierFullError before any byte moves

        def send() -> list[RemoteHandle]:
            try:
                payload = np.empty(total, np.uint8)
                flat, offsets, off = torch.from_numpy(payload), [], 0
                for d in datas:
                    flat[off : off + d.numel()].copy_(d)
                    offsets.append(off)
                    off += d.numel()
            except BaseException:
                self._unreserve(node, _stored(total))
                raise
            node_id, ref, seconds = self._send(payload, node, what)
            key = next(_handle_ids)
            handles = [
                RemoteHandle(next(_handle_ids), node_id, d.numel(), t.dtype, tuple(t.shape), key, o)
                if d.numel()
                else RemoteHandle(next(_handle_ids), "", 0, t.dtype, tuple(t.shape))
                for t, d, o in zip(tensors, datas, offsets)
            ]
            self._register(handles, ref, _stored(total), seconds, batch=key)
            return handles

        self._submit_call(send, done)
        return done

    def _bytes_of(self, tensor: object, where: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"RemoteStore.{where}: expected a torch.Tensor, got {type(tensor).__name__}"
            )
        check_storable(tensor)
        if tensor.device.type != "cpu":
            raise ValueError(
                f"RemoteStore.{where} takes CPU tensors, got one on {tensor.device}; "
                f"copy it to the host first"
            )
        return as_bytes(tensor.detach())

    def _send(self, payload: np.ndarray, node: _Node, what: str) -> tuple[str, object, float]:
        """Send to ``node`` (reserved); if that node fails, retry on another one with room
        (``what``: the payload for the retry's TierFullError, as ``_reserve`` takes it).
        Returns (node id, ObjectRef of the bytes there, seconds)."""
        ray = require_ray("RemoteStore")
        payload = _padded(payload)
        nbytes = payload.nbytes
        tried: set[str] = set()
        while True:
            tried.add(node.node_id)
            t0 = time.perf_counter()
            try:
                self._check_session()
                ack, ref = node.actor.hold.options(num_returns=2).remote(payload)
                ray.get(ack, timeout=self.timeout)
            except ray.exceptions.GetTimeoutError as exc:
                self._unreserve(node, nbytes)
                if self._node_alive(node.node_id):
                    raise TimeoutError(
                        f"RemoteStore.put: memory node {node.node_id} did not take "
                        f"{format_size(nbytes)} within timeout={self.timeout}s; pass a larger "
                        f"timeout for slow links"
                    ) from exc
                self._mark_lost(node)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                self._unreserve(node, nbytes)
                with self._lock:
                    node.writable = False  # its actor is gone: no more puts there
                if not self._node_alive(node.node_id):
                    self._mark_lost(node)
            except BaseException:
                self._unreserve(node, nbytes)
                raise
            else:
                return node.node_id, ref, time.perf_counter() - t0
            node = self._reserve(nbytes, tried, what)  # TierFullError when no other node has room

    def _register(
        self, handles: list[RemoteHandle], ref, nbytes: int, seconds: float, batch: int = -1
    ) -> None:
        with self._lock:
            if self.closed:
                return
            if ref is not None:
                self._pool.refs[batch if batch >= 0 else handles[0].id] = ref
            if batch >= 0:
                self._pool.batches[batch] = ({h.id for h in handles if h.batch == batch}, nbytes)
                self.stats.batches += 1
            for h in handles:
                self._live[h.id] = h
            node = self._pool.nodes.get(next((h.node for h in handles if h.nbytes), ""))
            if node is not None:
                node.held += nbytes
            if node is None or not node.lost:  # a node lost since the put landed holds nothing
                self.stats.used_bytes += nbytes
            self.stats.peak_used_bytes = max(self.stats.peak_used_bytes, self.stats.used_bytes)
            self.stats.live_tensors += len(handles)
            self.stats.puts += len(handles)
            self.stats.bytes_written += nbytes
            self.stats.write_seconds += seconds

    def get(
        self, handle: RemoteHandle, *, into: torch.Tensor | None = None
    ) -> Future[torch.Tensor]:
        """Start fetching a tensor; returns a future of a CPU tensor bit-identical to the one put.

        ``into``: a contiguous CPU uint8 buffer of at least ``handle.nbytes`` bytes to land in.
        The future fails with :class:`NodeLostError` when the handle's node is lost. A handle
        that :meth:`prefetch` has read ahead is served from that copy.
        """
        _check_handle(handle, "get(handle)")
        out = _landing(handle, into)
        with self._lock:
            self._check_open()
            self._check_live(handle)
            ahead = self._prefetch.ahead.pop(handle.id, None)
            if ahead is not None:
                self.stats.prefetch_hits += 1
            else:
                where = self._where([handle])
        if ahead is None:
            return self._read([handle], [out], where, single=True)
        self._refill()
        if into is None:
            return ahead[1]
        done = running()

        def landed(f: Future) -> None:
            if f.exception() is not None:
                done.set_exception(f.exception())
                return
            try:
                out.copy_(as_bytes(f.result()))
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(out.view(handle.dtype).reshape(handle.shape))

        ahead[1].add_done_callback(landed)
        return done

    def get_many(self, handles: Sequence[RemoteHandle]) -> Future[list[torch.Tensor]]:
        """Fetch several tensors at once (one fetch per batch object); a future of them, in order.

        Does not use :meth:`prefetch`'s copies (use one or the other for the same handles). Fails
        with :class:`NodeLostError` naming every lost node the handles were on (``nodes``), or
        with the first other error."""
        check_many(handles, "RemoteStore.get_many(handles)", "RemoteHandles", RemoteHandle)
        for i, h in enumerate(handles):
            _check_handle(h, f"get_many(handles[{i}])")
        outs = [_landing(h, None) for h in handles]
        with self._lock:
            self._check_open()
            for h in handles:
                self._check_live(h)
            where = self._where(handles)
        return self._read(list(handles), outs, where, single=False)

    def _check_live(self, handle: RemoteHandle) -> None:
        if self._live.get(handle.id) is not handle:
            raise KeyError(f"{handle} is not live in this store (freed, or from another store)")

    def _where(self, handles: list[RemoteHandle]) -> dict[int, tuple[_Node | None, object]]:
        """(node, ObjectRef) of each object these handles' bytes are in (lock held)."""
        return {
            h.key: (self._pool.nodes.get(h.node), self._pool.refs.get(h.key))
            for h in handles
            if h.nbytes
        }

    def _read(self, handles, outs, where, single: bool, done: Future | None = None) -> Future:
        """Fetch ``handles`` into ``outs`` on an I/O thread; a future of the tensor (``single``)
        or of the list of tensors (``done``, when given: a future handed out before the read)."""
        done = running() if done is None else done

        def finish() -> None:
            with self._lock:
                self.stats.gets += len(handles)
            got = [o.view(h.dtype).reshape(h.shape) for h, o in zip(handles, outs)]
            done.set_result(got[0] if single else got)

        lost = [
            h
            for h in handles
            if h.nbytes
            and (where[h.key][0] is None or where[h.key][0].lost or where[h.key][1] is None)
        ]
        if lost:
            nodes = list(dict.fromkeys(h.node for h in lost))  # each once, in order met
            what = f"{lost[0]} was" if len(lost) == 1 else f"{len(lost)} tensors were"
            done.set_exception(self._lost_error(nodes[0], f"{what} held there", *nodes[1:]))
        elif not where:
            finish()
        else:

            def job() -> None:
                try:
                    self._fetch(handles, outs, where)
                except BaseException as exc:
                    done.set_exception(exc)
                else:
                    finish()

            self._submit(job, done)
        return done

    def _fetch(self, handles, outs, where) -> None:
        """One ``ray.get`` per object, then each handle's bytes copied out of it."""
        ray = require_ray("RemoteStore")
        t0 = time.perf_counter()
        nbytes = 0
        self._check_session()
        members: dict[int, list] = {}  # object key -> its (handle, out) pairs: one pass, not n
        for h, out in zip(handles, outs):
            if h.nbytes:
                members.setdefault(h.key, []).append((h, out))
        lost: dict[str, int] = {}  # lost node -> bytes of these handles it held, in order met
        cause: BaseException | None = None
        for key, (node, ref) in where.items():
            held = sum(h.nbytes for h, _ in members[key])
            if node.lost:  # found lost by an earlier object of this call
                lost[node.node_id] = lost.get(node.node_id, 0) + held
                continue
            try:
                arr = ray.get(ref, timeout=self.timeout)
            except ray.exceptions.GetTimeoutError as exc:
                if self._node_alive(node.node_id):
                    raise TimeoutError(
                        f"RemoteStore.get: {format_size(held)} from memory node {node.node_id} "
                        f"did not arrive within timeout={self.timeout}s; pass a larger timeout "
                        f"for slow links"
                    ) from exc
                self._mark_lost(node)
                lost[node.node_id], cause = lost.get(node.node_id, 0) + held, cause or exc
                continue
            except ray.exceptions.ObjectLostError as exc:
                # We own the object and never free it early, so Ray reports it lost only once
                # every copy's node failed (a failed reconstruction, here): the node is gone,
                # whether or not its health checks have caught up yet. The memory node is the
                # unit of failure.
                self._mark_lost(node)
                lost[node.node_id], cause = lost.get(node.node_id, 0) + held, cause or exc
                continue
            try:  # arr: a read-only view of the local object store
                for h, out in members[key]:
                    np.copyto(out.numpy(), arr[h.offset : h.offset + h.nbytes])
                    nbytes += h.nbytes
            finally:
                del arr
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.read_seconds += time.perf_counter() - t0
        if lost:  # every lost node this read met, not only the first
            what = f"{format_size(sum(lost.values()))} of this read was held there"
            first, *more = lost
            raise self._lost_error(first, what, *more) from cause

    @renamed(window="prefetch_budget")
    def prefetch(
        self, handles: Sequence[RemoteHandle], *, prefetch_budget: SizeLike = "256MiB"
    ) -> None:
        """Read ``handles`` ahead, in this order, before :meth:`get` asks for them (Leap's
        prefetch along a known order): reads start at once for up to ``prefetch_budget`` bytes,
        and each ``get`` of a prefetched handle (served from its copy) starts the next ones. At
        most ``prefetch_budget`` bytes are read ahead and not yet taken (at least one tensor). A
        new call replaces the order and drops read-ahead copies of handles not in it; ``free``
        drops a handle's copy. Never blocks on a transfer."""
        check_many(handles, "RemoteStore.prefetch(handles)", "RemoteHandles", RemoteHandle)
        limit = parse_size(prefetch_budget, name="prefetch_budget", allow_zero=False)
        for i, h in enumerate(handles):
            _check_handle(h, f"prefetch(handles[{i}])")
        with self._lock:
            self._check_open()
            for h in handles:
                self._check_live(h)
            pf = self._prefetch
            keep = {h.id for h in handles}
            for hid in [i for i in pf.ahead if i not in keep]:
                del pf.ahead[hid]
            pf.order = collections.deque(h for h in handles if h.nbytes and h.id not in pf.ahead)
            pf.window = limit
        self._refill()

    def _refill(self) -> None:
        """Start read-aheads from the order while they fit the window."""
        with self._lock:
            if self.closed:
                return
            pf = self._prefetch
            used = sum(n for n, _ in list(pf.ahead.values()))
            start = []
            while pf.order:
                h = pf.order[0]
                if self._live.get(h.id) is not h or h.id in pf.ahead:
                    pf.order.popleft()  # freed, or already read ahead
                    continue
                if (used or start) and used + h.nbytes > pf.window:
                    break
                pf.order.popleft()
                used += h.nbytes
                # in `ahead` before the lock is released: a get from now on takes this read
                # (else it would read on its own, and this copy would be left in `ahead` for good)
                fut = running()
                pf.ahead[h.id] = (h.nbytes, fut)
                start.append((h, self._where([h]), fut))
            self.stats.prefetched += len(start)
        for h, where, fut in start:
            try:
                self._read([h], [_landing(h, None)], where, single=True, done=fut)
            except BaseException as exc:  # (closed meanwhile): a get that took it must not hang
                fut.set_exception(exc)

    def free(self, handle: RemoteHandle) -> None:
        """Give a tensor's memory back. Never blocks (safe in finalizers and callbacks); a handle
        on a lost node is freed the same way. After ``close()`` it is a no-op. The object of a
        :meth:`put_many` batch is freed with the last of its handles."""
        _check_handle(handle, "free(handle)")
        if self.closed:
            return
        self._unlive(handle)
        self._prefetch.ahead.pop(handle.id, None)  # its read-ahead copy, if any
        nbytes = _stored(handle.nbytes)
        if handle.batch >= 0:
            nbytes = 0
            batch = self._pool.batches.get(handle.batch)
            if batch is not None:
                batch[0].discard(handle.id)
                # the last member out frees the object; pop() picks one of two racing frees
                if not batch[0] and self._pool.batches.pop(handle.batch, None) is not None:
                    self._pool.refs.pop(handle.batch, None)
                    nbytes = batch[1]
        else:
            self._pool.refs.pop(handle.id, None)  # Ray frees the object (dict.pop: atomic)
        self._freed.append((handle.node, nbytes, 1))
        self._drain_soon()

    @property
    def nodes(self) -> list[str]:
        """Ray node ids of the memory nodes that are not lost."""
        return [n.node_id for n in self._pool.nodes.values() if not n.lost]

    def close(self) -> None:
        """Wait for running transfers (each ends within ``timeout``), drop every object, end the
        memory-node actors."""
        self._finalizer()
        self._live.clear()
        self._prefetch.ahead.clear()
        self._prefetch.order.clear()

    def __repr__(self) -> str:
        return (
            f"RemoteStore(nodes={len(self.nodes)}, live={len(self._live)}, "
            f"used={format_size(self.stats.used_bytes)} of "
            f"{format_size(self.stats.budget_bytes)})"
        )

    # ---------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("RemoteStore is closed")
        self._check_session()

    def _check_session(self) -> None:
        if _session() != self._session:  # else the next Ray call would quietly ray.init() again
            raise ClosedError(
                "RemoteStore: Ray was shut down (ray.shutdown()) since this store was made, and "
                "its memory nodes and every tensor they held went with it; close this store "
                "before ray.shutdown(), and make a new one after ray.init()"
            )

    def _submit_call(self, fn: Callable[[], Any], done: Future) -> None:
        """Run ``fn`` on the I/O thread; ``done`` gets its result or its exception."""

        def job() -> None:
            try:
                result = fn()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(result)

        self._submit(job, done)

    def _submit(self, job, done: Future) -> None:
        def cancelled(f: Future) -> None:  # close() dropped the queued job: fail, never hang
            if f.cancelled() and not done.done():
                done.set_exception(ClosedError("RemoteStore was closed before this transfer ran"))

        try:
            self._executor.submit(job).add_done_callback(cancelled)
        except RuntimeError as exc:  # executor shut down under us
            raise ClosedError("RemoteStore is closed") from exc
