"""OffloadedAdamW through DCP's ``get_state_dict`` / ``set_state_dict``, the way torchtitan and
FSDP2 users save and resume, compared bit for bit with ``torch.optim.AdamW(fused=True)`` resumed
the same way (one process, and 2 gloo ranks under FSDP2 and DDP)."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from tensortier.optim import OffloadedAdamW
from tests import distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 7), torch.nn.Linear(7, 4)
    )


def _wrapped(wrap: str, world: int) -> torch.nn.Module:
    m = _model()
    if wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(m)
    if wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (m[0], m[2], m[3], m):
            fully_shard(layer, mesh=mesh)
    return m


def _optimizer(kind: str, m: torch.nn.Module):
    if kind == "torch":
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="256B")


def _train(m, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _resumed(kind: str, wrap: str, options: dict, rank: int, world: int, path: str) -> list:
    """Train 3 steps, save with DCP from ``get_state_dict``, load into a fresh model and
    optimizer with ``set_state_dict``, train 2 more; this rank's parameters."""
    opts = StateDictOptions(**options)
    m = _wrapped(wrap, world)
    opt = _optimizer(kind, m)
    _train(m, opt, 3, rank)
    msd, osd = get_state_dict(m, opt, options=opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    m2 = _wrapped(wrap, world)
    opt2 = _optimizer(kind, m2)
    msd2, osd2 = get_state_dict(m2, opt2, options=opts)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    if opts.strict:
        set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)  # fmt: skip
    else:  # the recipe of OffloadedAdamW.state_dict() for a sharded optimizer: the model strictly
        set_model_state_dict(m2, state["model"])
        set_optimizer_state_dict(m2, opt2, state["optim"], options=opts)
    _train(m2, opt2, 2, 10 + rank)
    _train(m, opt, 2, 10 + rank)  # uninterrupted
    return [[_local(p).tolist() for p in x.parameters()] for x in (m2, m)]


CASES = {
    "fsdp": [{}, {"full_state_dict": True}],
    # a sharded OffloadedAdamW (ZeRO-1) holds state for the parameters this rank owns only:
    # DCP's strict check would call the others missing, unless flattened (state_dict()'s doc)
    "ddp": [{"strict": False}, {"flatten_optimizer_state_dict": True}],
}


def _worker(rank: int, world: int, wrap: str, root: str) -> dict:
    return {
        f"{kind}-{i}": _resumed(kind, wrap, o, rank, world, os.path.join(root, f"{kind}-{i}"))
        for kind in ("torch", "tt")
        for i, o in enumerate(CASES[wrap])
    }


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_get_and_set_state_dict_resume_like_torch_adamw_on_two_ranks(wrap, tmp_path):
    reports = distributed.run(_worker, 2, wrap, str(tmp_path), timeout=240)
    for rank, r in enumerate(reports):
        for i, options in enumerate(CASES[wrap]):
            resumed, uninterrupted = r[f"tt-{i}"]
            assert resumed == uninterrupted, (rank, options)
            assert resumed == r[f"torch-{i}"][0], (rank, options)


def test_get_and_set_state_dict_resume_like_torch_adamw_in_one_process(tmp_path):
    got = {k: _resumed(k, "", {}, 0, 1, str(tmp_path / k)) for k in ("torch", "tt")}
    assert got["tt"][0] == got["tt"][1] == got["torch"][0]


def _edited(rank: int, world: int) -> dict:
    """FSDP2 parameters changed in place through the DTensor between steps (``p.mul_`` under
    ``no_grad``, ``nn.init``, ``load_state_dict``): only the DTensor's version counter moves."""
    out = {}
    for kind in ("torch", "tt"):
        m = _wrapped("fsdp", world)
        opt = _optimizer(kind, m)
        saved = {k: v.detach().clone() for k, v in m.state_dict().items()}
        for step in range(3):
            _train(m, opt, 1, rank + step)
            with torch.no_grad():
                if step == 0:
                    [p.mul_(0.5) for p in m.parameters()]
                elif step == 1:
                    torch.nn.init.zeros_(m[2].bias)
                else:
                    m.load_state_dict(saved)
        _train(m, opt, 1, 7)
        out[kind] = [_local(p).tolist() for p in m.parameters()]
    return out


def test_fsdp2_parameters_changed_in_place_through_the_dtensor_are_kept_as_by_torch():
    for r in distributed.run(_edited, 2, timeout=120):
        assert r["tt"] == r["torch"]
