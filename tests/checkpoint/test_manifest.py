"""A manifest with a valid checksum but malformed content (hand-edited, another tool, a bug) is
damage like any other: CorruptDataError, a warning, and a fallback to the previous checkpoint,
with nothing loaded from it (issue 18 #17). A checkpoint that does not fit the objects passed to
``restore`` is a ConfigError raised before anything is loaded."""

import json
import os
import shutil
import warnings

import crc32c
import numpy as np
import pytest
import torch

import tensortier as tt
from tensortier.checkpoint import Checkpointer
from tensortier.checkpoint._format import canonical
from tensortier.checkpoint._tree import MAX_DEPTH
from tensortier.errors import ConfigError, CorruptDataError
from tests.checkpoint import _train


def _deep(n):
    x = 1
    for _ in range(n):
        x = [x]
    return x


def _set(part, value):
    return lambda body: body["state"].__setitem__(part, value)


def _set_rng(stream, value):
    return lambda body: body["state"]["rng"].__setitem__(stream, value)


def _first_param_state(body):
    return body["state"]["optimizer"]["state"]["items"][0]  # int keys: a tagged [key, value] list


EDITS = {
    "python RNG state of the wrong type": _set_rng("python", {"$tt": "tuple", "items": [3, "x"]}),
    "numpy RNG state too short": _set_rng(
        "numpy", {"$tt": "tuple", "items": ["MT19937", [1, 2], 0, 0, 0.0]}
    ),
    "torch RNG state is not a tensor": _set_rng("torch", [1, 2, 3]),
    "CUDA RNG states are not a list": _set_rng("cuda", 7),
    "unknown RNG stream": _set_rng("mersenne", 1),
    "RNG is a list": _set("rng", [1]),
    "dict key that is a tuple holding a list": _set(
        "extra", {"$tt": "dict", "items": [[{"$tt": "tuple", "items": [[1]]}, 1]]}
    ),
    "dict key that is bytes": _set(
        "extra", {"$tt": "dict", "items": [[{"$tt": "bytes", "hex": "00"}, 1]]}
    ),
    "tensor reference whose name is a list": _set("extra", {"$tt": "tensor", "name": ["x"]}),
    "tensor reference to a missing tensor": _set("extra", {"$tt": "tensor", "name": "nope"}),
    "extra nested 900 lists deep": _set("extra", _deep(900)),
    "extra nested just past the limit": _set("extra", _deep(MAX_DEPTH + 2)),
    "ndarray with a negative shape": _set(
        "extra", {"$tt": "ndarray", "dtype": "int8", "shape": [-1], "hex": "00"}
    ),
    "ndarray whose bytes do not fill its shape": _set(
        "extra", {"$tt": "ndarray", "dtype": "int32", "shape": [3], "hex": "00"}
    ),
    "bytes that are not hex": _set("extra", {"$tt": "bytes", "hex": 5}),
    "model state that is a list": _set("model", [1, 2]),
    "optimizer without param_groups": lambda b: b["state"]["optimizer"].pop("param_groups"),
    "optimizer state entry that is a list": lambda b: _first_param_state(b).__setitem__(1, [1]),
    "unknown part of the state": _set("weights", {}),
    "state that is a list": lambda b: b.__setitem__("state", [1]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 0 and 1 of the tiny training run, and the model's state at each."""
    root = tmp_path_factory.mktemp("src")
    model, opt, sched = _train.make()
    states = []
    with Checkpointer(root, every=1) as ck:
        for step in range(2):
            _train.step(model, opt, sched, ck)
            ck.maybe_save(step, model=model, optimizer=opt, scheduler=sched)
            ck.wait()
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    return root, states


def _edited(saved, tmp_path, edit):
    root = tmp_path / "ck"
    shutil.copytree(saved[0], root)
    path = root / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc["body"])
    doc["crc32c"] = crc32c.crc32c(canonical(doc["body"]))  # the checksum is valid
    path.write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize("label", list(EDITS))
def test_malformed_manifest_falls_back_to_the_previous_checkpoint(saved, tmp_path, label):
    root = _edited(saved, tmp_path, EDITS[label])
    model, opt, sched = _train.make(seed=7)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    with Checkpointer(root) as ck, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = ck.restore(model=model, optimizer=opt, scheduler=sched)
    assert state.saved_step == 0
    assert any("step-1" in str(w.message) and "unusable" in str(w.message) for w in caught)
    assert _train.same_state(model.state_dict(), saved[1][0])  # step 0's weights, nothing mixed
    assert not torch.equal(torch.get_rng_state(), rng_before)  # step 0's RNG state applied


@pytest.mark.parametrize("label", ["python RNG state of the wrong type", "RNG is a list"])
def test_bad_rng_state_alone_leaves_everything_untouched(saved, tmp_path, label):
    root = _edited(saved, tmp_path, EDITS[label])
    shutil.rmtree(root / "step-0")  # nothing to fall back to
    model, opt, sched = _train.make(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    with (
        Checkpointer(root) as ck,
        pytest.warns(UserWarning, match="unusable"),
        pytest.raises(CorruptDataError, match="no usable checkpoint"),
    ):
        ck.restore(model=model, optimizer=opt, scheduler=sched)
    assert _train.same_state(model.state_dict(), before)  # before the fix: model overwritten
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize(
    "file, kind",
    [
        ("manifest.json", "link to /dev/zero"),  # before the fix: read until memory ran out
        ("manifest.json", "fifo"),  # before the fix: open() blocked for a writer, forever
        ("shard-00000.safetensors", "fifo"),  # the same, in safetensors' open
    ],
)
def test_a_file_that_is_not_a_regular_file_is_damage_not_a_hang(saved, tmp_path, file, kind):
    root = tmp_path / "ck"
    shutil.copytree(saved[0], root)
    target = root / "step-1" / file
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    model, opt, sched = _train.make(seed=7)
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match="not a regular file"):
        state = ck.restore(model=model, optimizer=opt, scheduler=sched)
    assert state.saved_step == 0
    assert _train.same_state(model.state_dict(), saved[1][0])


def test_a_checkpoint_of_another_model_is_refused_before_anything_loads(saved, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved[0], root)
    torch.manual_seed(3)
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with Checkpointer(root) as ck, pytest.raises(ConfigError, match="does not fit the model"):
        ck.restore(model=other)
    assert _train.same_state(other.state_dict(), before)  # first layer matches: still untouched


def test_an_optimizer_with_other_groups_is_refused_before_the_model_loads(saved, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved[0], root)
    model, _, _ = _train.make(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with Checkpointer(root) as ck, pytest.raises(ConfigError, match="parameter groups"):
        ck.restore(model=model, optimizer=opt)
    assert _train.same_state(model.state_dict(), before)


@pytest.mark.parametrize("kind", ["AdamW", "OffloadedAdamW"])
def test_another_optimizers_state_is_refused_before_the_model_loads(tmp_path, kind):
    model, _, _ = _train.make()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 16)).sum().backward()
    sgd.step()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, model=model, optimizer=sgd)
    fresh, _, _ = _train.make(seed=7)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opt = (torch.optim.AdamW if kind == "AdamW" else tt.OffloadedAdamW)(fresh.parameters())
    # before the fix: KeyError('step') / TypeError from load_state_dict, the model already loaded
    with Checkpointer(tmp_path) as ck, pytest.raises(ConfigError, match=f"the {kind} passed"):
        ck.restore(model=fresh, optimizer=opt)
    assert _train.same_state(fresh.state_dict(), before)
    assert opt.state_dict()["state"] == {}
    if kind == "AdamW":  # the optimizer is untouched and still steps
        fresh(torch.randn(8, 16)).sum().backward()
        opt.step()
    else:
        opt.close()


