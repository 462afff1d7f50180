import math
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier._lifetime import quiesce
from tensortier.errors import ClosedError, ConfigError, TierFullError
from tensortier.optim import OffloadedAdamW, OptimizerStats
from tests._helpers import HostAdamW, Trace, assert_same_trace


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Linear(24, 3)
    )
    return m.to(dtype)


def _groups(m):
    return [
        {"params": list(m[0].parameters()), "weight_decay": 0.1},
        {"params": list(m[2].parameters()) + list(m[3].parameters()), "lr": 3e-3},
    ]


def _batches(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 12, generator=g).to(dtype) for _ in range(n)]


def _train(model, opt, batches, *, accum=1, clip=None, sched=None):
    for i in range(0, len(batches), accum):
        for x in batches[i : i + accum]:
            model(x).square().mean().backward()
        if clip is not None:
            if isinstance(opt, OffloadedAdamW):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _rel_close(a, b, tol=1e-6):
    for p, q in zip(a.parameters(), b.parameters()):
        err = (p.double() - q.double()).abs().max().item()
        scale = max(q.double().abs().max().item(), 1e-12)
        assert err <= tol * scale, (err, scale)


TIERS = ["host", "disk"]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("overlap", [True, False])
def test_matches_torch_adamw_groups_sched_clip_accum(tier, overlap, spill_dir):
    ref_m, tt_m = _model(), _model()
    ref = torch.optim.AdamW(_groups(ref_m), lr=1e-2, weight_decay=0.01)
    opt = OffloadedAdamW(
        _groups(tt_m),
        lr=1e-2,
        weight_decay=0.01,
        tier=tier,
        spill_dir=spill_dir,
        bucket_size="2KiB",
        overlap=overlap,
    )
    sched_ref = torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    sched_tt = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = _batches(40)  # 20 steps of 2 accumulated backward passes
    _train(ref_m, ref, data, accum=2, clip=0.05, sched=sched_ref)
    _train(tt_m, opt, data, accum=2, clip=0.05, sched=sched_tt)
    _rel_close(tt_m, ref_m)
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"]
    opt.close()


@pytest.mark.parametrize("tier", TIERS)
def test_overlap_launches_in_backward_and_matches_fused_bitwise(tier, spill_dir):
    ref_m, tt_m = _model(), _model()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(
        tt_m.parameters(),
        lr=1e-2,
        tier=tier,
        spill_dir=spill_dir,
        bucket_size="1KiB",
        overlap=True,
    )
    data = _batches(20)
    _train(ref_m, ref, data)
    _train(tt_m, opt, data)
    for p, q in zip(tt_m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)
    assert opt.stats().launched_in_backward > 0  # buckets were updated while backward ran
    opt.close()


def test_frozen_and_gradless_params_like_torch():
    def build():
        m = _model()
        m[0].bias.requires_grad_(False)
        return m

    ref_m, tt_m = build(), build()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = OffloadedAdamW(tt_m.parameters(), lr=1e-2, bucket_size="1KiB", overlap=True)
    for i, x in enumerate(_batches(10)):
        for m, o in ((ref_m, ref), (tt_m, opt)):
            # every third step the last layer gets no gradient
            out = m[2](m[1](m[0](x))).sum() if i % 3 == 0 else m(x).sum()
            out.backward()
            o.step()
            o.zero_grad()
    _rel_close(tt_m, ref_m)
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert set(sd["state"]) == set(rsd["state"])  # frozen bias has no state, like torch
    for k in rsd["state"]:
        assert sd["state"][k]["step"].item() == rsd["state"][k]["step"].item()
    opt.close()


