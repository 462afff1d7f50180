"""In-memory replicas of the newest checkpoint on other Ray nodes (Gemini-style fast recovery).

Where the bytes live, and why they outlive the writer. Each replica node runs one *detached*,
named holder actor per checkpoint directory (namespace ``tensortier-ckpt-<sha256(dir)[:16]>``,
name ``replica-<node id>``), pinned to its node. The writer sends it the committed checkpoint's
files (the safetensors shard images, raw bytes) and the manifest's bytes; the holder copies each
shard into its node's object store with its own ``ray.put``, so the objects are *owned by the
holder*, not by the writer. Ray frees an object when its owner dies: objects the writer put
itself would vanish with the writer's process, while the holder (detached: it is not tied to the
writer's job) and its objects live on until the directory's next replica replaces them, someone
calls :func:`drop_replicas`, or the node dies. A reader in a new process finds the holders by
their namespace, borrows the object references from them and fetches the bytes straight from the
replica node's object store. The holder's class lives in ``_holder.py`` and reaches its worker by
value, so that worker never imports torch (its start-up is what the first push waits for).

Protocol per checkpoint (run by the persist thread, after the disk commit): ``begin(step,
manifest, files)`` drops the previous replica (older than the disk's newest by then, so never
useful again) and records what is expected; ``put`` stores each file; ``commit`` marks the replica
complete only when every expected file arrived with its exact size (the disk format's "manifest
last" rule). A writer killed in between leaves an incomplete replica, which readers ignore.

Restore uses a replica only when it is complete, of the step the disk's newest checkpoint has,
its manifest equals the disk's manifest byte for byte after canonical encoding, and every tensor
matches the manifest's CRC32C. Anything else is a fallback to disk with a reason. Payloads are
raw bytes and JSON written by us; nothing is unpickled but Ray's own control messages. Every wait
on an actor call or an object is bounded by ``timeout`` seconds (GCS look-ups such as
``get_actor`` have no timeout argument and rely on Ray's own GCS RPC timeouts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tensortier._ray import require_ray
from tensortier._units import check_int
from tensortier.checkpoint._format import Shard, canonical, crc, parse_manifest
from tensortier.checkpoint._tree import dtype_from_name
from tensortier.errors import ConfigError, CorruptDataError

log = logging.getLogger("tensortier.checkpoint")
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


def namespace(root: str) -> str:
    """The Ray namespace of a checkpoint directory's holders (its absolute path, hashed)."""
    return "tensortier-ckpt-" + hashlib.sha256(root.encode()).hexdigest()[:16]


@dataclass
class Found:
    """A verified replica: the tensors of the manifest, and where they came from."""

    tensors: dict[str, torch.Tensor]
    node: str
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, see _Laps


