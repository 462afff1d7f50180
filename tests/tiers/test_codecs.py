"""Round trips of every codec on every dtype it accepts, bit for bit (lossless) or within cast error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils._python_dispatch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.errors import ConfigError, CorruptDataError
from tensortier.tiers.codecs import (
    LOSSLESS_CODECS,
    LOSSLESS_DTYPES,
    Codec,
    calibration_sample,
    estimate_ratio,
    get_codec,
    measure_codec,
    payload_bytes,
    sparse_ratio,
    zero_fraction,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    from tensortier.tiers.codecs import _as_bits

    return _as_bits(t)


def _make(dtype: torch.dtype, n: int, zero_frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) >= zero_frac
    if dtype.is_complex:
        x = torch.randn(n, generator=g, dtype=dtype)
    elif dtype.is_floating_point:
        x = torch.randn(n, generator=g).to(dtype)
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(
            max(info.min, -1000), min(info.max, 1000) + 1, (n,), generator=g, dtype=dtype
        )
    keep = torch.rand(n, generator=g) >= zero_frac
    return torch.where(keep, x, torch.zeros((), dtype=dtype))


@settings(max_examples=60, deadline=None)
@given(
    codec=st.sampled_from(LOSSLESS_CODECS),
    dtype=st.sampled_from(LOSSLESS_DTYPES),
    n=st.integers(0, 300),
    zero_frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    rows=st.sampled_from([1, 3]),
)
def test_lossless_round_trip_is_bit_exact(codec, dtype, n, zero_frac, seed, rows):
    t = _make(dtype, n * rows, zero_frac, seed).reshape(rows, n)
    c = get_codec(codec)
    assert isinstance(c, Codec) and c.lossless
    payloads, meta = c.encode(t)
    out = c.decode(payloads, meta)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(_bits(out), _bits(t))


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_special_float_bit_patterns_survive(codec):
    t = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 0.0])
    c = get_codec(codec)
    out = c.decode(*c.encode(t))
    assert torch.equal(_bits(out), _bits(t))  # -0.0 is not turned into +0.0


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_non_contiguous_input_round_trips_values(codec):
    t = torch.relu(torch.randn(16, 9)).t()[:, ::2]
    c = get_codec(codec)
    out = c.decode(*c.encode(t))
    assert torch.equal(out, t)


def test_sparse_payload_matches_predicted_ratio():
    t = _make(torch.float32, 8000, 0.9, 1)
    payloads, _ = get_codec("sparse").encode(t)
    ratio = payload_bytes(payloads) / (t.numel() * 4)
    assert ratio == pytest.approx(sparse_ratio(zero_fraction(t), 4), abs=1e-3)
    assert ratio < 0.2
    assert estimate_ratio("sparse", t) == pytest.approx(ratio, abs=1e-3)


@pytest.mark.parametrize("name,to", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_codec_is_lossy_and_halves_bytes(name, to):
    t = torch.randn(1000)
    c = get_codec(name)
    assert not c.lossless
    payloads, meta = c.encode(t)
    assert payload_bytes(payloads) == t.numel() * 2
    out = c.decode(payloads, meta)
    assert out.dtype == torch.float32
    assert torch.equal(out, t.to(to).float())
    with pytest.raises(ConfigError, match="float32"):
        c.encode(torch.zeros(3, dtype=torch.float16))


def test_bad_names_and_corrupt_payloads_raise_typed_errors():
    with pytest.raises(ConfigError, match="unknown codec"):
        get_codec("gzip")
    c = get_codec("zstd")
    payloads, meta = c.encode(torch.randn(100))
    meta = {**meta, "nbytes": 404}
    with pytest.raises(CorruptDataError):
        c.decode(payloads, meta)


def test_measure_codec_reports_speed_ratio_and_exactness():
    sample = calibration_sample(1 << 16, zero_frac=0.75)
    speed, exact = measure_codec(get_codec("sparse"), sample, repeat=1)
    assert exact and speed.encode_bps > 0 and speed.decode_bps > 0
    assert speed.ratio == pytest.approx(sparse_ratio(0.75, 4), abs=0.02)


# ----------------------------------------------------------------------------- no syncs on a device
class _SyncingOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ops that make a CUDA host wait for the device: reading a value (``item``), sizes
    that depend on data (``nonzero``, ``masked_select``) and boolean-mask indexing, which needs
    the mask's count on the host. Runs on CPU: the ops are the same on either device."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in ("aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense"):
            self.seen.append(name)
        if name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            self.seen.append(name + " (boolean mask)")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", LOSSLESS_DTYPES, ids=str)
def test_sparse_device_decode_uses_no_syncing_op_and_is_bit_exact(dtype):
    """REVIEW #10: decode on a device scattered with ``bits[mask] = values`` (a sync per call)."""
    from tensortier.tiers.codecs import _scatter_by_mask

    for zero_frac in (0.0, 0.7, 1.0):
        t = _make(dtype, 999, zero_frac, 3)
        bits = _bits(t)
        mask = bits != 0
        values = bits[mask]  # the encoder's payload (made on the host)
        mode = _SyncingOps()
        with mode:
            out = _scatter_by_mask(mask, values)
        assert mode.seen == []
        assert torch.equal(out, bits)


