"""Issue 13: activation offload on many ranks (gloo, 2 processes spawned here).

``tt.offload(budget=)`` under DDP: rank 0 plans and every rank runs that plan (the other ranks
never call the policy); spill files go to one private directory per rank; ranks passing another
budget fail on every rank with ConfigError naming the rank, instead of hanging later; the plan
cache is rank 0's alone, and ranks whose inputs differ in size run the plan of the largest.
"""

import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensortier as tt
from tensortier.errors import ConfigError
from tensortier.planner import runtime
from tensortier.planner.policies import Options
from tests import distributed

FAST = Options(search_iters=40, search_seconds=3)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(4)]
    return nn.Sequential(*layers, nn.Linear(128, 1))


def _train(rank: int, world: int, spill: str, budget: str, rows: tuple = (256, 256)) -> dict:
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
        x = torch.randn(rows[rank], 128, generator=g)
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
        "profiled_rows": sorted({t.shape[0] for t in off.profile.tensors if len(t.shape) == 2}),
    }
    off.close()
    return report


def _train_then_disagree(rank: int, world: int, spill: str) -> dict:
    report = _train(rank, world, spill, "64MiB")
    try:  # then a job whose ranks pass different budgets (one spawn: start-up is most of the cost)
        _train(rank, world, spill, "64MiB" if rank == 0 else "32MiB")
        report["error"] = None
    except ConfigError as exc:
        report["error"] = repr(exc)
    return report


def test_budget_plan_made_on_rank_zero_runs_on_every_rank(tmp_path):
    """...and ranks passing different budgets fail on every rank (at the first step), instead of
    hanging later in a collective."""
    spill = str(tmp_path)
    a, b = distributed.run(_train_then_disagree, 2, spill, timeout=180)
    assert a["plan"] == b["plan"] and a["recomputed"] == b["recomputed"]
    # one private spill directory per rank under the shared root, named by its rank
    assert len(a["own"]) == 1 and len(b["own"]) == 1 and a["own"] != b["own"]
    assert os.listdir(spill) == [] or all(not os.listdir(tmp_path / d) for d in os.listdir(spill))
    for p in (a, b):
        assert p["error"] and "budget" in p["error"] and "rank 1" in p["error"]


def test_ranks_whose_batches_differ_while_profiling_plan_for_the_largest(tmp_path):
    """A rank with a smaller batch (dynamic padding, a short last batch) ran the same model: the
    ranks agree on its structure, and rank 0 plans with the larger rank's profile (it was a
    ConfigError on every rank: the saved tensors' sizes were compared)."""
    a, b = distributed.run(_train, 2, str(tmp_path), "64MiB", (192, 320), timeout=180)
    assert a["plan"] == b["plan"]
    assert a["profiled_rows"] == b["profiled_rows"] == [320]  # rank 1's inputs, the larger


def _recompute_all(rank: int, world: int, spill: str) -> list[str]:
    m, ref = _mlp(), _mlp()
    ddp, ref_ddp = DDP(m), DDP(ref)
    off = tt.offload(budget="64MiB", spill_dir=spill, options=FAST, policy="recompute_all")
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(256, 128, generator=g)
        with off:
            loss = ddp(x).sum()
        loss.backward()
        ref_ddp(x).sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))
        m.zero_grad()
        ref.zero_grad()
    recomputed = sorted(off.choice.plan.recomputed())
    off.close()
    return recomputed


def test_a_ddp_model_is_planned_per_layer_not_as_one_unit(tmp_path):
    """DDP(model) is planned as the model inside (its layers ``module.0``, ...), not as one unit
    ``module`` that could only be recomputed or kept whole; recomputing under DDP gives DDP's
    gradients bit for bit."""
    for recomputed in distributed.run(_recompute_all, 2, str(tmp_path), timeout=180):
        assert recomputed == [f"module.{i}" for i in range(5)]


