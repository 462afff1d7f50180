"""Forwards written as users write them, under a ``recompute_all`` plan: bit for bit with plain.

Each model is tiny; six steps take it through warm-up, probe, two timing passes and two planned
steps (every unit recomputed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensortier.planner.policies import Options
from tensortier.planner.runtime import planned_offload

FAST = Options(search_iters=60, search_seconds=5)
W = 32


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Dropout(0.2))


class _Shared(nn.Module):
    """One block used twice in a forward (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.a, self.blk, self.head = nn.Linear(W, W), _block(), nn.Linear(W, 1)

    def forward(self, x):
        return self.head(self.blk(self.blk(self.a(x))))


class _Pair(nn.Module):
    """Returns a tuple holding a dict, as Hugging Face layers return ``ModelOutput``s."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        h = self.lin(x).tanh()
        return h, {"aux": h * 2}


class _Tuples(nn.Module):
    def __init__(self):
        super().__init__()
        self.u, self.v, self.head = _Pair(), _Pair(), nn.Linear(W, 1)

    def forward(self, x):
        h, extra = self.u(x)
        h, extra = self.v(h + extra["aux"])
        return self.head(h + extra["aux"])


class _NoGradPart(nn.Module):
    """A target computed under ``no_grad`` inside the forward, a frozen block before the rest."""

    def __init__(self):
        super().__init__()
        self.frozen, self.target, self.body = _block(), nn.Linear(W, W), _block()
        self.head = nn.Linear(W, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            target = self.target(x).relu()
        return self.head(self.body(self.frozen(x)) * target)


class _Autocast(nn.Module):
    """bfloat16 autocast on the CPU around the blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(_block() for _ in range(3)))
        self.head = nn.Linear(W, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(self.blocks(x)).float()


def _train(make, x: torch.Tensor, ctx=None, steps: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    torch.manual_seed(1)  # the dropout masks
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = m(x).square().mean()
        else:
            with ctx:
                loss = m(x).square().mean()
        loss.backward()
        out += [p.grad.clone() for p in m.parameters() if p.grad is not None]
        opt.step()
    return out + [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize(
    "make",
    [_Shared, _Tuples, _NoGradPart, _Autocast],
    ids=["shared-block", "tuple-and-dict-outputs", "no-grad-and-frozen", "autocast-bf16"],
)
def test_recompute_all_trains_bit_for_bit(spill_dir, make):
    x = torch.randn(16, W)
    plain = _train(make, x)
    off = planned_offload("64MiB", spill_dir=spill_dir, policy="recompute_all", options=FAST)
    try:
        planned = _train(make, x, off)
        assert off.choice is not None and off.choice.plan.recomputed()
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
