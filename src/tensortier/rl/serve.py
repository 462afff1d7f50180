"""Run a replay buffer, memory bank or parameter store as a Ray actor shared by many processes.

Ray is the transport (no home-made RPC): ``serve`` starts an actor that owns the store; the handle it
returns is picklable, so collectors in Ray tasks/actors on any node add and sample through it.
Collectors encode items to blobs on their side and the learner decodes sampled blobs on its side, so
the actor only moves bytes and updates indexes. A parameter store publishes each version with one
``ray.put``; readers get that object (zero-copy from the object store on the same node).

Ray is imported here only when ``serve`` or a handle method runs, never by ``import tensortier``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tensortier.errors import ConfigError
from tensortier.rl import _codec
from tensortier.rl.memory_bank import MemoryBank
from tensortier.rl.param_store import Params, ParamStore
from tensortier.rl.replay import Batch, ReplayBuffer


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tt.rl.serve needs Ray: pip install 'tensortier[rl]' (or pip install ray)"
        ) from exc
    return ray


# ---------------------------------------------------------------------- actors (plain classes)
class _BufferActor:
    """Owns a ReplayBuffer or MemoryBank inside the actor process."""

    def __init__(self, kind: str, kwargs: dict, saved: str | None):
        if kind == "replay":
            self.obj = ReplayBuffer.load(saved, **kwargs) if saved else ReplayBuffer(**kwargs)
        else:
            self.obj = MemoryBank(**kwargs)

    def extend(self, blobs: list[bytes]) -> np.ndarray:
        if isinstance(self.obj, ReplayBuffer):
            return self.obj._extend_blobs(blobs)
        with self.obj._lock:
            return self.obj._store.add(blobs)[0]

    def sample(self, n: int):
        return self.obj._sample_blobs(n)

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

    def publish(self, boxed: list) -> int:
        with self.cond:
            self.version += 1
            self.refs[self.version] = boxed[0]  # boxed: Ray passes the ref itself, not its value
            for v in [v for v in self.refs if v <= self.version - self.keep]:
                del self.refs[v]  # Ray frees the object once no reader holds it
            self.cond.notify_all()
            return self.version

    def get(self, min_version: int, timeout: float | None):
        with self.cond:
            if not self.cond.wait_for(lambda: self.version >= min_version, timeout):
                return self.version, None
            return self.version, [self.refs[self.version]]

    def latest(self) -> int:
        return self.version


# ---------------------------------------------------------------------- client handles
class RemoteReplayBuffer:
    """A ReplayBuffer (or MemoryBank) living in a Ray actor; picklable, so pass it to collectors."""

    def __init__(self, actor, kind: str):
        self.actor = actor
        self.kind = kind

    def _get(self, ref):
        return _ray().get(ref)

    def add(self, item: Any) -> int:
        return int(self.extend([item])[0])

    append = add

    def extend(self, items) -> np.ndarray:
        return self._get(self.actor.extend.remote([_codec.encode(it) for it in items]))

    def sample(self, batch_size: int) -> Batch:
        blobs, keys, weights = self._get(self.actor.sample.remote(int(batch_size)))
        items, collated = _codec.decode_batch(blobs)
        return Batch(items, keys, weights, collated)

    def update_priorities(self, indices, priorities) -> None:
        if hasattr(priorities, "detach"):
            priorities = priorities.detach().float().cpu().numpy()
        self._get(self.actor.update_priorities.remote(np.asarray(indices), np.asarray(priorities)))

    def __getitem__(self, index):
        single = isinstance(index, (int, np.integer))
        items = [_codec.decode(b) for b in self._get(self.actor.get_blobs.remote(index))]
        return items[0] if single else items

    def update(self, index: int, item: Any) -> None:
        self._get(self.actor.update.remote(int(index), _codec.encode(item)))

    __setitem__ = update

    def __delitem__(self, index) -> None:
        self._get(self.actor.delete.remote(index))

    def __len__(self) -> int:
        return self._get(self.actor.length.remote())

    @property
    def stats(self) -> dict:
        return self._get(self.actor.stats.remote())

    def save(self, dirname: str) -> None:
        self._get(self.actor.save.remote(os.fspath(dirname)))

    def close(self) -> None:
        """Close the store (deleting its spill files) and end the actor."""
        ray = _ray()
        try:
            ray.get(self.actor.close.remote())
        finally:
            ray.kill(self.actor)


class RemoteParamStore:
    """A parameter store behind a Ray actor: one ``ray.put`` per version, any number of readers."""

    def __init__(self, actor):
        self.actor = actor

    def publish(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        ray = _ray()
        payload = {}
        for name, t in state_dict.items():
            t = t.detach().cpu().contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _codec._TORCH_DTYPES:
                raise TypeError(f"publish: {name!r} has unsupported dtype {t.dtype}")
            payload[name] = (dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy())
        ref = ray.put(payload)  # once per version, shared by every reader
        return ray.get(self.actor.publish.remote([ref]))

    @property
    def version(self) -> int:
        return _ray().get(self.actor.latest.remote())

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        v, boxed = _ray().get(self.actor.get.remote(version, timeout))
        if boxed is None:
            raise TimeoutError(f"version {version} not published within {timeout}s (newest {v})")
        return v

    def get(self, min_version: int = 1, timeout: float | None = None) -> Params:
        """Newest version >= ``min_version``; tensors are read-only views of Ray's object store."""
        ray = _ray()
        v, boxed = ray.get(self.actor.get.remote(min_version, timeout))
        if boxed is None:
            raise TimeoutError(
                f"version {min_version} not published within {timeout}s (newest {v})"
            )
        payload = ray.get(boxed[0])
        tensors = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the object store is read-only
            for name, (dtype, shape, raw) in payload.items():
                t = torch.from_numpy(raw) if raw.size else torch.empty(0, dtype=torch.uint8)
                tensors[name] = t.view(_codec._TORCH_DTYPES[dtype]).reshape(shape)
        return Params(v, tensors)

    def close(self) -> None:
        _ray().kill(self.actor)


