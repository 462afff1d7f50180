"""The replica holder actor's class, in a module that imports neither torch nor tensortier.

Why a module of its own: Ray ships an actor's class to a fresh worker process on the replica
node. Pickled by reference (the default for an importable class), that worker had to import
``tensortier``, and with it torch, before it could answer the first call: measured on a 2-core
machine, a holder was ready after 2.1-3.7 s that way and after 0.7-0.8 s without the import, and
that start-up is the first replica push's extra time. :func:`holder_class` has Ray pickle this
module by value, so the worker imports only Ray and numpy (and needs no tensortier installed).

Never import tensortier (or torch) here; ``tests/checkpoint/test_replicas.py`` checks that the
holder's worker never loads them. What the holder keeps and why it owns its objects:
``_replica.py``.
"""

from __future__ import annotations

import sys

import numpy as np
import ray


class Holder:
    """The actor on a replica node (a plain class; :func:`holder_class` wraps it). Holds one
    replica: the files of one checkpoint step, each a flat uint8 object it owns."""

    def __init__(self, root: str):
        self.root = root
        self._reset(None, b"", {})

    def _reset(self, step, manifest: bytes, files: dict) -> None:
        self.step, self.manifest, self.expected = step, manifest, dict(files)
        self.refs: dict[str, object] = {}  # dropping a ref frees its object (we own it)
        self.complete = False

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def begin(self, step: int, manifest: bytes, files: dict) -> bool:
        self._reset(step, bytes(manifest), files)
        return True

    def put(self, step: int, name: str, payload) -> int:
        if step != self.step or name not in self.expected:
            raise ValueError(f"unexpected file {name!r} of step {step} (holding step {self.step})")
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
            raise TypeError(f"a replica holds flat uint8 arrays only, got {type(payload)}")
        if payload.nbytes != self.expected[name]:
            raise ValueError(f"{name}: {payload.nbytes} bytes, expected {self.expected[name]}")
        self.refs[name] = ray.put(payload)  # owned by this (detached) actor, on this node
        return payload.nbytes

    def commit(self, step: int) -> bool:
        if step != self.step or set(self.refs) != set(self.expected):
            return False
        self.complete = True
        return True

    def describe(self) -> dict:
        return {
            "root": self.root,
            "step": self.step,
            "complete": self.complete,
            "manifest": self.manifest,
            "files": dict(self.expected),
            "node": self.node_id(),
        }

    def fetch(self, step: int) -> dict:
        """References to the files of ``step`` (nested in a dict: the caller borrows them)."""
        if not self.complete or step != self.step:
            return {}
        return {name: [ref] for name, ref in self.refs.items()}


def holder_class():
    """``ray.remote(Holder)``, pickled by value so the holder's worker never imports tensortier."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # idempotent
    return ray.remote(Holder)
