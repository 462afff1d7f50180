"""Saved tensors through codecs and math views (review-12-18 #4, #8, #10): results bit-identical to
plain PyTorch, encoding and decoding off the forward/backward thread, dtypes a codec cannot take
travel raw, conjugate/negative views keep their bits."""

import threading
from concurrent.futures import Future

import pytest
import torch
from torch import nn

import tensortier as tt
from tensortier.tiers.codecs import LOSSLESS_CODECS, get_codec

TIERS = ["host", "disk"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())


def _grads(model, x, off=None):
    model.zero_grad(set_to_none=True)
    if off is None:
        loss = model(x).square().mean()
    else:
        with off:
            loss = model(x).square().mean()
            # every write done before the forward ends: backward reads (and decodes) every
            # record instead of taking the tail from the tensors still in flight
            off._engine.synchronize()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


class _Spy:
    """Wraps a codec and records the thread of every encode/decode."""

    def __init__(self, codec):
        self._codec = codec
        self.name, self.lossless = codec.name, codec.lossless
        self.threads: list[tuple[str, threading.Thread]] = []

    def encode(self, t):
        self.threads.append(("encode", threading.current_thread()))
        return self._codec.encode(t)

    def decode(self, payloads, meta):
        self.threads.append(("decode", threading.current_thread()))
        return self._codec.decode(payloads, meta)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_codec_gradients_bit_identical_and_never_on_the_training_thread(spill_dir, tier, codec):
    """#8: the codec runs on the engine's copy workers (``to_host/to_store(codec=)``), never on the
    forward thread (where a device tensor needs a blocking D2H) nor the backward thread."""
    model, x = _model(), torch.randn(128, 64)
    ref = _grads(model, x)
    spy = _Spy(get_codec(codec))
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0, codec=spy)
    for _ in range(2):
        got = _grads(model, x, off)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert {kind for kind, _ in spy.threads} == {"encode", "decode"}
    main = threading.main_thread()
    assert all(th is not main for _, th in spy.threads), "a codec ran on the training thread"
    assert off.stats.bytes_offloaded[tier] > 0
    off.close()


@pytest.mark.parametrize("served", ["read back", "from the tensor"])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_cast_codecs_round_trip_through_the_engine(spill_dir, codec, served):
    """A lossy cast gives what a cast there and back gives, also when backward takes the tensor
    itself because its write was still in flight (the values must not depend on timing)."""
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    dtype = torch.float16 if codec == "fp16" else torch.bfloat16
    ref = torch.autograd.grad((x.exp() * 2).sum(), x)[0]  # exp saves its fp32 output
    off = tt.Offloader("host", min_bytes=0, codec=get_codec(codec))
    held = []
    if served == "from the tensor":  # hold every write back until backward is done
        real = off._engine.to_host

        def late(tensor, **kw):
            proxy = Future()
            held.append((real(tensor, **kw), proxy))
            return proxy

        off._engine.to_host = late
    with off:
        y = x.exp()
        loss = (y * 2).sum()
        if not held:
            off._engine.synchronize()  # written: backward reads and decodes the copy
    (got,) = torch.autograd.grad(loss, x)
    for fut, proxy in held:
        proxy.set_result(fut.result())
    expected = x.detach().exp().to(dtype).float() * 2  # exp's backward: grad * saved output
    assert torch.equal(got, expected) and not torch.equal(got, ref)
    off.close()


def _overflow_in_second_step(off, device):
    """Two steps through ``off``: the second saves values beyond fp16's range (what a probe of
    the first step could not see); returns the error of each backward."""
    torch.manual_seed(0)
    x = torch.randn(256, 256, device=device, requires_grad=True)
    errors = []
    for scale in (1.0, 1e5):
        with off:
            y = x * scale
            loss = (y.sigmoid() * y).sum()  # mul saves y
        try:
            torch.autograd.grad(loss, x)
            errors.append(None)
        except tt.ConfigError as exc:
            errors.append(str(exc))
    off.close()
    return errors


@pytest.mark.parametrize("tier", TIERS)
def test_fp16_overflow_in_a_later_step_fails_that_backward(spill_dir, tier):
    """fp16 stored a later step's values beyond +-65504 as inf (the overflow check ran on the
    planner's probe only): gradients silently inf/NaN. Now that step's backward raises."""
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0, codec="fp16")
    first, second = _overflow_in_second_step(off, "cpu")
    assert first is None
    assert second is not None and "codec='bf16'" in second


