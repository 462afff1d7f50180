"""A Ray cluster of simulated nodes on this machine for tests (``ray.cluster_utils.Cluster``).

One per test module (a module-scoped fixture calls :func:`local_cluster`): a head node with no
CPUs (the driver's node) and ``workers`` nodes, everything Ray writes (sessions, logs, sockets,
spilled objects) under a private temporary directory that is removed at the end, and fast health
checks so a removed node is found dead in about a second instead of ~15 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

STORE = 96 << 20  # object store of each simulated node (Ray needs at least 75 MiB)
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


@contextlib.contextmanager
def local_cluster(workers: int = 2, store: int = STORE) -> Iterator[LocalCluster]:
    import ray
    from ray.cluster_utils import Cluster

    # A short private directory: Ray's socket paths under it must stay below 108 bytes.
    tmp = tempfile.mkdtemp(prefix="tt-ray-")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    c = None
    try:
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": store,
                "include_dashboard": False,
                "_system_config": FAST_DEATH,
            },
        )
        nodes = [c.add_node(num_cpus=0, object_store_memory=store) for _ in range(workers)]
        ray.init(address=c.address, log_to_driver=False)
        yield LocalCluster(c, [n.node_id for n in nodes], tmp)
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)
