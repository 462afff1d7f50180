"""2 gloo ranks: a rank whose save fails (its disk full, a value it cannot save) must leave no
manifest claiming a complete checkpoint, no debris, the previous checkpoint the newest for every
rank, no rank waiting for it until commit_timeout, and the group able to save the next step."""

import errno
import json
import os
import shutil

import crc32c
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tensortier.checkpoint import Checkpointer, _persist
from tensortier.checkpoint._format import canonical
from tensortier.errors import ConfigError, CorruptDataError, TierFullError
from tests import distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _one_rank_full(rank: int, world: int, root: str) -> dict:
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    ck = Checkpointer(root, keep=2, every=1000, commit_timeout=60)
    ck.save(1, model=m, optimizer=opt, extra={"rank": rank})
    ck.wait()
    good = {k: v.clone() for k, v in m.state_dict().items()}
    real = _persist._pwrite
    if rank == 1:

        def full(*_args):
            raise OSError(errno.ENOSPC, "No space left on device")

        _persist._pwrite = full
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    error = None
    try:
        ck.save(2, model=m, optimizer=opt, extra={"rank": rank})
        ck.wait()
    except (TierFullError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    _persist._pwrite = real
    listing = sorted(os.listdir(root))
    ck.close()
    fresh = _model()
    with Checkpointer(root, keep=2, every=1000) as ck2:
        state = ck2.restore(model=fresh)
    same = all(torch.equal(fresh.state_dict()[k], v) for k, v in good.items())
    return {"error": error, "listing": listing, "saved_step": state.saved_step, "same": same}


def test_a_rank_with_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_last_good(tmp_path):
    root = str(tmp_path / "ck")
    reports = distributed.run(_one_rank_full, 2, root, timeout=120)
    assert reports[1]["error"].startswith("TierFullError"), reports
    assert reports[0]["error"] is not None and "rank 1" in reports[0]["error"], reports
    for r in reports:
        assert r["listing"] == [".tensortier-checkpoint.lock", "step-1"], r
        assert (r["saved_step"], r["same"]) == (1, True), r


def _one_rank_bad_extra(rank: int, world: int, root: str) -> dict:
    m = _model()
    ck = Checkpointer(root, keep=2, every=1000, commit_timeout=5)
    ck.save(1, model=m)
    ck.wait()
    error = None
    try:
        ck.save(2, model=m, extra={"hook": print} if rank == 1 else {"ok": 1})
    except ConfigError as exc:  # before the fix rank 0 raised gloo's timeout (a RuntimeError)
        error = str(exc)
    listing = sorted(os.listdir(root))
    ck.save(3, model=m, extra={"rank": rank})  # before the fix: the group was out of step
    ck.close()
    return {"error": error, "listing": listing, "after": sorted(os.listdir(root))}


def test_a_rank_that_cannot_capture_its_state_fails_the_save_everywhere_at_once(tmp_path):
    root = str(tmp_path / "ck")
    reports = distributed.run(_one_rank_bad_extra, 2, root, timeout=120)
    assert "extra/hook" in reports[1]["error"], reports
    assert "rank 1 could not capture its state" in reports[0]["error"], reports
    assert "extra/hook" in reports[0]["error"], reports
    for r in reports:
        assert r["listing"] == [".tensortier-checkpoint.lock", "step-1"], r
        assert r["after"] == [".tensortier-checkpoint.lock", "step-1", "step-3"], r


def _rank0_manifest_full(rank: int, world: int, root: str) -> dict:
    m = _model()
    ck = Checkpointer(root, keep=2, every=1000, commit_timeout=60)
    ck.save(1, model=m)
    ck.wait()
    real = _persist._pwrite

    def full(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    if rank == 0:
        _persist._pwrite = full  # every shard is written; rank 0's manifest is not
    error = None
    try:
        ck.save(2, model=m)
        ck.wait()
    except (TierFullError, RuntimeError) as exc:
        error = type(exc).__name__
    _persist._pwrite = real
    listing = sorted(os.listdir(root))
    ck.close()
    return {"error": error, "listing": listing}


def test_rank_0_out_of_space_for_the_manifest_raises_tier_full_like_one_process(tmp_path):
    root = str(tmp_path / "ck")
    reports = distributed.run(_rank0_manifest_full, 2, root, timeout=120)
    # before the fix: RuntimeError on rank 0 too, so `except TierFullError` missed its own disk
    assert [r["error"] for r in reports] == ["TierFullError", "RuntimeError"], reports
    for r in reports:
        assert r["listing"] == [".tensortier-checkpoint.lock", "step-1"], r


def _restore_other_steps(rank: int, world: int, root: str) -> dict:
    m = _model()
    with Checkpointer(root, keep=3, every=1000, commit_timeout=60) as ck:
        for step in (1, 2):
            with torch.no_grad():
                m[0].weight.fill_(float(step))
            ck.save(step, model=m)
            ck.wait()
    fresh = _model()
    error = None
    with Checkpointer(root, keep=3, every=1000, commit_timeout=60) as ck:
        try:  # before the fix: rank 0 loaded step 1 and rank 1 step 2, silently
            ck.restore(model=fresh, step=1 + rank)
        except ConfigError as exc:
            error = str(exc)
    return {"error": error, "untouched": torch.equal(fresh[0].weight, _model()[0].weight)}


def test_ranks_restoring_different_steps_are_refused_before_anything_loads(tmp_path):
    reports = distributed.run(_restore_other_steps, 2, str(tmp_path / "ck"), timeout=120)
    for r in reports:
        assert "ranks disagree on step: rank 0 has 1, rank 1 has 2" in r["error"], r
        assert r["untouched"] is True, r


def _save_ddp(rank: int, world: int, root: str) -> list[str]:
    ddp = DDP(_model())  # the README's pattern: the wrapped model is passed
    with Checkpointer(root, every=1000) as ck:
        ck.save(0, model=ddp)
    return list(ddp.state_dict())


def test_a_ddp_checkpoint_restores_into_the_bare_model_in_one_process(tmp_path):
    root = str(tmp_path / "ck")
    keys = distributed.run(_save_ddp, 2, root, timeout=120)[0]
    assert keys[0].startswith("module.")
    bare = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    with Checkpointer(root) as ck:  # before the fix: ConfigError, missing 0.weight ...
        ck.restore(model=bare)
    assert all(
        torch.equal(a, b)
        for a, b in zip(bare.state_dict().values(), _model().state_dict().values())
    )
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))
    with Checkpointer(root) as ck, pytest.raises(ConfigError, match="other shapes"):
        ck.restore(model=other)  # a different model is still refused, naming the keys


