"""DCP interop on 2 ranks (gloo): a checkpoint written the way DCP's docs and torchtitan write
one (``get_state_dict``: the optimizer state keyed by parameter FQN), imported and restored on
2 ranks into a sharded OffloadedAdamW (plain and FSDP2); an ``export_dcp`` of a Checkpointer's own
checkpoint loaded with plain ``dcp.load`` + ``set_state_dict`` on 2 ranks."""

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)

from tensortier.checkpoint import Checkpointer, export_dcp, import_dcp
from tensortier.optim import OffloadedAdamW
from tests import distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _fsdp(m: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2], m):
        fully_shard(layer, mesh=mesh)
    return m


def _trained_torch(tmp) -> dict:
    """One process: torch AdamW after 2 steps, saved by DCP from ``get_state_dict``."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(2):
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    assert "0.weight" in osd["state"]  # DCP's layout: keyed by FQN
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(tmp, "dcp"), no_dist=True)
    return opt.state_dict()


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _restore_sharded(rank: int, world: int, root: str, wrap: str) -> list:
    m = _model()
    if wrap == "fsdp":
        _fsdp(m, world)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="256B")
    with Checkpointer(root, read_only=True) as ck:
        ck.restore(model=m, optimizer=opt)
    state = opt.full_state_dict()["state"]
    opt.close()
    return [[_full(v).tolist() for _, v in sorted(state[i].items())] for i in sorted(state)]


def test_imported_fqn_keyed_optimizer_state_restores_into_a_sharded_offloaded_adamw(tmp_path):
    want = _trained_torch(str(tmp_path))["state"]
    root = str(tmp_path / "ck")
    import_dcp(str(tmp_path / "dcp"), root, step=1)
    expected = [[v.tolist() for _, v in sorted(want[i].items())] for i in sorted(want)]
    for wrap in ("sharded", "fsdp"):
        got = distributed.run(_restore_sharded, 2, root, wrap, timeout=60)
        for r in range(2):
            assert got[r] == expected, f"{wrap}: rank {r} lost the imported optimizer state"


def _save_ddp(rank: int, world: int, root: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())
    ddp(torch.randn(4, 8)).square().sum().backward()
    with Checkpointer(root) as ck:
        ck.save(0, model=ddp)


def test_export_of_a_ddp_checkpoint_loads_into_the_bare_model(tmp_path):
    root = str(tmp_path / "ck")
    distributed.run(_save_ddp, 2, root, timeout=60)
    export_dcp(root, str(tmp_path / "dcp"))
    torch.manual_seed(1)
    bare = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    state = {"model": get_model_state_dict(bare)}  # no "module.": DCP's names for DDP's
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    set_model_state_dict(bare, state["model"])
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), _model().parameters()))
