"""Offloading from several threads at once: PyTorch's saved-tensor hooks are per thread, so each
thread's forward goes through its own offloader, and one thread's modules never leak into
another thread's pass."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import tensortier as tt


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def _train(model: nn.Module, enter, seed: int, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``model``, each forward inside ``enter()`` (None: plain); returns
    the losses and the final parameters. (Models are made beforehand, on the main thread: the
    global RNG that initializes them is shared by every thread.)"""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        if enter is None:
            out = model(x)
        else:
            with enter():
                out = model(x)
        loss = out.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses + [p.detach().clone() for p in model.parameters()]


def _in_threads(work, n: int = 2) -> list:
    """Run ``work(i, barrier)`` on ``n`` threads; re-raise the first error."""
    results: list = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n, timeout=30)

    def run(i: int) -> None:
        try:
            results[i] = work(i, barrier)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_two_threads_each_train_under_tt_offload_at_once(spill_dir, tier):
    want = [_train(_model(), None, seed=i) for i in range(2)]
    models = [_model() for _ in range(2)]

    def work(i: int, barrier: threading.Barrier) -> list:
        # both threads ask for the same settings before either enters: before the fix they got
        # one shared offloader ("already active", or a ClosedError when the second call closed
        # the first thread's, or one pass mixing both threads' tensors)
        off = tt.offload(tier=tier, spill_dir=spill_dir, min_bytes=0)
        barrier.wait()
        enter = lambda: tt.offload(tier=tier, spill_dir=spill_dir, min_bytes=0)  # noqa: E731
        got = _train(models[i], enter, seed=i)
        assert tt.offload(tier=tier, spill_dir=spill_dir, min_bytes=0) is off  # reused per thread
        assert off.stats.tensors_offloaded > 0
        off.close()
        return got

    got = _in_threads(work)
    for a, b in zip(want, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_another_threads_modules_are_not_tracked_by_this_pass():
    class Alpha(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.alpha = nn.Linear(32, 32)

        def forward(self, x):
            return self.alpha(x).tanh().sum()

    class Beta(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.beta = nn.Linear(32, 32)

        def forward(self, x):
            return self.beta(x).sigmoid().sum()

    seen: list[str] = []
    off = tt.Offloader("host", min_bytes=0, decide=lambda info: seen.append(info.module) or "host")
    a, b = Alpha(), Beta()
    try:
        with off:
            # a model running on another thread meanwhile (not offloaded: hooks are per thread);
            # before the fix its module names replaced this pass's, so Alpha's Linear read as ""
            other = threading.Thread(target=lambda: b(torch.randn(8, 32)).backward())
            other.start()
            other.join(30)
            loss = a(torch.randn(8, 32))
        loss.backward()
    finally:
        off.close()
    assert seen == ["alpha", ""]  # Linear's input in Alpha.alpha, tanh's output in Alpha itself
