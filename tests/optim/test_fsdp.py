"""Issue 13: OffloadedAdamW under FSDP2 (``fully_shard``, gloo, 2 processes spawned here).

FSDP2 + OffloadedAdamW updates each rank's local shards and gives the bits of FSDP2 +
``torch.optim.AdamW(fused=True)`` (plain and with ``clip_grad_norm_`` over DTensor gradients);
its state is DTensor with the parameters' layout (DCP saves and reloads it); the Checkpointer
saves the FSDP2 model and optimizer on 2 ranks and restores them in one process.
"""

import os

import torch

from tensortier.checkpoint import Checkpointer
from tensortier.optim import OffloadedAdamW
from tests import distributed

STEPS = 10


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 7), torch.nn.Linear(7, 4)
    )


def _fsdp(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(kind: str, clip: bool, rank: int, world: int):
    m = _fsdp(_model(), world)
    if kind == "torch":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    else:
        opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="256B")
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        m(torch.randn(4, 8, generator=g)).square().mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return m, opt


def _local_equal(a, b) -> bool:
    return all(
        torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters())
    )


def _worker(rank: int, world: int, root: str, out: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    report = {}
    for clip in (False, True):
        ref, topt = _train("torch", clip, rank, world)
        got, opt = _train("tt", clip, rank, world)
        report[f"equal-{clip}"] = _local_equal(ref, got)
        if clip:
            opt.close()
            continue
        sd, tsd = opt.state_dict(), topt.state_dict()
        report["dtensor_state"] = all(
            isinstance(sd["state"][i][k], DTensor)
            and sd["state"][i][k].placements == tsd["state"][i][k].placements
            and torch.equal(sd["state"][i][k].to_local(), tsd["state"][i][k].to_local())
            for i in tsd["state"]
            for k in ("exp_avg", "exp_avg_sq")
        )
        full = opt.full_state_dict()
        report["full_state"] = all(
            torch.equal(full["state"][i][k], tsd["state"][i][k].full_tensor())
            for i in tsd["state"]
            for k in ("exp_avg", "exp_avg_sq")
        )
        # DCP: save the DTensor state, load it into a fresh optimizer over the same model
        dcp.save({"optimizer": sd}, checkpoint_id=os.path.join(out, "dcp"))
        fresh = OffloadedAdamW(got.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="256B")
        target = {"optimizer": fresh.state_dict()}
        dcp.load(target, checkpoint_id=os.path.join(out, "dcp"))
        fresh.load_state_dict(target["optimizer"])
        again = fresh.full_state_dict()
        report["dcp"] = all(
            torch.equal(again["state"][i][k], full["state"][i][k])
            for i in full["state"]
            for k in ("step", "exp_avg", "exp_avg_sq")
        )
        fresh.close()
        with Checkpointer(root, every=1000) as ck:
            ck.save(STEPS - 1, model=got, optimizer=opt)
        if rank == 0:
            torch.save(
                {"full": full, "params": [p.full_tensor() for p in got.parameters()]},
                os.path.join(out, "saved.pt"),
            )
        else:
            [p.full_tensor() for p in got.parameters()]  # collectives
        opt.close()
    return report


def test_fsdp2_matches_fused_adamw_and_checkpoints(tmp_path):
    root, out = str(tmp_path / "ck"), str(tmp_path)
    reports = distributed.run(_worker, 2, root, out, timeout=180)
    for rank, r in enumerate(reports):
        for key in ("equal-False", "equal-True", "dtensor_state", "full_state", "dcp"):
            assert r[key] is True, (rank, key)
    # the FSDP2 checkpoint (DTensor shards of 2 ranks) restores in one process, in full
    saved = torch.load(os.path.join(out, "saved.pt"))
    m = _model()
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    with Checkpointer(root) as ck:
        assert ck.restore(model=m, optimizer=opt).saved_step == STEPS - 1
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), saved["params"]))
    sd = opt.state_dict()
    assert all(
        torch.equal(sd["state"][i][k], saved["full"]["state"][i][k])
        for i in saved["full"]["state"]
        for k in ("step", "exp_avg", "exp_avg_sq")
    )
    opt.close()
