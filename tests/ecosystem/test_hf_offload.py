"""Activation offload around Hugging Face models, trained a few steps, bit for bit against plain PyTorch.

Each test trains a fresh tiny GPT-2 / Llama / BERT (built from a config) twice from identical
weights, on identical batches and dropout seeds: once plain, once the way a user would add
tensortier. Offloading moves saved tensors and must never change a single bit of the result.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tensortier as tt
from tensortier.errors import ConfigError
from tests.ecosystem._hf import (
    KINDS,
    assert_same_params,
    batch,
    block_path,
    blocks,
    build,
    train,
    trainer_args,
    twin,
)

STEPS = 3


@pytest.mark.parametrize("to", ["host", "disk"])
@pytest.mark.parametrize("kind", KINDS)
def test_offload_trains_bit_identical(kind, to, spill_dir):
    ref = build(kind, dropout=0.1)  # dropout on: offloading must not draw from the RNG
    got = twin(ref)
    want_losses = train(ref, kind, steps=STEPS)
    off = tt.offload(tier=to, spill_dir=spill_dir, min_bytes=0)
    try:
        losses = train(
            got,
            kind,
            steps=STEPS,
            ctx=lambda: tt.offload(tier=to, spill_dir=spill_dir, min_bytes=0),
        )
        assert off.stats.bytes_offloaded[to] > 0 and off.stats.passes == STEPS
    finally:
        off.close()
    assert losses == want_losses
    assert_same_params(got, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_offload_module_on_the_block_list_trains_bit_identical(kind):
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    train(ref, kind, steps=STEPS)
    handle = tt.offload_module(blocks(got), tier="host", min_bytes=0)
    off = handle.offloader  # after remove() the handle holds it only weakly: it may be collected
    try:
        train(got, kind, steps=STEPS)
        assert off.stats.bytes_offloaded["host"] > 0
    finally:
        handle.remove()
        off.close()
    assert_same_params(got, ref)


def test_a_copy_of_a_model_under_offload_module_runs_plainly_once_removed(spill_dir):
    """``copy.deepcopy(model)`` after ``offload_module`` (an EMA, a reference or teacher model)
    copies the hooks, which call the same offloader: after ``handle.remove()`` the copy's
    forward raised ``ClosedError`` ("tt.offload() closes the previous settings' offloader"). The
    copy's hooks now stop with the original's."""
    model = build("gpt2")
    plain = twin(model)
    handle = tt.offload_module(blocks(model), tier="disk", spill_dir=spill_dir, min_bytes=0)
    teacher = copy.deepcopy(model)
    handle.remove()
    x = batch("gpt2", 0)
    teacher(**x).loss.backward()
    plain(**x).loss.backward()
    for (name, a), b in zip(teacher.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("kind", KINDS)
def test_offload_module_runs_one_pass_per_forward(kind):
    """One offload pass spans the forward however many blocks are hooked (issue 12 #4: each
    block's exit closed a pass and fetched that block's activations straight back, so nothing
    was saved; the GPU check of the memory itself is in ``test_gpu.py``)."""
    model = build(kind)
    handle = tt.offload_module(blocks(model), tier="host", min_bytes=0)
    off = handle.offloader  # kept: after remove() the handle holds it only weakly
    try:
        for step in range(2):
            loss = model(**batch(kind, step)).loss
            stats = off.stats
            assert stats.bytes_offloaded["host"] > 0
            assert stats.passes == step + 1, f"{stats.passes} passes for {step + 1} forwards"
            loss.backward()
            model.zero_grad(set_to_none=True)
    finally:
        handle.remove()
        off.close()


@pytest.mark.parametrize("kind", KINDS)
def test_planner_budget_trains_bit_identical_with_dropout(kind, spill_dir):
    """``tt.offload(budget=...)``: warm-up, probe, timing passes, then the plan; dropout masks
    must be the plain run's in every one of them (issue 12 #7: the probe drew from the RNG)."""
    steps = 6  # warm-up, probe, two timing passes, two planned steps
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    want_losses = train(ref, kind, steps=steps)
    opts = dict(budget="64MiB", spill_dir=spill_dir, tier="disk")
    off = tt.offload(**opts)
    try:
        losses = train(got, kind, steps=steps, ctx=lambda: tt.offload(**opts))
        assert off.choice is not None, "no plan was chosen after the profiling passes"
    finally:
        off.close()
    assert losses == want_losses
    assert_same_params(got, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_planner_sees_each_block_of_a_nested_hf_model(kind, spill_dir):
    """HF models keep their blocks in nested lists (``transformer.h``, ``model.layers``,
    ``bert.encoder.layer``): the plan must be per block, not backbone + head (issue 12 #7)."""
    model = build(kind)
    opts = dict(budget="64MiB", spill_dir=spill_dir, tier="disk")
    off = tt.offload(**opts)
    try:
        train(model, kind, steps=5, ctx=lambda: tt.offload(**opts))
        names = [u.name for u in off.profile.units]
    finally:
        off.close()
    path = block_path(model)
    per_block = [n for n in names if n.startswith(path + ".")]
    assert {n.split(".")[len(path.split("."))] for n in per_block} == {"0", "1"}, names


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gradient_accumulation_under_offload(kind, spill_dir):
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    train(ref, kind, steps=2, accum=3)
    off = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0)
    try:
        train(
            got,
            kind,
            steps=2,
            accum=3,
            ctx=lambda: tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0),
        )
    finally:
        off.close()
    assert_same_params(got, ref)