@pytest.mark.parametrize("tier", TIERS)
def test_state_dict_roundtrip_resumes_exactly(tier, spill_dir):
    a, b = _model(), _model()
    data = _batches(20)
    opt_a = OffloadedAdamW(a.parameters(), lr=1e-2, tier=tier, spill_dir=spill_dir, overlap=True)
    _train(a, opt_a, data)
    opt_b = OffloadedAdamW(b.parameters(), lr=1e-2, tier=tier, spill_dir=spill_dir, overlap=True)
    _train(b, opt_b, data[:10])
    sd = opt_b.state_dict()
    for entry in sd["state"].values():  # tensors and plain values only: safetensors + JSON
        assert all(torch.is_tensor(v) for v in entry.values())
    opt_b.close()  # disk states: the files are gone, the state survives in sd
    opt_c = OffloadedAdamW(b.parameters(), lr=1.0, tier=tier, spill_dir=spill_dir, overlap=True)
    opt_c.load_state_dict(sd)
    assert opt_c.param_groups[0]["lr"] == 1e-2
    _train(b, opt_c, data[10:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    opt_a.close()
    opt_c.close()


def test_loads_torch_adamw_state_dict():
    a, b = _model(), _model()
    data = _batches(12)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    _train(a, ref, data[:6])
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            q.copy_(p)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2, overlap=True)
    opt.load_state_dict(ref.state_dict())
    _train(a, ref, data[6:])
    _train(b, opt, data[6:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_keeps_fp32_masters(dtype):
    ref_m = _model()
    tt_m = _model(dtype=dtype)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3, fused=True)
    opt = OffloadedAdamW(tt_m.parameters(), lr=1e-3, overlap=True)
    for x in _batches(5):
        ref_m(x).square().mean().backward()
        for p, q in zip(tt_m.parameters(), ref_m.parameters()):
            p.grad = q.grad.to(dtype)  # same gradients, rounded to the model dtype
        ref.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    sd = opt.state_dict()
    for i, (p, q) in enumerate(zip(tt_m.parameters(), ref_m.parameters())):
        master = sd["state"][i]["master_param"]
        assert master.dtype == torch.float32
        assert torch.equal(p, master.to(dtype))  # the model holds its master, rounded
        assert (master - q).abs().max().item() < 1e-2 * max(q.abs().max().item(), 1)
    opt.close()


@pytest.mark.parametrize("seed", range(9))
def test_user_change_to_param_wins_over_master(seed):
    """Issue 12 defect 1: this compared against a torch AdamW that load_state_dict had silently
    turned non-fused (our groups lacked ``fused``); for-loop and fused AdamW round differently in
    ~1 element in 2000, so the outcome depended on the data (seeds 4, 6, 8 failed on the CI box;
    other machines' gradients hit other elements). Now the reference stays fused: equal by
    construction, whatever the data or vector width."""
    m = _model(seed)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, overlap=True)
    _train(m, opt, _batches(2, seed=seed))
    with torch.no_grad():
        m[0].weight.fill_(0.5)  # e.g. model.load_state_dict after the optimizer exists
    clone = _model()
    clone.load_state_dict(m.state_dict())
    ref2 = torch.optim.AdamW(clone.parameters(), lr=1e-2, fused=True)
    ref2.load_state_dict(opt.state_dict())
    assert ref2.param_groups[0]["fused"] is True
    _train(m, opt, _batches(1, seed=seed + 100))
    _train(clone, ref2, _batches(1, seed=seed + 100))
    for p, q in zip(m.parameters(), clone.parameters()):
        assert torch.equal(p, q)
    opt.close()


TORCH_GROUP_KEYS = set(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])


def test_state_dict_into_fused_torch_adamw_keeps_fused():
    """Issue 12 defect 11a: torch's load_state_dict replaces its groups with the loaded ones, so
    every key torch's AdamW has must be there, with fused=True (the kernel we run)."""
    m = _model()
    opt = OffloadedAdamW(_groups(m), lr=1e-2, overlap=True)
    _train(m, opt, _batches(2))
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        assert set(g) == TORCH_GROUP_KEYS
        assert g["fused"] is True and g["decoupled_weight_decay"] is True
    ref = torch.optim.AdamW(_groups(_model()), lr=1e-2, fused=True)
    ref.load_state_dict(sd)
    assert all(g["fused"] is True and g["foreach"] is None for g in ref.param_groups)
    assert ref.param_groups[1]["lr"] == 3e-3 and ref.param_groups[0]["weight_decay"] == 0.1
    opt.close()


