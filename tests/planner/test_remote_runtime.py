"""``tt.offload(budget=..., remote=pool)`` on a local Ray cluster (one per module): the remote
channels measured, the plan's remote swaps run through the offloader, training bit-identical."""

from __future__ import annotations

import gc

import pytest
import torch

ray = pytest.importorskip("ray")

import tensortier as tt  # noqa: E402
from tensortier._lifetime import quiesce  # noqa: E402
from tensortier.planner.policies import Options  # noqa: E402
from tensortier.planner.simulator import Mode  # noqa: E402
from tensortier.tiers.remote import RemoteStore  # noqa: E402
from tests.activations.test_offloader import _inputs, gpt  # noqa: E402

FAST = Options(search_iters=60, search_seconds=5, plan_seconds=10)
STEPS = 6  # warm-up, probe, 2 timing passes, the plan twice


@pytest.fixture(scope="module")
def pool(ray_nodes):
    with ray_nodes.module():
        store = RemoteStore("64MiB", timeout=30)
        try:
            yield store
        finally:
            store.close()


def _train(ctx=None) -> list[torch.Tensor]:
    """SGD steps of the tiny GPT from seed 0; the losses, then the parameters."""
    torch.manual_seed(0)
    model = gpt()
    inputs = _inputs("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = model(*inputs)
        else:
            with ctx:
                loss = model(*inputs)
        loss = loss if loss.dim() == 0 else loss.float().square().mean()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out + [p.detach().clone() for p in model.parameters()]


def _report(off) -> str:
    bw = off.profile.bandwidth
    modes = sorted({a.label() for a in off.choice.plan.actions.values()})
    return (
        f"plan {off.choice.plan.policy} {modes}; h2remote {bw.h2remote / 1e9:.2f} GB/s, "
        f"remote2h {bw.remote2h / 1e9:.2f} GB/s, h2disk {bw.h2disk / 1e9:.2f} GB/s, "
        f"disk2h {bw.disk2h / 1e9:.2f} GB/s; remote bytes {off.stats.bytes_offloaded['remote']}"
    )


def test_a_remote_pool_is_measured_and_auto_trains_bit_identically(pool, tmp_path):
    plain = _train()
    off = tt.offload(budget="256MiB", remote=pool, spill_dir=str(tmp_path), options=FAST)
    try:
        planned = _train(off)
        assert off.choice is not None  # the last steps ran the plan
        print(_report(off))  # which tier auto chose on this machine (-s shows it)
        assert off.profile.bandwidth.remote  # both remote channels measured
        uses_remote = any(a.mode == Mode.REMOTE for a in off.choice.plan.actions.values())
        assert (off.stats.bytes_offloaded["remote"] > 0) == uses_remote
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
    gc.collect()
    quiesce()
    assert len(pool) == 0 and not pool.closed  # the probe's and the plan's objects freed


def test_to_remote_sends_the_plans_swaps_to_the_pool(pool, tmp_path):
    plain = _train()
    off = tt.offload(
        budget="256MiB",
        tier="remote",
        remote=pool,
        policy="swap_all",
        spill_dir=str(tmp_path),
        options=FAST,
    )
    try:
        gets = pool.stats.gets
        planned = _train(off)
        print(_report(off))
        assert {a.mode for a in off.choice.plan.actions.values()} == {Mode.REMOTE}
        assert off.stats.bytes_offloaded["remote"] > 0  # Action("remote") reached the offloader
        assert pool.stats.gets > gets
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
    gc.collect()
    quiesce()
    assert len(pool) == 0 and not pool.closed