def test_tied_gpt2_weights_stay_tied_and_identical_under_offload(spill_dir):
    ref = build("gpt2", dropout=0.1)
    got = twin(ref)
    assert got.lm_head.weight is got.transformer.wte.weight  # GPT-2 ties its output embedding
    train(ref, "gpt2", steps=STEPS)
    off = tt.offload(tier="host", min_bytes=0)
    try:
        train(got, "gpt2", steps=STEPS, ctx=lambda: tt.offload(tier="host", min_bytes=0))
    finally:
        off.close()
    assert got.lm_head.weight is got.transformer.wte.weight
    assert_same_params(got, ref)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_torch_checkpoint_blocks_inside_offload(kind, spill_dir):
    """Users wrap some blocks in ``torch.utils.checkpoint`` and offload the rest."""

    def wrap(model):
        model.config.use_cache = False  # as HF does under checkpointing: no cache to grow twice
        for block in blocks(model)[:1]:
            block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(
                block.forward
            )
        return model

    ref = wrap(build(kind, dropout=0.1))
    got = wrap(build(kind, dropout=0.1))
    train(ref, kind, steps=STEPS)
    off = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0)
    try:
        train(
            got,
            kind,
            steps=STEPS,
            ctx=lambda: tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0),
        )
    finally:
        off.close()
    assert_same_params(got, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_gradient_checkpointing_under_offload(kind, spill_dir):
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    for m in (ref, got):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train(ref, kind, steps=STEPS)
    off = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0)
    try:
        train(
            got,
            kind,
            steps=STEPS,
            ctx=lambda: tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0),
        )
        assert off.stats.bytes_offloaded["disk"] > 0
    finally:
        off.close()
    assert_same_params(got, ref)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_stream_parameters_trains_a_tied_hf_model_bit_identical(kind):
    """GPT-2 ties ``lm_head`` to ``wte``, BERT ties the MLM decoder to the word embeddings: a
    parameter owned by two modules must stream as one (issue 12 #3)."""
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    train(ref, kind, steps=STEPS)
    streamer = tt.stream_parameters(got)
    try:
        opt = torch.optim.AdamW(got.parameters(), lr=1e-2)
        torch.manual_seed(1234)
        for step in range(STEPS):
            loss = got(**batch(kind, step)).loss
            assert torch.isfinite(loss), f"streamed loss {loss.item()} at step {step}"
            loss.backward()
            with streamer.resident():
                opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        streamer.close()
    assert_same_params(got, ref)