@pytest.mark.parametrize("variant", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
def test_loads_any_torch_adamw_state_dict_and_stays_fused(variant):
    a, b = _model(), _model()
    data = _batches(10)
    ref = torch.optim.AdamW(_groups(a), lr=1e-2, **variant)
    _train(a, ref, data[:4])
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            q.copy_(p)
    opt = OffloadedAdamW(_groups(b), lr=1e-2, bucket_size="1KiB", overlap=True)
    opt.load_state_dict(ref.state_dict())
    for g in opt.param_groups:  # the loaded group's foreach/fused do not describe our kernel
        assert g["fused"] is True and g["foreach"] is None
    fused = torch.optim.AdamW(_groups(_model()), lr=1e-2, fused=True)
    fused.load_state_dict(opt.state_dict())
    assert all(g["fused"] is True for g in fused.param_groups)
    if variant.get("fused"):  # same kernel from here on: bit-identical
        _train(a, ref, data[4:])
        _train(b, opt, data[4:])
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    opt.close()


def test_refuses_amsgrad_and_adam_l2_state():
    m = _model()
    with pytest.raises(ConfigError, match="amsgrad"):
        OffloadedAdamW([{"params": m.parameters(), "amsgrad": True}], overlap=True)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, overlap=True)
    for ref in (
        torch.optim.AdamW(m.parameters(), amsgrad=True),
        torch.optim.Adam(m.parameters(), weight_decay=0.1),
    ):
        with pytest.raises(ConfigError, match="amsgrad|decoupled_weight_decay"):
            opt.load_state_dict(ref.state_dict())
    opt.close()


def test_disk_full_applies_nothing(spill_dir):
    m = _model()
    nbytes = sum(p.numel() for p in m.parameters()) * 4
    # room for one copy of the state (plus slab rounding), not the two a step needs
    opt = OffloadedAdamW(
        m.parameters(),
        lr=1e-2,
        tier="disk",
        spill_dir=spill_dir,
        bucket_size="4KiB",  # one bucket; a slab holds exactly its 12 KiB state
        disk_budget=16 * 1024,
        overlap=True,
    )
    assert nbytes <= 4096 and len(opt._buckets) == 1
    data = _batches(3)
    _train(m, opt, data[:1])
    before = [p.detach().clone() for p in m.parameters()]
    sd_before = opt.state_dict()
    m(data[1]).square().mean().backward()
    with pytest.raises(TierFullError):
        opt.step()
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)  # no parameter half-updated
    sd_after = opt.state_dict()
    for k, e in sd_before["state"].items():
        for key, t in e.items():
            assert torch.equal(t, sd_after["state"][k][key])
    opt.close()


def test_disk_host_memory_is_bounded(spill_dir):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])  # ~4 MiB of fp32
    opt = OffloadedAdamW(
        m.parameters(),
        tier="disk",
        spill_dir=spill_dir,
        bucket_size="256KiB",
        pipeline_depth=3,
        overlap=True,
    )
    bound = 3 * 3 * (256 * 1024 + 4096)  # depth * (master + 2 moments) * bucket (+ page rounding)
    assert opt.stats().host_state_bytes <= bound
    full = sum(p.numel() for p in m.parameters()) * 12
    assert bound < full / 4
    for x in torch.randn(3, 4, 256):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats().host_state_bytes <= bound  # the ring never grows
    assert opt._states.store.stats.used_bytes >= full  # the state is on disk
    opt.close()


@pytest.mark.parametrize("old", [{"states": "host"}, {"disk_capacity": "1MiB"}])
def test_old_keywords_still_work_with_a_warning(old, tmp_path):
    """One vocabulary (issue 26): ``tier=`` and ``disk_budget=``; the old names map to them with
    a DeprecationWarning for 0.1."""
    (name,) = old
    new = {"states": "tier", "disk_capacity": "disk_budget"}[name]
    with pytest.warns(DeprecationWarning, match=f"{name}= is now {new}="):
        opt = OffloadedAdamW(_model().parameters(), spill_dir=str(tmp_path), **old)
    opt.close()