def _save_two(rank: int, world: int, root: str) -> None:
    with Checkpointer(root, every=1000) as ck:
        ck.save(0, model=_model())


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("two") / "ck")
    distributed.run(_save_two, 2, root, timeout=120)
    return root


@pytest.mark.parametrize(
    "chunk",
    [{"shape": [16, 8]}, {"offsets": [9, 9], "shape": [16, 8]}, ["offsets"], {"offsets": [0]}],
    ids=["no offsets", "outside the tensor", "not a mapping", "wrong rank"],
)
def test_a_crafted_chunk_entry_is_damage_not_a_raw_error(two_rank_checkpoint, tmp_path, chunk):
    root = tmp_path / "ck"
    shutil.copytree(two_rank_checkpoint, root)
    manifest = root / "step-0" / "manifest.json"
    doc = json.loads(manifest.read_text())
    for r in doc["body"]["ranks"]:
        r["chunks"] = {n: chunk for n, info in r["tensors"].items() if len(info["shape"]) == 2}
    doc["crc32c"] = crc32c.crc32c(canonical(doc["body"]))  # the checksum is valid
    manifest.write_text(json.dumps(doc))
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    # before the fix: a raw KeyError / TypeError out of restore()
    with (
        Checkpointer(root) as ck,
        pytest.warns(UserWarning, match="bad chunk entry"),
        pytest.raises(CorruptDataError, match="bad chunk entry"),
    ):
        ck.restore(model=model)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
