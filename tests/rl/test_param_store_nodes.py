"""serve(ParamStore) across nodes: a local Ray cluster of a head (no CPUs) and two worker nodes.

Readers: two on the first worker node, one on the second. Payloads are >= 1 MiB where a test needs
the object store (Ray inlines smaller objects into the reply).
"""

import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Pin  # noqa: E402

from benchmarks.params_nodes import (  # noqa: E402
    plasma_bytes,
    primary_bytes,
    start_cluster,
    stop_cluster,
)  # noqa: E402
from tensortier.errors import CorruptDataError  # noqa: E402
from tensortier.rl import ParamStore, param_nodes, serve  # noqa: E402

_MB = 1 << 20
_T = 60  # seconds any one wait in these tests may take


def _raw(t: torch.Tensor) -> tuple[str, tuple, bytes]:
    return (
        str(t.dtype),
        tuple(t.shape),
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
    )


def _where(t: torch.Tensor) -> tuple[str, int, int] | None:
    """(file inode, file offset, private kB) of the mapping under ``t``'s first byte, here.

    Private kB (smaps ``Anonymous``): pages this process copied; 0 means every page of the mapping
    is still the file's, shared with every other process that maps it.
    """
    addr = t.data_ptr()
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and ":" not in parts[0]:  # a mapping's header line
                if found is not None:
                    break
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    found = (parts[4], int(parts[2], 16) + (addr - lo))
            elif found is not None and parts[0] == "Anonymous:":
                return (*found, int(parts[1]))
    return None


@ray.remote(num_cpus=0)
class Reader:
    def __init__(self):
        self.held = {}

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get(self, store, version: int, timeout: float = _T, raw: bool = True):
        """(version, shared, {name: raw bytes} if raw) or the error's type name.

        Measuring tests pass raw=False: returned bytes would be objects in the stores too.
        """
        try:
            p = store.get(min_version=version, timeout=timeout)
        except Exception as exc:  # the type is what the tests check
            return type(exc).__name__
        self.held[p.version] = p
        return p.version, p.shared, {k: _raw(t) for k, t in p.items()} if raw else None

    def held_raw(self, version: int):
        return {k: _raw(t) for k, t in self.held[version].items()}

    def where(self, version: int, name: str):
        return _where(self.held[version][name])

    def write(self, version: int, name: str, value: float) -> None:
        self.held[version][name].fill_(value)

    def drop(self) -> None:
        self.held.clear()

    def globals_unpickled_by_get(self, store, version: int) -> list[str]:
        """Every global a pickle stream names while this reader gets ``version``."""
        import io
        import pickle

        import ray.cloudpickle as cp

        seen = []

        class Recorder(pickle.Unpickler):
            def find_class(self, module, name):
                seen.append(f"{module}.{name}")
                return super().find_class(module, name)

        def loads(data, *, buffers=None, **_):
            return Recorder(io.BytesIO(data), buffers=buffers).load()

        old = cp.loads
        cp.loads = loads
        try:
            p = store.get(min_version=version, timeout=_T)
        finally:
            cp.loads = old
        assert p.version == version
        return seen