@pytest.mark.parametrize("how", ["offload_module", "tt.offload"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_activation_offload_with_streamed_parameters(kind, how, spill_dir):
    """Parameters streamed and activations offloaded, the two memory savers together. Only the
    innermost saved-tensor hooks run: ``offload_module`` inside the streamed model kept the
    streamed parameters by reference, so backward read their NaN placeholders (wrong gradients,
    silently); ``tt.offload`` around it offloaded nothing. Each now hands on what the other owns."""
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    train(ref, kind, steps=2)
    streamer = tt.stream_parameters(got)
    handle = None
    if how == "offload_module":
        handle = tt.offload_module(blocks(got), tier="disk", spill_dir=spill_dir, min_bytes=0)
        off, ctx = handle.offloader, contextlib.nullcontext
    else:
        off = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0)
        ctx = lambda: off  # noqa: E731
    try:
        opt = torch.optim.AdamW(got.parameters(), lr=1e-2)
        torch.manual_seed(1234)
        for step in range(2):
            with ctx():
                loss = got(**batch(kind, step)).loss
            loss.backward()
            with streamer.resident():
                opt.step()
            opt.zero_grad(set_to_none=True)
        assert off.stats.bytes_offloaded["disk"] > 0, "no activation was offloaded"
    finally:
        streamer.close()
        if handle is not None:
            handle.remove()
        off.close()
    assert_same_params(got, ref)


def _streamed_steps(model, kind: str, streamer, opt, steps: range) -> None:
    torch.manual_seed(1234)
    for step in steps:
        model(**batch(kind, step)).loss.backward()
        with streamer.resident() if streamer else contextlib.nullcontext():
            opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_streamed_hf_model_saves_and_loads_its_real_weights(kind, tier, tmp_path, spill_dir):
    """While streamed, a model's parameters hold NaN placeholders between forwards: its
    ``state_dict()``, ``save_pretrained`` and a ``Checkpointer`` save wrote the NaNs (silently: the
    reloaded model was all NaN), and ``load_state_dict`` into it failed with torch's "more than
    one element of the written-to tensor". Both now see the real weights (tied ones included)."""
    ref = build(kind, dropout=0.1)
    got = twin(ref)
    later = build(kind, seed=5)  # weights loaded into the streamed model mid-run
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _streamed_steps(ref, kind, None, ref_opt, range(1))
    streamer = tt.stream_parameters(got, tier=tier, spill_dir=spill_dir)
    try:
        opt = torch.optim.AdamW(got.parameters(), lr=1e-2)
        _streamed_steps(got, kind, streamer, opt, range(1))
        want = {k: v.clone() for k, v in ref.state_dict().items()}
        saved = got.state_dict()
        assert list(saved) == list(want)
        assert all(torch.equal(saved[k], want[k]) for k in want), "state_dict() is not the weights"
        got.save_pretrained(tmp_path / "hf")
        with tt.Checkpointer(tmp_path / "ck") as ck:
            ck.save(1, model=got)
        ref.load_state_dict(later.state_dict())
        got.load_state_dict(later.state_dict())  # then trained on, streamed
        _streamed_steps(ref, kind, None, ref_opt, range(1, 2))
        _streamed_steps(got, kind, streamer, opt, range(1, 2))
    finally:
        streamer.close()
    assert_same_params(got, ref)
    reloaded = type(got).from_pretrained(tmp_path / "hf")
    restored = build(kind, seed=9)
    with tt.Checkpointer(tmp_path / "ck") as ck:
        ck.restore(model=restored)
    for other in (reloaded, restored):
        for name, w in other.state_dict().items():
            assert torch.equal(w, want[name]), f"{name} was saved from the placeholders"


@pytest.mark.parametrize("make", ["fused", "foreach", "offloaded"])
def test_an_optimizer_step_outside_resident_names_the_fix(make):
    """A streamed model's parameters are placeholders between forwards; ``opt.step()`` without
    ``with streamer.resident():`` (the HF ``Trainer``'s loop, or a forgotten line) wrote into
    them: fused AdamW (the ``Trainer``'s default) crashed the process with a segmentation fault,
    foreach AdamW raised torch's "more than one element of the written-to tensor". It is a
    ``ConfigError`` naming the fix, raised before anything changed."""
    ref = build("gpt2")
    got = twin(ref)
    streamer = tt.stream_parameters(got)
    try:
        if make == "offloaded":
            opt = tt.OffloadedAdamW(got.parameters(), lr=1e-2)
        else:
            opt = torch.optim.AdamW(got.parameters(), lr=1e-2, **{make: True})
        got(**batch("gpt2", 0)).loss.backward()
        with pytest.raises(ConfigError, match=r"streamer\.resident\(\)"):
            opt.step()
        with streamer.resident():
            opt.step()  # the step refused changed nothing: this one is the first
    finally:
        streamer.close()
        if make == "offloaded":
            opt.close()
    flags = {"foreach": True} if make == "foreach" else {"fused": True}  # offloaded: fused's bits
    want = torch.optim.AdamW(ref.parameters(), lr=1e-2, **flags)
    ref(**batch("gpt2", 0)).loss.backward()
    want.step()
    assert_same_params(got, ref)


def test_copying_a_streamed_hf_model_names_the_fix():
    """``copy.deepcopy(model)`` (an EMA, ``AveragedModel``, a reference model) of a streamed model
    failed deep in ``copy`` with "cannot pickle '_queue.SimpleQueue' object"; a copy would hold
    the placeholders anyway. It is a ``ConfigError`` naming what to copy instead."""
    model = build("gpt2")
    streamer = tt.stream_parameters(model)
    try:
        with pytest.raises(ConfigError, match="state_dict"):
            copy.deepcopy(model)
        with pytest.raises(ConfigError, match="state_dict"):
            torch.optim.swa_utils.AveragedModel(model)
    finally:
        streamer.close()
    copy.deepcopy(model)  # resident again: copies as any model


@pytest.mark.parametrize("kind", KINDS)
def test_stream_parameters_with_an_indexed_device(kind):
    """``device`` spelled with an index (``cuda:0`` on a GPU, ``cpu:0`` here) is the same device
    as the parameters' (issue 12 #3: never matched, NaN gradients)."""
    ref = build(kind)
    got = twin(ref)
    x = batch(kind, 0)
    ref(**x).loss.backward()
    streamer = tt.stream_parameters(got, device=torch.device("cpu", 0))
    try:
        got(**x).loss.backward()
    finally:
        streamer.close()
    for (name, a), (_, b) in zip(got.named_parameters(), ref.named_parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name


# ----------------------------------------------------------------------------- HF Trainer
def _trainer_history(model, tmp_path, offload=None) -> list[tuple]:
    """Eight optimizer steps of HF ``Trainer`` with gradient accumulation over two batches,
    clipping and dropout; with ``offload``, the forward runs inside it, the way a user adds
    tensortier to a Trainer: ``compute_loss`` overridden (accelerate calls ``backward`` later,
    outside the block). The logged loss and gradient norm of every step."""
    from transformers import Trainer

    class OffloadTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            with offload():
                return super().compute_loss(model, inputs, *args, **kwargs)

    rows = [{k: v[i] for k, v in batch("gpt2", j).items()} for j in range(6) for i in range(4)]
    args = trainer_args(tmp_path, gradient_accumulation_steps=2, max_steps=8, max_grad_norm=0.5)
    trainer = (OffloadTrainer if offload else Trainer)(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("how", ["host", "disk", "budget"])
def test_hf_trainer_with_offload_in_compute_loss_is_bit_identical(how, tmp_path, spill_dir):
    ref = build("gpt2", dropout=0.1)
    got = twin(ref)
    want = _trainer_history(ref, tmp_path / "ref")
    if how == "budget":
        off = tt.offload(budget="64MiB", spill_dir=spill_dir)
    else:
        off = tt.offload(tier=how, spill_dir=spill_dir, min_bytes=0)
    try:
        history = _trainer_history(got, tmp_path / "tt", lambda: off)
        if how == "budget":  # through warm-up, profiling and trials to the plan
            assert off.choice is not None
        else:
            assert off.stats.bytes_offloaded[how] > 0 and off.stats.passes == 16
    finally:
        off.close()
    assert len(history) == 8 and history == want
    assert_same_params(got, ref)
