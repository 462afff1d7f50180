import errno
import json
import os
import resource
import threading
import warnings

import crc32c
import pytest
import torch
from safetensors.torch import load_file

import tensortier as tt
from tensortier.checkpoint import Checkpointer, _persist
from tensortier.checkpoint._format import canonical
from tensortier.errors import ClosedError, ConfigError, CorruptDataError, TierFullError
from tests.checkpoint import _train


def run(ck, model, opt, sched, start, stop, extra=None):
    losses = []
    for i in range(start, stop):
        losses.append(_train.step(model, opt, sched, ck))
        ck.maybe_save(i, model=model, optimizer=opt, scheduler=sched, extra=extra or {"pos": i})
    return losses


def shard(path):
    return os.path.join(path, "shard-00000.safetensors")


def test_exported_at_top_level():
    assert tt.Checkpointer is Checkpointer and "Checkpointer" in tt.__all__


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"keep": 1}, "at least 2"),
        ({"keep": 0}, "at least 2"),
        ({"every": 0}, "steps >= 1"),
        ({"every": "often"}, "'auto'"),
        ({"max_overhead": 3.5}, "fraction"),
        ({"max_overhead": "0.1"}, "fraction"),
        ({"shard_size": "lots"}, "shard_size"),
        ({"io_threads": "2"}, "io_threads='2': pass an int"),
        ({"io_threads": 0}, "io_threads=0: pass an int"),
        ({"io_threads": 10**6}, "from 1 to 256"),
        ({"io_threads": True}, "io_threads=True"),
        ({"direct": "yes"}, "direct='yes'"),
        ({"warmup": -1}, "warmup=-1"),
        ({"keep": 2.5}, "keep=2.5"),
    ],
)
def test_bad_settings_refused_with_the_fix(tmp_path, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        Checkpointer(tmp_path, **kwargs)


def test_a_misspelt_setting_names_the_checkpointer_and_its_settings(tmp_path):
    """``Checkpointer(dir, kep=3)`` said "CheckpointConfig.__init__() got an unexpected keyword
    argument", a class the user never met, and ``help(Checkpointer)`` showed only ``**settings``."""
    with pytest.raises(
        TypeError,
        match=r"Checkpointer\(\) got an unexpected keyword argument 'kep'; its settings are keep, every",
    ):
        Checkpointer(tmp_path / "ck", kep=3)
    assert not os.path.exists(tmp_path / "ck")  # refused before anything was made
    doc = Checkpointer.__doc__
    for name, default in [("keep", "3"), ("every", '"auto"'), ("io_threads", "4")]:
        assert f"``{name}={default}``" in doc
        assert repr(getattr(tt.checkpoint.CheckpointConfig(), name)).replace("'", '"') == default
    for f in __import__("dataclasses").fields(tt.checkpoint.CheckpointConfig):
        assert f"``{f.name}=" in doc, f.name


def test_resume_reproduces_the_uninterrupted_losses_bit_for_bit(tmp_path):
    _, _, _, expected = _train.reference(20)
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, keep=2, every=5) as ck:
        assert ck.restore(model=model, optimizer=opt, scheduler=sched) is None
        first = run(ck, model, opt, sched, 0, 12)  # saves after steps 4 and 9, then "crashes"
    # a new process: different initial weights and RNG streams, restored from step 9
    model, opt, sched = _train.make(seed=123)
    with Checkpointer(tmp_path, keep=2, every=5) as ck:
        state = ck.restore(model=model, optimizer=opt, scheduler=sched)
        assert (state.step, state.saved_step, state.extra) == (10, 9, {"pos": 9})
        rest = run(ck, model, opt, sched, state.step, 20)
    assert first == expected[:12]
    assert rest == expected[10:]  # exact float equality, not allclose


