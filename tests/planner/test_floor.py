"""The lowest peak the planner says a model reaches (issue 25's "GPU truth": the floor a
``BudgetError`` names, and the plan an infeasible re-plan falls back to) on a real Hugging Face
GPT-2 trained under bf16 autocast, as the GPU check trains it."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tensortier.planner.policies import Options, evaluate, smallest, swap_all  # noqa: E402
from tensortier.planner.runtime import planned_offload  # noqa: E402
from tensortier.planner.simulator import Mode, Plan, UnitAction  # noqa: E402

FAST = Options(search_iters=60, search_seconds=5, plan_seconds=10)
LAYERS, WIDTH, SEQ, VOCAB, BATCH = 3, 128, 128, 1024, 4
BUDGET = 48 << 20  # the offloader's resident buffers count: the plan still fits with room


def _gpt2() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=4,
        n_positions=SEQ,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(cfg).train()


def _train(model, ids, steps: int, ctx=None) -> list[torch.Tensor]:
    """``steps`` steps as scripts/gpu_check.py's ``train_step`` runs them (bf16 autocast inside
    the offload block), then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with ctx or torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses + [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A planned offload profiled on the autocast GPT-2 (warm-up, probe, two timing passes, the
    plan and a step of it), and whether that training matched plain training bit for bit."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    plain = _train(_gpt2(), ids, 6)
    spill = str(tmp_path_factory.mktemp("spill"))
    off = planned_offload(BUDGET, spill_dir=spill, options=FAST)
    try:
        ran = _train(_gpt2(), ids, 6, off)
    finally:
        off.close()
    return off, all(torch.equal(a, b) for a, b in zip(plain, ran))


def test_autocast_gpt2_under_a_budget_trains_bit_identically(planned):
    """As the GPU check trains it: bf16 autocast inside the offload block, through warm-up,
    probe, timing passes and plan; every measured planned step under the budget."""
    off, same = planned
    assert off.choice is not None and same
    assert off.measured_peaks and max(off.measured_peaks) <= BUDGET, off.measured_peaks


def test_the_smallest_peak_is_no_higher_than_offloading_every_unit(planned):
    """``smallest`` gave every unit the action with the lowest peak it reaches alone: on this
    model recompute for each layer (alone, it lowers a peak the other kept layers set), which
    together peak above offloading every unit (each rerun brings a whole layer back with its
    temporaries). The conservative fallback of an infeasible re-plan and the floor a
    non-``auto`` BudgetError names were then above a plan the planner had: 1.15x on the
    issue's CPU reproduction (GPT-2 4 x 256, T=256, batch 8)."""
    off, _ = planned
    opts = replace(FAST, margin=0.0, tiers=("disk",))
    floor = smallest(off.profile, opts)
    everything = swap_all(off.profile, 1, opts)
    recompute = {u.name: UnitAction(Mode.RECOMPUTE if u.recomputable else Mode.DISK)
                 for u in off.profile.units}  # fmt: skip
    rerun = evaluate(off.profile, Plan("rerun", recompute), opts)
    assert floor.result.peak_bytes <= everything.result.peak_bytes
    assert floor.result.peak_bytes <= rerun.result.peak_bytes