def test_state_nested_deeper_than_the_limit_is_refused_at_save(tmp_path):
    with Checkpointer(tmp_path, every=1) as ck, pytest.raises(ConfigError, match="levels deep"):
        ck.save(0, extra=_deep(MAX_DEPTH + 5))
    with Checkpointer(tmp_path, every=1) as ck:  # the limit itself round-trips
        ck.save(0, extra=_deep(MAX_DEPTH - 1))
        ck.wait()
        assert ck.restore().extra == _deep(MAX_DEPTH - 1)


def test_numpy_arrays_with_nan_and_inf_round_trip_exactly(tmp_path):
    values = np.array([1.5, np.nan, -np.inf, -0.0], dtype=np.float32)
    extra = {"metrics": values, "ints": np.arange(6, dtype=np.int64).reshape(2, 3)}
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, extra=extra)  # before: the JSON manifest refused NaN, the persist failed
        ck.wait()
        got = ck.restore().extra
    assert got["metrics"].dtype == np.float32 and got["metrics"].tobytes() == values.tobytes()
    assert np.array_equal(got["ints"], extra["ints"]) and got["ints"].dtype == np.int64


def test_numpy_scalars_keep_their_type_so_resumed_arithmetic_is_the_same(tmp_path):
    extra = {"decay": np.float32(0.999), "seen": np.int64(7), "done": np.bool_(False)}
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, extra=extra)
    with Checkpointer(tmp_path, every=1) as ck:
        got = ck.restore().extra
    # before the fix: Python float/int/bool, so float32 arithmetic became float64 after a resume
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in extra.items()}
    assert got == extra
    assert (got["decay"] * np.float32(0.3)).tobytes() == (
        extra["decay"] * np.float32(0.3)
    ).tobytes()