def test_files_are_plain_safetensors_with_the_exact_bytes(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, every=1) as ck:
        _train.step(model, opt, sched, ck)
        ck.maybe_save(0, model=model, optimizer=opt, scheduler=sched)
    loaded = load_file(shard(tmp_path / "step-0"))
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[f"model/{name}"], t)
    assert torch.equal(loaded["optimizer/state/0/exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    manifest = json.loads((tmp_path / "step-0" / "manifest.json").read_text())
    assert manifest["body"]["step"] == 0
    assert all(isinstance(e["crc32c"], int) for e in manifest["body"]["tensors"].values())


def test_every_dtype_and_odd_shapes_round_trip(tmp_path):
    from tests.conftest import ALL_DTYPES, bit_equal, make_tensor

    extra = {f"{d}": make_tensor((3, 5), d) for d in ALL_DTYPES}
    extra["scalar"] = torch.tensor(7.5)
    extra["empty"] = torch.empty(0, 4)
    extra["strided"] = torch.arange(20.0).reshape(4, 5).t()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, extra=extra)
        ck.wait()
        got = ck.restore().extra
    assert got.keys() == extra.keys()
    for k in extra:
        assert bit_equal(got[k], extra[k].contiguous()), k


def test_snapshot_buffers_are_reused_and_bounded(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, every=1, keep=2) as ck:
        run(ck, model, opt, sched, 0, 2)
        ck.wait()
        images = [b.data_ptr() for b in ck._images]
        held = ck.stats().host_bytes
        run(ck, model, opt, sched, 2, 8)
        assert [b.data_ptr() for b in ck._images] == images
        assert ck.stats().host_bytes == held
        assert ck.stats().saves == 8
    assert ck.stats().committed == 8


def test_host_budget_too_small_names_the_minimum(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, every=1, host_budget="4KiB") as ck:
        _train.step(model, opt, sched, ck)
        with pytest.raises(tt.BudgetError, match="at least") as info:
            ck.save(0, model=model, optimizer=opt)
        assert info.value.minimum > 4096


def test_optimizer_step_waits_for_the_snapshot_even_without_the_explicit_call(tmp_path):
    model, opt, sched = _train.make()
    gate = threading.Event()
    order = []
    with Checkpointer(tmp_path, every=1) as ck:
        _train.step(model, opt, sched)
        real = ck._copier.submit

        def slow_copy(fn):
            def held():
                gate.wait()
                out = fn()
                order.append("copied")
                return out

            return real(held)

        ck._copier.submit = slow_copy
        ck.maybe_save(0, model=model, optimizer=opt, scheduler=sched)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.register_step_pre_hook(lambda *_: order.append("step"))  # runs after ck's hook
        threading.Timer(0.05, gate.set).start()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()  # ck's pre-hook blocks here until the copy finished
        ck.wait()
    assert order == ["copied", "step"]
    saved = load_file(shard(tmp_path / "step-0"))
    for name, t in before.items():  # BN buffers too: forward changed them after maybe_save
        assert torch.equal(saved[f"model/{name}"], t), name


def test_retention_keeps_the_newest(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, keep=3, every=2) as ck:
        run(ck, model, opt, sched, 0, 14)
        ck.wait()
        assert ck.checkpoints() == [str(tmp_path / f"step-{s}") for s in (13, 11, 9)]
    # a run resumed from an older checkpoint keeps the one it just wrote (and retires the newer)
    with Checkpointer(tmp_path, keep=2, every=1) as ck:
        ck.restore(model=model, optimizer=opt, scheduler=sched, step=9)
        ck.save(10, model=model)
        ck.wait()
        assert ck.checkpoints() == [str(tmp_path / f"step-{s}") for s in (10, 9)]


def test_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, keep=5, every=2) as ck:
        run(ck, model, opt, sched, 0, 6)  # steps 1, 3, 5
    flip = shard(tmp_path / "step-5")
    with open(flip, "r+b") as f:  # flip one bit in the data section
        f.seek(os.path.getsize(flip) - 3)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    cut = shard(tmp_path / "step-3")
    os.truncate(cut, os.path.getsize(cut) - 100)
    model2, opt2, sched2 = _train.make(seed=5)
    with Checkpointer(tmp_path, keep=5) as ck, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = ck.restore(model=model2, optimizer=opt2, scheduler=sched2)
    messages = [str(w.message) for w in caught]
    assert state.saved_step == 1
    assert any("step-5" in m and "checksum mismatch" in m for m in messages), messages
    assert any("step-3" in m and "cannot read" in m for m in messages), messages
    ref_model, ref_opt, _, _ = _train.reference(2)
    assert _train.same_state(model2.state_dict(), ref_model.state_dict())
    assert _train.same_state(opt2.state_dict(), ref_opt.state_dict())


