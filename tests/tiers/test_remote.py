"""RemoteStore on a Ray cluster of simulated nodes on this machine (ray.cluster_utils.Cluster)."""

import pathlib
import threading
import warnings

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier._ray import end_actors  # noqa: E402
from tensortier.errors import ClosedError, ConfigError, NodeLostError, TierFullError  # noqa: E402
from tensortier.tiers.host import HostPool  # noqa: E402
from tensortier.tiers.remote import MIN_OBJECT, RemoteHandle, RemoteStore  # noqa: E402
from tensortier.transfer import HostTensor, Transfer, TransferEngine  # noqa: E402
from tests.ray_cluster import STORE as _STORE  # noqa: E402
from tests.ray_cluster import cluster_fixture, remote_store_fixture  # noqa: E402

cluster = cluster_fixture("cluster", "workers", "tmp")


store = remote_store_fixture("64MiB")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def _cases():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    yield "f32", base
    yield "f64", base.double()
    yield "f16", base.half()
    yield "bf16", base.bfloat16()
    yield "i8", (base * 50).to(torch.int8)
    yield "u8", (base * 50).abs().to(torch.uint8)
    yield "i16", (base * 500).to(torch.int16)
    yield "i32", (base * 5e5).to(torch.int32)
    yield "i64", (base * 5e9).to(torch.int64)
    yield "bool", base > 0
    yield "c64", torch.complex(base, -base)
    yield "c128", torch.complex(base, base * 2).to(torch.complex128)
    yield "transposed", base.t()
    yield "strided view", base[1::2, ::3]
    yield "expanded", torch.arange(4.0).expand(3, 4)
    yield "0-d", torch.tensor(3.5)
    yield "empty", torch.empty(0, 5)
    yield "conj", torch.complex(base, base).conj()
    yield "neg view", torch.complex(base, base).conj().imag
    yield "large", torch.randn(1 << 20, generator=g)  # 4 MiB: out of band, not inlined


@pytest.mark.parametrize("name,tensor", list(_cases()), ids=[n for n, _ in _cases()])
def test_round_trip_is_bit_identical(store, name, tensor):
    h = store.put(tensor).result(timeout=60)
    assert isinstance(h, RemoteHandle) and h in store
    back = store.get(h).result(timeout=60)
    expected = tensor.resolve_conj().resolve_neg()
    assert _same(back, expected), name
    if back.numel():  # writable memory of its own
        back.reshape(-1)[0] = back.reshape(-1)[-1]
    store.free(h)
    assert h not in store


def test_handles_spread_over_the_other_nodes(cluster, store):
    _, workers, _ = cluster
    assert sorted(store.nodes) == sorted(workers)  # not the driver's node
    hs = [store.write(torch.full((1 << 18,), float(i))) for i in range(4)]
    assert {h.node for h in hs} == set(workers)  # most-free-first alternates
    for i, h in enumerate(hs):
        assert torch.equal(store.read(h), torch.full((1 << 18,), float(i)))
        store.free(h)


def test_payloads_are_raw_bytes_not_pickles(store):
    t = torch.arange(1000, dtype=torch.int32).reshape(10, 100)
    h = store.write(t)
    raw = ray.get(store._pool.refs[h.id], timeout=30)
    # padded to MIN_OBJECT: a smaller object would be returned inline into this process
    assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.shape == (MIN_OBJECT,)
    assert bytes(raw[:4000]) == t.numpy().tobytes()
    # the memory node refuses anything but a flat uint8 array (no user objects)
    node = store._pool.nodes[h.node].actor
    with pytest.raises(ray.exceptions.RayTaskError, match="flat uint8"):
        ray.get(node.hold.options(num_returns=2).remote({"x": 1})[0], timeout=30)
    store.free(h)