def _fsdp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:  # the blocks and the head, a Linear holding its parameters itself
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp_recompute_all(rank: int, world: int, spill: str) -> list[str]:
    m, ref = _fsdp(_mlp(), world), _fsdp(_mlp(), world)
    off = tt.offload(budget="64MiB", spill_dir=spill, options=FAST, policy="recompute_all")
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(256, 128, generator=g)
        with off:
            loss = m(x).sum()
        loss.backward()
        ref(x).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())
        m.zero_grad()
        ref.zero_grad()
    recomputed = sorted(off.choice.plan.recomputed())
    off.close()
    return recomputed


def test_a_budget_plan_under_fsdp2_recomputes_and_matches_fsdp2(tmp_path):
    """The profiler sized each unit's gradients from its parameters as the unit's forward
    pre-hook sees them: sharded DTensors for a module FSDP2 shards itself, whose storage cannot
    be read (it raised); recomputing under FSDP2 gives FSDP2's gradients bit for bit."""
    for recomputed in distributed.run(_fsdp_recompute_all, 2, str(tmp_path), timeout=180):
        assert recomputed == [str(i) for i in range(5)]


def _cached(rank: int, world: int, spill: str, cache: str) -> dict:
    """Two jobs with one plan cache, then a step where rank 1's batch is larger."""
    if rank != 0:  # rank 0 alone plans and reads and writes the cache

        def refuse(*args, **kwargs):
            raise AssertionError("a rank other than 0 planned or read the plan cache")

        runtime.choose = refuse
        runtime.load_cached = refuse
    m = _mlp()
    g = torch.Generator().manual_seed(rank)

    def step(off, rows: int = 256) -> None:
        with off:
            loss = m(torch.randn(rows, 128, generator=g)).sum()
        loss.backward()

    off = tt.offload(budget="64MiB", spill_dir=spill, options=FAST, plan_cache=cache)
    for _ in range(5):  # warm-up, profile, timing passes, then the plan
        step(off)
    first = repr(off.choice.plan)
    off.close()
    torch.distributed.barrier()  # rank 0 has written the cache
    again = tt.offload(budget="64MiB", spill_dir=spill, options=FAST, plan_cache=cache)
    step(again)  # a restarted job: the cached plan from its first step
    report = {"first": first, "cached": again.cached, "again": repr(again.choice.plan)}
    step(again, 256 if rank == 0 else 512)  # every rank runs the plan of the largest inputs
    report["bucket"] = again._current
    report["plan"] = repr(again.choice.plan)
    again.close()
    return report


def test_plan_cache_and_shape_buckets_are_rank_zeros(tmp_path):
    spill, cache = tmp_path / "spill", tmp_path / "cache"
    spill.mkdir()
    a, b = distributed.run(_cached, 2, str(spill), str(cache), timeout=180)
    assert len(os.listdir(cache)) == 2  # one file per bucket, written by rank 0 alone
    assert a["cached"] and b["cached"] and a["again"] == b["again"] == a["first"] == b["first"]
    assert a["bucket"] == b["bucket"] and '"inputs": [[[512, 128]' in a["bucket"]
    assert a["plan"] == b["plan"]


def _another_model_on_rank1(rank: int, world: int, spill: str) -> str | None:
    torch.manual_seed(0)
    width = 128 if rank == 0 else 160  # same layers, saved tensors of the same ranks
    m = nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, 1))
    off = tt.offload(budget="64MiB", spill_dir=spill, options=FAST)
    try:
        for _ in range(6):
            with off:
                loss = m(torch.randn(64, 128)).sum()
            loss.backward()
        return None
    except ConfigError as exc:
        return str(exc)
    finally:
        off.close()


def test_ranks_with_other_parameters_fail_on_every_rank_without_ddp(tmp_path):
    """Without DDP nothing else compares the models: once saved tensors' sizes could differ
    (ranks with other batch sizes), a rank with another layer width got rank 0's plan."""
    told = distributed.run(_another_model_on_rank1, 2, str(tmp_path), timeout=180)
    for error in told:
        assert error and "parameters" in error and "rank 1" in error, told
