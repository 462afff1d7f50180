"""Round trips of every codec on every dtype it accepts, bit for bit (lossless) or within cast error."""

from __future__ import annotations

import pytest
import torch
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