def test_full_pool_raises_and_store_stays_usable(store):
    per_node = store.stats.budget_bytes // 2
    big = torch.zeros(per_node // 4 * 3, dtype=torch.uint8)  # 3/4 of one node: one per node
    a, b = store.write(big), store.write(big)
    assert a.node != b.node
    with pytest.raises(TierFullError, match="remote tier budget exceeded") as err:
        store.put(big)
    assert err.value.tier == "remote" and err.value.requested == big.numel()
    assert store.stats.used_bytes == 2 * big.numel()
    small = store.write(torch.ones(100))  # room left for small ones
    store.free(a)
    c = store.write(big)  # a's room is reusable at once
    assert torch.equal(store.read(c), big) and torch.equal(store.read(small), torch.ones(100))
    for h in (b, c, small):
        store.free(h)
    assert store.stats.used_bytes == 0 and len(store) == 0


def test_bad_arguments_are_typed(cluster, store):
    with pytest.raises(ConfigError, match="timeout"):
        RemoteStore("1MiB", timeout=0)
    with pytest.raises(ConfigError, match="object store"):
        RemoteStore(4 * _STORE)
    with pytest.raises(ConfigError, match="nodes="):
        RemoteStore("1MiB", nodes=["not-a-node"])
    with pytest.raises(TypeError, match="torch.Tensor"):
        store.put(b"bytes")
    with warnings.catch_warnings():  # the strided nested layout is a prototype
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"nested.*unbind"):  # was torch's reshape error
        store.put(nested)
    h = store.write(torch.ones(3))
    store.free(h)
    with pytest.raises(KeyError):
        store.get(h)
    with pytest.raises(KeyError):
        store.free(h)


