"""Issue 13: Checkpointer on many ranks (gloo, processes spawned from pytest).

DDP + sharded OffloadedAdamW + a scheduler, saved on 4 ranks, restored on 4 (bit-identical
resume, per-rank RNG and extra), on 2 and in one process (same full state); a rank SIGKILLed
during persist leaves the previous checkpoint the newest everywhere; a corrupt shard of one rank
is named and every rank falls back; DCP interop both ways.
"""

import os
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tensortier.checkpoint import Checkpointer, export_dcp, import_dcp
from tensortier.checkpoint._faults import ENV
from tensortier.optim import OffloadedAdamW
from tests import distributed


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 7), torch.nn.Linear(7, 4)
    )


def _setup(rank: int):
    m = _model()
    # find_unused_parameters: DDP then never rebuilds its buckets after the first iteration. A
    # rebuild moves gradients to other offsets of the all-reduce buffer, and gloo's ring sums
    # each chunk in another rank order: at 4 ranks a fresh DDP (any restart) would round its
    # first sums differently from the run it resumes, with or without tensortier.
    ddp = DDP(m, find_unused_parameters=True) if torch.distributed.is_initialized() else m
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="512B")
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    torch.manual_seed(100 + rank)  # every rank's random stream differs
    return m, ddp, opt, sched


def _step(ddp, opt, sched, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # the data depends on (rank, step) only
    ddp(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _params(m) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _same_state(a: dict, b: dict) -> bool:
    return set(a["state"]) == set(b["state"]) and all(
        torch.equal(a["state"][i][k], b["state"][i][k])
        for i in b["state"]
        for k in ("step", "exp_avg", "exp_avg_sq")
    )


# ----------------------------------------------------------------------------- save on 4 ranks
def _save4(rank: int, world: int, root: str, out: str) -> dict:
    m, ddp, opt, sched = _setup(rank)
    ck = Checkpointer(root, keep=3, every=1000)
    for step in range(5):
        _step(ddp, opt, sched, rank, step)
    ck.save(4, model=m, optimizer=opt, scheduler=sched, extra={"rank": rank, "note": "x"})
    ck.wait()
    full = opt.full_state_dict()
    drawn = torch.rand(3).tolist()  # the resumed run must draw the same numbers on this rank
    if rank == 0:
        torch.save({"full": full, "params": _params(m)}, os.path.join(out, "at-save.pt"))
    for step in range(5, 8):
        _step(ddp, opt, sched, rank, step)
    if rank == 0:
        torch.save(_params(m), os.path.join(out, "final.pt"))
    # DCP interop: the same state through torch.distributed.checkpoint (sharded DTensor form)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=out + "/dcp")
    if rank == 0:
        torch.save(opt.full_state_dict(), os.path.join(out, "dcp-full.pt"))
    else:
        opt.full_state_dict()  # a collective
    ck.close()
    opt.close()
    files = sorted(os.listdir(os.path.join(root, "step-4")))
    return {"drawn": drawn, "files": files}


def _resume4(rank: int, world: int, root: str, out: str) -> dict:
    m, ddp, opt, sched = _setup(rank)
    torch.manual_seed(12345)  # the restore must put back this rank's own stream
    with Checkpointer(root, keep=3, every=1000) as ck:
        state = ck.restore(model=m, optimizer=opt, scheduler=sched)
    drawn = torch.rand(3).tolist()
    for step in range(state.step, 8):
        _step(ddp, opt, sched, rank, step)
    final = torch.load(os.path.join(out, "final.pt"))
    equal = all(torch.equal(p, q) for p, q in zip(m.parameters(), final))
    opt.close()
    return {"step": state.step, "extra": state.extra, "drawn": drawn, "equal": equal}


def _restore2(rank: int, world: int, root: str, out: str) -> dict:
    m, ddp, opt, sched = _setup(rank)
    with Checkpointer(root, keep=3, every=1000) as ck:
        state = ck.restore(model=m, optimizer=opt, scheduler=sched)
    saved = torch.load(os.path.join(out, "at-save.pt"))
    report = {
        "step": state.step,
        "extra": state.extra,
        "params": all(torch.equal(p, q) for p, q in zip(m.parameters(), saved["params"])),
        "state": _same_state(opt.full_state_dict(), saved["full"]),
        "lr": opt.param_groups[0]["lr"],
    }
    opt.close()
    return report


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ck4"))
    out = str(tmp_path_factory.mktemp("out4"))
    reports = distributed.run(_save4, 4, root, out, timeout=180)
    return root, out, reports


def test_saved_by_four_ranks_each_rank_its_own_files(saved4):
    root, _, reports = saved4
    assert reports[0]["files"] == ["manifest.json"] + [f"rank-{r:05d}" for r in range(4)]
    assert len({tuple(r["drawn"]) for r in reports}) == 4  # per-rank random streams


def test_resume_on_four_ranks_is_bit_identical(saved4):
    root, out, saved = saved4
    reports = distributed.run(_resume4, 4, root, out, timeout=180)
    for rank, r in enumerate(reports):
        assert r["step"] == 5 and r["equal"] is True, (rank, r)
        assert r["extra"] == {"rank": rank, "note": "x"}
        assert r["drawn"] == saved[rank]["drawn"]  # this rank's RNG state came back


def test_restore_on_two_ranks_gives_the_same_full_state(saved4):
    root, out, _ = saved4
    reports = distributed.run(_restore2, 2, root, out, timeout=180)
    for rank, r in enumerate(reports):
        assert r["step"] == 5 and r["params"] is True and r["state"] is True, (rank, r)
        assert r["extra"] == {"rank": rank, "note": "x"}
        assert r["lr"] == pytest.approx(1e-2 * 0.5)  # the scheduler state came back too


def test_restore_in_one_process_gives_the_same_full_state(saved4):
    root, out, _ = saved4
    m, _, opt, sched = _setup(0)
    with Checkpointer(root, keep=3, every=1000) as ck:
        state = ck.restore(model=m, optimizer=opt, scheduler=sched)
    saved = torch.load(os.path.join(out, "at-save.pt"))
    assert state.step == 5 and state.extra == {"rank": 0, "note": "x"}
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), saved["params"]))
    assert _same_state(opt.state_dict(), saved["full"])
    opt.close()