@ray.remote(num_cpus=0)
class Publisher:
    def publish(self, store, value: float) -> int:
        return store.publish({"w": torch.full((_MB // 4,), value)})


@pytest.fixture(scope="module")
def cluster():
    c, workers, tmp = start_cluster(96 * _MB, 96 * _MB)
    try:
        head = ray.get_runtime_context().get_node_id()
        readers = [
            Reader.options(scheduling_strategy=Pin(node, soft=False)).remote()
            for node in (workers[0], workers[0], workers[1])
        ]
        assert ray.get([r.node.remote() for r in readers], timeout=120) == [
            workers[0],
            workers[0],
            workers[1],
        ]
        yield head, workers, readers
    finally:
        stop_cluster(c, tmp)


@pytest.fixture
def store(cluster):
    head, _, readers = cluster
    s = serve(ParamStore(keep=2), scheduling_strategy=Pin(head, soft=False))
    try:
        yield s
    finally:
        ray.get([r.drop.remote() for r in readers], timeout=_T)
        s.close()


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    base = torch.randn(6, 8, generator=g)
    return {
        "big": torch.randn(_MB // 4, generator=g),  # 1 MiB: in the object store, not inlined
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "i64": (base * 5e9).to(torch.int64),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "scalar": torch.tensor(float(version)),
        "empty": torch.empty(0, 5),
        "transposed": base.t(),
    }


def test_one_copy_per_node_shared_by_its_readers(cluster, store):
    head, workers, readers = cluster
    size = 16 * _MB  # runs first: larger than any space an earlier object could have freed
    before = plasma_bytes()
    store.publish({"w": torch.ones(size // 4)})
    got = ray.get([r.get.remote(store, 1, _T, False) for r in readers], timeout=_T)
    assert got == [(1, True, None)] * 3
    grown = {n: (plasma_bytes()[n] - before[n]) / size for n in (head, *workers)}
    # the publisher's copy on the head, then one per node: 2 readers on workers[0] share one
    assert 0.9 < grown[head] < 1.5, grown
    assert 0.9 < grown[workers[0]] < 1.5, grown
    assert 0.9 < grown[workers[1]] < 1.5, grown
    _, boxed = store._wait(1, _T)
    where = ray.experimental.get_object_locations(boxed)[boxed[0]]["node_ids"]
    assert sorted(where) == sorted([head, *workers])  # Ray's own count: one copy on each node
    pages = ray.get([r.where.remote(1, "w") for r in readers], timeout=_T)
    assert pages[0] == pages[1]  # the same file and offset, no page copied: the same memory
    assert pages[0][2] == 0 and pages[2][2] == 0, pages
    assert pages[2][0] != pages[0][0]  # the other node's store is another file


def test_readers_on_two_nodes_see_every_version_bit_exactly(cluster, store):
    _, _, readers = cluster
    for v in (1, 2, 3):
        waiting = [r.get.remote(store, v) for r in readers]  # asked before it is published
        sd = _state(v)
        assert store.publish(sd) == v
        want = {k: _raw(t) for k, t in sd.items()}
        for got in ray.get(waiting, timeout=_T):
            assert got == (v, True, want)  # newest version, zero-copy, same bytes
    assert ray.get(readers[2].get.remote(store, 9, 0.5), timeout=_T) == "TimeoutError"


def test_a_reader_writing_into_its_tensors_changes_only_its_own_pages(cluster, store):
    _, _, readers = cluster
    store.publish({"w": torch.ones(_MB // 4)})
    ray.get([r.get.remote(store, 1) for r in readers], timeout=_T)
    ray.get(readers[0].write.remote(1, "w", 123.0), timeout=_T)
    ones = _raw(torch.ones(_MB // 4))
    mine, other = ray.get([r.where.remote(1, "w") for r in readers[:2]], timeout=_T)
    assert mine[2] >= _MB // 1024 and other[2] == 0  # the writer's pages became its own
    assert ray.get(readers[0].held_raw.remote(1), timeout=_T)["w"] == _raw(
        torch.full((_MB // 4,), 123.0)
    )
    assert ray.get(readers[1].held_raw.remote(1), timeout=_T)["w"] == ones  # same node
    assert ray.get(readers[0].get.remote(store, 1), timeout=_T)[2]["w"] == ones  # a fresh get


def test_old_versions_are_freed_and_held_ones_stay_intact(cluster, store):
    head, _, readers = cluster
    size = 2 * _MB
    store.publish({"w": torch.full((size // 4,), 1.0)})
    first = ray.get(readers[0].get.remote(store, 1), timeout=_T)[2]
    for v in range(2, 31):
        assert store.publish({"w": torch.full((size // 4,), float(v))}) == v
        if v % 5 == 0:  # readers on both nodes follow along, dropping what they held
            ray.get([r.drop.remote() for r in readers[1:]], timeout=_T)
            ray.get([r.get.remote(store, v, _T, False) for r in readers[1:]], timeout=_T)
    # 30 versions published from the head; it holds keep=2, plus v1 (held by a reader) and
    # v30 (held by two): a leak would hold ~30
    deadline = time.monotonic() + _T  # Ray reports resource usage every few hundred ms
    while (held := primary_bytes()[head] / size) > 3.5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 2.5 < held < 3.5, held
    assert ray.get(readers[0].held_raw.remote(1), timeout=_T) == first  # held: never reused
    ray.get(readers[0].drop.remote(), timeout=_T)
    while (held := primary_bytes()[head] / size) > 2.5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 1.5 < held < 2.5, held  # dropped by its last reader: freed


def test_a_dead_publisher_gives_readers_a_typed_error_and_held_params_stay(cluster, store):
    head, _, readers = cluster
    pub = Publisher.options(scheduling_strategy=Pin(head, soft=False)).remote()
    assert ray.get(pub.publish.remote(store, 7.0), timeout=_T) == 1
    held = ray.get(readers[0].get.remote(store, 1), timeout=_T)[2]
    ray.kill(pub, no_restart=True)
    # its objects died with it (Ray removed ray.put(_owner=)): on a node without a copy of
    # version 1, a typed error within the timeout
    assert ray.get(readers[2].get.remote(store, 1, 20.0), timeout=_T) == "ClosedError"
    for v in range(2, 6):  # a live publisher carries on; the store reuses freed space
        assert store.publish({"w": torch.full((_MB // 4,), float(v))}) == v
    assert ray.get(readers[2].get.remote(store, 5), timeout=_T)[0] == 5
    assert ray.get(readers[0].held_raw.remote(1), timeout=_T) == held


def test_a_reader_unpickles_nothing_but_arrays_and_refs(cluster, store):
    _, _, readers = cluster
    store.publish(_state(1))
    seen = ray.get(readers[2].globals_unpickled_by_get.remote(store, 1), timeout=_T)
    assert seen and all(g.startswith(("numpy.", "ray.")) for g in seen), seen


def test_payloads_are_checked_and_copied_where_no_mapping_can_be_made():
    sd = _state(4)
    payload = param_nodes.encode(sd)
    assert all(a.dtype == np.uint8 and a.ndim == 1 for a in payload)
    tensors, shared = param_nodes.views(payload, None, 4)  # heap arrays: no shared mapping
    assert not shared and {k: _raw(t) for k, t in tensors.items()} == {
        k: _raw(t) for k, t in sd.items()
    }
    tensors["big"].fill_(0)  # a private copy
    assert payload[1][:4].tobytes() == _raw(sd["big"])[2][:4]
    bad = [payload[0], payload[1].view(np.int8), *payload[2:]]
    odd = np.frombuffer(b'{"magic": "tt-params-1", "tensors": [["w", "float32"]]}', np.uint8)
    for wrong in (
        {"w": 1},
        [],
        bad,
        [np.frombuffer(b"{}", np.uint8)],
        payload[:-1],
        [odd, payload[1]],
    ):
        with pytest.raises(CorruptDataError):
            param_nodes.views(wrong, None, 4)


def test_any_tensor_local_publish_takes_travels_through_serve_bit_exactly():
    """serve(ParamStore).publish encoded tensors by hand and raised RuntimeError on a one-element
    view with stride != 1, which ParamStore.publish takes; both now encode through as_bytes."""
    wide = torch.randn(4, 6, dtype=torch.bfloat16)
    sd = {
        "scale": torch.arange(2.0)[::2],  # one element, stride 2
        "wt": wide.t(),  # transposed bf16
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "neg": torch.randn(2, 2, dtype=torch.complex64).conj().imag,  # a negative view
        "empty": torch.empty(0, 5)[:, ::2],
        "step": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
    }
    tensors, _ = param_nodes.views(param_nodes.encode(sd), None, 1)
    with ParamStore() as local:
        published = local.get(local.publish(sd))
        for name, t in sd.items():
            want = t.resolve_conj().resolve_neg()
            for got in (tensors[name], published[name]):
                assert got.dtype == t.dtype and got.shape == t.shape, name
                assert torch.equal(got, want), name