def test_sparse_bit_packing_builds_no_host_tensor_per_call(monkeypatch):
    """REVIEW #10: ``_BIT_WEIGHTS.to(device)`` was a pageable host->device copy on every encode;
    the shift table is made once per device, on that device."""

    c = get_codec("sparse")
    c.encode(torch.ones(10))
    made = []
    real = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: made.append(k) or real(*a, **k))
    for _ in range(3):
        out = c.decode(*c.encode(torch.relu(torch.randn(100))))
    assert made == []  # the host packs with numpy; a device makes its table once, there
    assert out.shape == (100,)


def test_corrupt_sparse_payload_raises_a_typed_error():
    c = get_codec("sparse")
    (packed, values), meta = c.encode(torch.relu(torch.randn(1000)))
    with pytest.raises(CorruptDataError):
        c.decode([packed, values[:-1]], meta)


def _damaged_sparse(device: str) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    c = get_codec("sparse")
    (packed, values), meta = c.encode(torch.relu(torch.randn(1000)))
    packed, values = packed.to(device), values.to(device)
    return [
        (packed[:-1], values, meta),  # a short mask
        (torch.cat([packed, packed]), values, meta),  # a long one (its tail was ignored)
        (packed, torch.cat([values] * 3), meta),  # more values than elements
        (packed, values.view(torch.uint8), meta),  # values of another width
    ]


@pytest.mark.parametrize("case", range(4))
def test_a_sparse_payload_of_the_wrong_size_is_corrupt_on_any_device(case):
    """Decode off the host skipped the size checks (they used to need the data): a short mask
    failed with a RuntimeError from reshape. They come from shapes alone now, and the "meta"
    device takes the device route (no count of set bits) here on the CPU."""
    for device in ("cpu", "meta"):
        packed, values, meta = _damaged_sparse(device)[case]
        with pytest.raises(CorruptDataError, match="sparse payload"):
            get_codec("sparse").decode([packed, values], meta)


@pytest.mark.gpu
def test_cuda_sparse_payload_of_the_wrong_size_is_corrupt():
    for packed, values, meta in _damaged_sparse("cuda"):
        with pytest.raises(CorruptDataError, match="sparse payload"):
            get_codec("sparse").decode([packed, values], meta)


def test_zero_fraction_needs_no_copy_of_the_tensor():
    """The planner's probe runs it on every saved tensor within the memory budget: it used to
    make a bool mask and an int64 copy of it (2.25x the tensor's bytes)."""
    from tensortier._memory import HighWater, status_bytes
    from tensortier.tiers.codecs import zero_fraction

    if not status_bytes("VmHWM"):
        pytest.skip("needs /proc/self/status")
    t = torch.zeros(8 << 20)  # 32 MiB
    t[::4] = 1.0
    w = HighWater()
    w.start()
    start = status_bytes("VmRSS")
    assert zero_fraction(t) == 0.75
    assert w.stop() - start < 8 << 20


