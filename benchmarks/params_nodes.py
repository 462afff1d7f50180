"""Parameters across nodes: publish-to-all-readers latency and object-store copies per node.

A local Ray cluster of simulated nodes (``ray.cluster_utils.Cluster``: a head with no CPUs, where
the publisher runs, and two worker nodes, each with its own object store of a set size). Three
readers, two on the first worker node and one on the second, wait for the next version; the time
from just before ``publish`` until the last reader has its tensors and has read one byte of every
4 KiB page is the latency. Paths, same run, same readers:

- ``serve(ParamStore)``: one ``ray.put`` per version; each node pulls it once; readers get
  copy-on-write views of their node's copy (``rl/param_nodes.py``).
- ``main: shared views``: the same object, read as main did before (``torch.from_numpy`` of Ray's
  arrays: views of the node's shared copy that a writing reader would change for all).
- ``per reader: argument``: the weights passed to each reader as a call argument
  (``reader.set_weights.remote(state)``), so Ray stores one object per reader.

Copies per node are measured, not assumed: the growth of each node's object-store file (pages
touched, in units of the payload size) while the first version reaches the readers, on a fresh
cluster per path and size (2-3 nodes' start-up each, so the whole run takes minutes).
Run: ``python -m benchmarks.params_nodes --json benchmarks/results/params-nodes-cpu.json``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch

from benchmarks import _harness as harness
from benchmarks._common import write_json
from tensortier._units import format_size, parse_size, print_table

READERS_PER_NODE = (2, 1)  # readers on the first and the second worker node
_saved_tmpdir: list[str | None] = []  # RAY_TMPDIR before start_cluster, restored by stop_cluster


def plasma_bytes() -> dict[str, int]:
    """Bytes each alive node's object store has touched (its file's allocated pages), by node id.

    A high-water mark (the store reuses freed space), read from the raylet that runs the store:
    tmpfs allocates a page when it is first written, so a second copy of an object shows up as
    twice the growth. Linux only; missing nodes are left out.
    """
    import ray

    out = {}
    raylets = {}
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"raylet" in cmd:
            raylets[path.split("/")[2]] = set(cmd.split(b"\0"))
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        sock = node["ObjectStoreSocketName"].encode()
        # exact arguments: one node's socket name can be a prefix of another's (plasma_store.1)
        args = {sock, b"--store_socket_name=" + sock}
        files = {}  # the raylet may hold one file through several descriptors: count it once
        for pid, cmd in raylets.items():
            if not args & cmd:
                continue
            for fd in glob.glob(f"/proc/{pid}/fd/*"):
                try:
                    if os.path.basename(os.readlink(fd)).startswith("plasma"):
                        st = os.stat(fd)
                        files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
                except OSError:
                    continue
        if files:
            out[node["NodeID"]] = sum(files.values())
    return out


def primary_bytes() -> dict[str, int]:
    """Bytes of primary copies each alive node's object store holds, as Ray accounts them.

    Ray charges an object to its ``object_store_memory`` resource on the node where it was put
    (pulled copies are not charged), so this is live usage, freed objects excluded.
    """
    import ray
    from ray._private import state

    total = {
        n["NodeID"]: n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"]
    }
    free = state.available_resources_per_node()
    return {n: int(t - free.get(n, {}).get("object_store_memory", 0)) for n, t in total.items()}


def start_cluster(store_bytes: int, head_store_bytes: int, system_config: dict | None = None):
    """(cluster, [worker node ids], private RAY_TMPDIR): head without CPUs + two worker nodes."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="tt-ray-")  # short: Ray's socket paths must stay < 108 bytes
    _saved_tmpdir.append(os.environ.get("RAY_TMPDIR"))
    os.environ["RAY_TMPDIR"] = tmp
    head = {"num_cpus": 0, "object_store_memory": head_store_bytes, "include_dashboard": False}
    if system_config:
        head["_system_config"] = system_config
    c = Cluster(initialize_head=True, head_node_args=head)
    nodes = [c.add_node(num_cpus=1, object_store_memory=store_bytes) for _ in READERS_PER_NODE]
    ray.init(address=c.address, log_to_driver=False)
    return c, [n.node_id for n in nodes], tmp


def stop_cluster(c, tmp: str) -> None:
    import ray

    ray.shutdown()
    c.shutdown()
    old = _saved_tmpdir.pop() if _saved_tmpdir else None
    if old is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old
    shutil.rmtree(tmp, ignore_errors=True)


def _touch(tensors) -> list[float]:
    """Reads one byte of every page of ``tensors``; their first float32 values, whatever their
    dtype (main's and the argument path's are raw bytes), which say the version that arrived:
    :func:`_state` fills each tensor with the version plus its place."""
    firsts = []
    for t in tensors:
        if t.numel():
            raw = t.reshape(-1).view(torch.uint8)
            float(raw[::4096].sum())  # one byte of every page
            firsts.append(float(raw[:4].view(torch.float32)[0]))
    return firsts


def _is_version(firsts: list[float], version: int) -> bool:
    """Whether a reader's first values are those of :func:`_state` at ``version``."""
    return firsts == [float(version + i) for i in range(4)]