def test_close_frees_everything_and_ends_the_actors(cluster):
    _, _, tmp = cluster
    # Fill 60% of both nodes' object stores, close, fill them again: had the first store left its
    # objects behind, the second would need 120% and Ray would spill to disk under tmp.
    chunk = torch.ones(4 << 20, dtype=torch.uint8)
    per_node = _STORE * 6 // 10 // chunk.numel() * chunk.numel()
    s = RemoteStore(2 * per_node, timeout=30)
    hs = [s.write(chunk) for _ in range(2 * per_node // chunk.numel())]
    refs = list(s._pool.refs.values())
    actors = [n.actor for n in s._pool.nodes.values()]
    del refs  # the test must not keep the objects alive itself
    s.close()
    assert s.closed and len(s) == 0 and not s._pool.refs
    again = RemoteStore(2 * per_node, timeout=30)
    try:
        for _ in hs:
            again.write(chunk)
        spilled = [
            p
            for p in pathlib.Path(tmp).rglob("*")
            if p.is_file() and any(part.startswith("ray_spilled_objects") for part in p.parts)
        ]
        assert not spilled, spilled
    finally:
        again.close()
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.node_id.remote(), timeout=30)
    with pytest.raises(ClosedError):
        s.put(torch.ones(1))
    with pytest.raises(ClosedError):
        s.get(hs[0])
    s.free(hs[0])  # no-op after close
    s.close()  # idempotent


def test_node_loss_fails_its_handles_naming_the_node(cluster):
    c, workers, _ = cluster
    doomed = c.add_node(num_cpus=0, object_store_memory=_STORE)
    s = RemoteStore("32MiB", nodes=[doomed.node_id, workers[0]], timeout=30)
    try:
        # large and small (below Ray's inline limit: must still live on the node, not here)
        data = [torch.randn(n) for n in (1 << 16, 10, 1 << 16, 10)]
        hs = [s.write(t) for t in data]
        small = [[torch.arange(k, k + 5) for k in range(3)] for _ in range(2)]
        batches = [s.put_many(ts).result(timeout=60) for ts in small]  # one on each node
        assert {b[0].node for b in batches} == {doomed.node_id, workers[0]}
        on_doomed = sorted((h for h in hs if h.node == doomed.node_id), key=lambda h: h.nbytes)
        assert on_doomed[0].nbytes == 40  # the first get, which finds the node lost: a small one
        kept = [(h, t) for h, t in zip(hs, data) if h.node != doomed.node_id]
        assert on_doomed and kept
        c.remove_node(doomed, allow_graceful=False)
        with pytest.raises(NodeLostError, match=doomed.node_id) as err:
            s.get(on_doomed[0]).result(timeout=60)
        assert err.value.node == doomed.node_id
        for h in on_doomed[1:]:  # known lost now: failed at once
            with pytest.raises(NodeLostError, match=doomed.node_id):
                s.get(h).result(timeout=5)
        with TransferEngine(host=HostPool("1MiB"), remote=s) as engine:  # through the engine
            with pytest.raises(NodeLostError, match=doomed.node_id):
                engine.from_store(on_doomed[-1], "remote", to="host").result(timeout=5)
            engine.synchronize(timeout=5)
        engine.host.close()
        for h, t in kept:
            assert torch.equal(s.read(h), t)
        for b, ts in zip(batches, small):
            if b[0].node == doomed.node_id:
                with pytest.raises(NodeLostError, match=doomed.node_id):
                    s.get_many(b).result(timeout=30)
                with pytest.raises(NodeLostError, match=doomed.node_id):
                    s.get(b[1]).result(timeout=30)
            else:
                assert all(torch.equal(x, t) for x, t in zip(s.get_many(b).result(timeout=30), ts))
        assert s.nodes == [workers[0]]
        assert s.stats.lost_nodes == 1 and s.stats.lost_tensors == len(on_doomed) + 3
        fresh = s.write(torch.arange(10))  # puts go to the surviving node
        assert fresh.node == workers[0] and torch.equal(s.read(fresh), torch.arange(10))
        for h in hs + [fresh] + batches[0] + batches[1]:
            s.free(h)
        assert s.stats.used_bytes == 0 and len(s) == 0
    finally:
        s.close()


def test_put_many_sends_one_object_and_frees_it_with_its_last_handle(store):
    tensors = [t for _, t in _cases() if t.numel() < 1000]  # every small dtype and layout
    before, batches = dict(store._pool.refs), store.stats.batches
    hs = store.put_many(tensors).result(timeout=60)
    assert store.stats.batches == batches + 1
    new = set(store._pool.refs) - set(before)
    assert len(new) == 1  # one object for the whole batch
    (key,) = new
    assert {h.key for h in hs if h.nbytes} == {key} and all(h in store for h in hs)
    raw = ray.get(store._pool.refs[key], timeout=30)  # raw bytes, not a pickle
    assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8
    stored = max(sum(h.nbytes for h in hs), MIN_OBJECT)
    assert raw.nbytes == stored
    del raw
    for h, t in zip(hs, tensors):  # one member at a time
        assert _same(store.get(h).result(timeout=60), t.resolve_conj().resolve_neg())
    backs = store.get_many(hs).result(timeout=60)  # all at once
    for back, t in zip(backs, tensors):
        assert _same(back, t.resolve_conj().resolve_neg())
    used = store.stats.used_bytes
    assert used >= stored
    for h in hs[:-1]:
        store.free(h)
        assert store.stats.used_bytes == used  # the object lives while a member does
    assert key in store._pool.refs
    store.free(hs[-1])
    assert key not in store._pool.refs and key not in store._pool.batches
    assert store.stats.used_bytes == used - stored
    with pytest.raises(KeyError):
        store.get_many(hs)


def test_put_many_full_pool_and_bad_arguments(store):
    per_node = store.stats.budget_bytes // 2
    used = store.stats.used_bytes
    half = torch.zeros(per_node // 2 + 1, dtype=torch.uint8)
    with pytest.raises(TierFullError, match="remote tier budget exceeded"):
        store.put_many([half, half])  # the batch goes whole to one node
    assert store.stats.used_bytes == used and len(store) == 0
    with pytest.raises(TypeError, match="put_many"):
        store.put_many(torch.ones(3))
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        store.put_many([torch.ones(3), "x"])
    assert store.put_many([]).result(timeout=5) == []
    with pytest.raises(TypeError, match="get_many"):
        store.get_many("x")


def test_prefetch_reads_ahead_within_the_window(store):
    data = [torch.full((1 << 16,), float(i)) for i in range(6)]  # 256 KiB each
    hs = [store.write(t) for t in data]
    gets = store.stats.gets
    store.prefetch(hs, prefetch_budget=2 * hs[0].nbytes)
    assert len(store._prefetch.ahead) == 2  # bounded in bytes
    assert store.stats.prefetched == 2
    for i, (h, t) in enumerate(zip(hs, data)):
        into = torch.empty(h.nbytes, dtype=torch.uint8) if i == 3 else None
        back = store.get(h, into=into).result(timeout=60)
        assert torch.equal(back, t)
        if into is not None:
            assert back.data_ptr() == into.data_ptr()
        assert len(store._prefetch.ahead) <= 2
    assert store.stats.prefetch_hits == 6 and store.stats.prefetched == 6
    assert store.stats.gets - gets == 6  # each tensor read once
    # a new order replaces the old one; free drops a read-ahead copy
    store.prefetch(hs[:3], prefetch_budget="1GiB")
    assert set(store._prefetch.ahead) == {h.id for h in hs[:3]}
    store.free(hs[0])
    assert hs[0].id not in store._prefetch.ahead
    with pytest.raises(KeyError):
        store.prefetch(hs[:1])
    with pytest.raises(ConfigError, match="prefetch_budget"):
        store.prefetch(hs[1:], prefetch_budget=0)
    for h in hs[1:]:
        store.free(h)
    assert not store._prefetch.ahead and store.stats.used_bytes == 0


# ---------------------------------------------------------------- through the TransferEngine
@pytest.fixture
def engine(store):
    with TransferEngine(host=HostPool("16MiB"), remote=store) as e:
        yield e
    e.host.close()


def test_engine_to_remote_and_back_is_bit_identical(store, engine):
    t = torch.randn(257, 3).t()  # non-contiguous
    f = engine.to_store(t, "remote")
    assert isinstance(f, Transfer)
    h = f.result(timeout=60)
    assert isinstance(h, RemoteHandle) and h in store
    back = engine.from_store(h, "remote", to="device", device="cpu").result(timeout=60)
    assert _same(back, t.contiguous())
    host = engine.from_store(h, "remote", to="host").result(timeout=60)
    assert isinstance(host, HostTensor) and _same(host.tensor, t.contiguous())
    host.free()
    back = engine.from_store(h, "remote", device="cpu", free=True).result(timeout=60)
    assert _same(back, t.contiguous()) and h not in store
    assert engine.stats.bytes["h2remote"] == h.nbytes and engine.stats.count["remote2h"] == 3
    # a host-pool tensor, freed once sent; an empty tensor
    staged = engine.to_host(torch.arange(100)).result(timeout=60)
    h2 = engine.to_store(staged, "remote", free=True).result(timeout=60)
    assert staged.block.freed and torch.equal(store.read(h2), torch.arange(100))
    e = engine.to_store(torch.empty(0, 4), "remote").result(timeout=60)
    assert engine.from_store(e, "remote", device="cpu", free=True).result(timeout=60).shape == (
        0,
        4,
    )
    store.free(h2)
    engine.synchronize(timeout=30)


def test_engine_remote_errors_are_typed(store, engine):
    big = torch.zeros(store.stats.budget_bytes, dtype=torch.uint8)
    with pytest.raises(TierFullError, match="remote"):
        engine.to_store(big, "remote")
    engine.synchronize(timeout=5)  # the throttle got its bytes back
    h = store.write(torch.ones(4))
    store.free(h)
    with pytest.raises(KeyError):
        engine.from_store(h, "remote")
    with pytest.raises(ConfigError, match="to must be"):
        engine.from_store(h, "remote", to="disk")
    bare = TransferEngine(host=HostPool("1MiB"))
    with bare, pytest.raises(ValueError, match="no remote tier"):
        bare.to_store(torch.ones(3), "remote")
    bare.host.close()
    engine.synchronize(timeout=5)


@pytest.mark.gpu
def test_engine_remote_round_trip_from_and_to_cuda(store):
    with TransferEngine(host=HostPool("16MiB", pin=True), remote=store, device="cuda") as e:
        x = torch.randn(1000, 33, device="cuda")
        h = e.to_store(x * 2, "remote").result(timeout=60)  # staged through a pinned block
        y = e.from_store(h, "remote", free=True).result(timeout=60)
        assert y.device.type == "cuda" and torch.equal(y, x * 2)
        e.synchronize(timeout=30)
    e.host.close()


def test_a_store_left_open_at_exit_does_not_reconnect_to_ray(cluster):
    """Issue 23 #4 (the README's RemoteStore block): at exit Ray's atexit shutdown runs before
    the store's finalizer, whose cleanup then connected to the cluster a second time and the
    exiting process died with SIGSEGV in about one run in ten (exit hooks run last registered
    first: tensortier imported before ray). The actors went with the driver anyway."""
    import os
    import subprocess
    import sys

    c, _, tmp = cluster
    code = (
        "import tensortier as tt\n"  # before ray: Ray's exit hook then runs first
        "import ray, torch\n"
        "ray.init(address='auto')\n"
        "pool = tt.tiers.RemoteStore(budget='64MiB')\n"
        "h = pool.put(torch.arange(100_000)).result()\n"
    )
    env = dict(os.environ, RAY_ADDRESS=c.address, RAY_TMPDIR=tmp)
    root = pathlib.Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Connected to Ray cluster") == 1, proc.stderr[-3000:]


def test_a_put_in_flight_to_a_node_found_lost_is_counted_once(cluster):
    """A get marks a node lost while a put reserved on it is queued: the put retries on the
    other node. stats.used_bytes used to drop the put's reservation with the node's bytes, then
    count the put again: 4 MiB low ("0B free ... 28MiB of 32MiB used")."""
    c, workers, _ = cluster
    doomed = c.add_node(num_cpus=0, object_store_memory=_STORE)
    # one I/O thread: the get's job runs before the put's, in the order they were called
    s = RemoteStore("32MiB", nodes=[workers[0], doomed.node_id], timeout=30, io_threads=1)
    try:
        kept = s.write(
            torch.randn(1 << 18)
        )  # 1 MiB on the first node: the doomed one has more room
        assert s.stats.used_bytes == 1 << 20
        gone = s.write(torch.randn(1 << 16))
        assert (kept.node, gone.node) == (workers[0], doomed.node_id)
        c.remove_node(doomed, allow_graceful=False)
        lost = s.get(gone)  # will find the node lost
        tensor = torch.randn(1 << 20)  # 4 MiB, reserved on the doomed node before the get fails
        put = s.put(tensor)
        with pytest.raises(NodeLostError, match=doomed.node_id):
            lost.result(timeout=60)
        moved = put.result(timeout=60)
        assert moved.node == workers[0] and torch.equal(s.read(moved), tensor)
        assert s.stats.used_bytes == 5 << 20  # 1 MiB kept + 4 MiB moved; the lost node's gone
        for h in (kept, gone, moved):
            s.free(h)
        assert s.stats.used_bytes == 0
    finally:
        s.close()


def test_a_small_tensor_refused_for_its_padding_says_so(store):
    # The message named "a 104KiB tensor" for a 40-byte one: the minimum object, not the tensor.
    per_node = store.stats.budget_bytes // 2
    big = torch.zeros(per_node - MIN_OBJECT // 2, dtype=torch.uint8)  # each node: < MIN_OBJECT free
    full = [store.write(big), store.write(big)]
    try:
        with pytest.raises(TierFullError, match=r"a 40B tensor \(104KiB .*put_many") as err:
            store.put(torch.ones(10))
        assert err.value.requested == MIN_OBJECT  # what it would take on its node
        with pytest.raises(TierFullError, match=r"a 80B batch of 2 tensors \(104KiB "):
            store.put_many([torch.ones(10), torch.ones(10)])
    finally:
        for h in full:
            store.free(h)


def test_puts_after_every_memory_node_actor_died_say_so(cluster):
    # The TierFullError said "the most free on any of the 0 usable nodes is 0B (1% used). Free
    # tensors, raise the budget, or add nodes": none of which helps when the actors are gone.
    s = RemoteStore("8MiB", timeout=30)
    try:
        t = torch.randn(1 << 16)
        h = s.write(t)
        end_actors([n.actor for n in s._pool.nodes.values()], lambda a: a.node_id.remote())
        assert torch.equal(s.read(h), t)  # the objects outlive the actor that made them
        with pytest.raises(
            TierFullError,
            match=r"2 of the 2 memory nodes take no more puts "
            r"\(2 whose actor died.*make a new RemoteStore",
        ):
            s.write(torch.ones(1 << 16))
        s.free(h)
    finally:
        s.close()


def test_get_many_of_single_puts_looks_each_handle_up_a_bounded_number_of_times(store, monkeypatch):
    # _fetch scanned every handle for each object, twice: n single puts cost 2n^2 key reads.
    n = 40
    tensors = [torch.full((3,), float(i)) for i in range(n)]
    hs = [store.write(t) for t in tensors]
    reads = [0]
    plain = RemoteHandle.key.fget

    def counted(h: RemoteHandle) -> int:
        reads[0] += 1
        return plain(h)

    monkeypatch.setattr(RemoteHandle, "key", property(counted))
    try:
        backs = store.get_many(hs).result(timeout=60)
        assert all(torch.equal(b, t) for b, t in zip(backs, tensors))
        assert reads[0] <= 8 * n, f"{reads[0]} key reads for {n} handles"
    finally:
        monkeypatch.undo()
        for h in hs:
            store.free(h)


def test_a_small_put_retried_after_its_node_is_lost_names_its_own_size(cluster):
    # The retry on another node said "a 104KiB tensor" for a 40-byte one (the padded size),
    # where the first attempt's refusal names both.
    c, workers, _ = cluster
    doomed = c.add_node(num_cpus=0, object_store_memory=_STORE)
    s = RemoteStore("8MiB", nodes=[workers[0], doomed.node_id], timeout=30, io_threads=1)
    try:
        big = torch.zeros(s.stats.budget_bytes // 2 - MIN_OBJECT // 2, dtype=torch.uint8)
        full = s.write(big)  # the first node: < MIN_OBJECT free
        gone = s.write(torch.ones(10))
        assert (full.node, gone.node) == (workers[0], doomed.node_id)
        c.remove_node(doomed, allow_graceful=False)
        lost = s.get(gone)  # finds the node lost, before the put below is sent
        put = s.put(torch.ones(10))  # reserved on the doomed node, then retried on the full one
        with pytest.raises(NodeLostError):
            lost.result(timeout=60)
        with pytest.raises(TierFullError, match=r"a 40B tensor \(104KiB .*put_many"):
            put.result(timeout=60)
    finally:
        s.close()


def test_a_get_racing_a_prefetch_refill_takes_the_read_ahead_copy(store, monkeypatch):
    # A get that came between the refill's pick (under the lock) and its read-ahead landing in
    # `ahead` read on its own; the read-ahead copy then stayed in `ahead` for good, filling the
    # window, so nothing more was read ahead.
    data = [torch.full((1 << 16,), float(i)) for i in range(3)]
    hs = [store.write(t) for t in data]
    hits = store.stats.prefetch_hits
    picked, go = threading.Event(), threading.Event()
    real = store._read

    def read(*args, **kwargs):  # the prefetching thread stops between its pick and its read
        if threading.current_thread() is refill:
            picked.set()
            assert go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_read", read)
    refill = threading.Thread(
        target=store.prefetch, args=(hs,), kwargs={"prefetch_budget": hs[0].nbytes}
    )
    refill.start()
    try:
        assert picked.wait(30)
        first = store.get(hs[0])  # races the refill of hs[0]
    finally:
        go.set()
        refill.join(30)
    assert torch.equal(first.result(timeout=60), data[0])
    for h, t in zip(hs[1:], data[1:]):
        assert torch.equal(store.get(h).result(timeout=60), t)
    assert store.stats.prefetch_hits - hits == 3  # each one served by its read-ahead
    assert not store._prefetch.ahead  # nothing stranded
    for h in hs:
        store.free(h)


def test_get_many_over_two_lost_nodes_names_both(cluster):
    # The error named the first lost node only, both when the read found them lost and after.
    c, _, _ = cluster
    doomed = [c.add_node(num_cpus=0, object_store_memory=_STORE) for _ in range(2)]
    ids = {d.node_id for d in doomed}
    s = RemoteStore("16MiB", nodes=sorted(ids), timeout=30)
    try:
        hs = [s.write(torch.full((1 << 16,), float(i))) for i in range(4)]
        assert {h.node for h in hs} == ids
        for d in doomed:
            c.remove_node(d, allow_graceful=False)
        for _ in ("the read finds them lost", "known lost"):
            with pytest.raises(NodeLostError) as err:
                s.get_many(hs).result(timeout=60)
            assert all(n in str(err.value) for n in ids)
            assert set(err.value.nodes) == ids and err.value.node in ids
        assert s.stats.lost_nodes == 2 and s.nodes == []
    finally:
        s.close()