def test_stats_is_a_method_and_reset_starts_afresh():
    m = _model()
    opt = OffloadedAdamW(m.parameters(), bucket_size="1KiB", overlap=False)
    _train(m, opt, _batches(2))
    st = opt.stats()
    assert isinstance(st, OptimizerStats) and st.steps == 2 and st.buckets > 1
    opt.reset_stats()
    fresh = opt.stats()
    assert fresh.steps == 0 and fresh.launched_in_step == 0 and fresh.buckets == st.buckets
    assert fresh.host_state_bytes == st.host_state_bytes  # memory is refreshed, not zeroed
    _train(m, opt, _batches(1))
    assert opt.stats().steps == 1 and st.steps == 2  # counts go to the new counters only
    opt.close()


def test_bad_config_and_closed():
    m = _model()
    with pytest.raises(ConfigError, match="tier"):
        OffloadedAdamW(m.parameters(), tier="gpu", overlap=True)
    with pytest.raises(ConfigError, match="bucket_size"):
        OffloadedAdamW(m.parameters(), bucket_size="lots", overlap=True)
    with pytest.raises(ConfigError, match="learning rate"):
        OffloadedAdamW(m.parameters(), lr=-1, overlap=True)
    opt = OffloadedAdamW(m.parameters(), overlap=True)
    opt.close()
    with pytest.raises(ClosedError):
        opt.step()


def test_clip_returns_total_norm_like_torch():
    a, b = _model(), _model()
    x = _batches(1)[0]
    a(x).sum().backward()
    b(x).sum().backward()
    opt = OffloadedAdamW(b.parameters(), overlap=True)
    n1 = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    n2 = opt.clip_grad_norm_(0.1)
    assert math.isclose(n1.item(), n2.item(), rel_tol=0, abs_tol=0)
    opt.close()


@settings(max_examples=8, deadline=None)
@given(bucket=st.integers(64, 8192), overlap=st.booleans(), accum=st.integers(1, 3))
def test_bucketing_never_changes_results(bucket, overlap, accum):
    """Whatever the bucket size, overlap and accumulation: bit-identical to fused torch AdamW."""
    ref_m, tt_m = _model(), _model()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    opt = OffloadedAdamW(
        tt_m.parameters(), lr=1e-2, weight_decay=0.05, bucket_size=bucket, overlap=overlap
    )
    data = _batches(3 * accum)
    _train(ref_m, ref, data, accum=accum)
    _train(tt_m, opt, data, accum=accum)
    for p, q in zip(tt_m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)
    opt.close()