def test_dcp_interop_both_ways(saved4, tmp_path):
    root, out, _ = saved4
    saved = torch.load(os.path.join(out, "at-save.pt"))
    # ours -> DCP: a plain torch model and AdamW load it with torch.distributed.checkpoint
    export_dcp(root, str(tmp_path / "exported"))
    import torch.distributed.checkpoint as dcp

    m = _model()
    topt = torch.optim.AdamW(m.parameters(), fused=True)
    template = {
        "model": m.state_dict(),
        "optimizer": {
            "state": {
                i: {k: torch.zeros_like(v) for k, v in e.items()}
                for i, e in saved["full"]["state"].items()
            },
            "param_groups": topt.state_dict()["param_groups"],
        },
    }
    dcp.load(template, checkpoint_id=str(tmp_path / "exported"))
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), saved["params"]))
    assert _same_state(template["optimizer"], saved["full"])
    # DCP (saved by 4 ranks, DTensor optimizer state) -> ours, restored in one process
    import_dcp(out + "/dcp", str(tmp_path / "imported"), step=7)
    m2, _, opt2, _ = _setup(0)
    with Checkpointer(str(tmp_path / "imported")) as ck:
        state = ck.restore(model=m2, optimizer=opt2)
    assert state.saved_step == 7
    final = torch.load(os.path.join(out, "final.pt"))
    assert all(torch.equal(p, q) for p, q in zip(m2.parameters(), final))
    assert _same_state(opt2.state_dict(), torch.load(os.path.join(out, "dcp-full.pt")))
    opt2.close()


# ----------------------------------------------------------------------------- crash, corruption
def _crash(rank: int, world: int, root: str) -> dict:
    m, ddp, opt, sched = _setup(rank)
    ck = Checkpointer(root, keep=3, every=1000, commit_timeout=20)
    for step in range(3):
        _step(ddp, opt, sched, rank, step)
        ck.save(step, model=m, optimizer=opt)
        ck.wait()
    if rank == 1:
        os.environ[ENV] = "chunk-written@1"  # rank 1 dies writing its shards of the next save
    _step(ddp, opt, sched, rank, 3)
    ck.save(3, model=m, optimizer=opt)
    try:
        ck.wait()
    except Exception as exc:  # rank 0: the commit never completes
        return {"error": repr(exc)}
    return {"error": None}


def _restore_after(rank: int, world: int, root: str) -> dict:
    m, ddp, opt, sched = _setup(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(root, keep=3, every=1000) as ck:
            state = ck.restore(model=m, optimizer=opt)
    opt.close()
    return {"step": state.saved_step, "warnings": [str(w.message) for w in caught]}


def test_killed_rank_and_corrupt_shard(tmp_path):
    root = str(tmp_path / "ck")
    payloads = distributed.run(_crash, 2, root, timeout=120, expect_errors=True)
    assert payloads[1]["ok"] is False  # SIGKILLed at the fault point
    assert payloads[0]["ok"] and payloads[0]["result"]["error"] is not None
    # rank 0's error says which checkpoint and what to do, not only gloo's "connection closed"
    assert "step 3" in payloads[0]["result"]["error"], payloads[0]
    assert "not committed" in payloads[0]["result"]["error"], payloads[0]
    # the previous checkpoint is the newest, for one process and for every rank
    m, _, opt, _ = _setup(0)
    with Checkpointer(root) as ck:
        assert ck.restore(model=m, optimizer=opt).saved_step == 2
    opt.close()
    assert sorted(os.listdir(root)) == [".tensortier-checkpoint.lock", "step-0", "step-1", "step-2"]
    # corrupt rank 1's shard of step 2: every rank falls back to step 1, naming rank 1
    shard = os.path.join(root, "step-2", "rank-00001", "shard-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        byte = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    reports = distributed.run(_restore_after, 2, root, timeout=120)
    for r in reports:
        assert r["step"] == 1
        assert any("rank 1's shard" in w and "step-2" in w for w in r["warnings"]), r
