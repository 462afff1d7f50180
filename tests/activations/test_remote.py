"""Activation offload to remote memory (tier="remote") on a local Ray cluster (one per module)."""

import gc
import threading

import pytest
import torch
from torch import nn

ray = pytest.importorskip("ray")

import tensortier as tt  # noqa: E402
from tensortier._lifetime import quiesce  # noqa: E402
from tensortier.errors import ConfigError, NodeLostError  # noqa: E402
from tensortier.tiers.codecs import ZstdCodec  # noqa: E402
from tensortier.tiers.remote import RemoteStore  # noqa: E402
from tests.activations.test_offloader import _inputs, _step, cnn, gpt, mlp  # noqa: E402
from tests.ray_cluster import STORE, cluster_fixture, remote_store_fixture  # noqa: E402

cluster = cluster_fixture()


store = remote_store_fixture("128MiB")


def _offloaded_step(model, inputs, off):
    """As ``_step``, but every write lands before forward ends, so saved tensors come back from
    the remote pool (a record whose write is still in flight when forward ends keeps its
    source, and backward would get that instead)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
    model.zero_grad(set_to_none=True)
    with off:
        out = model(*inputs)
        off._engine.synchronize(timeout=60)  # before the pass ends: the tail keeps no source
    loss = out if out.dim() == 0 else out.float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_gradients_bit_identical_to_no_offload(store, name):
    torch.manual_seed(0)
    model = {"mlp": mlp, "cnn": cnn, "gpt": gpt}[name]()
    inputs = _inputs(name)
    ref_loss, ref = _step(model, inputs)
    off = tt.Offloader("remote", remote=store, min_bytes=0)
    gets = store.stats.gets
    for _ in range(2):  # second pass reuses the learned prefetch order
        loss, grads = _offloaded_step(model, inputs, off)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(ref, grads))
    assert off.stats.tensors_offloaded > 0 and off.stats.bytes_offloaded["remote"] > 0
    assert off.stats.bytes_offloaded["host"] == 0 and off.stats.bytes_offloaded["disk"] == 0
    assert off.stats.order_reused == 1
    assert store.stats.gets > gets  # read back from the remote pool
    off.close()
    gc.collect()
    quiesce()
    assert len(store) == 0 and not store.closed  # every record freed; the caller's store open


def test_owned_store_from_a_dict_and_bad_arguments(cluster):
    model, inputs = mlp(), _inputs("mlp")
    ref_loss, ref = _step(model, inputs)
    off = tt.Offloader("remote", remote={"budget": "16MiB", "timeout": 30}, min_bytes=0)
    loss, grads = _offloaded_step(model, inputs, off)
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(ref, grads))
    owned = off._engine.remote
    off.close()
    assert owned.closed  # made by the offloader: closed with it
    with pytest.raises(ConfigError, match="remote="):
        tt.Offloader("remote")
    with pytest.raises(ConfigError, match="remote="):
        tt.Offloader("remote", remote="16MiB")
    with pytest.raises(ConfigError, match="codec"):
        tt.Offloader("remote", remote={"budget": "1MiB"}, codec=ZstdCodec())


def test_node_loss_fails_backward_with_node_lost_error(cluster):
    doomed = cluster.cluster.add_node(num_cpus=0, object_store_memory=STORE)
    s = RemoteStore("32MiB", nodes=[doomed.node_id], timeout=30)
    off = tt.Offloader("remote", remote=s, min_bytes=0, prefetch_budget=0)
    try:
        model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU())
        x = torch.randn(64, 64)
        with off:
            loss = model(x).square().mean()
        off._engine.synchronize(timeout=60)  # every saved tensor is on the doomed node
        assert len(s) > 0 and all(h.node == doomed.node_id for h in s._live.values())
        cluster.cluster.remove_node(doomed, allow_graceful=False)
        raised: list = []

        def backward() -> None:
            try:
                loss.backward()
            except BaseException as exc:
                raised.append(exc)

        t = threading.Thread(target=backward, daemon=True)
        t.start()
        t.join(90)
        assert not t.is_alive(), "backward hung after the memory node was lost"
        assert len(raised) == 1 and isinstance(raised[0], NodeLostError), raised
        assert raised[0].node == doomed.node_id
    finally:
        off.close()
        s.close()
