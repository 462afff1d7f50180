"""Issue 24: ranks that call save()/restore() differently fail on every rank, never lose data.

2 gloo ranks. Saving different steps or different parts used to commit on every rank a
manifest naming shards that were not there (or without one rank's optimizer state), and
retention then deleted the last good checkpoint; a rank that skipped save() left the others
with gloo's raw timeout text; a checkpoint one rank could not load was loaded on the others.
"""

import os
import time

import torch

from tensortier.checkpoint import Checkpointer
from tensortier.errors import ConfigError
from tests import distributed


def _model(width: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, width))


def _trained():
    """The same on every rank (as under DDP): replicated tensors are written by one rank."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    return m, opt


def _error(call) -> str | None:
    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return None


def _disagree(rank: int, world: int, root: str) -> dict:
    m, opt = _trained()
    ck = Checkpointer(root, keep=2, every=1000, commit_timeout=60)
    for step in (1, 2):
        ck.save(step, model=m, optimizer=opt)
        ck.wait()
    steps = _error(lambda: ck.save(5 if rank == 0 else 6, model=m, optimizer=opt))
    parts = _error(lambda: ck.save(3, model=m, optimizer=opt if rank == 0 else None))
    listing = sorted(os.listdir(root))
    ck.save(3, model=m, optimizer=opt)  # agreeing ranks save again as usual
    ck.wait()
    ck.close()
    # restore: rank 1's model has another shape, so neither rank may load the checkpoint
    fresh = _model(4 if rank == 0 else 5)
    before = [p.detach().clone() for p in fresh.parameters()]
    with Checkpointer(root, keep=2, every=1000) as ck2:
        misfit = _error(lambda: ck2.restore(model=fresh))
    untouched = all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))
    return {
        "steps": steps,
        "parts": parts,
        "listing": listing,
        "after": sorted(os.listdir(root)),
        "misfit": misfit,
        "untouched": untouched,
    }


def test_ranks_saving_other_steps_or_parts_fail_everywhere_and_keep_the_last_good(tmp_path):
    root = str(tmp_path / "ck")
    reports = distributed.run(_disagree, 2, root, timeout=180)
    for r in reports:
        assert "rank 0: step 5 with model+optimizer" in r["steps"], r
        assert "rank 1: step 6 with model+optimizer" in r["steps"], r
        assert "rank 0: step 3 with model+optimizer" in r["parts"], r
        assert "rank 1: step 3 with model)" in r["parts"], r
        # nothing written, nothing retired: the two good checkpoints are still there
        assert r["listing"] == [".tensortier-checkpoint.lock", "step-1", "step-2"], r
        assert r["after"] == [".tensortier-checkpoint.lock", "step-2", "step-3"], r
        assert "does not fit the model" in r["misfit"] and r["untouched"] is True, r
    assert "rank 1 cannot restore this checkpoint, so no rank loaded it" in reports[0]["misfit"]
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    with Checkpointer(root) as ck:  # step 3 holds every rank's model and optimizer
        assert ck.restore(model=m, optimizer=opt).saved_step == 3
    trained, trained_opt = _trained()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), trained.parameters()))
    assert torch.equal(
        opt.state_dict()["state"][0]["exp_avg"], trained_opt.state_dict()["state"][0]["exp_avg"]
    )


def _skip(rank: int, world: int, root: str) -> dict:
    m = _model()
    ck = Checkpointer(root, keep=2, every=1000, commit_timeout=3)
    error = None
    if rank == 0:
        error = _error(lambda: ck.save(4, model=m))
    else:
        time.sleep(6)  # alive but never saving: rank 0 must time out, not see a dead peer
    ck.close()
    return {"error": error, "listing": sorted(os.listdir(root))}


def test_a_rank_that_skips_save_is_named(tmp_path):
    root = str(tmp_path / "ck")
    reports = distributed.run(_skip, 2, root, timeout=120)
    error = reports[0]["error"]
    assert error is not None and "rank 1 did not call save()/maybe_save() for step 4" in error
    assert "commit_timeout=3s" in error
    assert reports[0]["listing"] == [".tensortier-checkpoint.lock"]
