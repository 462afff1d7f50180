"""``python -m benchmarks planner``: what the sweep does with its workers' rows (the worker itself
runs in tests/planner/test_runtime.py)."""

import argparse
import json

import pytest

from benchmarks import planner


def test_a_lossless_plan_whose_gradients_differ_fails_the_run_after_the_json(tmp_path, monkeypatch):
    """``grads_match: false`` was a table cell; a lossy plan (None) is not a failure."""
    rows = [
        {"model": "m", "frac": 0.5, "budget_bytes": 9, "policy": p, "grads_match": g,
         "step_times_s": [1.0, 1.0]}
        for p, g in (("keep", True), ("fine", None), ("swap_all", False))
    ]  # fmt: skip
    summary = [{"model": "m", "frac": 0.5, "error": "no plan"}]
    monkeypatch.setattr(planner, "_sweep", lambda args, models: (rows, summary))
    p = argparse.ArgumentParser()
    planner.add_args(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--models", "m", "--quiet-wait", "0", "--json", str(out)])
    with pytest.raises(SystemExit) as got:
        planner.run(args)
    assert "m@0.5 swap_all: gradients bit-identical" in str(got.value)
    assert "fine" not in str(got.value) and "keep" not in str(got.value)
    assert [r["grads_match"] for r in json.loads(out.read_text())["rows"]] == [True, None, False]


def test_the_sweeps_model_and_batch_live_on_the_machines_device(monkeypatch):
    """The worker built its model and batch on the CPU even on a GPU machine, so the sweep
    measured the host's memory and speed, not the device's the budgets are for."""
    import torch

    from tensortier import _device

    monkeypatch.setattr(_device, "default_device", lambda: torch.device("meta"))
    args = argparse.Namespace(model="gpt:1x32x2", heads=2, seq=8, vocab=64)
    model, x, y = planner._build(args)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert x.device.type == y.device.type == "meta"


def test_a_cuda_step_is_metered_by_the_allocator_after_its_last_kernel(monkeypatch):
    """On a GPU the step's peak was the host's RSS; it is now the CUDA allocator's mark, read
    after a synchronize, and the cache is left warm (emptying it would make every timed step
    allocate afresh)."""
    import torch

    calls = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda d=None: calls.append("sync"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: calls.append("reset"))
    monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: 100)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: 350)
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty"))
    meter = planner._StepPeak(torch.device("cuda", 0))
    assert meter.start() == 100 and meter.stop() == 350
    assert calls == ["sync", "reset", "sync"]


def test_a_cpu_step_records_its_rss_peak():
    args = argparse.Namespace(model="gpt:1x32x2", heads=2, seq=8, vocab=64)
    var = {"peaks": []}
    dt, peak, digest = planner._Runner(*planner._build(args)).step(var)
    assert var["peaks"] == [peak] and peak > 0 and dt > 0
