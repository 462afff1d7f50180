import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier.errors import ClosedError, ConfigError, RateLimitTimeout  # noqa: E402
from tensortier.rl import (  # noqa: E402
    MemoryBank,
    ParamStore,
    Prioritized,
    RateLimit,
    ReplayBuffer,
    serve,
)
from tensortier.rl._actors import call as _call  # noqa: E402
from tensortier.rl.serve import _PARAM_THREADS  # noqa: E402
from tensortier.tiers.remote import RemoteStore  # noqa: E402
from tests.conftest import in_thread, same_item  # noqa: E402


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(tmp),
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0.5)
def collector(buf, worker: int, n: int) -> list[int]:
    keys = []
    for i in range(n):
        obs = np.full(256, worker * 1000 + i, np.float32)
        keys.append(buf.add({"obs": obs, "w": worker, "i": i}))
    return keys


@pytest.mark.slow
def test_buffer_actor_round_trip_with_collector_processes(ray_session, tmp_path):
    local = ReplayBuffer(1000, sampler=Prioritized(), spill_dir=tmp_path, host_budget="64KiB")
    first = local.add({"obs": np.full(256, -1000, np.float32), "w": -1, "i": 0})  # obs = w*1000+i
    remote = serve(local, num_cpus=0.5)
    assert len(remote) == 1 and remote[first]["w"] == -1  # carried over
    keys = ray.get([collector.remote(remote, w, 50) for w in range(3)])
    assert len(remote) == 151
    for w, ks in enumerate(keys):
        got = remote[ks[7]]
        assert got["w"] == w and got["i"] == 7 and (got["obs"] == w * 1000 + 7).all()
    batch = remote.sample(32)
    assert batch.collated and batch.items["obs"].shape == (32, 256)
    assert (batch.items["obs"][:, 0] == batch.items["w"] * 1000 + batch.items["i"]).all()
    remote.update_priorities(batch.indices, torch.rand(32))
    del remote[keys[0][0]]
    assert len(remote) == 150
    with pytest.raises(ray.exceptions.RayTaskError, match="KeyError"):
        remote[keys[0][0]]
    assert remote.stats["disk_items"] > 0
    remote.close()
    local.close()


@pytest.mark.slow
def test_param_store_actor_publishes_once_per_version(ray_session):
    remote = serve(ParamStore(), num_cpus=0)

    @ray.remote(num_cpus=0.25)
    def reader(store, want: int) -> float:
        p = store.get(min_version=want, timeout=30)
        return float(p["w"].sum()) + p.version * 1000

    sd = {"w": torch.ones(1000), "b": torch.zeros(3, dtype=torch.bfloat16)}
    pending = [reader.remote(remote, 2) for _ in range(3)]
    assert remote.publish(sd) == 1
    sd["w"] *= 2
    assert remote.publish(sd) == 2
    assert ray.get(pending) == [2000.0 + 2000] * 3
    got = remote.get()
    assert torch.equal(got["w"], sd["w"]) and got["b"].dtype == torch.bfloat16
    with pytest.raises(TimeoutError):
        remote.wait_for(9, timeout=0.1)
    remote.close()


def test_serve_refuses_other_objects():
    with pytest.raises(Exception, match="ReplayBuffer"):
        serve(object())


# ---------------------------------------------------------------------- faults (issues 12, 18)
def _in_thread(fn, limit: float = 60.0):
    """:func:`in_thread` with a longer limit: a served actor starts in a new process."""
    return in_thread(fn, limit)


def _copies(spill_dir) -> list[str]:
    return [f for f in os.listdir(spill_dir) if f.startswith("tt-serve-")]


@ray.remote
def add_and_read(buf, params, worker: int) -> float:  # default resources: needs a whole CPU
    key = buf.add({"obs": np.full(4, worker, np.float32)})
    return float(buf[key]["obs"][0]) + float(params.get(timeout=30)["w"].sum())


