"""A tiny deterministic training run shared by the checkpoint tests and the crash child.

It draws from every RNG stream a resume must restore (torch: data and dropout; numpy and Python:
noise), has a BatchNorm buffer that forward mutates, AdamW state and a StepLR scheduler.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn


def make(seed: int = 0, width: int = 32):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = nn.Sequential(
        nn.Linear(16, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return model, opt, sched


def step(model, opt, sched, ck=None) -> float:
    x = torch.randn(8, 16) + float(np.random.rand()) + random.random()
    y = x.sum(1, keepdim=True)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    if ck is not None:
        ck.before_optimizer_step()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.item()


def reference(steps: int, width: int = 32):
    """Model, optimizer and scheduler after ``steps`` uninterrupted steps, and the losses."""
    model, opt, sched = make(width=width)
    losses = [step(model, opt, sched) for _ in range(steps)]
    return model, opt, sched, losses


def same_state(a: dict, b: dict) -> bool:
    """Nested state dicts equal bit for bit (tensors by bytes, everything else by ==)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b))
        )
    return a == b