@pytest.mark.parametrize(
    "device,dtype",
    [
        pytest.param("cpu", torch.float32, id="cpu"),  # parameters are their own masters
        pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),  # host masters, as on CUDA
        pytest.param("cuda", torch.float32, id="cuda", marks=pytest.mark.gpu),
    ],
)
def test_model_matches_host_reference(device, dtype):
    """Parameters on ``device``, overlapped: bit-identical after every step to ``HostAdamW``
    (fp32 host masters updated by CPU fused AdamW), the computation offloading promises. On CPU
    in fp32 the reference is itself pinned to ``torch.optim.AdamW(fused=True)``; on CUDA, CUDA's
    AdamW rounds differently and could only be compared at a tolerance (``rel 1e-6`` passed on
    the H100, but Adam magnifies last-bit differences on near-zero gradients)."""
    make = {
        "reference": lambda ps: HostAdamW(ps, lr=1e-2),
        "tt": lambda ps: OffloadedAdamW(ps, lr=1e-2, bucket_size="1KiB", overlap=True),
        "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    }
    kinds = ["reference", "tt"] + (["torch"] if device == "cpu" and dtype == torch.float32 else [])
    models = {k: _model(dtype=dtype).to(device) for k in kinds}
    opts = {k: make[k](m.parameters()) for k, m in models.items()}
    traces = {k: Trace(m) for k, m in models.items()}
    for x in _batches(10, dtype=dtype):
        for k, m in models.items():
            m(x.to(device)).float().square().mean().backward()
            opts[k].step()
            traces[k].record()
            opts[k].zero_grad()
    opts["tt"].close()
    for k in kinds[1:]:
        assert_same_trace(traces[k], traces["reference"], k, f"{opts['tt'].stats()}")
    assert all(p.device.type == device for p in models["tt"].parameters())
    assert opts["tt"].stats().speculated > 0


@pytest.mark.parametrize("tier", TIERS)
def test_late_gradient_after_bucket_launched_is_applied(tier, spill_dir):
    """A frozen param given a gradient by hand after backward: its bucket already ran; step() runs
    a second update for it, reading the first one's result (disk: the not yet committed copy)."""

    def build():
        m = _model()
        m[3].bias.requires_grad_(False)
        return m

    ref_m, tt_m = build(), build()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(tt_m.parameters(), lr=1e-2, tier=tier, spill_dir=spill_dir, overlap=True)
    assert len(opt._buckets) == 1
    for i, x in enumerate(_batches(6)):
        for m, o in ((ref_m, ref), (tt_m, opt)):
            m(x).square().mean().backward()
            m[3].bias.grad = torch.full_like(m[3].bias, 0.1 * (i + 1))
            o.step()
            o.zero_grad()
    for p, q in zip(tt_m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)
    assert opt.stats().launched_in_backward > 0
    opt.close()


def test_state_dict_splits_into_tensors_and_json():
    """What a safetensors + JSON checkpointer needs: every leaf a tensor or a JSON value."""
    import json

    m = _model(dtype=torch.bfloat16)
    opt = OffloadedAdamW(_groups(m), lr=1e-2, overlap=True)
    _train(m, opt, _batches(2, dtype=torch.bfloat16))
    sd = opt.state_dict()
    tensors = {f"{k}.{name}": t for k, e in sd["state"].items() for name, t in e.items()}
    assert all(torch.is_tensor(t) for t in tensors.values())
    assert any(k.endswith("master_param") for k in tensors)
    json.dumps(sd["param_groups"])  # plain Python values only
    opt.close()


def test_dropped_on_its_own_worker_thread_still_cleans_up(spill_dir):
    """Lifetime rules: the last reference dies on the optimizer's worker thread; the cleanup
    (joining that worker, closing the disk store) must run elsewhere, not fail there."""
    raised = []
    hook, sys.unraisablehook = sys.unraisablehook, raised.append
    try:
        m = _model()
        opt = OffloadedAdamW(
            m.parameters(), lr=1e-2, tier="disk", spill_dir=spill_dir, overlap=True
        )
        _train(m, opt, _batches(1))
        worker = opt._worker
        go = threading.Event()
        fut = worker.submit(lambda o=opt: go.wait(10))  # the job holds the last reference
        del opt
        go.set()
        fut.result(timeout=10)
        for _ in range(100):  # the work item (and the optimizer) is freed just after the result
            if quiesce() and not any(t.is_alive() for t in worker._threads):
                break
            time.sleep(0.05)
    finally:
        sys.unraisablehook = hook
    assert not raised, [str(r.exc_value) for r in raised]  # e.g. "cannot join current thread"
    assert not any(t.is_alive() for t in worker._threads)
    # the spill_dir fixture checks that the disk store's files are gone


def test_overlap_auto_speculates_only_for_gpu_parameters():
    """CPU backward already uses every core: the default does not speculate (nor pay the spare)."""
    m = _model()
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, bucket_size="1KiB")
    assert opt.overlap is False
    _train(m, opt, _batches(4))
    assert opt.stats().speculated == 0 and opt.stats().launched_in_step > 0
    opt.close()
    with pytest.raises(ConfigError, match="overlap="):
        OffloadedAdamW(_model().parameters(), overlap="yes")


