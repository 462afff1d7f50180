"""Issue 13: activation offload on many ranks (gloo, 2 processes spawned here).

``tt.offload(budget=)`` under DDP: rank 0 plans and every rank runs that plan (the other ranks
never call the policy); spill files go to one private directory per rank; ranks passing another
budget fail on every rank with ConfigError naming the rank, instead of hanging later.
"""

import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensortier as tt
from tensortier.planner import runtime
from tensortier.planner.policies import Options
from tests import distributed

FAST = Options(search_iters=40, search_seconds=3)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(4)]
    return nn.Sequential(*layers, nn.Linear(128, 1))


def _train(rank: int, world: int, spill: str, budget: str) -> dict:
    if rank != 0:  # only rank 0 may plan: the others must receive its choice

        def refuse(*args, **kwargs):
            raise AssertionError("a rank other than 0 ran the planner's policy")

        runtime.choose = refuse
    m = _mlp()
    ddp = DDP(m)
    ref = _mlp()
    ref_ddp = DDP(ref)
    off = tt.offload(budget=budget, spill_dir=spill, options=FAST)
    g = torch.Generator().manual_seed(rank)
    dirs: set[str] = set()
    for _ in range(6):  # warm-up, profile, timing passes, then the plan
        x = torch.randn(256, 128, generator=g)
        with off:
            loss = ddp(x).sum()
            dirs |= set(os.listdir(spill))
        loss.backward()
        ref_ddp(x).sum().backward()
        same = all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))
        assert same, "offloaded gradients differ from plain DDP"
        m.zero_grad()
        ref.zero_grad()
    plan = off.choice.plan
    report = {
        "recomputed": sorted(plan.recomputed()),
        "plan": repr(plan),
        "dirs": sorted(d for d in dirs if d.startswith("tt-act")),
        "own": [d for d in dirs if d.startswith(f"tt-act-rank{rank}-")],
    }
    off.close()
    return report


def test_budget_plan_made_on_rank_zero_runs_on_every_rank(tmp_path):
    spill = str(tmp_path)
    a, b = distributed.run(_train, 2, spill, "64MiB", timeout=180)
    assert a["plan"] == b["plan"] and a["recomputed"] == b["recomputed"]
    # one private spill directory per rank under the shared root, named by its rank
    assert len(a["own"]) == 1 and len(b["own"]) == 1 and a["own"] != b["own"]
    assert os.listdir(spill) == [] or all(not os.listdir(tmp_path / d) for d in os.listdir(spill))


def _mismatch(rank: int, world: int, spill: str) -> dict:
    budget = "64MiB" if rank == 0 else "32MiB"
    _train(rank, world, spill, budget)
    return {}


def test_ranks_with_different_budgets_fail_on_every_rank(tmp_path):
    payloads = distributed.run(_mismatch, 2, str(tmp_path), timeout=120, expect_errors=True)
    for p in payloads:
        assert not p["ok"]
        assert "ConfigError" in p["error"] and "budget" in p["error"] and "rank 1" in p["error"]