class Reader:
    """A reader actor (wrapped by ``ray.remote`` at run time); keeps the version it read last."""

    def __init__(self):
        self.held = None

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def read(self, store, version: int, mode: str) -> tuple[float, list[float]]:
        import ray

        if mode == "cow":
            p = store.get(min_version=version, timeout=600)
            tensors = list(p.values())
        else:  # main's reader: ray.get and torch.from_numpy of the read-only arrays
            _, boxed = store._wait(version, 600)
            p = ray.get(boxed[0])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                tensors = [torch.from_numpy(a) for a in p[1:]]
        firsts = _touch(tensors)
        self.held = p
        return time.monotonic(), firsts

    def set_weights(self, payload) -> tuple[float, list[float]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensors = [torch.from_numpy(a) for a in payload[1:]]
        firsts = _touch(tensors)
        self.held = payload
        return time.monotonic(), firsts

    def drop(self) -> None:
        self.held = None


def _state(nbytes: int, version: int) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // 4 // 4)
    return {f"layer{i}.weight": torch.full((per,), float(version + i)) for i in range(4)}


def _path_rows(path: str, sizes: list[int], rounds: int, store: int, head_store: int) -> list:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Pin

    from tensortier.rl import ParamStore, param_nodes, serve

    c, workers, tmp = start_cluster(store, head_store)
    rows = []
    try:
        head = ray.get_runtime_context().get_node_id()
        actor_cls = ray.remote(num_cpus=0)(Reader)
        readers = [
            actor_cls.options(scheduling_strategy=Pin(node, soft=False)).remote()
            for node, k in zip(workers, READERS_PER_NODE)
            for _ in range(k)
        ]
        ray.get([r.node.remote() for r in readers], timeout=300)
        pstore = serve(ParamStore(), scheduling_strategy=Pin(head, soft=False))
        version = 0
        for nbytes in sizes:
            lat, copies, intact = [], {}, True
            for i in range(rounds + 1):  # round 0 warms up (and is the one counted for copies)
                before = plasma_bytes()
                if path == "per reader: argument":
                    payload = param_nodes.encode(_state(nbytes, i))
                    t0 = time.monotonic()
                    done = ray.get([r.set_weights.remote(payload) for r in readers], timeout=600)
                    del payload
                else:
                    pending = [
                        r.read.remote(
                            pstore, version + 1, "cow" if path.startswith("serve") else "main"
                        )
                        for r in readers
                    ]
                    time.sleep(0.5)  # every reader is waiting in get()
                    state = _state(nbytes, i)
                    t0 = time.monotonic()
                    version = pstore.publish(state)
                    done = ray.get(pending, timeout=600)
                lat.append(max(t for t, _ in done) - t0)
                intact = intact and all(_is_version(firsts, i) for _, firsts in done)
                if i == 0:
                    after = plasma_bytes()
                    real = sum(t.numel() * 4 for t in _state(nbytes, 0).values())
                    copies = {
                        "head" if n == head else f"node{workers.index(n) + 1}": round(
                            (after.get(n, 0) - before.get(n, 0)) / real, 2
                        )
                        for n in [head, *workers]
                    }
            rows.append(
                {
                    "section": "params-nodes",
                    "peer": path,
                    "bytes": real,
                    "readers": f"{READERS_PER_NODE[0]}+{READERS_PER_NODE[1]} on 2 nodes",
                    "latency_s": min(lat[1:]),
                    "latency_median_s": statistics.median(lat[1:]),
                    "copies_per_node": copies,
                    "intact": intact,  # every reader read the version just published
                }
            )
            print(f"  {path}: {format_size(real)} -> {min(lat[1:]):.3f} s, copies {copies}")
            ray.get([r.drop.remote() for r in readers], timeout=60)
        pstore.close()
    finally:
        stop_cluster(c, tmp)
    return rows


PATHS = ("serve(ParamStore)", "main: shared views", "per reader: argument")


def section(sizes: list[int], rounds: int = 2, paths=PATHS) -> list[dict]:
    """Rows for ``python -m benchmarks replay`` (and this module's ``main``): a fresh cluster per path
    and size, so each copy count starts from empty object stores (a store reuses freed space, and
    its touched pages are what is counted)."""
    rows = []
    for path in paths:
        for nbytes in sizes:
            store = max(256 << 20, 4 * nbytes + (64 << 20))  # node: 2 readers x (held + new)
            try:
                rows += _path_rows(path, [nbytes], rounds, store, store)  # head: keep=2 + new
            except Exception as exc:  # reported, not hidden
                rows.append({"section": "params-nodes", "peer": path, "error": repr(exc)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="5MB,50MB,500MB", help="comma list of parameter sizes")
    p.add_argument("--rounds", type=int, default=3, help="timed publishes per size (+1 warm-up)")
    p.add_argument("--json", default=None)
    p.add_argument("--quiet-wait", type=float, default=harness.QUIET_WAIT_S)
    p.add_argument("--quiet-load", type=float, default=None)
    args = p.parse_args(argv)
    sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",")]
    # best of --rounds inside one cluster per path: the load envelope only (as tiers --remote)
    session = harness.Session("params-nodes", 1, args.quiet_wait, args.quiet_load)
    with session:
        rows = section(sizes, args.rounds)
    measurement = session.report({})
    print_table(
        rows, ["peer", "bytes", "latency_s", "latency_median_s", "copies_per_node", "error"]
    )
    write_json(
        args.json,
        "params-nodes",
        rows,
        measurement=measurement,
        settings={"sizes": sizes, "rounds": args.rounds, "readers": list(READERS_PER_NODE)},
    )
    print(harness.summary_line(measurement))
    harness.require(checks(rows))


def checks(rows: list[dict]) -> dict[str, bool]:
    """Per path and size, whether every reader read the version just published (a stale or
    torn one would make its latency meaningless), for :func:`harness.require`."""
    name = "params-nodes {} {}: every reader read the version just published"
    return {
        name.format(r["peer"], format_size(r["bytes"])): r["intact"] for r in rows if "intact" in r
    }


if __name__ == "__main__":
    main()