@pytest.mark.parametrize("overlap", [True, False])
def test_synchronous_disk_full_keeps_the_ring_and_training_resumes_exactly(
    overlap, spill_dir, request
):
    """put() raising TierFullError at once (capacity, or ENOSPC making a slab) must return each
    ring buffer exactly once; once the disk has room again training continues bit-identically
    to torch skipping the failed steps (review finding 2)."""
    full_at = {1, 2}

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(40, 40) for _ in range(6)])

    g = torch.Generator().manual_seed(3)
    data = [torch.randn(4, 40, generator=g) for _ in range(10)]
    ref_m, tt_m = build(), build()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(
        tt_m.parameters(),
        lr=1e-2,
        tier="disk",
        spill_dir=spill_dir,
        bucket_size="8KiB",
        pipeline_depth=2,
        overlap=overlap,
    )
    store = opt._states.store
    real_put = store.put
    request.addfinalizer(opt.close)

    def full_put(tensor):
        raise TierFullError("disk full (test)", tier="disk", requested=tensor.nbytes)

    for i, x in enumerate(data):
        for m, o in ((ref_m, ref), (tt_m, opt)):
            m(x).square().mean().backward()
            if o is opt:
                store.put = full_put if i in full_at else real_put
                if i in full_at:
                    with pytest.raises(TierFullError):
                        o.step()
                else:
                    o.step()
                states = opt._states  # free buffers and read-aheads: never one buffer twice
                bufs = list(states._ring.queue) + [r[0] for r in states._reads.values()]
                assert len({t.data_ptr() for t in bufs}) == len(bufs) <= 2
            elif i not in full_at:
                o.step()
            o.zero_grad()
    for p, q in zip(tt_m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)
    opt.close()


def test_cpu_fp32_step_runs_in_place_on_the_parameters(monkeypatch):
    """Issue 27: host states and CPU fp32 parameters, the parameters are the masters. The fused
    kernel gets the parameters' and gradients' own storage, no tensor is copied during the step
    (no master write-back, no gradient staging), and the state holds only the moments, as
    ``torch.optim.AdamW(fused=True)`` does; results stay bit-identical to it."""
    m, ref = _model(), _model()
    opt = OffloadedAdamW(_groups(m), lr=1e-2, bucket_size="1KiB")
    topt = torch.optim.AdamW(_groups(ref), lr=1e-2, fused=True)
    batches = _batches(4)
    kernel, copy = torch._fused_adamw_, torch.Tensor.copy_
    seen: list[tuple[set, set]] = []
    copied: list[int] = []

    def counting_kernel(params, grads, *args, **kwargs):
        seen.append(({p.data_ptr() for p in params}, {g.data_ptr() for g in grads}))
        return kernel(params, grads, *args, **kwargs)

    def counting_copy(self, src, *args, **kwargs):
        copied.append(self.numel() * self.element_size())
        return copy(self, src, *args, **kwargs)

    for x in batches:
        m(x).square().mean().backward()
        params = {p.data_ptr() for p in m.parameters()}
        grads = {p.grad.data_ptr() for p in m.parameters()}
        seen.clear()
        copied.clear()
        with monkeypatch.context() as mp:
            mp.setattr(torch, "_fused_adamw_", counting_kernel)
            mp.setattr(torch.Tensor, "copy_", counting_copy)
            opt.step()
        assert set().union(*(s[0] for s in seen)) == params  # the parameters themselves
        assert set().union(*(s[1] for s in seen)) == grads  # the gradients themselves
        assert copied == []  # bytes copied per step: none
        opt.zero_grad()
    _train(ref, topt, batches)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    params = list(m.parameters())
    n = sum(p.numel() for p in params)
    assert 8 * n <= opt.stats().host_state_bytes <= 8 * n + 2 * 64 * len(params)  # moments only
    opt.close()


