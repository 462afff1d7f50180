"""The model and training loop both checkpoint benchmarks use (``checkpoint.py`` and
``checkpoint_replica.py``): an MLP whose parameters plus AdamW state make a chosen size."""

from __future__ import annotations

import math
import time

import torch
from torch import nn


def build(state_bytes: int, device: torch.device, layers: int = 4):
    """An MLP of ``layers`` square layers with AdamW state that totals about ``state_bytes``."""
    params = state_bytes // 12  # fp32 weights + exp_avg + exp_avg_sq
    width = max(8, int(math.sqrt(params / layers)))
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, width


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(model, opt, width, batch, steps, device, *, before_step=None, after_step=None) -> float:
    """Run ``steps`` steps; returns the wall time, including whatever the hooks block."""
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        x = torch.randn(batch, width, device=device)
        model(x).pow(2).mean().backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if after_step is not None:
            after_step(i)
    _sync(device)
    return time.perf_counter() - t0
