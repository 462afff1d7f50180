"""OffloadedAdamW(tier="remote"): state in other Ray nodes' memory (a local Cluster)."""

import threading

import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier.errors import ConfigError, NodeLostError  # noqa: E402
from tensortier.optim import OffloadedAdamW  # noqa: E402
from tensortier.tiers.remote import RemoteStore  # noqa: E402
from tests.ray_cluster import STORE, cluster_fixture, remote_store_fixture  # noqa: E402

cluster = cluster_fixture()


store = remote_store_fixture("16MiB")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Linear(24, 3)
    )


def _train(model, opt, batches):
    for x in batches:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 12, generator=g) for _ in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
def test_remote_states_match_fused_torch_adamw_bitwise(store, overlap):
    ref_m, tt_m = _model(), _model()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    opt = OffloadedAdamW(
        tt_m.parameters(),
        lr=1e-2,
        weight_decay=0.05,
        tier="remote",
        remote=store,
        bucket_size="1KiB",  # several buckets, streamed through the ring
        pipeline_depth=2,
        overlap=overlap,
    )
    assert len(opt._buckets) > 2
    data = _batches(8)
    _train(ref_m, ref, data)
    _train(tt_m, opt, data)
    for p, q in zip(tt_m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)
    state_bytes = sum(p.numel() for p in tt_m.parameters()) * 12
    assert store.stats.used_bytes >= state_bytes  # the state is in the remote pool
    assert {h.node for hs in opt._states._committed.values() for h in hs} == set(store.nodes)
    opt.close()
    assert not store.closed and store.stats.used_bytes == 0  # the caller's store: memory back


def test_state_dict_round_trip_and_an_owned_store(cluster):
    a, b = _model(), _model()
    data = _batches(12)
    opts = {"budget": "8MiB", "timeout": 30}
    opt_a = OffloadedAdamW(a.parameters(), lr=1e-2, tier="remote", remote=opts, overlap=False)
    _train(a, opt_a, data)
    opt_b = OffloadedAdamW(b.parameters(), lr=1e-2, tier="remote", remote=opts, overlap=False)
    _train(b, opt_b, data[:6])
    sd = opt_b.state_dict()
    owned = opt_b._states.store
    opt_b.close()
    assert owned.closed  # made by the optimizer from the dict: closed with it
    opt_c = OffloadedAdamW(b.parameters(), lr=1.0, tier="remote", remote=opts, overlap=False)
    opt_c.load_state_dict(sd)
    _train(b, opt_c, data[6:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    opt_a.close()
    opt_c.close()


def test_bad_remote_arguments_are_typed(store):
    m = _model()
    with pytest.raises(ConfigError, match="remote="):
        OffloadedAdamW(m.parameters(), tier="remote")
    with pytest.raises(ConfigError, match="remote="):
        OffloadedAdamW(m.parameters(), tier="remote", remote="8MiB")
    closed = RemoteStore("1MiB", timeout=30)
    closed.close()
    with pytest.raises(ConfigError, match="closed"):
        OffloadedAdamW(m.parameters(), tier="remote", remote=closed)


def test_node_loss_raises_node_lost_error_from_step_without_hanging(cluster):
    doomed = cluster.cluster.add_node(num_cpus=0, object_store_memory=STORE)
    s = RemoteStore("8MiB", nodes=[doomed.node_id, cluster.workers[0]], timeout=30)
    m = _model()
    opt = OffloadedAdamW(
        m.parameters(),
        lr=1e-2,
        tier="remote",
        remote=s,
        bucket_size="512B",
        pipeline_depth=2,
        overlap=False,
    )
    try:
        data = _batches(4)
        _train(m, opt, data[:2])
        # buckets the next step must still read from the doomed node (the ring has read a few
        # ahead already: those bytes are here and the step may use them)
        unread = [
            i
            for i, hs in opt._states._committed.items()
            if i not in opt._states._reads and any(h.node == doomed.node_id for h in hs)
        ]
        assert unread
        before = [p.detach().clone() for p in m.parameters()]
        cluster.cluster.remove_node(doomed, allow_graceful=False)
        m(data[2]).square().mean().backward()
        raised: list = []

        def step() -> None:
            try:
                opt.step()
            except BaseException as exc:
                raised.append(exc)

        t = threading.Thread(target=step, daemon=True)
        t.start()
        t.join(90)
        assert not t.is_alive(), "step() hung after a memory node was lost"
        assert len(raised) == 1 and isinstance(raised[0], NodeLostError), raised
        assert raised[0].node == doomed.node_id and doomed.node_id in str(raised[0])
        for p, q in zip(m.parameters(), before):
            assert torch.equal(p, q)  # nothing applied
    finally:
        opt.close()
        s.close()
