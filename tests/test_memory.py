"""Process memory on CPU (``tensortier._memory``): high-water marks that survive nesting, and an
offloader whose disk tier really takes activations out of the process's RSS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tensortier._memory import HighWater, reset_peak_rss, status_bytes

linux = pytest.mark.skipif(not status_bytes("VmHWM"), reason="needs /proc/self/status")


@linux
def test_a_high_water_mark_survives_a_nested_reset():
    outer = HighWater()
    outer.start()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    peak_with_big = status_bytes("VmRSS")
    del big
    inner = HighWater()
    inner.start()  # resets the kernel's mark, as every meter must
    reset_peak_rss()  # and someone else's reset too
    assert inner.stop() < peak_with_big - (32 << 20)
    # the mark the resets erased was handed to the open watch (give or take a few pages)
    assert outer.stop() >= peak_with_big - (1 << 20)


SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import tensortier as tt
    from tensortier._device import rss_bytes
    from tensortier._memory import HighWater
    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=512)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = random_batch(cfg, 16)
    off = tt.Offloader("disk", spill_dir=sys.argv[1], min_bytes="256KiB", prefetch_budget="16MiB",
                       inflight_budget="16MiB") if sys.argv[2] == "disk" else None
    base = rss_bytes()
    peaks = []
    for _ in range(4):
        w = HighWater(); w.start()
        if off is None:
            loss = model(x, y)
        else:
            with off:
                loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
        peaks.append(w.stop() - base)
    print(json.dumps(peaks))
    """
)


def _peaks(tmp_path, variant: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), variant],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux
@pytest.mark.slow
def test_a_disk_offloader_on_cpu_keeps_every_step_low_from_the_first(tmp_path):
    """glibc keeps freed activations in its heap (a step's RSS peak stayed near plain's with
    everything on disk) unless its mmap threshold is fixed, which a CPU disk offloader does."""
    plain = max(_peaks(tmp_path, "plain"))
    disk = _peaks(tmp_path, "disk")
    assert max(disk) < 0.6 * plain, (disk, plain)
