"""Issue 13: OffloadedAdamW sharded across DDP ranks (gloo, 2 and 4 processes spawned here).

Every case trains the same model twice in each process, DDP + ``torch.optim.AdamW(fused=True)``
and DDP + sharded ``OffloadedAdamW``, on the same per-rank data, and compares parameters bit
for bit after 10 steps; the references run in the same processes, so DDP's reductions are the
same for both.
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tensortier.errors import ConfigError
from tensortier.optim import OffloadedAdamW
from tests import distributed

STEPS = 10


def _model():
    torch.manual_seed(0)
    # weights cut by rows (Shard(0)) and biases/odd shapes owned whole, at 2 and at 4 ranks
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 4),
    )


def _iterate(x: torch.Tensor, *pairs) -> None:
    """One iteration of each (model, optimizer) pair on ``x``: loss ``square().mean()``,
    backward, step, zero_grad (the reference first, in the same order on every rank)."""
    for model, opt in pairs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _train(case: str, kind: str, rank: int, tmp: str):
    """One run of ``case``; returns (model, optimizer)."""
    m = _model()
    ddp = DDP(m)
    if kind == "torch":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    else:
        tier = "disk" if case == "disk" else "host"
        opt = OffloadedAdamW(
            m.parameters(),
            lr=1e-2,
            weight_decay=0.1,
            bucket_size="512B",
            tier=tier,
            spill_dir=tmp if tier == "disk" else None,  # one root: private subdirectories
            defer_gather=case.startswith("defer"),
        )
        assert opt._sharded
        if case == "rounds":  # all-gathers in many 64-byte rounds (pieces span several)
            opt._gatherer.max_bytes = 128 * 2
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if "scaler" in case else None
    g = torch.Generator().manual_seed(100 + rank)  # every rank sees different data
    for step in range(STEPS):
        if case == "no_sync":
            with ddp.no_sync():
                ddp(torch.randn(4, 8, generator=g)).square().mean().backward()
        loss = ddp(torch.randn(4, 8, generator=g)).square().mean()
        if scaler is not None:
            if step == 3 and rank == 0:
                loss = loss * float("inf")  # an overflow on one rank: all-reduced to every rank
            scaler.scale(loss).backward()
            if case.endswith("scaler_clip"):  # deferred: unscaled copies made on step()'s thread
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if case == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            elif case == "opt_clip":
                if kind == "torch":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                else:
                    opt.clip_grad_norm_(0.05)
            opt.step()
        opt.zero_grad()
    return m, opt


def _parity(rank: int, world: int, tmp: str, cases: list[str]) -> dict:
    report = {}
    for case in cases:
        ref, topt = _train(case, "torch", rank, tmp)
        got, opt = _train(case, "tt", rank, tmp)
        opt.synchronize()  # defer_gather: the parameters are read directly
        report[case] = _equal(ref, got)
        if case == "plain":
            # the full layout equals torch's state, bit for bit
            full, rsd = opt.full_state_dict(), topt.state_dict()
            report["full_state"] = set(full["state"]) == set(rsd["state"]) and all(
                torch.equal(full["state"][i][k].float(), rsd["state"][i][k].float())
                for i in rsd["state"]
                for k in ("step", "exp_avg", "exp_avg_sq")
            )
            report["bytes"] = opt.stats().host_state_bytes
        report[f"skipped-{case}"] = [opt.stats().skipped_steps, opt.stats().steps]
        opt.close()
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_matches_ddp_fused_adamw(world, tmp_path):
    cases = ["plain", "clip", "opt_clip", "no_sync", "scaler", "scaler_clip", "disk", "rounds"]
    cases += ["defer_scaler_clip"]
    if world == 4:
        cases = ["plain", "clip", "no_sync", "scaler"]
    reports = distributed.run(_parity, world, str(tmp_path), cases)
    for rank, report in enumerate(reports):
        for case in cases + ["full_state"]:
            assert report[case] is True, (rank, case)
        assert report["skipped-plain"] == [0, STEPS]
        assert report["skipped-scaler"] == [1, STEPS - 1]  # the overflow skipped on every rank
    # per-rank host state is 1/N of the whole state (fp32 masters and moments: 12 B/param; an
    # unsharded optimizer of CPU fp32 parameters keeps only the moments), within one bucket
    full = 12 * sum(p.numel() for p in _model().parameters())
    per_rank = [r["bytes"] for r in reports]
    assert max(per_rank) <= full / world + 512 * 3, (per_rank, full)
    assert sum(per_rank) <= full + world * 64 * 3 * 8, (per_rank, full)


def _load_full(rank: int, world: int) -> dict:
    """A full torch AdamW state (any world size's) loads into the sharded optimizer."""
    ref, topt = _train("plain", "torch", rank, "")
    m = _model()
    ddp = DDP(m)
    with torch.no_grad():
        for p, q in zip(m.parameters(), ref.parameters()):
            p.copy_(q)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="512B")
    opt.load_state_dict(topt.state_dict())
    refddp = DDP(ref)
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        _iterate(x, (refddp, topt), (ddp, opt))
    out = {"equal": _equal(ref, m)}
    opt.close()
    return out


