"""Plans reused: the plan cache (JSON, keyed by model, shape bucket, dtype and budget) and plans
per shape bucket chosen at run time without profiling again."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from tensortier.planner.buckets import bucket
from tensortier.planner.policies import Options
from tensortier.planner.runtime import planned_offload

FAST = Options(search_iters=60, search_seconds=5, plan_seconds=20)
STEPS = 5  # warm-up, probe, 2 timing passes, one planned step


class _Seq(nn.Module):
    """Blocks over a (batch, seq, width) input, so the sequence length can vary."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _grads(model, xs, off=None) -> list[torch.Tensor]:
    out = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        if off is None:
            loss = model(x).square().mean()
        else:
            with off:
                loss = model(x).square().mean()
        loss.backward()
        out += [p.grad.clone() for p in model.parameters()]
    return out


def _run(cache, spill_dir, *, width=512, seq=128, steps=STEPS, budget="48MiB"):
    model = _Seq(width)
    x = torch.randn(8, seq, width, generator=torch.Generator().manual_seed(1))
    plain = _grads(model, [x] * steps)
    off = planned_offload(budget, spill_dir=spill_dir, options=FAST, plan_cache=cache)
    try:
        got = _grads(model, [x] * steps, off)
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))  # bit-identical throughout
    return off


def test_a_restarted_job_runs_the_cached_plan_from_its_first_step(tmp_path, spill_dir):
    cache = tmp_path / "plans"
    first = _run(cache, spill_dir)
    assert not first.cached and first._profiler is not None
    (path,) = list(cache.iterdir())
    data = json.loads(path.read_text())  # JSON, never pickle
    assert data["key"]["budget"] == 48 << 20 and data["key"]["inputs"][0][0] == [8, 128, 512]
    second = _run(cache, spill_dir, steps=2)
    assert second.cached and second._profiler is None  # no warm-up, no profiling
    assert second.choice.plan.to_dict() == first.choice.plan.to_dict()
    assert second.profile.to_dict() == first.profile.to_dict()
    # the cached plan is the plan a fresh choice makes from the same profile
    assert second._overhead == first._overhead  # the budget is accounted the same way
    fresh = second._choose(second.profile)
    assert fresh.plan.to_dict()["actions"] == second.choice.plan.to_dict()["actions"]


@pytest.mark.parametrize("change", ["model", "shape", "budget"])
def test_a_cached_plan_is_refused_when_the_model_shapes_or_budget_change(
    tmp_path, spill_dir, change
):
    cache = tmp_path / "plans"
    _run(cache, spill_dir)
    kw = {"model": {"width": 256}, "shape": {"seq": 32}, "budget": {"budget": "56MiB"}}[change]
    again = _run(cache, spill_dir, **kw)
    assert not again.cached and again._profiler is not None  # profiled again
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_cache_file_means_profiling_again(tmp_path, spill_dir):
    cache = tmp_path / "plans"
    _run(cache, spill_dir)
    (path,) = list(cache.iterdir())
    path.write_text('{"key": ')  # torn
    again = _run(cache, spill_dir)
    assert not again.cached
    assert json.loads(path.read_text())["key"]["budget"] == 48 << 20  # rewritten whole
    assert not [p for p in os.listdir(cache) if p.startswith(".plan-")]  # no temporaries left


def test_other_sequence_lengths_get_their_bucket_plan_without_profiling(spill_dir):
    model = _Seq()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, 256, generator=gen) for _ in range(STEPS)]
    xs += [torch.randn(8, 100, 256, generator=gen), torch.randn(8, 120, 256, generator=gen)]
    xs += [torch.randn(8, 64, 256, generator=gen)]
    plain = _grads(model, xs)
    off = planned_offload("48MiB", spill_dir=spill_dir, options=FAST)
    try:
        got = _grads(model, xs, off)
        profiled = [r for r in off.profile.passes if r["kind"] != "trial"]  # trials: not profiled
        passes = len(profiled)
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert bucket(100) == bucket(120) == 128 and bucket(64) == 64
    assert len(off._buckets) == 2  # seq 64 (profiled) and seq 128 (scaled), one plan each
    scaled = [b for b in off._buckets.values() if b.sizes][0]
    assert scaled.sizes[64] == 128 and scaled.sizes[8 * 64] == 8 * 128  # rows of the matmuls
    assert scaled.profile.saved_bytes == pytest.approx(
        2 * off._buckets[next(iter(off._buckets))].profile.saved_bytes, rel=0.01
    )
    assert passes == 3 and off._profiled == 3  # the probe and two timing passes, never again


def test_an_unwritable_cache_warns_once_and_training_goes_on(tmp_path, spill_dir, caplog):
    """A cache path that cannot be made (under a regular file): the first plan, a new bucket's
    plan and every later one fail to save; one warning, the plans stay in memory, gradients
    bit-identical to plain PyTorch."""
    (tmp_path / "file").write_text("not a directory")
    cache = tmp_path / "file" / "plans"
    model = _Seq()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, 256, generator=gen) for _ in range(STEPS)]
    xs += [torch.randn(8, 100, 256, generator=gen), torch.randn(8, 64, 256, generator=gen)]
    plain = _grads(model, xs)
    off = planned_offload("48MiB", spill_dir=spill_dir, options=FAST, plan_cache=cache)
    with caplog.at_level("WARNING", logger="tensortier"):
        try:
            got = _grads(model, xs, off)
        finally:
            off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert len(off._buckets) == 2  # both buckets planned (and neither saved)
    warned = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warned) == 1 and str(cache) in warned[0].getMessage()
    assert (tmp_path / "file").read_text() == "not a directory"


