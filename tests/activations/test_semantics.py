"""Offloading keeps PyTorch's semantics: in-place checks, devices, autocast's cached weight casts."""

import contextlib
from concurrent.futures import Future

import pytest
import torch
from torch import nn

import tensortier as tt
from tensortier.activations import offloader as O
from tensortier.transfer import TransferEngine

INPLACE = "one of the variables needed for gradient computation has been modified by an inplace"


def _saved_then_modified():
    x = torch.randn(64, 64, requires_grad=True)
    h = x.exp()  # saved by exp (its output) and by mul
    y = (h * h).sum()
    h.add_(1)  # in place after it was saved
    y.backward()


def _inplace_that_autograd_allows():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 64), nn.Linear(64, 8)
    x = torch.randn(32, 64, requires_grad=True)
    h = lin1(x)
    h.relu_()  # relu_ saves its own output, after the in-place change
    h = h * 2
    h.sigmoid_()
    loss = lin2(h).square().mean()
    loss.backward()
    return [x.grad, lin1.weight.grad, lin2.weight.grad]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_inplace_change_of_a_saved_tensor_raises_like_pytorch(spill_dir, tier):
    with pytest.raises(RuntimeError, match=INPLACE):  # plain PyTorch
        _saved_then_modified()
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0)
    try:
        # before the fix this ran silently with pack-time (or, racing the copy, new) values
        with pytest.raises(RuntimeError, match=INPLACE), off:
            _saved_then_modified()
        # what autograd allows stays allowed, with identical results
        ref = _inplace_that_autograd_allows()
        with off:
            got = _inplace_that_autograd_allows()
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    finally:
        off.close()


def test_autocast_weight_casts_stay_on_the_device(spill_dir):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
        )

    x = torch.randn(32, 64)

    def step(m, off=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if off is None:
                out = m(x)
            else:
                with off:
                    out = m(x)
        out.float().square().mean().backward()
        return [p.grad for p in m.parameters()]

    ref = step(model())
    # the second and third Linear save the bf16 cast of their weight, transposed (the first one's
    # input needs no gradient): 256*256 + 10*256 elements of 2 bytes
    casts = (256 * 256 + 10 * 256) * 2
    off = tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0, record=True)
    try:
        grads = step(model(), off)
        assert all(torch.equal(a, b) for a, b in zip(ref, grads))
        moved = [(r["dtype"], tuple(r["shape"])) for r in off.records]
        assert ("torch.bfloat16", (256, 256)) not in moved  # before: moved to disk and back
        assert ("torch.bfloat16", (256, 10)) not in moved
        assert off.stats.tensors_offloaded > 0
    finally:
        off.close()
    moved = {}
    for offload_casts in (False, True):
        off = tt.Offloader(
            "disk", spill_dir=spill_dir, min_bytes=0, offload_weight_casts=offload_casts
        )
        try:
            grads = step(model(), off)
            assert all(torch.equal(a, b) for a, b in zip(ref, grads))  # bit-identical to plain
            moved[offload_casts] = off.stats.bytes_offloaded["disk"]
            assert off.stats.bytes_weight_casts == (0 if offload_casts else casts)
        finally:
            off.close()
    assert moved[True] - moved[False] == casts


class ElsewhereEngine(TransferEngine):
    """An engine whose device is not the CPU (as on a CUDA machine): ``to_device`` without
    ``device=`` lands there, like the real engine's CUDA path. "meta" stands in for the GPU."""

    def __init__(self, **kwargs):
        kwargs["device"] = "cpu"
        super().__init__(**kwargs)
        self.device = torch.device("meta")
        self.asked: list = []

    def to_device(self, host, *, free=False, device=None):
        self.asked.append(device)
        inner = super().to_device(host, free=free, device=torch.device("cpu"))
        out = Future()
        target = device if device is not None else self.device
        inner.add_done_callback(lambda f: out.set_result(f.result().to(target)))
        return out


