"""`python -m benchmarks tiers --remote`: the remote tier against Ray's own transfer of one object.

A Ray cluster of two simulated nodes on this machine (``ray.cluster_utils.Cluster``, under a
private temporary directory): the driver's node and one memory node. Limits, Ray's own path for
one large object: put = ``ray.put`` on the driver, then an actor on the other node ``ray.get``s
it; get = an object made on the other node, ``ray.get`` by the driver. The tier: ``RemoteStore``
put and get of the same bytes (best of ``repeat``, bytes checked).

Also in the same run: small tensors (256 of 16 KiB) put and read one call each against one
``put_many``/``get_many``; a consumer reading 16 tensors in order and waiting for
each, without and with ``prefetch``; and the peer the issue names, Ray's own object spilling to
disk on the driver's node (``ray.put`` beyond the object store's capacity: each put spills
older objects; restore: ``ray.get`` of spilled objects). On one machine with free RAM Ray's spill
files sit in the page cache, so that peer measures memory copies more than a disk.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np
import torch

from benchmarks._common import two_ray_nodes
from tensortier.tiers.remote import RemoteStore


def remote_bandwidth(nbytes: int, repeat: int) -> tuple[list[dict], bool]:
    import ray

    store_bytes = max(2 * nbytes + (64 << 20), 96 << 20)  # Ray needs at least 75 MiB
    with two_ray_nodes(store_bytes) as (node, peer, tmp):
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
        # room for the small-tensor rows too: 256 objects padded to MIN_OBJECT (26 MiB)
        with RemoteStore(max(nbytes, 32 << 20), nodes=[node.node_id], timeout=120) as store:
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
            small, ok_small = _small_tensors(store, nbytes, repeat)
            ahead, ok_ahead = _prefetch(store, data, repeat)
        spill = _ray_spilling(ray, arr, store_bytes, repeat, tmp)
        rows = [
            {"path": "host->remote ray.put + remote ray.get (limit)", "gbps": ray_put_gbps},
            {"path": "host->remote (tensortier)", "gbps": put_gbps},
            {"path": "remote->host ray.get (limit)", "gbps": ray_get_gbps},
            {"path": "remote->host (tensortier)", "gbps": get_gbps},
        ]
        for row, limit in zip(rows, [ray_put_gbps, ray_put_gbps, ray_get_gbps, ray_get_gbps]):
            row["bytes"] = nbytes
            row["ratio_vs_limit"] = row["gbps"] / limit
        for row in spill:  # the remote tier against Ray's spilling: ratio = tier / spilling
            tier = put_gbps if row["path"].startswith("host->") else get_gbps
            row["remote_vs_spilling"] = tier / row["gbps"]
        return rows + spill + small + ahead, ok and ok_small and ok_ahead


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _small_tensors(store: RemoteStore, nbytes: int, repeat: int) -> tuple[list[dict], bool]:
    """256 tensors of 16 KiB: one put/get call each (all in flight at once) against one
    put_many / get_many. (One call each also pays the padding to ``MIN_OBJECT`` per tensor.)"""
    count, each = 256, 16 << 10
    data = [torch.randint(0, 255, (each,), dtype=torch.uint8) for _ in range(count)]
    total = each * count
    ok = True

    def one_by_one_put() -> list:
        return [f.result() for f in [store.put(t) for t in data]]

    def free(hs) -> None:
        for h in hs:
            store.free(h)

    held: list = []
    put_one = _best(lambda: held.append(one_by_one_put()) or free(held.pop()), repeat)
    put_many = _best(lambda: held.append(store.put_many(data).result()) or free(held.pop()), repeat)
    got: list = []

    def fresh_get(put, get) -> float:  # fresh objects: a second read would hit Ray's local copy
        times = []
        for _ in range(repeat):
            hs = put()
            t0 = time.perf_counter()
            got.append(get(hs))
            times.append(time.perf_counter() - t0)
            free(hs)
        return min(times)

    get_one = fresh_get(one_by_one_put, lambda hs: [f.result() for f in map(store.get, hs)])
    ok = ok and all(torch.equal(a, b) for a, b in zip(got[-1], data))
    get_many = fresh_get(
        lambda: store.put_many(data).result(), lambda hs: store.get_many(hs).result()
    )
    ok = ok and all(torch.equal(a, b) for a, b in zip(got[-1], data))
    rows = [
        {"path": f"host->remote {count} x {each} B, put each", "gbps": total / put_one / 1e9},
        {"path": f"host->remote {count} x {each} B, put_many", "gbps": total / put_many / 1e9},
        {"path": f"remote->host {count} x {each} B, get each", "gbps": total / get_one / 1e9},
        {"path": f"remote->host {count} x {each} B, get_many", "gbps": total / get_many / 1e9},
    ]
    for row, base in zip(rows, [put_one, put_one, get_one, get_one]):
        row["bytes"] = total
        row["speedup_vs_each"] = base / (total / row["gbps"] / 1e9)
    return rows, ok


def _prefetch(store: RemoteStore, data: torch.Tensor, repeat: int) -> tuple[list[dict], bool]:
    """A consumer reads 16 tensors in order, waiting for each and then computing on it (a sleep
    of 4 ms per 4 MiB, as if it consumed 1 GB/s): without and with prefetch."""
    parts = list(data.chunk(16))
    ok = True
    compute = parts[0].numel() / 1e9  # seconds per tensor

    def consume(prefetch: bool) -> float:
        nonlocal ok
        hs = [store.write(p) for p in parts]  # fresh: no copy cached on this node yet
        t0 = time.perf_counter()
        if prefetch:
            store.prefetch(hs, prefetch_budget=data.numel() // 4)
        backs = []
        for h in hs:
            backs.append(store.read(h))
            time.sleep(compute)
        seconds = time.perf_counter() - t0
        ok = ok and all(torch.equal(a, b) for a, b in zip(backs, parts))
        for h in hs:
            store.free(h)
        return seconds

    plain = min(consume(False) for _ in range(repeat))
    ahead = min(consume(True) for _ in range(repeat))
    rows = [
        {
            "path": "remote->host 16 reads in order + compute, no prefetch",
            "gbps": data.numel() / plain / 1e9,
        },
        {
            "path": "remote->host 16 reads in order + compute, prefetch",
            "gbps": data.numel() / ahead / 1e9,
        },
    ]
    for row in rows:
        row["bytes"] = data.numel()
        row["speedup_vs_each"] = plain / (data.numel() / row["gbps"] / 1e9)
    return rows, ok


def _ray_spilling(ray, arr: np.ndarray, store_bytes: int, repeat: int, tmp: str) -> list[dict]:
    """Ray's object spilling on the driver's node: ``repeat`` puts beyond the object store's
    capacity (each makes Ray spill older objects to disk), then gets of the ``repeat`` oldest
    objects (spilled, restored from disk). Totals, not best-of: Ray spills in batches, so one put
    may pay for the next ones. ``spilled_files``: files Ray wrote under its spill directory."""
    nbytes = arr.nbytes
    refs = [ray.put(arr) for _ in range(store_bytes // nbytes + 1)]  # full: spilling from here
    t0 = time.perf_counter()
    for _ in range(repeat):
        refs.append(ray.put(arr))
    put_seconds = time.perf_counter() - t0
    spilled = sum(1 for p in pathlib.Path(tmp).rglob("*") if p.is_file() and "spilled" in str(p))
    t0 = time.perf_counter()
    for ref in refs[:repeat]:
        got = ray.get(ref, timeout=120)
        np.copyto(np.empty_like(got), got)
        del got
    get_seconds = time.perf_counter() - t0
    del refs
    return [
        {
            "path": "host->disk Ray object spilling (ray.put beyond capacity)",
            "gbps": repeat * nbytes / put_seconds / 1e9,
            "bytes": repeat * nbytes,
            "spilled_files": spilled,
        },
        {
            "path": "disk->host Ray restore (ray.get of spilled objects)",
            "gbps": repeat * nbytes / get_seconds / 1e9,
            "bytes": repeat * nbytes,
        },
    ]