def _mismatch(rank: int, world: int) -> dict:
    """Both mismatches in one process group: an agreement that fails leaves it usable."""
    errors = {}
    for what in ("bucket_size", "parameters"):
        m = _model()
        try:
            if what == "bucket_size":
                OffloadedAdamW(m.parameters(), bucket_size="512B" if rank == 0 else "1KiB")
            else:
                params = list(m.parameters())
                OffloadedAdamW(params if rank != 1 else params[:-1])
        except ConfigError as exc:
            errors[what] = str(exc)
    return errors


def test_sharded_loads_full_adamw_state():
    assert distributed.run(_load_full, 2) == [{"equal": True}] * 2


def test_mismatched_ranks_fail_on_every_rank():
    for errors in distributed.run(_mismatch, 2, timeout=60):
        assert set(errors) == {"bucket_size", "parameters"}
        for what, message in errors.items():
            assert "rank 1" in message and what in message, message


def _load_other_model(rank: int, world: int) -> str:
    """Torch AdamW state of a model half as wide: each of its tensors has exactly one rank's
    share of our elements (every weight cut by rows, biases too small to cut)."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    DDP(m)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    topt = torch.optim.AdamW(other.parameters())
    other(torch.randn(2, 8)).sum().backward()
    topt.step()
    try:
        opt.load_state_dict(topt.state_dict())
        return "accepted"
    except ValueError as exc:
        return str(exc)
    finally:
        opt.close()


def test_the_state_of_a_smaller_model_is_refused_on_every_rank():
    for message in distributed.run(_load_other_model, 2):
        assert "has shape" in message and "the parameter has" in message, message


def test_shard_true_without_a_process_group_is_a_config_error():
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="shard=True"):
        OffloadedAdamW(_model().parameters(), shard=True)


def _square_model():
    torch.manual_seed(0)
    # four 16 KiB weights: with bucket_size=16KiB one bucket each, every rank owns rows of each
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])


def _instrument(calls: dict, last_update: int) -> None:
    """Count torch.distributed's all-gathers and all-reduces in ``calls``; the update with kernel
    call number ``last_update`` (mod 4) of each step waits (at most 10 s) for an all-gather
    issued during this step, and records in ``calls["overlapped"]`` whether one came."""
    import threading

    import tensortier.optim._update as upd

    gathered = threading.Event()
    calls.update(gathers=0, reduces=0, kernels=0, overlapped=[])

    def wrap(name: str, counter: str, module=dist):
        real = getattr(module, name)

        def counted(*a, **k):
            calls[counter] += 1
            if counter == "gathers":
                gathered.set()
            return real(*a, **k)

        setattr(module, name, counted)

    for name in ("all_gather_into_tensor", "all_gather_single"):  # whichever torch has
        if hasattr(dist, name):
            wrap(name, "gathers")
    wrap("all_reduce", "reduces")
    real_kernel = upd.adamw_

    def kernel(*a, **k):
        n = calls["kernels"]
        calls["kernels"] += 1
        if n % 4 == 0:
            gathered.clear()  # a new step: its first update
        if n % 4 == last_update:  # the step's last update runs only once a gather was issued
            calls["overlapped"].append(gathered.wait(timeout=10))
        return real_kernel(*a, **k)

    upd.adamw_ = kernel


def _overlap(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    data = [torch.randn(4, 64, generator=g) for _ in range(3)]
    ref = _square_model()
    rddp = DDP(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for x in data:
        _iterate(x, (rddp, ropt))
    m = _square_model()
    ddp = DDP(m)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="16KiB")
    assert opt._sharded and len(opt._buckets) == 4
    calls: dict = {}
    _instrument(calls, last_update=3)
    per_step = []
    for x in data:
        ddp(x).square().mean().backward()
        before = dict(calls)
        opt.step()
        per_step.append(
            [calls["gathers"] - before["gathers"], calls["reduces"] - before["reduces"]]
        )
        opt.zero_grad()
    opt.close()
    return {"equal": _equal(ref, m), "overlapped": calls["overlapped"], "per_step": per_step}


def test_each_bucket_is_gathered_while_the_next_updates():
    """Issue 27 #2: bucket 0's all-gather is issued before the last bucket's update ends (that
    update waits for it: the step would hang 10 s and record False if gathers came after every
    update), and the step's only other collective is the branch agreement (no failure
    all-reduce); parameters stay bit-identical to DDP + fused AdamW."""
    for r in distributed.run(_overlap, 2):
        assert r["equal"] is True
        assert r["overlapped"] == [True, True, True]
        # per step: one all-gather per bucket, one all-reduce (sparse / GradScaler branch)
        assert r["per_step"] == [[4, 1]] * 3, r["per_step"]


def _fail_one_update(rank: int, world: int, states: str, tmp: str, fault: bool = True) -> dict:
    """Rank 1 fails its part of step 2 (host: its second update; disk: its third state write);
    returns what every rank raised and its parameters after every step. ``host-defer``: host
    states with ``defer_gather=True`` (parameters read after ``synchronize()``)."""
    defer = states == "host-defer"
    states = "host" if defer else states
    import tensortier.optim._update as upd
    from tensortier.errors import TierFullError

    g = torch.Generator().manual_seed(100 + rank)
    m = _square_model()
    ddp = DDP(m)
    opt = OffloadedAdamW(
        m.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        bucket_size="16KiB",
        states=states,
        spill_dir=tmp if states == "disk" else None,
        defer_gather=defer,
    )
    real_kernel, calls = upd.adamw_, {"step": 0, "n": 0}

    def failing() -> bool:  # the n-th call of step 2 on rank 1
        calls["n"] += calls["step"] == 1
        return fault and rank == 1 and calls["step"] == 1 and calls["n"] == 2 + (states == "disk")

    def kernel(*a, **k):
        if failing():
            raise MemoryError("injected (test)")
        return real_kernel(*a, **k)

    if states == "host":
        upd.adamw_ = kernel
    else:
        store, real_put = opt._states.store, opt._states.store.put

        def put(*a, **k):
            if failing():  # a write that fails after it was queued (write-behind)
                from concurrent.futures import Future

                f = Future()
                f.set_exception(TierFullError("disk full (test)", tier="disk", requested=1))
                return f
            return real_put(*a, **k)

        store.put = put
    params, errors = [], []
    for i in range(3):
        calls["step"] = i
        ddp(torch.randn(4, 64, generator=g)).square().mean().backward()
        try:
            opt.step()
            if defer:  # a peer's failure is raised by the first wait after the step
                opt.synchronize()
            errors.append(None)
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        opt.zero_grad()
        opt.synchronize()  # defer_gather: the parameters are read directly
        params.append([p.detach().reshape(-1).tolist() for p in m.parameters()])
    opt.close()
    return {"params": params, "errors": errors}


@pytest.fixture(scope="module")
def unfaulted_step_2():
    """Rank 0's parameters after step 2 of the run without a fault: the same for every
    parametrization below, so run (two processes) once."""
    return distributed.run(_fail_one_update, 2, "host", "", False)[0]["params"][1]


@pytest.mark.parametrize("states", ["host", "disk", "host-defer"])
def test_a_failed_rank_fails_the_step_on_every_rank(states, tmp_path, unfaulted_step_2):
    """The failure protocol with overlapped gathers: every rank raises at step 2 naming rank 1
    (deferred: rank 0 at the wait after it, once the step's gathers are written);
    host states apply every piece that succeeded (rank 1's rows of the failed bucket keep their
    value, everything else updated), disk states apply nothing; replicas stay identical."""
    ok = unfaulted_step_2
    got = distributed.run(_fail_one_update, 2, states, str(tmp_path))
    for rank, r in enumerate(got):
        assert r["errors"][0] is None and r["errors"][2] is None, r["errors"]
        if rank == 1:
            assert r["errors"][1].startswith("TierFull" if states == "disk" else "MemoryError")
        else:
            applied = "no rank applied it" if states == "disk" else "were applied"
            assert "rank 1 failed its part" in r["errors"][1] and applied in r["errors"][1]
    assert got[0]["params"] == got[1]["params"]  # the replicas never diverge
    p1, p2 = got[0]["params"][0], got[0]["params"][1]
    if states == "disk":
        assert p2 == p1  # nothing applied anywhere
        return
    # buckets hold the layers in reverse; rank 1's second update is bucket 1 (layer 2), deferred
    # bucket 2 (layer 1: updated highest id first); rank 1 owns the rows 32..63 of each
    failed, rows = (1 if states == "host-defer" else 2), 32 * 64
    for layer in range(4):
        if layer == failed:
            assert p2[layer][rows:] == p1[layer][rows:]  # rank 1's failed piece: as before
            assert p2[layer][:rows] == ok[layer][:rows]  # rank 0's piece: updated, bit for bit
        else:
            assert p2[layer] == ok[layer]


def _shard_on_one_rank(rank: int, world: int) -> str:
    try:
        OffloadedAdamW(torch.nn.Linear(2, 2).parameters(), shard=True).close()
    except ConfigError as exc:
        return str(exc)
    return "made"


def test_shard_true_on_a_one_rank_group_says_there_is_nothing_to_shard():
    """It told a job that had called init_process_group to call init_process_group first."""
    (told,) = distributed.run(_shard_on_one_rank, 1)
    assert "one rank: there is nothing to shard" in told and "init_process_group" not in told


def _edit_state_sharded(rank: int, world: int) -> list[bool]:
    def mk():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(3, 2)
        )

    a, b = DDP(mk()), DDP(mk())
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2, shard=True, bucket_size="64")
    out = {}
    for model, o in ((a, ref), (b, opt)):
        g = torch.Generator().manual_seed(rank)
        for i in range(4):
            model(torch.randn(4, 6, generator=g)).square().mean().backward()
            o.step()
            o.zero_grad()
            if i == 1:  # each rank edits what it holds (a cut parameter: its Shard(0) piece)
                for p in model.parameters():
                    if o is ref or p in o.state:
                        o.state[p]["exp_avg"].zero_()
            if i == 2:  # a deleted entry: fresh state on each rank holding a part of it
                for p in list(model.parameters())[:2]:
                    if o is ref or p in o.state:
                        del o.state[p]
        out[o is ref] = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return [torch.equal(x, y) for x, y in zip(out[True], out[False])]


def test_edits_of_opt_state_apply_on_every_rank_as_in_ddp_with_fused_adamw():
    """``opt.state[p]`` under sharding (``optim/_state_view.py``): a parameter cut across ranks
    reads as its Shard(0) DTensor; zeroing each rank's moments, or deleting its entry, trains as
    DDP + fused AdamW with the same edits."""
    for same in distributed.run(_edit_state_sharded, 2, timeout=120):
        assert all(same), same


class _WithEmpty(torch.nn.Module):
    """A linear layer and two 0-element parameters (one with rows, one without)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)
        self.flat = torch.nn.Parameter(torch.empty(0))
        self.rows = torch.nn.Parameter(torch.empty(4, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().mean() + self.flat.sum() + self.rows.sum()


def _same_state(a: dict, b: dict) -> bool:
    a, b = a["state"], b["state"]
    return sorted(a, key=int) == sorted(b, key=int) and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


def _empty_params(rank: int, world: int) -> dict:
    m, ref = _WithEmpty(), _WithEmpty()
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, shard=True)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for model, o in ((m, opt), (ref, topt)):
        model(torch.ones(2, 8)).backward()
        o.step()
    full = opt.full_state_dict()
    back = torch.optim.AdamW(_WithEmpty().parameters(), lr=1e-2)
    back.load_state_dict(full)  # into torch.optim.AdamW, then into a new sharded optimizer
    again = OffloadedAdamW(_WithEmpty().parameters(), lr=1e-2, shard=True)
    again.load_state_dict(back.state_dict())
    out = {
        "full": _same_state(full, topt.state_dict()),
        "again": _same_state(again.full_state_dict(), topt.state_dict()),
    }
    opt.close()
    again.close()
    return out


def test_sharded_state_of_empty_parameters_matches_torch_adamw():
    # shard=True kept no state for a 0-element parameter, where torch.optim.AdamW keeps its
    # step and empty moments: full_state_dict() lacked them, and a round trip lost their step.
    assert distributed.run(_empty_params, 2) == [{"full": True, "again": True}] * 2
