"""Checkpointer under FSDP2 (``fully_shard``, gloo, 2 ranks): save mid-run on 2 ranks, restore
on 2 ranks and continue; the run ends bit for bit where the uninterrupted one ended (local
parameter shards, optimizer state, RNG, scheduler), with torch.optim.AdamW (DTensor state) and
with a sharded OffloadedAdamW."""

import os

import pytest
import torch

from tensortier.checkpoint import Checkpointer
from tensortier.optim import OffloadedAdamW
from tests import distributed

STEPS, SAVED = 5, 1


def _setup(kind: str, rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    if kind == "torch":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="256B")
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    torch.manual_seed(100 + rank)  # dropout: every rank's stream differs
    return m, opt, sched


def _run(rank: int, world: int, kind: str, root: str, restore: bool) -> list:
    m, opt, sched = _setup(kind, rank, world)
    start = 0
    with Checkpointer(root, every=SAVED + 1) as ck:
        if restore:
            start = ck.restore(model=m, optimizer=opt, scheduler=sched, step=SAVED).step
        for s in range(start, STEPS):
            g = torch.Generator().manual_seed(1000 * s + rank)
            m(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if not restore:
                ck.maybe_save(s, model=m, optimizer=opt, scheduler=sched)
    state = opt.state_dict()["state"] if kind == "torch" else opt.full_state_dict()["state"]
    if kind != "torch":
        opt.close()
    local = [p.to_local().tolist() for p in m.parameters()]
    moments = [
        (v.to_local() if hasattr(v, "to_local") else v).tolist()
        for i in sorted(state)
        for v in state[i].values()
    ]
    return [start, local, moments, torch.rand(2).tolist(), sched.get_last_lr()]


@pytest.mark.parametrize("kind", ["torch", "offloaded"])
def test_fsdp2_resume_on_two_ranks_is_bit_identical(tmp_path, kind):
    root = str(tmp_path / "ck")
    ref = distributed.run(_run, 2, kind, root, False, timeout=60)
    assert os.path.isdir(os.path.join(root, f"step-{SAVED}"))
    got = distributed.run(_run, 2, kind, root, True, timeout=60)
    for r in range(2):
        assert got[r][0] == SAVED + 1
        assert got[r][1:] == ref[r][1:], f"rank {r} differs from the uninterrupted run"
