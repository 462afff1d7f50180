"""DTensors replicated over a mesh dimension (tensor parallel's ``RowwiseParallel`` bias, HSDP's
replica dimension): every rank holds the same chunk. They were written by every holder, and
restore then refused every such checkpoint as damaged ("the saved chunks cover 8 of 4
elements"). Now one holder writes each chunk, and a checkpoint written the old way restores."""

import json
import os
import shutil

import pytest
import torch

from tensortier.checkpoint import Checkpointer
from tensortier.checkpoint._format import MANIFEST, manifest_bytes
from tests import distributed


def _build(kind: str, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if kind == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:  # HSDP: replicated over the first mesh dimension, sharded over the second
        from torch.distributed.fsdp import fully_shard

        fully_shard(m, mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard")))
    return m


def _step(m, opt, s: int) -> None:
    m(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _run(rank: int, world: int, kind: str, root: str, restore: bool) -> list:
    m = _build(kind, world)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with Checkpointer(root, every=1000) as ck:
        start = ck.restore(model=m, optimizer=opt).step if restore else 0
        for s in range(start, 4):
            _step(m, opt, s)
            if s == 1 and not restore:
                ck.save(s, model=m, optimizer=opt)
    state = opt.state_dict()["state"]
    return [p.to_local().tolist() for p in m.parameters()] + [
        v.to_local().tolist() if hasattr(v, "to_local") else v.tolist()
        for i in sorted(state)
        for v in state[i].values()
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (the directory its uninterrupted run checkpointed step 1 into, that run's end)."""
    runs: dict = {}

    def get(kind: str) -> tuple[str, list]:
        if kind not in runs:
            root = str(tmp_path_factory.mktemp(kind) / "ck")
            runs[kind] = root, distributed.run(_run, 2, kind, root, False, timeout=60)
        return runs[kind]

    return get


@pytest.mark.parametrize("kind", ["tp", "hsdp"])
def test_replicated_dtensors_are_written_once_and_resume_bit_identical(saved, tmp_path, kind):
    root, ref = saved(kind)
    with open(os.path.join(root, "step-1", MANIFEST)) as f:
        ranks = json.load(f)["body"]["ranks"]
    chunks = [(n, str(r["chunks"].get(n))) for r in ranks for n in r["tensors"]]
    assert len(chunks) == len(set(chunks)), "a replicated chunk was written by both ranks"
    copy = str(tmp_path / "ck")
    shutil.copytree(root, copy)
    assert distributed.run(_run, 2, kind, copy, True, timeout=60) == ref


def test_a_checkpoint_with_a_replicated_chunk_written_twice_restores(saved, tmp_path):
    root, ref = saved("tp")
    copy = str(tmp_path / "ck")
    shutil.copytree(root, copy)
    path = os.path.join(copy, "step-1", MANIFEST)
    with open(path) as f:
        body = json.load(f)["body"]
    r0, r1 = body["ranks"]
    bias = "model/2.bias"  # Replicate: what the writer before the fix wrote on rank 1 too
    assert bias in r0["tensors"] and bias not in r1["tensors"]
    r1["tensors"][bias], r1["chunks"][bias] = r0["tensors"][bias], r0["chunks"][bias]
    with open(path, "wb") as f:
        f.write(manifest_bytes(body))
    assert distributed.run(_run, 2, "tp", copy, True, timeout=60) == ref
