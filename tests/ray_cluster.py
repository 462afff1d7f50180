"""A Ray cluster of simulated nodes on this machine for tests (``ray.cluster_utils.Cluster``).

A head node (the driver's node) and ``workers`` nodes, everything Ray writes (sessions, logs,
sockets, spilled objects) under a private temporary directory that is removed at the end, and fast
health checks so a removed node is found dead in about a second instead of ~15 s. Every test
module that needs a cluster of simulated nodes gets it here (issue 26: it was rebuilt in three).

Starting one costs 7-70 s on a 2-core machine, so the modules share one per test session
(:class:`SharedCluster`, the ``ray_nodes`` fixture of ``tests/conftest.py``; issue 27): each
module connects its driver for its own tests and disconnects after them, and finds the cluster as
new (the two worker nodes alive, nodes its predecessors added gone, no named actor left).
:func:`local_cluster` still starts a private one for a module that needs another shape.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
import time
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


# The shared cluster's node shape: what every module sharing it needs at once (rl/test_sharded:
# one CPU and a ``shard`` resource per worker node, a CPU on the head; the others ask for none).
SHARED_CPUS = 1
SHARED_RESOURCES = {"shard": 1}


class SharedCluster:
    """One cluster of simulated nodes for a whole test session (see the module docstring).

    Nodes start with ``PYTHONPATH`` naming this checkout (their workers import its tensortier
    and tests, as :func:`local_cluster`'s ``checkout_path`` gives a private one).
    """

    def __init__(self, workers: int = 2, store: int = STORE):
        from ray.cluster_utils import Cluster

        self.tmp = tempfile.mkdtemp(prefix="tt-ray-")
        self.store, self.workers = store, workers
        with _environ(RAY_TMPDIR=self.tmp, PYTHONPATH=_checkout_path()):
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": SHARED_CPUS,
                    "object_store_memory": store,
                    "include_dashboard": False,
                    "_system_config": FAST_DEATH,
                },
            )
            self.own = [self._add() for _ in range(workers)]

    def _add(self):
        return self.cluster.add_node(
            num_cpus=SHARED_CPUS, object_store_memory=self.store, resources=SHARED_RESOURCES
        )

    def _repair(self) -> None:
        """Back to the session's shape: nodes an earlier module added go, a worker node it
        removed (or that died) is replaced."""
        live = list(self.cluster.worker_nodes)
        for node in live:
            if node not in self.own or not node.remaining_processes_alive():
                self.cluster.remove_node(node, allow_graceful=False)
        self.own = [n for n in self.own if n in self.cluster.worker_nodes]
        if len(self.own) < self.workers:
            with _environ(RAY_TMPDIR=self.tmp, PYTHONPATH=_checkout_path()):
                self.own += [self._add() for _ in range(self.workers - len(self.own))]

    @contextlib.contextmanager
    def module(self, *, checkout_path: bool = False) -> Iterator[LocalCluster]:
        """The cluster for one module's tests: the driver connected while they run; named
        actors they left behind (detached ones outlive the driver) are ended after them."""
        import ray

        self._repair()
        extra = {"PYTHONPATH": _checkout_path()} if checkout_path else {}
        with _environ(RAY_TMPDIR=self.tmp, **extra):
            ray.init(address=self.cluster.address, log_to_driver=False)
            try:
                nodes = list(self.own)
                yield LocalCluster(self.cluster, [n.node_id for n in nodes], self.tmp, nodes)
            finally:
                if ray.is_initialized():
                    _end_named_actors()
                ray.shutdown()

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _end_named_actors() -> None:
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        except ValueError:  # gone meanwhile
            pass
    deadline = time.monotonic() + 10
    while ray.util.list_named_actors(all_namespaces=True) and time.monotonic() < deadline:
        time.sleep(0.1)


def _checkout_path() -> str:
    return os.pathsep.join([str(ROOT / "src"), str(ROOT)])


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cluster_fixture(*fields: str, checkout_path: bool = False):
    """A module-scoped ``cluster`` fixture on the session's shared cluster (``ray_nodes``): the
    :class:`LocalCluster`, or the tuple of its ``fields`` (``cluster = cluster_fixture("cluster",
    "nodes")``). ``checkout_path``: the nodes' workers import this checkout's tensortier."""
    import pytest

    @pytest.fixture(scope="module")
    def cluster(ray_nodes):
        with ray_nodes.module(checkout_path=checkout_path) as lc:
            yield tuple(getattr(lc, f) for f in fields) if fields else lc

    return cluster


def remote_store_fixture(budget: str):
    """A module-scoped ``store`` fixture: a ``RemoteStore`` of ``budget`` on the module's
    ``cluster`` fixture, closed after the module's tests (``store = remote_store_fixture(...)``)."""
    import pytest

    @pytest.fixture(scope="module")
    def store(cluster):
        from tensortier.tiers.remote import RemoteStore

        s = RemoteStore(budget, timeout=30)
        try:
            yield s
        finally:
            s.close()

    return store
