"""The storage contract (``tiers/base.py``, ``STORE.md``): every store that declares ``Store``
behaves the same way, checked by one set of tests over the disk and the remote tier (the remote
one on a Ray cluster of simulated nodes on this machine)."""

from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch

from tensortier._lifetime import quiesce
from tensortier.errors import ClosedError
from tensortier.tiers.base import Handle, Store, StoreBase, failed
from tensortier.tiers.codecs import flat_values
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.host import aligned_empty
from tests.ray_cluster import local_cluster

KINDS = ["disk", "remote"]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    with local_cluster() as lc:
        yield lc


def _open(kind: str, request, directory) -> Store:
    if kind == "disk":
        return DiskStore(directory, slab_size="1MiB")
    request.getfixturevalue("cluster")
    from tensortier.tiers.remote import RemoteStore

    return RemoteStore("32MiB", timeout=30)


@pytest.fixture(scope="module", params=KINDS)
def store(request, tmp_path_factory):
    s = _open(request.param, request, tmp_path_factory.mktemp("store"))
    try:
        yield s
    finally:
        s.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return flat_values(t).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 17, generator=g)
    return [
        x,
        x.t(),  # non-contiguous
        x.bfloat16(),
        (x * 100).to(torch.int8),
        x > 0,
        torch.complex(x, -x).conj(),
        torch.empty(0, 3),
        torch.tensor(2.5),
        torch.randn(1 << 18, generator=g),  # 1 MiB
        x.to(torch.float8_e4m3fn),
        x.to(torch.float8_e5m2),
        (x * 1000).to(torch.int64).view(torch.uint64),  # negative ints: the top bit set
        (x * 1000).to(torch.int32).view(torch.uint32),
        (x * 1000).to(torch.int16).view(torch.uint16),
        x[0, :2][::2],  # one element, stride 2
        torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        torch.randn(3, generator=g).as_strided((4, 3), (0, 1)),  # a zero stride
        torch.randn([1] * 30 + [2], generator=g),
    ]


def test_each_store_declares_the_protocol(store):
    assert isinstance(store, Store) and store.tier in ("disk", "remote")
    h = store.put(torch.ones(3)).result(timeout=60)
    assert isinstance(h, Handle) and h.length >= h.nbytes == 12
    assert h.dtype == torch.float32 and h.shape == (3,)
    store.free(h)


def test_a_store_missing_a_required_method_fails_at_construction():
    """``StoreBase``'s required methods are abstract: a store that forgets one (here the drain
    of its freed queue) is a TypeError naming it when built, not a NotImplementedError on the
    first ``free`` of a running job; both real stores declare them all."""
    assert StoreBase.__abstractmethods__ == {"put", "get", "free", "close", "_drain_freed_locked"}
    assert not DiskStore.__abstractmethods__

    class Forgetful(StoreBase):
        tier = "forgetful"

        def put(self, tensor):
            return failed(RuntimeError("never called"))

        def get(self, handle, *, into=None):
            return failed(RuntimeError("never called"))

        def free(self, handle):
            pass

        def close(self):
            pass

    with pytest.raises(TypeError, match="_drain_freed_locked"):
        Forgetful()


def test_round_trip_is_bit_identical_and_free_forgets(store):
    before = len(store)
    for t in _tensors():
        h = store.put(t).result(timeout=60)
        assert h in store and len(store) == before + 1
        assert _same(store.get(h).result(timeout=60), t)
        store.free(h)
        assert h not in store and len(store) == before
        with pytest.raises(KeyError):
            store.free(h)
        with pytest.raises(KeyError):
            store.get(h)


def test_what_comes_back_is_a_plain_tensor_of_the_values_put(store):
    """STORE.md "What comes back": values, dtype and shape; not strides, autograd or aliasing."""
    base = torch.randn(4, 6, requires_grad=True)
    views = [base.t(), base[1:3]]  # two views of one storage, one non-contiguous
    handles = [store.put(v).result(timeout=60) for v in views]
    expected = [v.detach().clone() for v in views]
    with torch.no_grad():
        base.add_(1.0)  # after the puts: the stored values are those of put time
    back = [store.get(h).result(timeout=60) for h in handles]
    for b, e in zip(back, expected):
        assert _same(b, e) and b.is_contiguous()
        assert not b.requires_grad and b.grad_fn is None
    back[0].zero_()  # no aliasing: the other view's copy is untouched
    assert _same(back[1], expected[1])
    for h in handles:
        store.free(h)


