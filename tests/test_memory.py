"""Process memory on CPU (``tensortier._memory``): high-water marks that survive nesting, and an
offloader whose disk tier really takes activations out of the process's RSS."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap

import pytest
import torch

from tensortier._memory import HighWater, reset_peak_rss, status_bytes
from tests._helpers import run_fresh

linux = pytest.mark.skipif(not status_bytes("VmHWM"), reason="needs /proc/self/status")


@linux
def test_a_high_water_mark_survives_a_nested_reset():
    outer = HighWater()
    outer.start()
    # 64 MiB of its own mapping, touched: unmapped at close whatever glibc's heap holds (a
    # torch tensor could be carved from a free heap chunk an earlier test left, and stay in RSS)
    big = mmap.mmap(-1, 64 << 20)
    torch.frombuffer(big, dtype=torch.uint8).fill_(1)
    peak_with_big = status_bytes("VmRSS")
    big.close()
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


HEAP_GROWN_FIRST = textwrap.dedent(
    """
    import json, torch
    from tensortier._device import rss_bytes
    from tensortier._memory import release_freed_memory, trim

    big = torch.ones(16 << 20, dtype=torch.uint8)  # mmapped: its free raises glibc's threshold
    del big
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(128)]  # from the heap now
    top = blocks.pop()  # the last, at the heap's top: the heap cannot shrink below it
    del blocks  # 127 MiB of free chunks in the heap's middle, as plain training leaves them
    release_freed_memory()
    trim()  # as the planner does before it reads resident memory
    base = rss_bytes()
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(64)]
    del blocks
    print(json.dumps({"kept": rss_bytes() - base}))
    """
)


@linux
def test_blocks_freed_after_the_threshold_is_fixed_leave_a_heap_grown_before_it():
    """glibc serves a request from its heap's free chunks before it considers mmap: with only the
    threshold fixed, 64 MiB allocated and freed in 1 MiB blocks stayed resident (64 MiB kept) in
    a heap that grew before the threshold was fixed. Its free chunks are retired when it is."""
    kept = run_fresh(HEAP_GROWN_FIRST, timeout=300)["kept"]
    assert kept < 4 << 20, kept
