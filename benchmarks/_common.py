"""Shared plumbing for benchmark scripts: the environment row, the JSON file, worker processes,
a one-node and a two-node Ray cluster on this machine.

The table printer lives in the library (:func:`tensortier._units.print_table`): ``tensortier
plan`` prints its tables too, and nothing in ``src`` may import ``benchmarks``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from tensortier._device import device_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
# the peers' distributions whose versions a result names (those installed)
PEER_PACKAGES = (
    "numpy", "deepspeed", "datasets", "pyarrow", "lmdb", "ray", "torchrl", "tensordict",
    "gymnasium",
)  # fmt: skip


def versions() -> dict:
    """What produced a result: tensortier's version and commit (``-dirty`` with uncommitted
    edits), and the version of every installed peer, read from its metadata (nothing imported)."""
    import tensortier

    out = {"tensortier": getattr(tensortier, "__version__", "unknown")}
    try:
        git = ["git", "-C", ROOT]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)  # fmt: skip
        if head.returncode == 0:
            out["commit"] = head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:  # no git: the version alone
        pass
    for name in PEER_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def environment() -> dict:
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
    }


class PeakRSS:
    """This process's peak RSS, exact: the kernel's high-water mark (``VmHWM``), reset on demand
    through ``/proc/self/clear_refs``. Every area measures peaks this way, so variants compare.

    Why not a thread sampling RSS every few ms: it misses peaks shorter than its period (or
    while it waits for the GIL). Why not ``ru_maxrss``: it cannot be reset, and a child started
    by vfork + exec inherits its parent's high-water mark in it.
    """

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    def reset(self) -> int:
        """Lowers the high-water mark to the RSS now, and returns that RSS."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self._status("VmRSS")

    def peak(self) -> int:
        """The highest RSS since the last :meth:`reset` (or the process's start)."""
        return self._status("VmHWM")


def child_env(**extra: str) -> dict:
    """This process's environment for a worker ``python -m benchmarks.X``, plus ``extra``.

    Why: ``benchmarks`` is a plain folder of the repository, not an installed package, so a
    worker finds it only through ``PYTHONPATH``, from any working directory; the worker also
    imports the same ``tensortier`` as this process (a checkout's ``src`` before an install).
    """
    import tensortier

    src = os.path.dirname(os.path.dirname(os.path.abspath(tensortier.__file__)))
    path = [ROOT, src, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def write_json(path: str | None, benchmark: str, rows: list[dict], **extra) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"benchmark": benchmark, "env": environment(), **extra, "rows": rows}, f, indent=2
        )
    print(f"wrote {path}")


class RayPeer:
    """An actor for the other node of :func:`two_ray_nodes`: Ray's own transfer, the limit."""

    def pull(self, boxed: list) -> int:
        import ray

        return int(ray.get(boxed[0]).nbytes)  # the bytes land in this node's object store

    def make(self, n: int):
        import numpy as np

        return np.ones(n, np.uint8)


@contextlib.contextmanager
def two_ray_nodes(object_store_memory: int) -> Iterator[tuple[Any, Any, str]]:
    """``(node, peer, tmp)``: a Ray cluster of two simulated nodes on this machine, the driver's (no
    CPUs) and one other ``node``, each with ``object_store_memory`` bytes of object store, and a
    :class:`RayPeer` pinned to that node; ``ray.init`` connected; ``tmp`` is Ray's directory.

    Why here: the remote tier's and the checkpoint replicas' benchmarks need the same cluster,
    under a private ``RAY_TMPDIR`` (so sessions never share Ray's sockets and spill files), and
    the same teardown, which restores ``RAY_TMPDIR`` and removes the directory."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    tmp = tempfile.mkdtemp(prefix="tt-ray-bench-")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": object_store_memory,
                "include_dashboard": False,
            },
        )
        node = cluster.add_node(num_cpus=0, object_store_memory=object_store_memory)
        ray.init(address=cluster.address, log_to_driver=False)
        there = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        peer = ray.remote(RayPeer).options(num_cpus=0, scheduling_strategy=there).remote()
        yield node, peer, tmp
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def one_ray_node(num_cpus: int) -> Iterator[Any]:
    """``ray``, initialised as one local node of ``num_cpus`` CPUs under a private ``/tmp`` dir.

    Why here: the replay benchmark's Ray and sharded sections start the same node and tear it
    down the same way, the directory removed even when the section fails."""
    import ray

    tmp = tempfile.mkdtemp(prefix="tt-ray-", dir="/tmp")
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _temp_dir=tmp,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