def test_all_checkpoints_corrupt_raises_instead_of_starting_over(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, every=1) as ck:
        run(ck, model, opt, sched, 0, 1)
    (tmp_path / "step-0" / "manifest.json").write_text("{not json")
    with (
        Checkpointer(tmp_path) as ck,
        pytest.warns(UserWarning, match="unusable"),
        pytest.raises(CorruptDataError, match="no usable checkpoint"),
    ):
        ck.restore(model=model)


def test_partial_directories_are_ignored_and_cleaned(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, every=1) as ck:
        run(ck, model, opt, sched, 0, 1)
    os.rename(tmp_path / "step-0", tmp_path / "step-7.incomplete")
    with Checkpointer(tmp_path) as ck:
        assert not (tmp_path / "step-7.incomplete").exists()
        assert ck.restore(model=model) is None


def test_full_disk_raises_at_next_call_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    model, opt, sched = _train.make()
    ck = Checkpointer(tmp_path, keep=2, every=2)
    run(ck, model, opt, sched, 0, 4)  # steps 1, 3
    ck.wait()

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_persist, "_pwrite", full)
    run(ck, model, opt, sched, 4, 6)  # step 5 fails in the background
    with pytest.raises(TierFullError, match="disk full") as info:
        run(ck, model, opt, sched, 6, 8)  # raised by step 6 if already failed, else by step 7
    assert info.value.tier == "disk"
    assert sorted(os.listdir(tmp_path)) == [".tensortier-checkpoint.lock", "step-1", "step-3"]
    run(ck, model, opt, sched, 8, 10)  # step 9 fails too: close reports it
    with pytest.raises(TierFullError):
        ck.close()
    assert ck.closed
    monkeypatch.undo()
    with Checkpointer(tmp_path) as ck2:
        assert ck2.restore(model=model).saved_step == 3


def test_one_writer_per_directory_and_closed_errors(tmp_path):
    ck = Checkpointer(tmp_path)
    with pytest.raises(ConfigError, match="another Checkpointer"):
        Checkpointer(tmp_path)
    ck.close()
    with pytest.raises(ClosedError):
        ck.maybe_save(0)
    Checkpointer(tmp_path).close()  # the lock was released


def test_unsupported_state_is_refused_at_save_with_its_path(tmp_path):
    with Checkpointer(tmp_path, every=1) as ck, pytest.raises(ConfigError, match=r"extra/fn"):
        ck.save(0, extra={"fn": lambda: 0})
    assert not any(n.startswith("step-") for n in os.listdir(tmp_path))


def _forge(path, body):
    data = canonical(body)
    doc = {"crc32c": crc32c.crc32c(data), "body": body}
    (path / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "payload",
    [
        {"$tt": "pickle", "data": "gASVIQAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAV0b3VjaJSFlFKULg=="},
        {"py/object": "os.system", "$tt": "call", "args": ["touch canary"]},
        {"$tt": "tensor", "name": "../../canary"},
        {"__reduce__": ["os.system", ["touch canary"]]},
    ],
)
def test_crafted_manifest_cannot_execute_code(tmp_path, monkeypatch, payload):
    monkeypatch.chdir(tmp_path)
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path / "ck", every=1) as ck:
        run(ck, model, opt, sched, 0, 1)
    step = tmp_path / "ck" / "step-0"
    body = json.loads((step / "manifest.json").read_text())["body"]
    body["state"]["extra"] = payload
    _forge(step, body)
    with Checkpointer(tmp_path / "ck") as ck:
        if "$tt" in payload:
            with pytest.warns(UserWarning), pytest.raises(CorruptDataError):
                ck.restore(model=model)
        else:  # a plain dict is plain data
            assert ck.restore(model=model).extra == payload
    assert not (tmp_path / "canary").exists()