_READ_ONLY_CACHE = r"""
import logging, os, shutil, sys, tempfile
import torch
torch.set_num_threads(1)  # fork below: no OpenMP pool in the parent
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from test_cache import FAST, _Seq, _grads
from tensortier._lifetime import quiesce
from tensortier.planner.runtime import planned_offload

def xs(seq):
    return [torch.randn(8, seq, 256, generator=torch.Generator().manual_seed(seq))]

base = tempfile.mkdtemp(prefix="tt-test-plancache-")
os.chmod(base, 0o755)
cache, spill = os.path.join(base, "cache"), os.path.join(base, "spill")
os.makedirs(spill)
os.chmod(spill, 0o777)
try:
    model = _Seq()
    off = planned_offload("28MiB", spill_dir=spill, options=FAST, plan_cache=cache)
    _grads(model, xs(128) * 5, off)
    off.close()
    quiesce()  # no cleanup in flight when forking
    for name in os.listdir(cache):
        os.chmod(os.path.join(cache, name), 0o444)
    os.chmod(cache, 0o555)  # a shared, read-only cache
    root = os.geteuid() == 0
    pid = os.fork() if root else 0
    if pid == 0:
        code = 1
        try:
            if root:
                os.setgid(65534)
                os.setuid(65534)
            warned = []
            handler = logging.Handler()
            handler.emit = lambda r: warned.append(r.getMessage())
            logging.getLogger("tensortier").addHandler(handler)
            off = planned_offload("28MiB", spill_dir=spill, options=FAST, plan_cache=cache)
            try:
                got = _grads(model, xs(128) + xs(1024) + xs(2048), off)
            finally:
                off.close()
            plain = _grads(model, xs(128) + xs(1024) + xs(2048))
            same = all(torch.equal(a, b) for a, b in zip(plain, got))
            unwritable = [m for m in warned if "cannot be written" in m]
            print(f"cached={off.cached} same={same} warnings={len(unwritable)}")
            code = 0
        finally:
            if root:
                sys.stdout.flush()
                os._exit(code)
    else:
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
finally:
    shutil.rmtree(base, ignore_errors=True)  # the forked child leaves through os._exit
"""


def test_a_shared_read_only_cache_is_used_and_new_lengths_still_train():
    """Another user's read-only cache: its plan is used, then a new sequence length (whose plan
    cannot be saved) trains on with one warning. Run as uid 65534 when the tests run as root
    (root writes anywhere), in a fresh process (fork needs a process without thread pools)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _READ_ONLY_CACHE, __file__],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "cached=True same=True warnings=1", proc.stderr[-3000:]


def _no_codec(d: dict) -> None:
    d["plan"]["codecs"] = {"0": "rot13"}


def _lossy_codec(d: dict) -> None:
    d["plan"]["codecs"] = {str(i): "bf16" for i in range(len(d["profile"]["tensors"]))}
    d["plan"]["actions"] = {u: "disk+codec" if u else "keep" for u in d["plan"]["actions"]}


def _text_overhead(d: dict) -> None:
    d["overhead_bytes"] = "12MiB"


def _text_timing(d: dict) -> None:
    d["profile"]["units"][0]["fwd_s"] = "slow"


@pytest.mark.parametrize("edit", [_no_codec, _lossy_codec, _text_overhead, _text_timing])
def test_an_edited_cache_file_with_the_right_key_means_profiling_again(
    tmp_path, spill_dir, edit, caplog
):
    """A file whose key matches but whose contents do not hold (an unknown codec, a lossy codec
    the settings forbid, a value of the wrong type) raised ConfigError/ValueError/TypeError out
    of the first step, or ran a lossy codec; now a warning, profiling, gradients bit-identical."""
    cache = tmp_path / "plans"
    _run(cache, spill_dir)
    (path,) = list(cache.iterdir())
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    again = _run(cache, spill_dir)  # asserts gradients bit-identical to plain PyTorch
    assert not again.cached and "unusable" in caplog.text


def test_a_restart_whose_first_batch_is_larger_in_the_bucket_plans_for_its_size(
    tmp_path, spill_dir
):
    """The cached profile was measured at 100 tokens (bucket 128); a restart whose first batch
    had 128 ran the 100-token plan on it, and took 128 as the profiled size, so later batches
    up to it never got a plan for their size either."""
    cache, model, gen = tmp_path / "plans", _Seq(), torch.Generator().manual_seed(1)
    first = [torch.randn(8, 100, 256, generator=gen) for _ in range(STEPS)]
    off = planned_offload("48MiB", spill_dir=spill_dir, options=FAST, plan_cache=cache)
    try:
        _grads(model, first, off)
    finally:
        off.close()
    xs = [torch.randn(8, n, 256, generator=gen) for n in (128, 100, 120)]
    plain = _grads(model, xs)
    off = planned_offload("48MiB", spill_dir=spill_dir, options=FAST, plan_cache=cache)
    running = []
    try:
        for x in xs:
            got = _grads(model, [x], off)
            assert all(torch.equal(a, b) for a, b in zip(plain[: len(got)], got))
            plain = plain[len(got) :]
            running.append(off.profile.tensors[0].nbytes)  # the input, as the plan counts it
        assert off.cached
    finally:
        off.close()
    assert running == [8 * 128 * 256 * 4, 8 * 100 * 256 * 4, 8 * 128 * 256 * 4]
