import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier.rl import ParamStore, Prioritized, ReplayBuffer, serve  # noqa: E402


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
    local = ReplayBuffer(1000, sampler=Prioritized(), spill_dir=tmp_path, ram_budget="64KiB")
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