def test_default_actors_leave_the_cpus_to_collectors(ray_session):
    """Issue 12 #10: on a 2-CPU cluster a served buffer and ParamStore must not take both CPUs."""
    buf = serve(ReplayBuffer(100))
    params = serve(ParamStore())
    try:
        params.publish({"w": torch.ones(3)})
        refs = [add_and_read.remote(buf, params, w) for w in range(2)]
        done, _ = ray.wait(refs, num_returns=2, timeout=120)
        assert len(done) == 2, "collector tasks never started"
        assert sorted(ray.get(refs)) == [3.0, 4.0] and len(buf) == 2
    finally:
        buf.close()
        params.close()


def test_a_request_no_node_can_hold_fails_at_once_and_leaves_no_copy(ray_session, spill_dir):
    b = ReplayBuffer(10, spill_dir=spill_dir)
    b.add({"x": np.arange(3)})
    for request in ({"num_cpus": 8}, {"num_gpus": 1}, {"resources": {"no_such_thing": 1}}):
        err = _in_thread(lambda request=request: serve(b, **request))
        assert isinstance(err, ConfigError), err
        assert "no node" in str(err) and "num_cpus=0" in str(err)
    assert _copies(spill_dir) == []
    assert len(b) == 1
    b.close()


def test_bad_options_are_refused_before_anything_is_copied(spill_dir):
    b = ReplayBuffer(10, spill_dir=spill_dir)
    b.add({"x": np.arange(3)})
    for kwargs in ({"num_cpus": -1}, {"num_cpus": "1"}, {"start_timeout": -1}, {"name": 3}):
        with pytest.raises(ConfigError):
            serve(b, **kwargs)
    with pytest.raises(ConfigError, match="no_such_option"):
        serve(b, no_such_option=1)
    assert _copies(spill_dir) == []
    b.close()


def test_an_actor_that_cannot_start_in_time_is_cancelled(ray_session, spill_dir):
    @ray.remote(num_cpus=2)
    class Hog:
        def ready(self) -> bool:
            return True

    hog = Hog.remote()
    ray.get(hog.ready.remote())
    b = ReplayBuffer(10, spill_dir=spill_dir)
    b.add({"x": np.arange(3)})
    try:
        with pytest.warns(RuntimeWarning, match="num_cpus=0"):
            err = _in_thread(lambda: serve(b, num_cpus=1, start_timeout=1.0))
        assert isinstance(err, TimeoutError), err
        assert "CPU=1" in str(err) and "start_timeout" in str(err)
        assert _copies(spill_dir) == []
    finally:
        ray.kill(hog)
        b.close()


def test_errors_raised_by_the_actor_reach_the_caller_typed(ray_session, tmp_path):
    d = tmp_path / "durable"
    ReplayBuffer(10, durable=True, spill_dir=d).close()
    meta = d / "store.json"
    meta.write_text(meta.read_text().replace('"capacity": 10', '"capacity": 99'))
    with pytest.raises(ConfigError, match="max_items=99"):  # raised by the actor's constructor
        serve(ReplayBuffer(10, durable=True, spill_dir=d))


def test_remote_sample_validates_batch_size_and_closed_handles(ray_session):
    local = ReplayBuffer(10, sampler=Prioritized())
    local.add({"x": np.arange(3)})
    remote = serve(local)
    copy = pickle.loads(pickle.dumps(remote))  # what a collector holds
    try:
        for n in (0, -1, 2.5, "3", True):
            with pytest.raises(ConfigError, match="batch_size"):
                remote.sample(n)
        for n in (0, -1):  # the actor validates too, and its ConfigError arrives as itself
            with pytest.raises(ConfigError, match="batch_size"):
                _call(remote.actor.sample.remote(n), "ReplayBuffer")
        assert remote.sample(2).indices.shape == (2,)
        with pytest.raises(TypeError, match="index"):  # checked here, not wrapped by Ray
            remote["a"]
        with pytest.raises(TypeError, match="index"):
            remote.update("a", {"x": np.arange(3)})
        with pytest.raises(TypeError, match="indices"):
            remote.update_priorities([[0.5]], [1.0])
        with pytest.raises(KeyError):  # other errors keep Ray's wrapper, which is a KeyError too
            remote[12345]
    finally:
        remote.close()
        local.close()
    remote.close()  # idempotent
    with pytest.raises(ClosedError):
        remote.sample(1)
    with pytest.raises(ClosedError):  # another handle to the ended actor
        len(copy)