class _Laps:
    """Seconds per phase of one push or restore, so a slow one says where its time went
    (``CheckpointStats.last_replica_phases`` / ``last_replica_restore_phases``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.monotonic()

    def lap(self, phase: str) -> None:
        """Add the time since the previous lap to ``phase``."""
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._t
        self._t = now


class Fallback(Exception):
    """Why restore did not use a replica (the reason is the message)."""


def check_replicas(replicas: object, many_ranks: bool) -> int:
    replicas = check_int(
        replicas,
        f"replicas={replicas!r}: pass 0 (disk only), 1 or 2 (other nodes that keep the newest "
        f"checkpoint in RAM)",
        minimum=0,
        maximum=2,
    )
    if replicas and many_ranks:
        raise ConfigError(
            f"replicas={replicas}: in-memory replicas are supported for one process only, not a "
            f"process group; pass replicas=0"
        )
    return replicas


class Replicas:
    """The writer's side: pushes each committed checkpoint to ``count`` other nodes' holders."""

    def __init__(self, root: str, count: int, timeout: float):
        ray = require_ray("Checkpointer(replicas=...)")
        if not ray.is_initialized():
            raise ConfigError(
                f"replicas={count} needs a Ray cluster: call ray.init(address=...) before "
                f"creating the Checkpointer, or pass replicas=0"
            )
        self.root, self.count, self.timeout = root, count, timeout
        self.last_phases: dict[str, float] = {}  # the newest push's, see _Laps
        self.namespace = namespace(root)
        others = self._other_nodes(ray)
        if len(others) < count:
            raise ConfigError(
                f"replicas={count} needs {count} alive Ray nodes besides this one, but the "
                f"cluster has {len(others)}; add nodes or pass replicas={len(others)}"
            )

    @staticmethod
    def _other_nodes(ray) -> dict[str, float]:
        here = ray.get_runtime_context().get_node_id()
        return {
            n["NodeID"]: n.get("Resources", {}).get("object_store_memory", 0.0)
            for n in ray.nodes()
            if n.get("Alive") and n["NodeID"] != here
        }

    def _holder(self, ray, node_id: str):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from tensortier.checkpoint._holder import holder_class  # imports Ray: only when used

        return (
            holder_class()
            .options(
                name=f"replica-{node_id}",
                namespace=self.namespace,
                lifetime="detached",  # survives the writer's job: that is the point
                get_if_exists=True,
                num_cpus=0,
                max_restarts=0,
                max_concurrency=1,  # calls run in the order one caller sent them
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(self.root)
        )

    def push(self, step: int, manifest: bytes, shards: list[Shard], images: list) -> list[str]:
        """Send the committed checkpoint ``step`` to ``count`` nodes; returns the nodes that
        hold it complete. Raises on any failure (the caller counts it; the disk copy stands)."""
        from tensortier.checkpoint import _faults

        ray = require_ray("Checkpointer(replicas=...)")
        laps = _Laps()
        self.last_phases = laps.phases
        others = self._other_nodes(ray)
        need = sum(s.file_bytes for s in shards)
        held = {h["node"]: h for h in _describe_all(ray, self.namespace, self.timeout)[0]}
        fits = [n for n, store in others.items() if store >= need]
        # nodes that already hold this directory's replica first (their old one is replaced)
        chosen = sorted(fits, key=lambda n: (n not in held, n))[: self.count]
        if len(chosen) < self.count:
            raise RuntimeError(
                f"only {len(chosen)} of the {len(others)} other nodes have an object store of "
                f">= {need} bytes for a replica; {self.count} wanted"
            )
        for node in set(held) - set(chosen):  # a stale replica elsewhere: free it
            _kill(ray, f"replica-{node}", self.namespace)
        holders = [self._holder(ray, n) for n in chosen]
        files = {s.file: s.file_bytes for s in shards}
        laps.lap("choose")  # nodes, the holders there, stale replicas freed
        wait = [h.begin.remote(step, manifest, files) for h in holders]
        _get(ray, wait, self.timeout, "begin")
        laps.lap("start")  # holders ready: a new holder's worker start-up is here
        inflight: list[list] = []  # two files on the wire at most: bounded object-store use
        for shard, image in zip(shards, images):
            # one copy into this node's object store, read by every holder (a payload passed
            # to each call would be serialized, i.e. copied, once per holder)
            payload = ray.put(image[: shard.file_bytes].numpy())
            inflight.append([h.put.remote(step, shard.file, payload) for h in holders])
            del payload  # the calls keep it until they ran
            if len(inflight) > 1:
                _get(ray, inflight.pop(0), self.timeout, "put")
        for refs in inflight:
            _get(ray, refs, self.timeout, "put")
        laps.lap("send")  # into this node's object store, over the wire, into the holders'
        _faults.point("replica-sent")
        ok = _get(ray, [h.commit.remote(step) for h in holders], self.timeout, "commit")
        laps.lap("commit")
        if not all(ok):
            raise RuntimeError(f"a replica holder refused to commit step {step} on {chosen}")
        return chosen


def _get(ray, refs: list, timeout: float, what: str) -> list:
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"replica {what} did not finish within {timeout:g}s") from exc


def _kill(ray, name: str, ns: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=ns))
    except Exception as exc:  # gone already
        log.debug("replica %s/%s: %s", ns, name, exc)


def _describe_all(ray, ns: str, timeout: float) -> tuple[list[dict], list[str]]:
    """(descriptions of the live holders of namespace ``ns``, problems with the others)."""
    found, problems = [], []
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == ns
    ]
    calls = []
    for name in names:
        try:
            calls.append((name, ray.get_actor(name, namespace=ns).describe.remote()))
        except Exception as exc:  # the name went away in between
            problems.append(f"{name}: {type(exc).__name__}")
    deadline = time.monotonic() + timeout
    for name, ref in calls:
        try:
            found.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01)))
        except ray.exceptions.GetTimeoutError:
            problems.append(f"{name}: no answer within {timeout:g}s (node lost?)")
        except Exception as exc:  # ActorDiedError, node gone
            problems.append(f"{name}: {type(exc).__name__} (holder or its node lost)")
    return found, problems


def drop_replicas(directory: str, timeout: float = 30.0) -> int:
    """Free every in-memory replica of ``directory``'s checkpoints; returns how many were found."""
    import os

    ray = require_ray("Checkpointer(replicas=...)")
    if not ray.is_initialized():
        return 0
    ns = namespace(os.path.abspath(os.fspath(directory)))
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == ns
    ]
    for name in names:
        _kill(ray, name, ns)
    return len(names)


def load(root: str, body: dict, timeout: float) -> Found:
    """The tensors of the disk manifest ``body`` from a verified replica, or :class:`Fallback`."""
    ray = require_ray("Checkpointer(replicas=...)")
    if not ray.is_initialized():
        raise Fallback("Ray is not initialized in this process (ray.init(address=...) first)")
    step = body["step"]
    laps = _Laps()
    holders, problems = _describe_all(ray, namespace(root), timeout)
    complete = [h for h in holders if h.get("complete")]
    same = [h for h in complete if h.get("step") == step]
    if not same:
        seen = [
            f"node {h.get('node')}: step {h.get('step')}"
            + ("" if h.get("complete") else " (incomplete)")
            for h in holders
        ]
        if not holders and not problems:
            raise Fallback(
                "no replica found (no live holder for this directory: none was pushed, it was "
                "dropped, or its node was lost)"
            )
        raise Fallback(
            f"no complete replica of step {step} (the disk's newest): " + "; ".join(seen + problems)
        )
    reasons = list(problems)
    for h in same:
        try:
            return _load_one(ray, root, body, h, timeout, laps)
        except (Fallback, CorruptDataError) as exc:
            reasons.append(f"node {h.get('node')}: {exc}")
    raise Fallback("; ".join(reasons))