def test_change_through_param_data_counts_like_torch():
    """Issue 27: a CPU fp32 parameter is its own master, so a change made through ``p.data``
    (which bumps no version counter the optimizer could see) is trained on, as in torch."""
    m, ref = _model(), _model()
    opt = OffloadedAdamW(m.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    batches = _batches(3)
    _train(m, opt, batches[:2])
    _train(ref, topt, batches[:2])
    for model in (m, ref):
        model[0].weight.data.mul_(0.5)
    _train(m, opt, batches[2:])
    _train(ref, topt, batches[2:])
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    opt.close()


def test_loaded_master_param_of_an_fp32_cpu_parameter_is_ignored_like_torch():
    """Issue 27: a state dict with ``master_param`` (from a bf16 run) loaded into an fp32 CPU
    model, whose parameters are their own masters: the parameter wins, as in
    ``torch.optim.AdamW(fused=True).load_state_dict`` (the master was used before, which matched
    no torch optimizer)."""
    low = _model(dtype=torch.bfloat16)
    lopt = OffloadedAdamW(low.parameters(), lr=1e-2)
    _train(low, lopt, _batches(2, dtype=torch.bfloat16))
    sd = lopt.state_dict()
    lopt.close()
    assert "master_param" in sd["state"][0]
    m, ref = _model(seed=5), _model(seed=5)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2)
    opt.load_state_dict(sd)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    topt.load_state_dict(sd)
    _train(m, opt, _batches(2, seed=3))
    _train(ref, topt, _batches(2, seed=3))
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_gradient_not_shaped_like_its_parameter_is_refused_and_nothing_changes(overlap):
    """A gradient swapped through ``.grad.data`` for a tensor of another shape: the fused kernel
    would read past its end (torch's fused AdamW writes NaN or crashes there). ``step()`` raises
    a ConfigError naming the parameter and both shapes, changes nothing, and once the gradient
    is put back training goes on with the bits of ``torch.optim.AdamW(fused=True)``."""
    import copy

    m = _model()
    ref = copy.deepcopy(m)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, bucket_size="1KiB", overlap=overlap)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        x = torch.randn(6, 12, generator=gen)
        for mod in (m, ref):
            mod(x).square().mean().backward()
        if i == 3:
            good = m[2].weight.grad
            params = [p.detach().clone() for p in m.parameters()]
            state = copy.deepcopy(opt.state_dict())
            m[2].weight.grad = None
            m[2].weight.grad = good.clone()
            m[2].weight.grad.data = torch.zeros(3)
            with pytest.raises(ConfigError, match=r"param group 0, parameter 2: gradient of shape "
                               r"\(3,\) for a parameter of shape \(24, 24\)"):  # fmt: skip
                opt.step()
            assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
            after = opt.state_dict()["state"]
            for k, e in state["state"].items():
                assert all(torch.equal(e[key], after[k][key]) for key in e), k
            m[2].weight.grad = good  # put back: the step runs on it
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    opt.close()


@pytest.mark.parametrize("bucket_size", ["16MiB", "64KiB", "600KiB"])
def test_a_disk_budget_too_small_names_one_that_suffices(spill_dir, bucket_size):
    """The disk store's "Free tensors or raise the budget" named nothing the optimizer's user
    can free, nor how much budget a step needs (it writes a fresh copy of each bucket before it
    frees the old one). The size it names now trains on."""
    import re

    def train(budget) -> str | None:
        torch.manual_seed(0)
        widths = [(128, 256), (256, 256), (256, 10), (10, 300)]
        m = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in widths])
        opt = OffloadedAdamW(
            m.parameters(), lr=1e-3, tier="disk", spill_dir=spill_dir,
            disk_budget=budget, bucket_size=bucket_size,
        )  # fmt: skip
        try:
            for _ in range(4):
                m(torch.randn(4, 128)).sum().backward()
                opt.step()
                opt.zero_grad()
            return None
        except TierFullError as exc:
            return str(exc)
        finally:
            opt.close()

    told = train("1MiB")
    assert told and "disk_budget must hold the state" in told, told
    assert train(re.search(r"pass at least (\S+)$", told).group(1)) is None
