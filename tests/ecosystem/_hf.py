"""Tiny Hugging Face models built from configs, their data, and a plain training loop to compare with.

Every model is 2 layers, hidden 32, vocabulary 96: a step takes milliseconds on CPU and every
code path of the real architectures (attention, MLP, norms, tied embeddings) runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from tests.conftest import bit_equal

VOCAB, SEQ, BATCH = 96, 16, 4
KINDS = ("gpt2", "llama", "bert")


def build(kind: str, *, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """A freshly initialised tiny model (same seed, same weights) in training mode."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
        model = GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
            attention_dropout=dropout,
        )
        model = LlamaForCausalLM(cfg)
    elif kind == "bert":
        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        model = BertForMaskedLM(cfg)
    else:
        raise ValueError(kind)
    return model.train()


BLOCK_PATHS = ("transformer.h", "model.layers", "bert.encoder.layer")


def block_path(model: nn.Module) -> str:
    """Where the model keeps its repeated transformer blocks (where users find them)."""
    names = dict(model.named_modules())
    return next(p for p in BLOCK_PATHS if p in names)


def blocks(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(block_path(model))


def batch(kind: str, i: int) -> dict[str, torch.Tensor]:
    """Batch ``i`` of a fixed synthetic stream (its own generator: the global RNG is the model's)."""
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, SEQ - 3 :] = 0  # one padded row: the attention mask path runs too
    if kind == "bert":
        labels = torch.full_like(ids, -100)
        picked = torch.rand(ids.shape, generator=g) < 0.3
        labels[picked] = ids[picked]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(
    model: nn.Module,
    kind: str,
    *,
    steps: int = 3,
    accum: int = 1,
    ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    opt: torch.optim.Optimizer | None = None,
    seed: int = 1234,
) -> list[float]:
    """The loop every tutorial writes; ``ctx`` wraps each forward. Returns the losses."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)  # dropout masks
    losses = []
    for step in range(steps):
        for micro in range(accum):
            with ctx():
                loss = model(**batch(kind, step * accum + micro)).loss
            (loss / accum).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def twin(model: nn.Module) -> nn.Module:
    """An independent copy with identical weights (and identical tying)."""
    return copy.deepcopy(model)


def assert_same_params(got: nn.Module, want: nn.Module, what: str = "parameters") -> None:
    """Bit-identical parameters, with the names and largest differences when not."""
    bad = []
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        if not bit_equal(a.detach(), b.detach()):
            bad.append(f"{name}: max |diff| {(a.detach() - b.detach()).abs().max().item():.3g}")
    assert not bad, f"{what} differ from plain PyTorch in {len(bad)} tensors: " + "; ".join(bad[:6])


def assert_same_state(got: dict, want: dict) -> None:
    """Two ``torch.optim`` state dicts hold bit-identical per-parameter state."""
    assert sorted(got["state"]) == sorted(want["state"]), "different parameters have state"
    for i, ref in want["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = torch.as_tensor(got["state"][i][key]), torch.as_tensor(ref[key])
            assert bit_equal(a.float(), b.float()), f"state[{i}][{key!r}] differs"
    for g, r in zip(got["param_groups"], want["param_groups"]):
        for key in ("lr", "eps", "weight_decay", "maximize"):
            assert g[key] == r[key], f"param_groups[{key!r}]: {g[key]} != {r[key]}"
        assert tuple(g["betas"]) == tuple(r["betas"])


def params_of(model: nn.Module) -> Iterator[torch.Tensor]:
    return (p for p in model.parameters() if p.requires_grad)


def trainer_args(out_dir, **overrides):
    """HF ``TrainingArguments`` for the CPU tests: deterministic (seed 0, no workers), quiet,
    logging every step, no checkpoints unless ``overrides`` ask for them."""
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=BATCH,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**base, **overrides})