@pytest.mark.parametrize("name", LOSSLESS_CODECS)
def test_one_codec_used_by_several_threads_at_once_stays_exact(name):
    """An engine's copy workers encode and decode with the same codec object concurrently; shared
    zstandard contexts corrupted payloads ("Data corruption detected") or crashed the process."""
    from concurrent.futures import ThreadPoolExecutor

    codec = get_codec(name)
    g = torch.Generator().manual_seed(0)
    inputs = [
        (torch.randint(0, 4, (1 << 18,), generator=g) * torch.randn(1 << 18, generator=g)).float()
        for _ in range(4)
    ]

    def round_trips(x):
        for _ in range(15):
            payloads, meta = codec.encode(x)
            if not torch.equal(_bits(codec.decode(payloads, meta)), _bits(x)):
                return False
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trips, inputs))


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
@pytest.mark.parametrize("view", ["conj", "neg"])
def test_conjugate_and_negative_views_round_trip_their_values(codec, view):
    # z.conj() and the negative view z.conj().imag share z's bits and flip them lazily: the codec
    # must store the values the user sees, not raise torch's "unresolved conjugated tensors"
    # (one element: a contiguous negative view, which .contiguous() does not resolve)
    z = torch.randn(33, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    t = z.conj() if view == "conj" else z[:1].conj().imag
    c = get_codec(codec)
    out = c.decode(*c.encode(t))
    assert not out.is_conj() and not out.is_neg()
    assert torch.equal(_bits(out), _bits(t.resolve_conj().resolve_neg().clone()))


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_truncated_compressed_payload_is_a_corrupt_data_error(codec):
    c = get_codec(codec)
    (payload,), meta = c.encode(torch.arange(1000.0) % 7)  # compressible: not stored raw
    assert "raw" not in meta
    with pytest.raises(CorruptDataError, match=f"{codec} payload .* cannot be decoded"):
        c.decode([payload[:-7].clone()], meta)


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_one_element_view_with_a_stride_round_trips(codec):
    # x[::2] of two elements keeps stride 2 through .contiguous(); the byte codecs viewed it as
    # uint8 and torch refused ("stride(-1) must be 1")
    t = torch.tensor([1.5, -2.0])[::2]
    c = get_codec(codec)
    out = c.decode(*c.encode(t))
    assert torch.equal(_bits(out), _bits(t.clone()))


@pytest.mark.parametrize("codec", [*LOSSLESS_CODECS, "fp16", "bf16"])
def test_a_tensor_that_requires_grad_comes_back_detached_from_every_codec(codec):
    # the casts kept the payload in the user's graph and decoded a requires_grad tensor with a
    # grad_fn, unlike the lossless codecs (and the stores): what comes back is plain data
    t = torch.randn(40, requires_grad=True)
    c = get_codec(codec)
    payloads, meta = c.encode(t)
    out = c.decode(payloads, meta)
    assert not any(p.requires_grad for p in payloads)
    assert not out.requires_grad and out.grad_fn is None


def _incompressible(codec: str) -> torch.Tensor:
    """Random bytes (zstd, lz4 cannot shrink them) or a tensor without zeros (sparse)."""
    g = torch.Generator().manual_seed(7)
    if codec == "sparse":
        return torch.rand(4096, generator=g) + 1.0
    return torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g).view(torch.float32)


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_data_a_codec_cannot_shrink_is_stored_raw_never_larger(codec):
    # zstd/lz4 frames of random bytes were 1.00002-1.00006x the tensor, a sparse payload of a
    # dense fp32 tensor 1.03x (uint8: 1.125x): compress only where it pays
    t = _incompressible(codec)
    c = get_codec(codec)
    payloads, meta = c.encode(t)
    assert payload_bytes(payloads) == t.numel() * t.element_size()
    expected = t.clone()
    t.fill_(0.0)  # the payload is a copy: the engine frees or reuses the source once encoded
    out = c.decode(payloads, meta)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(_bits(out), _bits(expected))
    assert out.untyped_storage().data_ptr() != payloads[0].untyped_storage().data_ptr()


@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_a_damaged_raw_payload_is_a_corrupt_data_error(codec):
    c = get_codec(codec)
    (payload,), meta = c.encode(_incompressible(codec))
    with pytest.raises(CorruptDataError, match=f"{codec} payload stored raw has"):
        c.decode([payload[:-4].clone()], meta)


