"""`tensortier bench tiers --remote`: the remote tier against Ray's own transfer of one object.

A Ray cluster of two simulated nodes on this machine (``ray.cluster_utils.Cluster``, under a
private temporary directory): the driver's node and one memory node. Limits, Ray's own path for
one large object: put = ``ray.put`` on the driver, then an actor on the other node ``ray.get``s
it; get = an object made on the other node, ``ray.get`` by the driver. The tier: ``RemoteStore``
put and get of the same bytes (best of ``repeat``, bytes checked).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import torch

from tensortier.tiers.remote import RemoteStore


class _Peer:
    """An actor on the memory node: pulls a driver object there, or makes one there."""

    def pull(self, boxed: list) -> int:
        import ray

        return int(ray.get(boxed[0]).nbytes)  # the bytes land in this node's object store

    def make(self, n: int):
        return np.ones(n, np.uint8)


def remote_bandwidth(nbytes: int, repeat: int) -> tuple[list[dict], bool]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    tmp = tempfile.mkdtemp(prefix="tt-ray-bench-")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    store_bytes = max(2 * nbytes + (64 << 20), 96 << 20)  # Ray needs at least 75 MiB
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": store_bytes,
                "include_dashboard": False,
            },
        )
        node = cluster.add_node(num_cpus=0, object_store_memory=store_bytes)
        ray.init(address=cluster.address, log_to_driver=False)
        there = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        peer = ray.remote(_Peer).options(num_cpus=0, scheduling_strategy=there).remote()
        data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        arr = data.numpy()

        def best(fn) -> float:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return nbytes / min(times) / 1e9

        def ray_put() -> None:
            ref = ray.put(arr)
            ray.get(peer.pull.remote([ref]), timeout=120)
            del ref

        def ray_get() -> None:
            ref = peer.make.remote(nbytes)
            ray.wait([ref], fetch_local=False, timeout=120)
            t0 = time.perf_counter()
            got = ray.get(ref, timeout=120)
            out = np.empty_like(got)
            np.copyto(out, got)  # the tier returns writable memory of its own: same work
            timings.append(time.perf_counter() - t0)
            del got, ref

        timings: list[float] = []
        ray_put_gbps = best(ray_put)
        for _ in range(repeat):
            ray_get()
        ray_get_gbps = nbytes / min(timings) / 1e9

        ok = True
        with RemoteStore(nbytes, nodes=[node.node_id], timeout=120) as store:
            handles = []
            put_gbps = best(lambda: handles.append(store.write(data)) or store.free(handles[-1]))
            timings.clear()
            for _ in range(repeat):  # a fresh handle each time: a second read of one object
                h = store.write(data)  # would hit the copy Ray keeps on this node after the first
                t0 = time.perf_counter()
                back = store.read(h)
                timings.append(time.perf_counter() - t0)
                ok = ok and torch.equal(back, data)
                store.free(h)
            get_gbps = nbytes / min(timings) / 1e9
        rows = [
            {"path": "host->remote ray.put + remote ray.get (limit)", "gbps": ray_put_gbps},
            {"path": "host->remote (tensortier)", "gbps": put_gbps},
            {"path": "remote->host ray.get (limit)", "gbps": ray_get_gbps},
            {"path": "remote->host (tensortier)", "gbps": get_gbps},
        ]
        for row, limit in zip(rows, [ray_put_gbps, ray_put_gbps, ray_get_gbps, ray_get_gbps]):
            row["bytes"] = nbytes
            row["ratio_vs_limit"] = row["gbps"] / limit
        return rows, ok
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)