def test_remote_param_store_types_its_errors(ray_session):
    remote = serve(ParamStore())
    copy = pickle.loads(pickle.dumps(remote))
    try:
        with pytest.raises(TypeError, match="state_dict"):
            remote.publish([torch.ones(2)])
        with pytest.raises(ConfigError, match="min_version"):
            remote.get(min_version=-1)
        with pytest.raises(ConfigError, match="timeout"):
            remote.get(timeout="1")
        assert remote.publish({"w": torch.ones(2)}) == 1
    finally:
        remote.close()
    with pytest.raises(ClosedError):
        remote.get(timeout=1)
    with pytest.raises(ClosedError):
        copy.get(timeout=5)


def test_more_waiting_readers_than_actor_threads_do_not_block_publish(ray_session):
    remote = serve(ParamStore())
    try:
        # each asks to wait an hour; the actor answers within _WAIT_CHUNK and frees the thread
        waiting = [remote.actor.get.remote(1, 3600.0) for _ in range(_PARAM_THREADS + 8)]
        assert _in_thread(lambda: remote.publish({"w": torch.ones(2)})) == 1
        assert len(ray.get(waiting, timeout=60)) == _PARAM_THREADS + 8
        assert remote.get(timeout=30).version == 1
    finally:
        remote.close()


def blocked_round_trip(buf, wait_until) -> None:
    """RateLimit(1, min_size_to_sample=2, error_buffer=4, timeout=30) on an empty served buffer:
    a learner's sample waits on its side until an add admits it, then an insert waits until a
    sample admits it (counted through stats, no timing)."""
    got: list = []
    learner = threading.Thread(target=lambda: got.append(buf.sample(3)))
    learner.start()
    wait_until(lambda: buf.stats["rate_limiter"]["sample_waits"] == 1)  # size 0 < 2
    buf.extend([{"i": 0}, {"i": 1}])  # size 2, diff 2: a sample of 3 leaves -1 >= -2
    learner.join(30)
    assert not learner.is_alive() and len(got) == 1 and len(got[0]) == 3
    st = buf.stats["rate_limiter"]
    assert st["samples"] == 3 and st["sample_timeouts"] == 0
    buf.extend([{"i": 2}] * 4)  # inserts 6, diff 3
    released: list = []
    collector = threading.Thread(target=lambda: released.append(buf.extend([{"i": 3}] * 4)))
    collector.start()  # (6 + 4) - 3 = 7 > max_diff 6: waits for samples
    wait_until(lambda: buf.stats["rate_limiter"]["insert_waits"] == 1)
    buf.sample(3)  # diff 0: (6 + 4) - 6 = 4 <= 6 admits the collector
    collector.join(30)
    assert not collector.is_alive() and len(released) == 1 and len(released[0]) == 4
    st = buf.stats["rate_limiter"]
    assert st["inserts"] == 10 and st["insert_timeouts"] == 0


def _wait_until(pred) -> None:
    deadline = time.monotonic() + 30
    while not pred():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.01)


def test_served_rate_limited_buffer_waits_on_the_callers_side(ray_session):
    """The served buffer keeps its RateLimit (it used to be dropped: a learner got IndexError at
    once on an empty buffer) and waits without blocking the actor."""
    limit = RateLimit(1, min_size_to_sample=2, error_buffer=4, timeout=30)
    remote = serve(ReplayBuffer(100, rate_limit=limit))
    try:
        assert remote.rate_limit == limit
        blocked_round_trip(remote, _wait_until)
        remote.sample(3)
        remote.sample(3)  # diff 4 -> -2 = min_diff
        with pytest.raises(RateLimitTimeout):
            remote.sample(1, timeout=0)  # inserting is behind: at once, counted
        st = remote.stats["rate_limiter"]
        assert (st["samples"], st["sample_timeouts"]) == (12, 1)
    finally:
        remote.close()


# ---------------------------------------------------------------------- settings carried over
def _actor_config(remote):
    """(durable, fsync) of the store inside the actor."""
    return ray.get(
        remote.actor.__ray_call__.remote(lambda a: (a.obj._store.durable, a.obj._store.fsync))
    )


