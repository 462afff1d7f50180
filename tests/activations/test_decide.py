"""The ``decide`` hook's contract (what the planner relies on): one decision per storage and
forward, numbered in pack order whether the storage is kept or moved."""

from __future__ import annotations

import torch

import tensortier as tt


class _Twice(torch.autograd.Function):
    """Saves the same tensor for backward twice (as two ops sharing an input do)."""

    @staticmethod
    def forward(ctx, x, w):
        y = x * w
        ctx.save_for_backward(y, y, w)
        return y * y

    @staticmethod
    def backward(ctx, g):
        y, y2, w = ctx.saved_tensors
        return g * (y + y2) * w, None


def test_every_storage_is_decided_once_and_numbered_in_pack_order(spill_dir):
    seen = []

    def decide(info):
        seen.append(info.index)
        return "keep" if info.index % 2 == 0 else "disk"  # keep, move, keep, move...

    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(3)]
    x = torch.randn(64, 256, requires_grad=True)
    off = tt.Offloader("disk", spill_dir=spill_dir, decide=decide, min_bytes=0)
    try:
        with off:
            h = x
            for lin in layers:
                h = _Twice.apply(torch.relu(lin(h)), torch.ones(256))
            loss = h.sum()
        loss.backward()
    finally:
        off.close()
    # indices 0, 1, 2, ...: kept storages count too (they used to stay at the record count, so
    # every keep before the first move read as index 0, "a new forward"), and the storage
    # saved twice by _Twice is decided once whether it was kept or moved
    assert seen == list(range(len(seen))) and len(seen) >= 6
    assert off.stats.tensors_offloaded == len([i for i in seen if i % 2])
