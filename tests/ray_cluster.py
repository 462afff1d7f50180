"""A Ray cluster of simulated nodes on this machine for tests (``ray.cluster_utils.Cluster``).

One per test module (a module-scoped fixture calls :func:`local_cluster`): a head node (the
driver's node, no CPUs unless asked) and ``workers`` nodes, everything Ray writes (sessions, logs,
sockets, spilled objects) under a private temporary directory that is removed at the end, and fast
health checks so a removed node is found dead in about a second instead of ~15 s. Every test
module that needs a cluster of simulated nodes starts it here (issue 26: it was rebuilt in three).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

STORE = 96 << 20  # object store of each simulated node (Ray needs at least 75 MiB)
ROOT = pathlib.Path(__file__).resolve().parents[1]  # this checkout
FAST_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 2,
}


@dataclass
class LocalCluster:
    cluster: object  # ray.cluster_utils.Cluster
    workers: list[str]  # node ids of the worker nodes
    tmp: str  # RAY_TMPDIR of this cluster
    nodes: list = field(default_factory=list)  # the worker nodes' handles (``remove_node``)


@contextlib.contextmanager
def local_cluster(
    workers: int = 2,
    store: int = STORE,
    *,
    cpus: int = 0,
    resources: dict | None = None,
    checkout_path: bool = False,
) -> Iterator[LocalCluster]:
    """A started cluster with the driver connected; ``cpus`` per node (head included),
    ``resources`` per worker node. ``checkout_path``: ``PYTHONPATH`` names this checkout's
    ``src`` and root while it runs, so the nodes' workers and child processes import this
    checkout's tensortier and tests."""
    import ray
    from ray.cluster_utils import Cluster

    # A short private directory: Ray's socket paths under it must stay below 108 bytes.
    tmp = tempfile.mkdtemp(prefix="tt-ray-")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "PYTHONPATH")}
    os.environ["RAY_TMPDIR"] = tmp
    if checkout_path:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    c = None
    try:
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": cpus,
                "object_store_memory": store,
                "include_dashboard": False,
                "_system_config": FAST_DEATH,
            },
        )
        extra = {} if resources is None else {"resources": resources}
        nodes = [
            c.add_node(num_cpus=cpus, object_store_memory=store, **extra) for _ in range(workers)
        ]
        ray.init(address=c.address, log_to_driver=False)
        yield LocalCluster(c, [n.node_id for n in nodes], tmp, nodes)
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