def test_cpu_saved_tensor_comes_back_on_the_cpu_in_a_device_run(monkeypatch):
    monkeypatch.setattr(O, "TransferEngine", ElsewhereEngine)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    model(x).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    off = tt.Offloader("host", min_bytes=0)
    try:
        with off:
            loss = model(x).square().mean()
        # CPU tensors hold no device memory in a device run: saved by reference, not moved (before
        # the fix they were moved and came back on the engine's device)
        assert off.stats.tensors_offloaded == 0 and off.stats.bytes_kept > 0
        loss.backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
    finally:
        off.close()


def test_restore_goes_to_the_records_device_through_the_one_call(spill_dir, monkeypatch):
    """Every read back asks the engine for the saved tensor's own device (``_restore``); with an
    engine whose disk reads land on its own device only, disk payloads are staged through host."""
    monkeypatch.setattr(O, "_FROM_STORE_TAKES_DEVICE", False)
    engine = ElsewhereEngine(disk=tt.DiskStore(spill_dir))
    try:
        t = torch.randn(1000)
        host = engine.to_host(t).result()
        for where in (host, engine.to_store(t, "disk").result()):
            out = Future()
            O._restore(engine, where, torch.device("cpu"), out.set_result)
            back = out.result(timeout=30).result()
            assert back.device.type == "cpu" and torch.equal(back, t)
        assert engine.asked == [torch.device("cpu"), torch.device("cpu")]
        host.free()
        assert engine.host.stats.in_use == 0  # the staging block went back to the pool
    finally:
        engine.close()
        engine.disk.close()