def test_a_durable_bank_is_served_with_its_items_and_stays_durable(ray_session, tmp_path):
    """serve(MemoryBank(durable=True)) used to start a bank that was neither durable nor given
    the items: what collectors appended through it was gone once the actor ended."""
    d = tmp_path / "bank"
    bank = MemoryBank(100, spill_dir=d, durable=True, fsync=True)
    first = {"key": torch.randn(128, dtype=torch.bfloat16), "label": 0}
    k0 = bank.append(first)
    remote = serve(bank)  # closes `bank`: the actor owns the directory now
    try:
        assert _actor_config(remote) == (True, True)
        got = remote[k0]
        assert torch.equal(got["key"], first["key"]) and got["label"] == 0
        later = {"key": torch.randn(128, dtype=torch.bfloat16), "label": 1}
        k1 = remote.add(later)
    finally:
        remote.close()
    with MemoryBank(100, spill_dir=d, durable=True) as reopened:
        assert reopened.indices().tolist() == [k0, k1]
        assert torch.equal(reopened[k1]["key"], later["key"]) and reopened[k1]["label"] == 1


def test_a_non_durable_bank_with_items_is_refused(ray_session):
    with MemoryBank(10) as bank:
        bank.append({"x": 1})
        with pytest.raises(ConfigError, match="durable"):
            serve(bank)


def test_a_durable_buffer_keeps_fsync_in_its_actor(ray_session, tmp_path):
    remote = serve(ReplayBuffer(10, spill_dir=tmp_path / "rb", durable=True, fsync=True))
    try:
        assert _actor_config(remote) == (True, True)  # fsync was dropped: power loss lost adds
    finally:
        remote.close()


def test_stores_spilling_to_a_remote_pool_are_refused(ray_session):
    """The pool is this process's; the actor's store used to spill to disk instead, silently."""
    pool = RemoteStore(budget="2MiB")
    try:
        for store in (
            ReplayBuffer(10, tier="remote", remote=pool),
            MemoryBank(10, tier=["remote"], remote=pool),
        ):
            with store, pytest.raises(ConfigError, match="tier="):
                serve(store)
        with (
            ReplayBuffer(10, tier="remote", remote=pool) as store,
            pytest.raises(ConfigError, match="tier="),
        ):
            serve(store, shards=2)
    finally:
        pool.close()


@ray.remote(num_cpus=0)
def add_later(buf, delay: float) -> int:
    time.sleep(delay)
    return buf.add({"obs": np.arange(4.0)})


def test_served_sample_waits_for_collectors_up_to_its_timeout(ray_session):
    """sample(n, timeout=t) on a served buffer without a rate limit used to ignore ``t`` and
    raise IndexError at once, so a learner started before its collectors failed."""
    remote = serve(ReplayBuffer(100))
    try:
        with pytest.raises(IndexError, match="empty ReplayBuffer"):
            remote.sample(2)  # default: at once, as a local buffer
        with pytest.raises(IndexError, match="after waiting 0.2 s"):
            remote.sample(2, timeout=0.2)
        with pytest.raises(ConfigError, match="timeout"):
            remote.sample(2, timeout="1")
        pending = add_later.remote(remote, 0.5)  # the learner is already waiting then
        batch = remote.sample(2, timeout=60)
        assert batch.indices.tolist() == [ray.get(pending)] * 2
        assert (batch.items["obs"] == np.arange(4.0)).all()
        assert remote.sample(3, timeout=None).indices.shape == (3,)  # drawable: no wait
    finally:
        remote.close()


@pytest.mark.parametrize("shards", [None, 2])
def test_served_extend_refuses_a_dict_instead_of_storing_its_keys(ray_session, shards):
    remote = serve(ReplayBuffer(10), shards=shards)
    try:
        with pytest.raises(TypeError, match="extend takes a list"):
            remote.extend({"obs": np.zeros((4, 3)), "action": np.arange(4)})
        assert len(remote) == 0
    finally:
        remote.close()


