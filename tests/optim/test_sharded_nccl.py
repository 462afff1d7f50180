"""Issue 13 on GPUs (NCCL, 2 ranks, one GPU each): sharded OffloadedAdamW under DDP gives the
parameters of DDP + ``torch.optim.AdamW(fused=True)`` (CUDA fused kernel: compared with a
tolerance, the CPU kernel rounds differently), its host state is 1/N, and the Checkpointer saves
on NCCL ranks (its own gloo groups) and restores in one process."""

import os

import pytest
import torch

from tests import distributed

pytestmark = pytest.mark.gpu


def _worker(rank: int, world: int, root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensortier.checkpoint import Checkpointer
    from tensortier.optim import OffloadedAdamW

    dev = torch.device("cuda", rank)
    models = []
    for kind in ("torch", "tt"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
        m = m.to(dev)
        ddp = DDP(m, device_ids=[rank])
        if kind == "torch":
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        else:
            opt = OffloadedAdamW(m.parameters(), lr=1e-3, bucket_size="16KiB")
        g = torch.Generator().manual_seed(rank)
        for _ in range(10):
            ddp(torch.randn(16, 64, generator=g).to(dev)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        models.append(m)
        if kind == "tt":
            with Checkpointer(root, every=1000) as ck:
                ck.save(9, model=m, optimizer=opt)
            bytes_ = opt.stats().host_state_bytes
            opt.close()
    close = all(
        torch.allclose(p, q, atol=1e-5, rtol=1e-4)
        for p, q in zip(models[0].parameters(), models[1].parameters())
    )
    return {"close": close, "bytes": bytes_}


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_sharded_on_nccl_matches_fused_adamw_and_checkpoints(tmp_path):
    root = str(tmp_path / "ck")
    reports = distributed.run(_worker, 2, root, backend="nccl", timeout=300)
    assert all(r["close"] for r in reports)
    from tensortier.checkpoint import Checkpointer

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    with Checkpointer(root) as ck:
        assert ck.restore(model=m).saved_step == 9
    assert os.path.isdir(os.path.join(root, "step-9", "rank-00001"))