def test_auto_with_a_codec_spills_payloads_that_do_not_fit_the_host_pool(spill_dir):
    """The payloads' size is known only once encoded, on a copy worker: a full host pool there
    sends the tensor to disk instead of failing the backward."""
    model, x = _model(), torch.randn(128, 64)
    ref = _grads(model, x)
    off = tt.Offloader(
        "auto", spill_dir=spill_dir, min_bytes=0, host_budget="160KiB", codec=get_codec("zstd")
    )
    for _ in range(2):
        got = _grads(model, x, off)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert off.stats.bytes_offloaded["host"] > 0 and off.stats.bytes_offloaded["disk"] > 0
    off.close()


class _SavesAs(torch.autograd.Function):
    """Saves a cast of its input, as fp8 training recipes save theirs."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.save_for_backward(x.detach().to(dtype))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        return g * q.float(), None


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.uint32], ids=str)
@pytest.mark.parametrize("codec", [*LOSSLESS_CODECS, "bf16"])
def test_a_dtype_the_codec_cannot_take_travels_raw(spill_dir, tier, dtype, codec):
    """#10: an offloader-wide codec must not abort the forward on fp8 or unsigned tensors."""
    x = (torch.rand(4096) * 8).requires_grad_()

    def grad(off=None):
        x.grad = None
        if off is None:
            _SavesAs.apply(x, dtype).sum().backward()
        else:
            with off:
                y = _SavesAs.apply(x, dtype)
            y.sum().backward()
        return x.grad.clone()

    ref = grad()
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0, codec=get_codec(codec))
    assert torch.equal(grad(off), ref)
    assert off.stats.tensors_offloaded == 1
    off.close()


def _complex_grads(kind, off=None):
    torch.manual_seed(0)
    c = torch.randn(256, dtype=torch.complex64, requires_grad=True)
    d = torch.randn(256, dtype=torch.complex64)
    r = torch.randn(256, requires_grad=True)
    s = torch.randn(256)

    def loss():
        if kind == "conj":  # mul saves d.conj(), a lazy conjugate view
            return (c * d.conj()).abs().sum()
        if kind == "conj-of-result":  # the saved view's base requires grad too
            e = c * 2
            return (c * e.conj()).abs().sum()
        return (r * torch._neg_view(s)).square().sum()  # mul saves a lazy negative view

    if off is None:
        value = loss()
    else:
        with off:
            value = loss()
    value.backward()
    return c.grad if kind != "neg" else r.grad


@pytest.mark.parametrize("kind", ["conj", "conj-of-result", "neg"])
@pytest.mark.parametrize("codec", [None, "zstd", "sparse"])
@pytest.mark.parametrize("tier", TIERS)
def test_conjugate_and_negative_views_come_back_with_their_bits(spill_dir, kind, codec, tier):
    """#4: a saved ``d.conj()`` (conj bit set, storage not conjugated) came back unconjugated."""
    ref = _complex_grads(kind)
    off = tt.Offloader(
        tier,
        spill_dir=spill_dir,
        min_bytes=0,
        codec=None if codec is None else get_codec(codec),
    )
    got = _complex_grads(kind, off)
    assert off.stats.tensors_offloaded > 0
    assert torch.equal(got, ref)
    off.close()


@pytest.mark.parametrize("tier", TIERS)
def test_payloads_restored_raw_decode_on_the_consumer(spill_dir, tier):
    """The GPU route of codecs that decode on the device (sparse, casts): every payload of the
    Encoded comes back raw through one future, decoded by the consumer (run here on the CPU)."""
    from concurrent.futures import Future

    from tensortier import DiskStore, HostPool, TransferEngine
    from tensortier.activations.offloader import _Payloads, _restore_payloads

    x = torch.relu(torch.randn(1 << 16))
    with (
        DiskStore(spill_dir) as disk,
        TransferEngine(host=HostPool("16MiB", pin=False), disk=disk) as engine,
    ):
        codec = get_codec("sparse")
        if tier == "host":
            enc = engine.to_host(x, codec=codec).result()
        else:
            enc = engine.to_store(x, "disk", codec=codec).result()
        got: list[Future] = []
        _restore_payloads(engine, enc, torch.device("cpu"), got.append)
        engine.synchronize()
        (done,) = got
        payloads = done.result()
        assert isinstance(payloads, _Payloads) and len(payloads) == 2
        assert torch.equal(payloads.decode(), x)
        del payloads, done, got
        enc.free(disk)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("codec", [*LOSSLESS_CODECS, "bf16", "fp16"])
