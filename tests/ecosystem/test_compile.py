"""A ``torch.compile``d model under ``tt.offload``: bit for bit against the same compiled model
without offload, or a clear, typed refusal that names what is unsupported; never a silent wrong
result (issue 12, review #15).

In torch 2.13 AOTAutograd disables plain Python saved-tensor hooks while it traces, and the
compiled backward's saved tensors go through them at run time, so offload should work per
compiled region. ``aot_eager`` exercises exactly that without a C compiler; one tiny model also
goes through inductor (gcc on CPU, a few seconds of compile).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import tensortier as tt
from tests.ecosystem._hf import assert_same_params, build, train, twin


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # tensortier tracks modules with global forward hooks; dynamo warns that they fire an
        # extra time for the OptimizedModule wrapper (harmless here: it owns no parameters)
        warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
        yield
    torch._dynamo.reset()


def _train_or_refuse(run) -> bool:
    """Run ``run()``; True if it trained, False if tensortier refused with a typed error that
    names torch.compile (the other acceptable outcome)."""
    try:
        run()
    except tt.TensortierError as e:
        assert "compile" in str(e), f"refusal does not name what is unsupported: {e}"
        return False
    return True


@pytest.mark.parametrize("to", ["host", "disk"])
def test_compiled_hf_gpt2_under_offload_aot_eager(to, spill_dir):
    ref = build("gpt2", dropout=0.1)
    got = twin(ref)
    ref_c = torch.compile(ref, backend="aot_eager")
    got_c = torch.compile(got, backend="aot_eager")
    want_losses = train(ref_c, "gpt2", steps=3, opt=torch.optim.AdamW(ref.parameters(), lr=1e-2))
    opts = dict(tier=to, spill_dir=spill_dir, min_bytes=0)
    off = tt.offload(**opts)
    losses: list[float] = []
    try:
        trained = _train_or_refuse(
            lambda: losses.extend(
                train(
                    got_c,
                    "gpt2",
                    steps=3,
                    opt=torch.optim.AdamW(got.parameters(), lr=1e-2),
                    ctx=lambda: tt.offload(**opts),
                )
            )
        )
        if trained:
            assert off.stats.bytes_offloaded[to] > 0, "nothing was offloaded under compile"
    finally:
        off.close()
    if trained:
        assert losses == want_losses
        assert_same_params(got, ref)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.GELU(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def test_compiled_mlp_under_offload_inductor():
    ref, got = _mlp(), _mlp()
    ref_c, got_c = torch.compile(ref), torch.compile(got)  # inductor
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(8, 16, generator=g) for _ in range(3)]

    def run(model, compiled, ctx):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in xs:
            with ctx():
                loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    run(ref, ref_c, contextlib.nullcontext)
    off = tt.Offloader("host", min_bytes=0)
    try:
        trained = _train_or_refuse(lambda: run(got, got_c, lambda: off))
    finally:
        off.close()
    if trained:
        assert off.stats.bytes_offloaded["host"] > 0
        assert_same_params(got, ref)