def test_served_tied_weights_travel_once_and_arrive_tied(ray_session):
    emb = torch.randn(512, 128, dtype=torch.bfloat16)  # 128 KiB: through the object store
    sd = {"emb.weight": emb.detach(), "head.weight": emb.detach(), "bias": torch.zeros(512)}
    remote = serve(ParamStore())
    try:
        got = remote.get(remote.publish(sd), timeout=60)
        assert got["emb.weight"].data_ptr() == got["head.weight"].data_ptr()
        assert all(torch.equal(got[k], t) for k, t in sd.items())
    finally:
        remote.close()


@ray.remote(num_cpus=0)
def read_version(reader) -> tuple[int, float]:
    p = reader.get(min_version=1, timeout=30)
    return p.version, float(p["w"].sum())


def test_collectors_get_a_reader_and_local_stores_say_how_to_share(ray_session):
    """A ParamReader given to a Ray task failed with "cannot pickle 'mmap.mmap' object", and a
    local store with "cannot pickle '_thread.RLock' object"; a reader now attaches where it is
    unpickled, and a store's error names what to pass instead."""
    with ParamStore() as params:
        params.publish({"w": torch.ones(8)})
        assert ray.get(read_version.remote(ParamStore.attach(params.directory))) == (1, 8.0)
        with pytest.raises(TypeError, match=r"ParamStore\.attach"):
            pickle.dumps(params)
    with ReplayBuffer(10) as buf, MemoryBank(10) as bank:
        for store in (buf, bank):
            with pytest.raises(TypeError, match=r"tt\.rl\.serve"):
                pickle.dumps(store)


def _bank_reads(bank, keys: list[int]) -> dict:
    """What a bank answers to reads (items, or the error's type), for comparing two banks."""
    gone = keys[0]
    out = {}
    for name, read in {
        "get_many": lambda: bank.get_many(keys[2:5] + [keys[3], keys[3]]),  # repeats
        "empty": lambda: bank.get_many([]),
        "getitem": lambda: [bank[keys[4]], bank[np.int64(keys[5])], bank[keys[6:8]]],
        "tensor": lambda: bank.get_many(torch.tensor(keys[5:7])),
        "evicted": lambda: bank.get_many([keys[3], gone]),
        "never added": lambda: bank.get_many([keys[-1] + 1]),
        "bad": lambda: bank.get_many([1.5]),
        "contains": lambda: (keys[3] in bank, gone in bank, "x" in bank),
        "indices": lambda: bank.indices().tolist(),
        "iterate": lambda: list(bank),
    }.items():
        try:
            out[name] = read()
        except (KeyError, TypeError) as exc:
            out[name] = KeyError if isinstance(exc, KeyError) else TypeError
    return out


def test_a_served_bank_reads_as_the_local_bank_bit_for_bit(ray_session):
    # A served bank had no get_many() or indices(), and `k in bank` / `list(bank)` raised a
    # KeyError (Python fell back to bank[0], bank[1], ...).
    rng = np.random.default_rng(0)
    items = [
        {"k": torch.randn(2, 3, dtype=torch.bfloat16), "a": rng.integers(0, 9, i), "i": i}
        for i in range(12)
    ]
    local, remote = MemoryBank(10), serve(MemoryBank(10))
    try:
        keys = [local.extend(items[:6]).tolist() + local.extend(items[6:]).tolist()]
        keys.append(remote.extend(items[:6]).tolist() + remote.extend(items[6:]).tolist())
        assert keys[0] == keys[1]  # (the first two were evicted)
        want, got = _bank_reads(local, keys[0]), _bank_reads(remote, keys[0])
        assert want.keys() == got.keys()
        for name in want:
            assert _same_read(want[name], got[name]), name
        assert want["evicted"] is KeyError and want["contains"] == (True, False, False)
        assert len(want["iterate"]) == 10 and len(want["get_many"]) == 5
    finally:
        remote.close()
        local.close()
    with pytest.raises(ClosedError):
        remote.get_many([])


def _same_read(a, b) -> bool:
    """Reads equal to the bit (lists and tuples of items, element by element)."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_read, a, b))
    return same_item(a, b)