@pytest.mark.parametrize(
    "tensor",
    [torch.eye(2).to_sparse(), torch.empty(2, device="meta")],
    ids=["sparse", "meta"],
)
def test_a_tensor_without_dense_data_is_refused_at_save_with_its_path(tmp_path, tensor):
    with Checkpointer(tmp_path, every=1) as ck:
        with pytest.raises(ConfigError, match="extra/state/t: .* cannot be checkpointed"):
            ck.save(0, extra={"state": {"t": tensor}})  # before: a TypeError naming no value
        ck.save(1, extra={"ok": 1})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step-1"]


def _key_order(obj):
    """Every dict's keys in order, nested (what ``==`` on dicts ignores)."""
    if isinstance(obj, dict):
        return [(k, _key_order(v)) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [_key_order(v) for v in obj]
    return None


def test_extra_comes_back_with_its_keys_in_the_order_saved(tmp_path):
    scaler = torch.amp.GradScaler("cpu")
    extra = {
        "zeta": {"y": 1, "b": [{"q": 0, "c": 1}], "a": 2.5},
        "scaler": scaler.state_dict(),
        "alpha": {"step": torch.tensor(3), "mid": None},
    }
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, model=torch.nn.Linear(2, 2), extra=extra)
    with Checkpointer(tmp_path, every=1) as ck:
        got = ck.restore(model=torch.nn.Linear(2, 2)).extra
    assert _key_order(got) == _key_order(extra)  # as torch.save gives it back


def test_a_manifest_written_with_sorted_keys_still_verifies(saved, tmp_path):
    def sort_all(body):  # earlier versions wrote every object's keys sorted
        sorted_body = json.loads(json.dumps(body, sort_keys=True))
        body.clear()
        body.update(sorted_body)

    root = _edited(saved, tmp_path, sort_all)
    model, opt, sched = _train.make(seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: step 1 verifies
        with Checkpointer(root, every=1) as ck:
            state = ck.restore(model=model, optimizer=opt, scheduler=sched)
    assert state.saved_step == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[1][1].items())
