"""A DTensor with a ``Partial`` placement holds on each rank an addend of its value. The
Checkpointer wrote its local tensor as if it were ``Replicate``: a buffer whose value is 3 on two
gloo ranks was saved as rank 0's addend, 1, silently. Saving or restoring one is now a
``ConfigError`` on every rank that names the fix, and nothing is written or loaded."""

import os

import torch

from tensortier.checkpoint import Checkpointer
from tests import distributed


def _model(rank: int, world: int, partial: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    m = torch.nn.Linear(2, 2)
    mesh = init_device_mesh("cpu", (world,))
    value = torch.full((3,), float(rank + 1)) if partial else torch.full((3,), 3.0)
    m.register_buffer(
        "total", DTensor.from_local(value, mesh, [Partial() if partial else Replicate()])
    )
    return m


def _run(rank: int, world: int, root: str) -> list:
    errors = []
    with Checkpointer(root, every=1000) as ck:
        try:
            ck.save(1, model=_model(rank, world, partial=True))
        except Exception as exc:  # every rank: its own error
            errors.append(f"{type(exc).__name__}: {exc}")
        ck.save(2, model=_model(rank, world, partial=False))
        target = _model(rank, world, partial=True)
        try:
            ck.restore(model=target)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        errors.append(target.total.full_tensor().tolist())  # unchanged
    return errors


def test_a_partial_dtensor_is_refused_at_save_and_restore_on_every_rank(tmp_path):
    root = str(tmp_path / "ck")
    for rank, (saved, restored, value) in enumerate(distributed.run(_run, 2, root, timeout=90)):
        assert saved.startswith("ConfigError: model/total is a DTensor") and "redistribute" in saved
        assert "cannot be restored into it" in restored, rank
        assert value == [3.0] * 3
    assert sorted(os.listdir(root)) == [".tensortier-checkpoint.lock", "step-2"]
