"""Selective recompute for real: operators recorded in the probe, the plan's per-operator policy
run by ``torch.utils.checkpoint``, gradients bit-identical to plain training."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from tensortier.models import GPT, GPTConfig, Llama, LlamaConfig, random_batch
from tensortier.planner.ops import SelectivePolicy
from tensortier.planner.policies import selective_menu
from tensortier.planner.profile import Bandwidth
from tensortier.planner.profiler import Profiler, calibrate
from tensortier.planner.runtime import Recompute, selective_sets
from tensortier.planner.simulator import Mode, Plan, UnitAction

BW = Bandwidth(d2h=1e9, h2d=1e9, h2disk=1e9, disk2h=1e9)


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
        return Llama(cfg), cfg
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)
    return GPT(cfg), cfg


def _grads(model, x, y, steps: int = 2) -> list[torch.Tensor]:
    out = []
    torch.manual_seed(1)  # the same dropout masks in every run
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        out += [p.grad.clone() for p in model.parameters()]
    return out


def _profile(model, x, y, spill_dir):
    prof = Profiler(spill_dir=spill_dir, bandwidth=BW, codecs={}, device=torch.device("cpu"))
    try:
        for ctx in (prof.forward(), prof.timing()):
            model.zero_grad(set_to_none=True)
            with ctx:
                loss = model(x, y)
            loss.backward()
        return calibrate(prof.finish())
    finally:
        prof.offloader.close()


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_per_operator_policies_train_bit_identical(kind, spill_dir):
    model, cfg = _model(kind)
    x, y = random_batch(cfg, 4)
    plain = _grads(model, x, y)
    profile = _profile(model, x, y, spill_dir)
    blocks = [u for u in profile.units if u.name.endswith((".0", ".1")) and "wpe" not in u.name]
    assert blocks and all(u.selective for u in blocks)
    # every block's operators were seen, and its saved tensors traced to the op that made them
    assert all(len(u.ops) > 10 for u in blocks)
    traced = [t for t in profile.tensors if t.unit in {u.name for u in blocks}]
    # all but a block's input (made by the unit before it): looked up when each was packed,
    # since a freed storage's address is soon another op's
    assert sum(t.op_index >= 0 for t in traced) >= len(traced) - 2 * len(blocks)
    names = {u.name: {o.index: o.name for o in u.ops} for u in blocks}
    softmax = [t for t in traced if t.op == "SoftmaxBackward0"]
    assert softmax and all("softmax" in names[t.unit][t.op_index] for t in softmax)
    for pick in (0, -1):  # the smallest and the largest cache the menu offers
        plan = Plan(
            "sel",
            {
                u.name: UnitAction(Mode.SELECTIVE, part=selective_menu(profile, u)[pick])
                for u in blocks
            },
        )
        wrap = Recompute(model, [], selective_sets(profile, plan))
        try:
            assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, y), plain))
        finally:
            wrap.remove()
    everything = {u.name: frozenset(o.index for o in u.ops) for u in blocks}
    nothing = {u.name: frozenset() for u in blocks}  # cache all that may be cached
    for recompute in (everything, nothing):
        plan = Plan("sel", {n: UnitAction(Mode.SELECTIVE, part=r) for n, r in recompute.items()})
        wrap = Recompute(model, [], selective_sets(profile, plan))
        try:
            assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, y), plain))
        finally:
            wrap.remove()


def test_the_recorded_operators_account_for_the_units_memory(spill_dir):
    """Output bytes of a block's operators cover what autograd saves of it (the recorder sees
    every storage the block allocates); views and in-place ops allocate nothing."""
    model, cfg = _model("llama")
    x, y = random_batch(cfg, 4)
    profile = _profile(model, x, y, spill_dir)
    for u in profile.units:
        if not u.ops:
            continue
        saved = sum(t.nbytes for t in profile.tensors_of(u.name) if t.op_index >= 0)
        assert sum(o.out_bytes for o in u.ops) >= saved
        assert all(o.out_bytes == 0 for o in u.ops if o.view)
        assert sum(o.seconds for o in u.ops) == pytest.approx(u.fwd_s, rel=1e-6, abs=1e-12)


def test_the_policy_counts_a_forward_and_its_recompute_apart():
    """PyTorch before 2.5 asks the policy again for every operator of the recompute (2.5 on looks
    the forward's decisions up): with one counter for both, the recompute's first operator was
    numbered after the forward's last, so it was cached where the forward recomputed it."""
    save, rerun = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
    caching, _ = SelectivePolicy({1, 3}).contexts()
    op = torch.ops.aten.mul.Tensor
    for is_recompute in (False, True):
        ctx = SelectiveCheckpointContext(is_recompute=is_recompute)
        got = [caching.policy_fn(ctx, op) for _ in range(4)]
        assert got == [save, rerun, save, rerun], (is_recompute, got)
