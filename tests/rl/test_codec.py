import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.errors import CorruptDataError
from tensortier.rl import _codec
from tests.conftest import ALL_DTYPES, bit_equal, make_tensor

NP_DTYPES = ["<f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<i4", "<i8", "|b1", "<c8", "<u4", ">f4"]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bit_equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=4), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from(NP_DTYPES), min_size=4, max_size=4),
    seed=st.integers(0, 1000),
)
def test_numpy_fields_round_trip_exactly(shapes, dtypes, seed):
    rng = np.random.default_rng(seed)
    item = {}
    for i, shape in enumerate(shapes):
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtypes[i]).itemsize)
        item[f"f{i}"] = np.frombuffer(raw.astype(np.uint8).tobytes(), dtypes[i]).reshape(shape)
    out = _codec.decode(_codec.encode(item))
    assert list(out) == list(item)
    for k in item:
        assert same(item[k], out[k]), k
        assert out[k].flags.writeable


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_torch_fields_round_trip_bit_identical(dtype):
    t = make_tensor((3, 5), dtype)
    nc = make_tensor((4, 6), dtype).t()  # non-contiguous
    out = _codec.decode(_codec.encode({"t": t, "nc": nc, "s": t[0, 0].clone()}))
    assert bit_equal(out["t"], t) and bit_equal(out["nc"], nc.contiguous())
    assert bit_equal(out["s"], t[0, 0])


def test_scalars_bytes_and_single_values():
    item = {"r": 1.5, "done": True, "n": 7, "raw": b"\x00abc", "np": np.float32(2.5)}
    out = _codec.decode(_codec.encode(item))
    for k in item:
        assert same(item[k], out[k]) or (k == "np" and out[k] == item[k]), k
    assert _codec.decode(_codec.encode(b"xyz")) == b"xyz"
    arr = np.arange(6).reshape(2, 3)
    assert same(_codec.decode(_codec.encode(arr)), arr)


def test_nan_and_negative_zero_kept():
    a = np.array([np.nan, -0.0, np.inf], np.float32)
    assert _codec.decode(_codec.encode({"a": a}))["a"].tobytes() == a.tobytes()


def test_batch_collates_same_schema_and_lists_otherwise():
    blobs = [_codec.encode({"o": np.full((2, 2), i, np.int16), "r": float(i)}) for i in range(5)]
    batch, collated = _codec.decode_batch(blobs)
    assert collated and batch["o"].shape == (5, 2, 2) and batch["r"].tolist() == [0, 1, 2, 3, 4]
    assert (batch["o"][3] == 3).all()
    mixed = blobs + [_codec.encode({"o": np.zeros(3, np.int16), "r": 0.0})]
    items, collated = _codec.decode_batch(mixed)
    assert not collated and len(items) == 6 and items[5]["o"].shape == (3,)
    tb, collated = _codec.decode_batch([_codec.encode({"t": torch.ones(2) * i}) for i in range(3)])
    assert collated and torch.equal(tb["t"][:, 0], torch.tensor([0.0, 1.0, 2.0]))


def test_refuses_what_needs_pickle():
    with pytest.raises(TypeError, match="pickle"):
        _codec.encode({"o": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="np.asarray"):
        _codec.encode({"l": [1, 2]})
    with pytest.raises(ValueError, match="empty"):
        _codec.encode({})


def test_damaged_blob_is_refused():
    blob = _codec.encode({"a": np.arange(4)})
    with pytest.raises(CorruptDataError):
        _codec.decode(blob[:-3])
    with pytest.raises(CorruptDataError):
        _codec.decode(blob[:4] + b"{not json" + blob[13:])