def test_get_lands_in_a_given_buffer(store):
    t = torch.randn(1000, dtype=torch.float64)
    h = store.put(t).result(timeout=60)
    into = aligned_empty(h.length)  # what the contract asks of `into`
    back = store.get(h, into=into).result(timeout=60)
    assert _same(back, t) and back.data_ptr() == into.data_ptr()
    store.free(h)


def test_put_many_and_get_many_keep_order(store):
    ts = _tensors()
    handles = store.put_many(ts).result(timeout=60)
    assert len(handles) == len(ts) and all(h in store for h in handles)
    back = store.get_many(handles).result(timeout=60)
    assert all(_same(b, t) for b, t in zip(back, ts))
    assert _same(store.get(handles[1]).result(timeout=60), ts[1])  # members read one by one
    for h in handles:
        store.free(h)
    assert not any(h in store for h in handles)
    assert store.put_many([]).result(timeout=60) == []
    assert store.get_many([]).result(timeout=60) == []


def test_stats_count_puts_gets_and_bytes(store):
    before = store.stats.as_dict()
    t = torch.arange(4096, dtype=torch.int32)
    h = store.put(t).result(timeout=60)
    store.get(h).result(timeout=60)
    after = store.stats.as_dict()
    assert after["puts"] == before["puts"] + 1 and after["gets"] == before["gets"] + 1
    assert after["bytes_written"] >= before["bytes_written"] + t.nbytes
    assert after["bytes_read"] >= before["bytes_read"] + t.nbytes
    assert after["live_tensors"] == before["live_tensors"] + 1
    store.free(h)


@pytest.mark.parametrize("kind", KINDS)
def test_close_releases_and_refuses(kind, request, tmp_path):
    s = _open(kind, request, tmp_path)
    with s:
        h = s.write(torch.ones(8))
        assert torch.equal(s.read(h), torch.ones(8))
    assert s.closed and h not in s and len(s) == 0
    s.free(h)  # a no-op after close: everything was freed
    with pytest.raises(ClosedError):
        s.put(torch.ones(2))
    s.close()  # twice: fine


def _released(s: Store) -> bool:
    """Whether a closed store gave back what it held: the disk tier's directory, the remote
    tier's objects and memory-node actors."""
    if isinstance(s, DiskStore):
        return not os.path.exists(s.directory)
    import ray

    if s._pool.refs:
        return False
    for node in s._pool.nodes.values():
        try:
            ray.get(node.actor.node_id.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            continue
        return False
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_close_from_a_done_callback_of_its_own_future_releases_everything(kind, request, tmp_path):
    # The callback runs on the store's I/O thread: close() joined that thread and raised "cannot
    # join current thread", leaving the files (or the remote objects and actors) behind.
    s = _open(kind, request, tmp_path)
    closed, errors = threading.Event(), []

    def close_it(_) -> None:
        try:
            s.close()
        except BaseException as exc:
            errors.append(exc)
        closed.set()

    gate = threading.Event()
    # every I/O thread waits, so the put is still queued when the callback is added (with one
    # thread free the put could finish first, and the callback would run here, on this thread)
    slow = [s._executor.submit(gate.wait) for _ in range(s._executor._max_workers)]
    f = s.put(torch.ones(8))
    f.add_done_callback(close_it)
    assert not f.done()
    gate.set()
    assert closed.wait(60) and not errors, errors
    for job in slow:
        job.result(timeout=10)
    assert s.closed and len(s) == 0
    assert quiesce(60) and _released(s)
    with pytest.raises(ClosedError):
        s.put(torch.ones(2))


@pytest.mark.parametrize("kind", KINDS)
def test_pickling_a_store_names_what_to_send_instead(kind, request, tmp_path):
    s = _open(kind, request, tmp_path)
    with s, pytest.raises(TypeError, match=r"cannot be pickled.*send the tensors"):
        pickle.dumps(s)


def test_put_many_of_a_lone_tensor_or_get_many_of_a_lone_handle_is_refused(store):
    # DiskStore.put_many(t) iterated the tensor and stored each row as its own tensor; its
    # get_many(h) failed with "object is not iterable". RemoteStore refused both, naming the fix.
    live = len(store)
    with pytest.raises(TypeError, match=r"put_many\(tensors\): expected a list or tuple"):
        store.put_many(torch.ones(3, 2))
    assert len(store) == live
    h = store.write(torch.ones(3))
    with pytest.raises(TypeError, match=r"get_many\(handles\): expected a list or tuple"):
        store.get_many(h)
    store.free(h)
