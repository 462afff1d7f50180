"""Issue 24: ``import_dcp`` on untrusted or damaged DCP checkpoints, ``export_dcp`` with none
or of a wrapped model.

A crafted ``.metadata`` or non-tensor entry used to run code (DCP unpickles both); damaged input
let DCP's ``CheckpointException`` (a ``BaseException``) escape ``except Exception``; exporting a
directory without a checkpoint said it was corrupt. One process, real ``dcp.save`` output.
"""

import builtins
import glob
import logging
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from tensortier.checkpoint import Checkpointer, export_dcp, import_dcp
from tensortier.errors import ConfigError, CorruptDataError


@pytest.fixture(autouse=True)
def _quiet_dcp():
    logging.disable(logging.CRITICAL)  # DCP logs the tracebacks of its own fallbacks
    yield
    logging.disable(logging.NOTSET)


class _Runs:
    """Pickles as a call of ``fn(*args)``: what a crafted checkpoint does."""

    def __init__(self, fn, *args):
        self.call = (fn, args)

    def __reduce__(self):
        return self.call


def _trained():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, betas=(0.8, 0.9))
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return m, opt


def _saved(tmp_path, **entries) -> str:
    m, opt = _trained()
    out = str(tmp_path / "dcp")
    dcp.save(
        {"model": m.state_dict(), "optimizer": opt.state_dict(), **entries},
        checkpoint_id=out,
        no_dist=True,
    )
    return out


def test_import_round_trip_is_bit_identical(tmp_path):
    src = _saved(
        tmp_path, extra={"epoch": 3, "name": "run", "pair": (1, 2.5), "t": torch.arange(3)}
    )
    import_dcp(src, str(tmp_path / "ck"), step=9)
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters())
    with Checkpointer(str(tmp_path / "ck")) as ck:
        state = ck.restore(model=m, optimizer=opt)
    ref, ref_opt = _trained()
    assert state.saved_step == 9
    assert state.extra["epoch"] == 3 and state.extra["name"] == "run"
    assert state.extra["pair"] == (1, 2.5) and torch.equal(state.extra["t"], torch.arange(3))
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]  # non-tensor entries, weights-only
    for i, entry in theirs["state"].items():
        assert all(torch.equal(mine["state"][i][k], v) for k, v in entry.items())


def test_crafted_metadata_is_refused_without_running_code(tmp_path):
    src = _saved(tmp_path)
    marker = str(tmp_path / "code-ran")
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(_Runs(os.mkdir, marker), f)
    with pytest.raises(CorruptDataError, match="names the global posix.mkdir") as info:
        import_dcp(src, str(tmp_path / "ck"), step=1)
    assert info.value.path == os.path.join(src, ".metadata")
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "ck")  # nothing written


@pytest.mark.parametrize(
    "payload",
    [(builtins.exec, "raise SystemExit"), (torch.load, "/nonexistent"), (os.system, "true")],
    ids=["exec", "torch.load", "os.system"],
)
def test_metadata_allow_list_refuses_any_other_global(tmp_path, payload):
    src = _saved(tmp_path)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(_Runs(*payload), f)
    with pytest.raises(CorruptDataError, match="refused without running it"):
        import_dcp(src, str(tmp_path / "ck"), step=1)


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    src = _saved(tmp_path)
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # written by dcp.save in this test
    (tmp_path / "secret").write_bytes(b"x" * 4096)
    for info in md.storage_data.values():
        info.relative_path = "../secret"
    with open(path, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(
        CorruptDataError, match="'../secret', which is not a file of the checkpoint"
    ):
        import_dcp(src, str(tmp_path / "ck"), step=1)


def test_crafted_entry_is_refused_without_running_code(tmp_path):
    marker = str(tmp_path / "code-ran")
    src = _saved(tmp_path, extra={"state": _Runs(os.mkdir, marker)})
    with pytest.raises(CorruptDataError, match="'extra.state' is a pickled Python object"):
        import_dcp(src, str(tmp_path / "ck"), step=1)
    assert not os.path.exists(marker)


def test_damaged_input_is_a_typed_error(tmp_path):
    src = _saved(tmp_path)
    data = glob.glob(os.path.join(src, "*.distcp"))[0]
    os.truncate(data, os.path.getsize(data) // 2)
    with pytest.raises(CorruptDataError, match="DCP could not read the checkpoint"):
        import_dcp(src, str(tmp_path / "a"), step=1)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    with pytest.raises(CorruptDataError, match="not DCP metadata"):
        import_dcp(src, str(tmp_path / "b"), step=1)
    os.remove(os.path.join(src, ".metadata"))
    with pytest.raises(ConfigError, match="holds no DCP checkpoint"):
        import_dcp(src, str(tmp_path / "c"), step=1)
    with pytest.raises(ConfigError, match="holds no DCP checkpoint"):
        import_dcp(str(tmp_path / "missing"), str(tmp_path / "d"), step=1)


def test_export_without_a_checkpoint_says_there_is_none(tmp_path):
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ConfigError, match="holds no checkpoint"):
            export_dcp(str(where), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


class _Wrapper(torch.nn.Module):
    """Holds the model as ``.module``, as DDP does: its state_dict keys gain ``module.``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("wrap", ["module", "compiled"])
def test_export_of_a_wrapped_model_loads_into_the_bare_model(tmp_path, wrap):
    m, _ = _trained()
    wrapped = _Wrapper(m) if wrap == "module" else torch.compile(m)
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(0, model=wrapped)
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    torch.manual_seed(1)
    bare = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    state = {"model": get_model_state_dict(bare)}  # the bare model's FQNs, as DCP names them
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    set_model_state_dict(bare, state["model"])
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), m.parameters()))
