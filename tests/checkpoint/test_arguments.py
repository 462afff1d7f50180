"""Arguments that name where a checkpoint goes. The ``step`` names its directory (``step-<int>``):
anything that is not an int >= 0 must be refused at the call, never written where ``restore``
does not look. The directory must be a non-empty path: ``""`` meant the current directory."""

import os
import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tensortier.checkpoint import Checkpointer, export_dcp, import_dcp
from tensortier.errors import ConfigError


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize("step", [5.0, -1, True, "3"])
def test_a_step_that_is_not_an_int_is_refused_before_anything_is_written(tmp_path, step):
    with Checkpointer(tmp_path, every=1) as ck:
        with pytest.raises(ConfigError, match=r"step=.*int >= 0"):
            ck.save(step, model=_linear())
        with pytest.raises(ConfigError, match=r"step=.*int >= 0"):
            ck.maybe_save(step, model=_linear())
        with pytest.raises(ConfigError, match=r"step=.*int >= 0"):
            ck.restore(model=_linear(), step=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tensortier-checkpoint.lock"]


@pytest.mark.parametrize("step, fix", [(-1, "count steps from 0"), (5.0, "pass int(step)")])
def test_a_bad_step_is_refused_with_a_fix_that_works(tmp_path, step, fix):
    """-1 was told "pass int(step)", which gives -1 again."""
    with Checkpointer(tmp_path, every=1) as ck, pytest.raises(ConfigError, match=re.escape(fix)):
        ck.save(step, model=_linear())


@pytest.mark.parametrize("step", [np.int64(3), torch.tensor(3)])
def test_numpy_and_tensor_step_counters_save_and_restore(tmp_path, step):
    model = _linear()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(step, model=model)
    restored = torch.nn.Linear(3, 2)
    with Checkpointer(tmp_path, every=1) as ck:
        state = ck.restore(model=restored, step=step)
    assert (state.step, state.saved_step, state.path.endswith("step-3")) == (4, 3, True)
    assert torch.equal(restored.weight, model.weight)


@pytest.mark.parametrize("step", [5.0, -1])
def test_dcp_conversions_refuse_a_step_that_is_not_an_int(tmp_path, step):
    dcp_dir = str(tmp_path / "dcp")
    dcp.save({"model": _linear().state_dict()}, checkpoint_id=dcp_dir, no_dist=True)
    with pytest.raises(ConfigError, match=r"import_dcp: step=.*int >= 0"):
        import_dcp(dcp_dir, str(tmp_path / "ck"), step=step)
    assert not (tmp_path / "ck").exists() or not any(
        p.name.startswith("step-") for p in (tmp_path / "ck").iterdir()
    )
    import_dcp(dcp_dir, str(tmp_path / "ck"), step=5)
    with pytest.raises(ConfigError, match=r"export_dcp: step=.*int >= 0"):
        export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"), step=step)


@pytest.mark.parametrize("directory", ["", None, 123, b"ckpts"])
def test_a_directory_that_is_not_a_path_is_refused(tmp_path, monkeypatch, directory):
    monkeypatch.chdir(tmp_path)  # before the fix, "" wrote step-0/ and a lock file here
    with pytest.raises(ConfigError, match=r"directory=.*non-empty str or pathlib.Path"):
        Checkpointer(directory, every=1)
    assert os.listdir(tmp_path) == []
