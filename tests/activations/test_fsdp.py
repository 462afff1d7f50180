"""Issue 13: activation offload and recompute around FSDP2 (``fully_shard``, gloo, 2 ranks).

FSDP2 all-gathers each block's parameters for its forward and frees them after it
(``reshard_after_forward=True``), then gathers them again for backward. Those gathered
parameters are not activations: the offloader must never move them (else it copies whole
weights per step and reads storages FSDP2 frees), and ``torch.utils.checkpoint`` recompute
must re-gather them correctly. Gradients must equal plain FSDP2 bit for bit, and the bytes
offloaded must equal those of the same model without FSDP2 (where only activations move).
"""

import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tensortier as tt
from tests import distributed

STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int, ckpt: bool) -> None:
        super().__init__()
        self.up, self.down, self.ckpt = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), ckpt

    def _f(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x):
        return checkpoint(self._f, x, use_reentrant=False) if self.ckpt else self._f(x)


def _model(ckpt: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(32, ckpt) for _ in range(3)], nn.Linear(32, 1))


def _fsdp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    # the head too: a module holding parameters itself, which the offloader's forward pre-hook
    # sees as sharded DTensors (before FSDP2 gathers them; reading their storage raised)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
        for p in model.parameters()
    ]


def _run(rank: int, world: int, to: str, ckpt: bool, spill: str) -> dict:
    plain, offl, local = (_model(ckpt) for _ in range(3))
    plain, offl = _fsdp(plain, world), _fsdp(offl, world)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, offl, local)]
    off = tt.offload(tier=to, spill_dir=spill, min_bytes=0)
    off_local = tt.offload(tier=to, spill_dir=spill, min_bytes=0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g)
        plain(x).square().mean().backward()
        with off:
            loss = offl(x).square().mean()
        loss.backward()
        with off_local:  # same architecture without FSDP2: only activations can move here
            loss = local(x).square().mean()
        loss.backward()
        for a, b in zip(_grads(plain), _grads(offl)):
            assert torch.equal(a, b), "gradients under tt.offload differ from plain FSDP2"
        for opt in opts:
            opt.step()
            opt.zero_grad()
    moved = sum(off.stats.bytes_offloaded.values())
    moved_local = sum(off_local.stats.bytes_offloaded.values())
    off.close()
    off_local.close()
    return {"moved": moved, "moved_local": moved_local}


def _check(tmp_path, to: str, ckpt: bool) -> None:
    spill = str(tmp_path / "spill")
    os.makedirs(spill)
    for r in distributed.run(_run, 2, to, ckpt, spill):
        assert r["moved"] > 0
        assert r["moved"] == r["moved_local"], r  # FSDP2's gathered parameters never moved


def test_offload_to_disk_around_fsdp2_moves_activations_only(tmp_path):
    _check(tmp_path, "disk", ckpt=False)


def test_offload_to_host_with_recompute_under_fsdp2_regathers(tmp_path):
    _check(tmp_path, "host", ckpt=True)


class _Regathered(nn.Module):
    """Moves a buffer to new storage inside its forward and writes an activation into the
    storage it left: as when FSDP2 frees the parameters it gathered for a block once the block's
    forward ends (``reshard_after_forward=True``) and the allocator hands that memory to an
    activation (made deterministic here: the same block, without depending on malloc)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("w", torch.ones(n))

    def forward(self, x):
        left = self.w.untyped_storage()
        self.w.set_(torch.ones(self.w.numel()))
        h = torch.empty(0).set_(left).copy_(x * 2)  # an activation where the buffer was
        return h.sin()


def test_an_activation_at_the_address_of_a_freed_parameter_is_offloaded():
    """The offloader remembered the addresses of the parameters its modules held and kept any
    tensor found there by reference: once FSDP2 had freed a gathered parameter, an activation
    the allocator placed at its address stayed on the device (at random per rank, so the ranks
    profiled different saved tensors and a planned offload failed with ConfigError)."""
    n = 1 << 14
    x = torch.randn(n, requires_grad=True)
    off = tt.offload("host", min_bytes=0)
    with off:
        y = _Regathered(n)(x)
    y.sum().backward()
    assert off.stats.bytes_offloaded["host"] == n * 4  # h, saved by sin, moved
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())
    off.close()