def test_cuda_codec_pack_and_unpack_never_synchronise(spill_dir, tier, codec):
    """#8: under sync debug mode "error" any host sync in pack or unpack raises. Lossless codecs
    give gradients bit-identical to plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
    x = torch.randn(256, 512, device="cuda")
    ref = _grads(model, x)
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0, codec=get_codec(codec))
    _grads(model, x, off)  # warm: pool blocks pinned, side streams made
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with off:
            loss = model(x).square().mean()
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    if codec in LOSSLESS_CODECS:
        assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
    off.close()


@pytest.mark.gpu
@pytest.mark.parametrize("served", ["read back", "from the tensor"])
def test_cuda_fp16_overflow_in_a_later_step_fails_that_backward(spill_dir, served):
    """On the device the check is a flag read when the payload is decoded (no sync in pack),
    also when backward takes the tensor itself (kept at the tail)."""
    budget = 0 if served == "read back" else 1 << 30
    off = tt.Offloader("host", min_bytes=0, codec="fp16", prefetch_budget=budget)
    first, second = _overflow_in_second_step(off, "cuda")
    assert first is None
    assert second is not None and "codec='bf16'" in second


@pytest.mark.gpu
def test_cuda_conjugate_views_come_back_with_their_bits(spill_dir):
    torch.manual_seed(0)
    c = torch.randn(1 << 16, dtype=torch.complex64, device="cuda", requires_grad=True)
    d = torch.randn(1 << 16, dtype=torch.complex64, device="cuda")
    (c * d.conj()).abs().sum().backward()
    ref, c.grad = c.grad.clone(), None
    for tier in TIERS:
        off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0)
        with off:
            loss = (c * d.conj()).abs().sum()
        loss.backward()
        assert torch.equal(c.grad, ref)
        c.grad = None
        off.close()


@pytest.mark.parametrize("tier", TIERS)
def test_a_codec_passed_by_name_encodes_like_get_codec(spill_dir, tier):
    """``codec="zstd"`` (what a user types after reading ``get_codec``'s names) is that codec; it
    failed with ``AttributeError: 'str' object has no attribute 'name'`` inside the forward."""
    model, x = _model(), torch.randn(128, 64)
    ref = _grads(model, x)
    with tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0, codec="zstd") as off:
        assert off.codec.name == "zstd"
    got = _grads(model, x, off)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert off.stats.bytes_offloaded[tier] > 0
    off.close()
    assert tt.Action("disk", "lz4").codec.name == "lz4"


def test_a_codec_that_is_no_codec_is_refused_at_construction(spill_dir):
    with pytest.raises(tt.ConfigError, match="codec=3"):
        tt.Offloader("disk", spill_dir=spill_dir, codec=3)
    with pytest.raises(tt.ConfigError, match="unknown codec 'gzip'"):
        tt.offload(tier="disk", spill_dir=spill_dir, codec="gzip")


def test_offload_with_a_fresh_get_codec_each_step_reuses_one_offloader(spill_dir):
    """``with tt.offload(codec=tt.get_codec("sparse")):`` in a loop (the README's form) made a new
    offloader every step: the codec object was part of the cache key by identity, so each step
    opened a new spill directory and host pool and lost the learned prefetch order."""
    model, x = _model(), torch.randn(128, 64)
    ref = _grads(model, x)
    made = set()
    for _ in range(3):
        off = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0, codec=get_codec("sparse"))
        assert torch.equal(_grads(model, x, off)[0], ref[0])
        made.add(id(off))
    assert len(made) == 1 and off.stats.passes == 3
    other = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0, codec=get_codec("zstd"))
    assert other is not off and other.codec.name == "zstd"  # another codec: another setting
    other.close()