def test_crafted_file_names_and_pickled_shards_are_rejected(tmp_path, monkeypatch):
    import pickle

    monkeypatch.chdir(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch canary",))

    model, opt, sched = _train.make()
    with Checkpointer(tmp_path / "ck", every=1, keep=3) as ck:
        run(ck, model, opt, sched, 0, 2)
    step1 = tmp_path / "ck" / "step-1"
    body = json.loads((step1 / "manifest.json").read_text())["body"]
    name = next(iter(body["tensors"]))
    body["tensors"][name]["file"] = "../step-0/shard-00000.safetensors"
    _forge(step1, body)
    with open(shard(tmp_path / "ck" / "step-0"), "wb") as f:
        pickle.dump(Evil(), f)
    with (
        Checkpointer(tmp_path / "ck") as ck,
        pytest.warns(UserWarning) as caught,
        pytest.raises(CorruptDataError),
    ):
        ck.restore(model=model)
    assert any("bad file entry" in str(w.message) for w in caught)
    assert not (tmp_path / "canary").exists()


def test_auto_interval_is_measured_and_reported(tmp_path):
    model, opt, sched = _train.make()
    with Checkpointer(tmp_path, every="auto", max_overhead=0.5, warmup=2) as ck:
        assert ck.interval is None
        run(ck, model, opt, sched, 0, 40)
        ck.wait()
        ck.maybe_save(40, model=model, optimizer=opt)  # accounts the finished checkpoint
        assert ck.stats().saves >= 1
        assert ck.interval is not None and ck.interval >= 1
        assert ck.stats().last_cost_seconds is not None
        assert ck.stats().history[0]["persist_s"] > 0


@pytest.mark.gpu
def test_cuda_state_snapshots_on_a_side_stream_and_resumes(tmp_path):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(tmp_path, every=1) as ck:
        for i in range(3):
            model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
            opt.step()  # the pre-hook orders it after the snapshot copy
            opt.zero_grad()
            ck.maybe_save(i, model=model, optimizer=opt)
        ck.wait()
        expected = {k: v.cpu() for k, v in model.state_dict().items()}
    fresh = torch.nn.Linear(64, 64).cuda()
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(model=fresh).saved_step == 2
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.cpu(), expected[k])


def test_offloaded_adamw_resumes_exactly(tmp_path):
    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        return model, tt.OffloadedAdamW(model.parameters(), lr=1e-2, overlap=False)

    def steps(model, opt, ck, start, stop):
        losses = []
        for i in range(start, stop):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if ck is not None:
                ck.maybe_save(i, model=model, optimizer=opt)
        return losses

    model, opt = make(0)
    expected = steps(model, opt, None, 0, 10)
    opt.close()
    model, opt = make(0)
    with Checkpointer(tmp_path, every=3) as ck:
        assert steps(model, opt, ck, 0, 7) == expected[:7]  # saves after steps 2 and 5
    opt.close()
    model, opt = make(1)
    with Checkpointer(tmp_path) as ck:
        state = ck.restore(model=model, optimizer=opt)
        assert state.step == 6
        assert steps(model, opt, ck, 6, 10) == expected[6:]
    opt.close()


def test_thousands_of_small_shards_do_not_run_out_of_file_descriptors(tmp_path):
    model = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(100)])  # 200+ shards
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 150, hard))
    try:  # before the fix every shard was opened at once: EMFILE on every save
        with Checkpointer(tmp_path, every=1, shard_size="1KiB") as ck:
            ck.save(0, model=model)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(list((tmp_path / "step-0").glob("shard-*.safetensors"))) > 200
    restored = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(100)])
    with Checkpointer(tmp_path) as ck:
        ck.restore(model=restored)
    assert _train.same_state(restored.state_dict(), model.state_dict())