def _load_one(ray, root: str, body: dict, holder: dict, timeout: float, laps: _Laps) -> Found:
    node = holder["node"]
    where = f"replica on node {node}"
    replica_body = parse_manifest(holder["manifest"], where)
    if canonical(replica_body) != canonical(body):
        raise Fallback("its manifest differs from the disk checkpoint's")
    files = holder["files"]
    if set(files) != set(body.get("files", ())):
        raise Fallback("its files differ from the manifest's")
    laps.lap("find")  # the holders, their descriptions, the manifests compared
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(deadline - time.monotonic(), 0.01)

    out: dict[str, torch.Tensor] = {}
    try:
        actor = ray.get_actor(f"replica-{node}", namespace=namespace(root))
        refs = ray.get(actor.fetch.remote(body["step"]), timeout=timeout)
        if set(refs) != set(files):
            raise Fallback("it was replaced or dropped while being read")
        # every file is pulled at once; each is checked and copied out as soon as it landed,
        # while the others are still on the wire, and its object-store copy released
        pending = {refs[name][0]: name for name in files}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left())
            if not ready:
                raise Fallback(f"its bytes did not arrive within {timeout:g}s")
            name = pending.pop(ready[0])
            buf = ray.get(ready[0], timeout=left())
            laps.lap("fetch")  # blocked until the bytes were in this node's object store
            try:
                file_tensors(body, name, buf, where, out)
            finally:
                del buf  # a read-only view of the object store
            laps.lap("copy_verify")  # copied out of the object store, CRC32C checked
    except ray.exceptions.GetTimeoutError as exc:
        raise Fallback(f"its bytes did not arrive within {timeout:g}s") from exc
    except (Fallback, CorruptDataError):
        raise
    except Exception as exc:  # ActorDiedError, ObjectLostError, ...: the node or holder is gone
        raise Fallback(f"{type(exc).__name__}: holder or node lost while reading") from exc
    missing = set(body["tensors"]) - set(out)
    if missing:
        raise CorruptDataError(f"tensors {sorted(missing)[:5]} not in the replica", path=where)
    return Found(out, node, laps.phases)


def _header(buf: np.ndarray, file: str, where: str) -> tuple[dict, int]:
    """(safetensors header, start of its data section) of a shard's bytes."""
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < 8:
        raise CorruptDataError(f"{file}: not a shard", path=where)
    n = int.from_bytes(buf[:8].tobytes(), "little")
    if n > min(_MAX_HEADER, buf.nbytes - 8):
        raise CorruptDataError(f"{file}: header length {n} out of bounds", path=where)
    try:
        header = json.loads(buf[8 : 8 + n].tobytes())
    except (ValueError, RecursionError) as exc:
        raise CorruptDataError(f"{file}: bad header ({exc})", path=where) from exc
    if not isinstance(header, dict):
        raise CorruptDataError(f"{file}: bad header", path=where)
    return header, 8 + n


def file_tensors(
    body: dict, file: str, buf: np.ndarray, where: str, out: dict[str, torch.Tensor]
) -> None:
    """Add to ``out`` every tensor the manifest places in ``file``, copied out of the file's
    bytes ``buf`` and CRC-checked (the in-memory twin of ``_format.read_tensors``)."""
    header, start = _header(buf, file, where)
    for name, info in body["tensors"].items():
        if not isinstance(info, dict):
            raise CorruptDataError(f"tensor {name!r}: bad manifest entry", path=where)
        if info.get("file") != file:
            continue
        entry = header.get(name)
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        nbytes = info.get("nbytes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
            or start + offsets[1] > buf.nbytes
            or offsets[1] - offsets[0] != nbytes
        ):
            raise CorruptDataError(f"tensor {name!r}: bad entry in {file}", path=where)
        dtype = dtype_from_name(info.get("dtype"))
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CorruptDataError(f"tensor {name!r}: bad shape", path=where)
        raw = torch.empty(nbytes, dtype=torch.uint8)  # owned: the state may be changed in place
        if nbytes:
            np.copyto(raw.numpy(), buf[start + offsets[0] : start + offsets[1]])
        if crc(raw) != info.get("crc32c"):
            raise CorruptDataError(f"tensor {name!r}: checksum mismatch", path=where)
        try:
            out[name] = (
                raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
            )
        except RuntimeError as exc:
            raise CorruptDataError(f"tensor {name!r}: {exc}", path=where) from exc


__all__ = ["Fallback", "Found", "Replicas", "drop_replicas", "load", "namespace"]
