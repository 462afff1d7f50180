"""Tiny Hugging Face models built from configs (never downloaded) under ``tt.offload(budget=)``:
the planner sees their layers, and training with dropout on is bit-identical to plain."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tensortier.planner.policies import Options  # noqa: E402
from tensortier.planner.profiler import plan_units  # noqa: E402
from tensortier.planner.runtime import planned_offload  # noqa: E402

FAST = Options(search_iters=60, search_seconds=5)
VOCAB, SEQ = 128, 64


def _build(kind: str) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":  # dropout 0.1 on embeddings, attention and residuals by default
        cfg = transformers.GPT2Config(
            n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ
        )
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=3,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            attention_dropout=0.1,
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.BertConfig(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return transformers.BertForMaskedLM(cfg)


LAYERS = {
    "gpt2": ["transformer.h.0", "transformer.h.1", "transformer.h.2"],
    "llama": ["model.layers.0", "model.layers.1", "model.layers.2"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"],
}
OTHERS = {
    "gpt2": ["transformer.wte", "transformer.ln_f", "lm_head"],
    "llama": ["model.embed_tokens", "model.norm", "lm_head"],
    "bert": ["bert.embeddings", "cls"],
}


def _train(model, ids, steps, ctx=None) -> list[torch.Tensor]:
    model.train()  # dropout on
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_model_is_planned_per_layer_and_trains_bit_identically(kind, spill_dir):
    units = list(plan_units(_build(kind)))
    assert all(name in units for name in LAYERS[kind] + OTHERS[kind]), units
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    plain = _train(_build(kind), ids, 6)
    # the offloader keeps a few MiB of staging and read buffers resident (they count in the
    # budget); these tiny models then fit with room, and every profiling pass still offloads
    off = planned_offload("48MiB", spill_dir=spill_dir, options=FAST)
    try:
        # warm-up, probe, 2 timing passes, then 2 steps of the plan
        planned = _train(_build(kind), ids, 6, off)
    finally:
        off.close()
    planned_units = [u.name for u in off.profile.units]
    assert all(name in planned_units for name in LAYERS[kind]), planned_units
    assert set(off.choice.plan.actions) >= set(LAYERS[kind])  # one decision per layer
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
