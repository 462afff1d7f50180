"""``Checkpointer(dir, read_only=True)``: restore from a directory this process must not write
(a read-only mount, a pretrained run's checkpoints, a directory another run is writing into).
It takes no lock, removes no debris, writes no probe file, and refuses to save."""

import os

import pytest
import torch

from tensortier.checkpoint import Checkpointer
from tensortier.errors import ConfigError, SpillDirError


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _listing(root) -> dict[str, tuple[int, int]]:
    return {
        os.path.relpath(os.path.join(d, f), root): (
            os.stat(os.path.join(d, f)).st_size,
            os.stat(os.path.join(d, f)).st_mtime_ns,
        )
        for d, _, files in os.walk(root)
        for f in files
    }


def test_a_reader_restores_while_the_writer_holds_the_directory_and_writes_nothing(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path, every=1) as writer:  # the lock is held for the whole block
        writer.save(4, model=model, optimizer=opt, extra={"epoch": 2})
        writer.wait()
        (tmp_path / "step-9.incomplete").mkdir()  # a crashed run's debris: a writer removes it
        before = _listing(tmp_path)
        fresh = _model(1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        with Checkpointer(tmp_path, read_only=True) as reader:
            state = reader.restore(model=fresh, optimizer=fresh_opt)
        assert (state.saved_step, state.extra) == (4, {"epoch": 2})
        assert _listing(tmp_path) == before
        assert (tmp_path / "step-9.incomplete").is_dir()
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert str(fresh_opt.state_dict()) == str(opt.state_dict())


def test_a_reader_refuses_to_save_naming_the_fix(tmp_path):
    with Checkpointer(tmp_path, every=1) as writer:
        writer.save(0, model=_model(0))
    with Checkpointer(tmp_path, read_only=True, every=1) as reader:
        for call in (reader.save, reader.maybe_save):
            with pytest.raises(ConfigError, match=r"read_only=True\) only restores.*writable"):
                call(1, model=_model(0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-0"]


def test_a_reader_of_a_missing_directory_creates_nothing(tmp_path):
    with pytest.raises(SpillDirError, match="not a readable directory"):
        Checkpointer(tmp_path / "nope", read_only=True)
    assert not (tmp_path / "nope").exists()
    with pytest.raises(ConfigError, match="read_only='yes'"):
        Checkpointer(tmp_path, read_only="yes")


def test_an_unwritable_directory_names_read_only_as_the_fix(tmp_path, monkeypatch):
    with Checkpointer(tmp_path, every=1) as writer:
        writer.save(0, model=_model(0))
    real = os.access  # root writes anywhere: make the directory look read-only to the check
    monkeypatch.setattr(os, "access", lambda p, mode: not mode & os.W_OK and real(p, mode))
    with pytest.raises(SpillDirError, match="read_only=True to only restore"):
        Checkpointer(tmp_path)
    restored = _model(1)
    with Checkpointer(tmp_path, read_only=True) as reader:
        assert reader.restore(model=restored).saved_step == 0
    assert torch.equal(restored[0].weight, _model(0)[0].weight)
