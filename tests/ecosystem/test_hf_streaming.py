"""``stream_parameters`` under Hugging Face's own training features (tiny models from configs)."""

from __future__ import annotations

import pytest
import torch

import tensortier as tt
from tests.ecosystem._hf import KINDS, assert_same_params, batch, build, twin

STEPS = 2


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_gradient_checkpointing_of_a_streamed_model_trains_bit_identical(kind, reentrant):
    """``gradient_checkpointing_enable()`` (reentrant by default in transformers) recomputes each
    layer outside the model's forward: every streamed gradient was NaN."""
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    for m in (ref, got):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    streamer = tt.stream_parameters(got)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, got)]
    try:
        for step in range(STEPS):
            for m in (ref, got):
                torch.manual_seed(step)  # the same dropout masks for both
                m(**batch(kind, step)).loss.backward()
            for p, q in zip(got.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
            opts[0].step()
            with streamer.resident():
                opts[1].step()
            for opt in opts:
                opt.zero_grad(set_to_none=True)
    finally:
        streamer.close()
    assert_same_params(got, ref)