def test_sparse_codec_makes_no_int64_copy_of_its_mask():
    """Counting the mask's nonzeros with .sum() made an int64 copy of it (8 bytes per element):
    encoding 256 MiB of uint8 peaked at 11x the tensor."""
    from tensortier._memory import HighWater, status_bytes

    if not status_bytes("VmHWM"):
        pytest.skip("needs /proc/self/status")
    t = torch.zeros(32 << 20, dtype=torch.uint8)  # 32 MiB: its int64 copy would be 256 MiB
    t[::16] = 1
    c = get_codec("sparse")
    w = HighWater()
    w.start()
    start = status_bytes("VmRSS")
    payloads, meta = c.encode(t)
    out = c.decode(payloads, meta)
    assert w.stop() - start < (4 * 32) << 20  # mask, its uint8 copies, the result
    assert torch.equal(out, t)


def test_cast_overflows_names_the_values_fp16_would_turn_into_inf():
    from tensortier.tiers.codecs import cast_overflows

    big = torch.tensor([1.0, -7e4, float("nan"), float("inf")])
    assert cast_overflows("fp16", big) and not cast_overflows("bf16", big)
    # 65519 still rounds to 65504; inf and NaN are no overflow (they stay what they were)
    fits = torch.tensor([65519.0, -65504.0, float("inf"), float("nan"), 1e-9])
    assert not cast_overflows("fp16", fits)
    assert cast_overflows("fp16", torch.tensor([65520.0]))
    assert cast_overflows("bf16", torch.tensor([3.4e38]))
    assert not any(cast_overflows(n, big) for n in LOSSLESS_CODECS)
    assert not cast_overflows("fp16", torch.ones(3, 0))


