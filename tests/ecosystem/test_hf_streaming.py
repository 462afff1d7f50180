"""``stream_parameters`` under Hugging Face's own training features (tiny models from configs)."""

from __future__ import annotations

import pytest
import torch

import tensortier as tt
from tensortier.errors import ConfigError
from tests.ecosystem._hf import KINDS, VOCAB, assert_same_params, batch, build, twin

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


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_steps_run_wholly_inside_resident_train_bit_identical(kind):
    """Forward, backward and step inside ``resident()`` (a loop that steps where it computes):
    the block ran under ``no_grad``, so ``loss.backward()`` failed with torch's "element 0 of
    tensors does not require grad"."""
    ref = build(kind)
    got = twin(ref)
    streamer = tt.stream_parameters(got)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, got)]
    try:
        for step in range(STEPS):
            ref(**batch(kind, step)).loss.backward()
            opts[0].step()
            with streamer.resident():
                got(**batch(kind, step)).loss.backward()
                opts[1].step()
            for opt in opts:
                opt.zero_grad(set_to_none=True)
    finally:
        streamer.close()
    assert_same_params(got, ref)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_resize_token_embeddings_while_streamed_is_refused_and_the_fix_trains(kind):
    """``resize_token_embeddings`` copied the NaN placeholders into the new embedding and head;
    ``state_dict()`` (``save_pretrained``) saved them silently, and an untied head's weights
    were lost even after ``close()``; inside ``resident()`` the new embedding went (host tier:
    torch's size mismatch) or stayed half-stored (disk tier). Now it is refused naming the fix,
    which trains bit for bit as the plain resized model."""
    ref = build(kind)
    got = twin(ref)
    streamer = tt.stream_parameters(got)
    refused = pytest.raises(ConfigError, match="resize_token_embeddings.*close")
    with refused, streamer.resident():  # the real values are installed, not kept when resized
        got.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    with pytest.raises(ConfigError, match="resize_token_embeddings.*close"):
        # Llama's untied head is replaced by a new one: refused at once; GPT-2's tied embedding
        # is resized in place: its next use is refused
        got.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
        got.state_dict()
    with pytest.raises(ConfigError, match="resize_token_embeddings.*close"):
        got(**batch(kind, 0))
    streamer.close()  # the fix the error names: close, resize, stream again
    for m in (ref, got):
        torch.manual_seed(7)  # the new rows' initialisation
        m.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    assert_same_params(got, ref)
    streamer = tt.stream_parameters(got)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, got)]
    try:
        for step in range(STEPS):
            for m in (ref, got):
                m(**batch(kind, step)).loss.backward()
            opts[0].step()
            with streamer.resident():
                opts[1].step()
    finally:
        streamer.close()
    assert_same_params(got, ref)