def _hand_written_mlp_grads(off=None) -> list[torch.Tensor]:
    """A model written with plain leaf weights (tensors that require grad, not Parameters, as
    ``torch.func`` users and hand-written models have), inside ``off`` if given; its gradients."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(n, 64, generator=g).requires_grad_() for n in (64, 8))
    x = torch.randn(16, 64, generator=g)
    with off if off is not None else contextlib.nullcontext():
        out = torch.tanh(x @ w1.t()) @ w2.t()  # saves x, tanh's output and a view of w2
    out.square().mean().backward()
    return [w1.grad, w2.grad]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_leaf_weights_that_are_not_parameters_are_not_copied(spill_dir, tier):
    ref = _hand_written_mlp_grads()
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0)
    try:
        assert all(torch.equal(a, b) for a, b in zip(ref, _hand_written_mlp_grads(off)))
        # x and tanh's output move; w2 is held by the graph's AccumulateGrad node anyway, so
        # moving it freed nothing (before: it was copied out and read back too)
        assert off.stats.tensors_offloaded == 2
        assert off.stats.bytes_offloaded[tier] == 2 * 16 * 64 * 4
    finally:
        off.close()


def test_inplace_change_of_a_leaf_weight_saved_by_reference_still_raises(spill_dir):
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)
    off = tt.Offloader("host", min_bytes=0)
    try:
        with off:
            loss = (x @ w.t()).tanh().sum()  # saves x and a view of w: both leaves, kept
        assert off.stats.bytes_offloaded["host"] == 8 * 32 * 4  # tanh's output only
        with torch.no_grad():
            w.sub_(0.1)  # a manual SGD step before backward: plain PyTorch refuses it
        with pytest.raises(RuntimeError, match=INPLACE):
            loss.backward()
    finally:
        off.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_strided_nested_tensors_are_saved_by_reference(spill_dir, tier):
    def grads(off=None):
        a = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        b = torch.randn(5, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with off if off is not None else contextlib.nullcontext():
            nt = torch.nested.as_nested_tensor([a * 1, b * 1])  # layout=torch.strided
            y = torch.nested.to_padded_tensor(nt.sin() * nt, 0.0)
        y.sum().backward()
        return [y.detach(), a.grad, b.grad]

    ref = grads()
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0)
    try:  # before: the forward failed in pack ("NestedTensorImpl doesn't support sizes")
        assert all(torch.equal(x, y) for x, y in zip(ref, grads(off)))
    finally:
        off.close()


def test_offload_inside_allow_mutation_on_saved_tensors_says_why_it_raises():
    """PyTorch's ``allow_mutation_on_saved_tensors()`` clones a saved tensor its own hooks saved
    before it is modified; inside it, tt.offload's hooks save instead. The in-place error says so
    (save_on_cpu there gives a wrong gradient on a CPU machine, silently)."""

    def run(ctx):
        x = torch.randn(6, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            with ctx:
                h = x * 1
                y = h.sin()
                h.add_(1)  # allowed by PyTorch's context
            y.sum().backward()
        return x.grad

    assert torch.equal(
        run(contextlib.nullcontext()),
        torch.cos(torch.randn(6, generator=torch.Generator().manual_seed(0))),
    )
    off = tt.Offloader("host", min_bytes=0)
    try:
        with pytest.raises(RuntimeError, match=INPLACE) as err:
            run(off)
        assert "allow_mutation_on_saved_tensors() does not cover" in str(err.value)
    finally:
        off.close()


def _saved_input_then_modified(alias: bool):
    """A Linear saves its input; the input is then changed in place, by the caller's own name or,
    after that name is gone, through a ``detach()`` alias (which shares the version counter)."""
    torch.manual_seed(0)
    pre, lin = nn.Linear(64, 64), nn.Linear(64, 8)
    h = pre(torch.randn(32, 64))
    y = lin(h)
    if alias:
        d = h.detach()
        del h
        d.mul_(3)
    else:
        h.mul_(3)
    y.square().mean().backward()


@pytest.mark.parametrize("alias", [False, True], ids=["same_name", "detached_alias"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_inplace_change_of_a_saved_input_raises_like_pytorch(spill_dir, tier, alias):
    """PyTorch hands a pack hook a fresh ``detach()`` of a saved input, which dies at once: the
    check followed that alias, saw nothing, and backward used the changed values silently."""
    with pytest.raises(RuntimeError, match=INPLACE):  # plain PyTorch
        _saved_input_then_modified(alias)
    # no read-ahead: the source of the tail is not kept, the saved input lives only as bytes moved
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0, prefetch_budget=0)
    try:
        with pytest.raises(RuntimeError, match=INPLACE), off:
            _saved_input_then_modified(alias)
    finally:
        off.close()


def test_version_tracking_changes_no_version_and_keeps_no_bytes(spill_dir):
    """The tracker of a moved tensor shares its version counter, not its storage."""
    x = torch.randn(256, 256, requires_grad=True)
    off = tt.Offloader("host", spill_dir=spill_dir, min_bytes=0, prefetch_budget=0)
    try:
        with off:
            h = x * 2
            before = h._version
            y = h.sin()  # saves its input h
        assert h._version == before
        off._engine.synchronize()  # the copy is written: the engine no longer holds the source
        ref = torch.multiprocessing.reductions.StorageWeakRef(h.untyped_storage())
        del h
        assert ref.expired()  # nothing of tensortier's holds the moved bytes
        y.sum().backward()
        assert torch.equal(x.grad, 2 * (x * 2).cos())
    finally:
        off.close()


@pytest.mark.parametrize("alias", [False, True], ids=["same_name", "detached_alias"])
def test_inplace_change_of_a_kept_tensor_raises_like_pytorch(spill_dir, alias):
    """A tensor the offloader keeps (under ``min_bytes``) is returned by reference from the pack
    hook, and PyTorch skips its own check whenever hooks are set: it ran on silently."""
    off = tt.Offloader("host", spill_dir=spill_dir)  # 1 MiB min_bytes: every tensor is kept
    try:
        with pytest.raises(RuntimeError, match=INPLACE), off:
            _saved_input_then_modified(alias)
        with pytest.raises(RuntimeError, match=INPLACE), off:
            _saved_then_modified()
        ref = _inplace_that_autograd_allows()  # what autograd allows stays allowed
        with off:
            got = _inplace_that_autograd_allows()
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    finally:
        off.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_optimizer_step_before_backward_raises_like_pytorch(spill_dir, tier):
    """Weights are saved by reference; an ``opt.step()`` between forward and backward changes
    them in place. Plain PyTorch refuses the backward; under the offloader it used the stepped
    weights silently."""

    def step_then_backward(ctx) -> None:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(8, 64)
        m(x).sum().backward()
        with ctx:
            loss = m(x).sum()
        opt.step()
        loss.backward()

    with pytest.raises(RuntimeError, match=INPLACE):
        step_then_backward(contextlib.nullcontext())
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0)
    try:
        with pytest.raises(RuntimeError, match=INPLACE):
            step_then_backward(off)
    finally:
        off.close()