@pytest.mark.parametrize("kw", [{"level": 99}, {"level": "3"}, {"level": None}, {"threads": 1.5}])
def test_a_bad_zstd_level_is_refused_when_the_codec_is_made(kw):
    # it failed with zstandard's bare ValueError on a copy worker, at the first backward
    from tensortier.tiers.codecs import ZstdCodec

    with pytest.raises(ConfigError, match=r"ZstdCodec\(.*pass an int level up to 22"):
        ZstdCodec(**kw)
    assert ZstdCodec(level=3).name == "zstd3"


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_frame_longer_or_shorter_than_its_tensor_is_a_corrupt_data_error(codec):
    c = get_codec(codec)
    payloads, meta = c.encode(torch.arange(1000.0) % 7)
    for nbytes in (3996, 4004):
        with pytest.raises(CorruptDataError, match=f"{codec} payload"):
            c.decode(payloads, {**meta, "nbytes": nbytes, "shape": [nbytes // 4]})


def _peak(fn):
    """``fn()`` and the growth of this process's resident memory while it ran."""
    from tensortier._memory import HighWater, status_bytes

    if not status_bytes("VmHWM"):
        pytest.skip("needs /proc/self/status")
    w = HighWater()
    w.start()
    start = status_bytes("VmRSS")
    out = fn()
    return out, w.stop() - start


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_decode_writes_into_the_tensor_without_a_second_copy(codec):
    """Decoding to ``bytes`` and copying them into a bytearray held the tensor twice (zstd;
    lz4.frame.decompress does the same inside, so lz4 streams the frame into one buffer)."""
    t = torch.zeros(64 << 20, dtype=torch.uint8)  # 64 MiB
    t[::7] = 3
    c = get_codec(codec)
    payloads, meta = c.encode(t)
    out, grew = _peak(lambda: c.decode(payloads, meta))
    assert grew < 96 << 20  # the result, not twice it
    assert torch.equal(out, t)


def test_lz4_truncated_or_trailing_frame_is_a_corrupt_data_error():
    c = get_codec("lz4")
    t = torch.arange(100_000.0) % 7
    (payload,), meta = c.encode(t)
    tail = torch.zeros(5, dtype=torch.uint8)
    for bad, why in [(payload[:-3], "cut short"), (torch.cat([payload, tail]), "5 bytes follow")]:
        with pytest.raises(CorruptDataError, match=why):
            c.decode([bad], meta)
    assert torch.equal(c.decode([payload], meta), t)


def test_sparse_encode_and_decode_take_a_few_chunks_beyond_their_output():
    """A whole-tensor mask and its uint8, padded and shifted copies (encode), the unpacked mask's
    copies and int64 indices (decode): 64 MiB of fp32 peaked at +150 MiB and +177 MiB."""
    g = torch.Generator().manual_seed(0)
    t = torch.relu(torch.randn(16 << 20, generator=g))  # 64 MiB, half zeros
    c = get_codec("sparse")
    (payloads, meta), grew = _peak(lambda: c.encode(t))
    assert grew < payload_bytes(payloads) + (24 << 20)
    out, grew = _peak(lambda: c.decode(payloads, meta))
    assert grew < (64 + 24) << 20
    assert torch.equal(out, t)


def test_fp16_refuses_a_tensor_it_would_turn_into_inf_on_every_encode():
    """The planner probed one step; a later step's tensor beyond +-65504 was stored as inf and
    silently corrupted the gradients. Every encode checks it; inf and NaN stay what they were."""
    c = get_codec("fp16")
    with pytest.raises(ConfigError, match="beyond fp16's range.*codec='bf16'"):
        c.encode(torch.tensor([1.0, -7e4]))
    with pytest.raises(ConfigError, match="beyond fp16's range"):
        c.encode(torch.full((5 << 20,), 1.0).index_fill_(0, torch.tensor([(5 << 20) - 1]), 7e4))
    fits = torch.tensor([65519.0, float("inf"), float("-inf"), float("nan"), -0.0])
    out = c.decode(*c.encode(fits))
    assert torch.equal(out.view(torch.int32)[[1, 2, 4]], fits.view(torch.int32)[[1, 2, 4]])
    assert out[0] == 65504 and out[3].isnan()
    assert get_codec("bf16").decode(*get_codec("bf16").encode(torch.tensor([7e4])))[0] == 70144
    assert c.decode(*c.encode(torch.ones(0, 3))).shape == (0, 3)
    # on a device the flag travels in the metadata (a 0-dim tensor) and decode raises
    payloads, meta = c.encode(torch.ones(3))
    with pytest.raises(ConfigError, match="beyond fp16's range"):
        c.decode(payloads, {**meta, "overflow": torch.tensor(True)})
    assert torch.equal(c.decode(payloads, {**meta, "overflow": torch.tensor(False)}), torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int16, torch.float32, torch.complex128])
def test_sparse_chunks_meet_at_any_size(monkeypatch, dtype):
    """Host encode/decode work chunk by chunk: every size around the chunk boundaries round-trips
    bit for bit, and the mask is the whole tensor's, bit i of byte i // 8 for element i."""
    from tensortier.tiers import codecs

    monkeypatch.setattr(codecs, "_CHUNK", 16)
    c = get_codec("sparse")
    for n in [*range(0, 40), 63, 64, 65]:
        t = _make(dtype, n, 0.8, n)
        payloads, meta = c.encode(t)
        assert torch.equal(_bits(c.decode(payloads, meta)), _bits(t))
        if not meta.get("raw"):
            mask = (_bits(t) != 0).numpy()
            assert payloads[0].numpy().tobytes() == np.packbits(mask, bitorder="little").tobytes()


def test_estimated_sparse_ratio_is_the_payloads_for_dense_and_complex_tensors():
    """Dense data is stored raw (ratio 1, not 1.03 or 1.125), and a complex tensor's mask has a
    bit per real component (itemsize 4 for complex64, not 8)."""
    from tensortier.tiers.codecs import estimate_ratio

    g = torch.Generator().manual_seed(0)
    keep = torch.rand(4096, generator=g) > 0.5
    for t in (
        torch.randn(4096, generator=g, dtype=torch.complex64) * keep,
        torch.randn(4096, generator=g),
        torch.ones(4096, dtype=torch.bool),
        torch.relu(torch.randn(4096, generator=g)),
    ):
        payloads, _ = get_codec("sparse").encode(t)
        actual = payload_bytes(payloads) / (t.numel() * t.element_size())
        assert estimate_ratio("sparse", t) == pytest.approx(actual, abs=1e-3)
