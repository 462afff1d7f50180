"""The ``decide`` hook's contract (what the planner relies on): one decision per storage and
forward, numbered in pack order whether the storage is kept or moved."""

from __future__ import annotations

import re

import pytest
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


def _forward(off: tt.Offloader) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    with off:
        loss = model(torch.randn(32, 64)).sum()
    loss.backward()


@pytest.mark.parametrize(
    "returned, says",
    [
        ("disk", "has no disk tier; make it with tier='auto'"),
        (tt.Action("disk"), "has no disk tier; make it with tier='auto'"),
        (None, "decide returned None; return an Action"),
        (5, "decide returned 5; return an Action"),
    ],
)
def test_a_decision_the_offloader_cannot_carry_out_says_how_to_fix_it(spill_dir, returned, says):
    """``"disk"`` on a host offloader raised the transfer engine's ValueError "pass
    disk=DiskStore(spill_dir)" (an engine the user never made); a value that is no decision raised
    AttributeError inside the pack hook."""
    off = tt.Offloader("host", spill_dir=spill_dir, min_bytes=0, decide=lambda info: returned)
    with pytest.raises(tt.ConfigError, match=re.escape(says)):
        _forward(off)
    off.close()
    if says.startswith("has no disk"):  # the fix it names works
        off = tt.Offloader("auto", spill_dir=spill_dir, min_bytes=0, decide=lambda i: returned)
        _forward(off)
        assert off.stats.bytes_offloaded["disk"] > 0
        off.close()