def serve(
    obj: ReplayBuffer | MemoryBank | ParamStore,
    *,
    num_cpus: float = 1,
    name: str | None = None,
    **actor_options: Any,
) -> RemoteReplayBuffer | RemoteParamStore:
    """Run a store like ``obj`` as a Ray actor and return a picklable handle to it.

    A ReplayBuffer's items, priorities and indices are carried over (through ``save``/``load`` on
    this machine) and ``obj`` stays usable and independent; a durable buffer is closed here and
    reopened by the actor from its directory. Extra ``actor_options`` go to
    ``ray.remote`` (e.g. ``resources``, ``scheduling_strategy``).
    """
    ray = _ray()
    opts = {"num_cpus": num_cpus, **actor_options}
    if name is not None:
        opts["name"] = name
    if isinstance(obj, ParamStore):
        actor = ray.remote(_ParamActor).options(max_concurrency=64, **opts).remote(obj.keep)
        return RemoteParamStore(actor)
    if isinstance(obj, ReplayBuffer):
        c = obj.config
        kwargs = {
            "capacity": c.capacity,
            "ram_budget": c.ram_budget,
            "spill_dir": c.spill_dir,
            "sampler": c.sampler,
            "max_uses": c.max_uses,
            "durable": c.durable,
            "seed": c.seed,
            "segment_size": c.segment_size,
        }
        saved = None
        if c.durable:
            obj.close()  # checkpointed; the actor reopens the same directory (one owner at a time)
        elif len(obj):
            saved = tempfile.mkdtemp(prefix="tt-serve-", dir=c.spill_dir)
            os.rmdir(saved)
            obj.save(saved)
            kwargs = {"ram_budget": c.ram_budget, "spill_dir": c.spill_dir, "seed": c.seed}
        actor = ray.remote(_BufferActor).options(**opts).remote("replay", kwargs, saved)
        handle = RemoteReplayBuffer(actor, "replay")
        if saved:
            len(handle)  # the actor has loaded the copy
            shutil.rmtree(saved, ignore_errors=True)
        return handle
    if isinstance(obj, MemoryBank):
        if len(obj):
            raise ConfigError("serve an empty MemoryBank (its items are not carried over)")
        s = obj._store
        kwargs = {
            "capacity": s.cap,
            "ram_budget": s.budget,
            "spill_dir": s._spill_dir,
            "segment_size": s.segment_size,
        }
        actor = ray.remote(_BufferActor).options(**opts).remote("bank", kwargs, None)
        return RemoteReplayBuffer(actor, "bank")
    raise ConfigError(
        f"serve takes a ReplayBuffer, MemoryBank or ParamStore, got {type(obj).__name__}"
    )
