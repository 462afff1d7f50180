import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.errors import CorruptDataError
from tensortier.tiers import itemcodec as _codec
from tests.conftest import ALL_DTYPES, bit_equal, make_tensor
from tests.conftest import same_item as same

NP_DTYPES = ["<f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<i4", "<i8", "|b1", "<c8", "<u4", ">f4"]


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


# --------------------------------------------------------------------------- str, alignment, views
def test_str_fields_and_items_round_trip():
    item = {"name": "images/0001.jpg", "caption": "naïve café \u2603", "empty": ""}
    assert _codec.decode(_codec.encode(item)) == item
    assert _codec.decode(_codec.encode("a/b/c.txt")) == "a/b/c.txt"
    batch, collated = _codec.decode_batch([_codec.encode({"s": "ab"}), _codec.encode({"s": "cd"})])
    assert collated and batch == {"s": ["ab", "cd"]}


def test_unsupported_types_name_the_accepted_ones():
    with pytest.raises(TypeError, match="numpy array, a torch tensor, bytes, str"):
        _codec.encode({"x": {1, 2}})


@pytest.mark.parametrize("big", [2**64, -(2**63) - 1, 10**30])
def test_an_int_past_64_bits_is_refused_naming_str(big):
    """It was refused as "dtype object cannot be stored without pickle": a Python int never
    names a dtype, so the message did not say what was wrong."""
    with pytest.raises(TypeError, match=rf"int {big} does not fit in 64 bits.*str"):
        _codec.encode({"n": big})
    for edge in (2**64 - 1, -(2**63)):  # the widest ints numpy stores (uint64, int64)
        assert _codec.decode(_codec.encode({"n": edge})) == {"n": edge}


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 21), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from(NP_DTYPES + ["<c16"]), min_size=5, max_size=5),
    align=st.sampled_from([1, 2, 8, 64]),
)
def test_aligned_blobs_round_trip_and_place_every_field_on_the_boundary(sizes, dtypes, align):
    item = {f"f{i}": np.arange(n).astype(dtypes[i]) for i, n in enumerate(sizes)}
    item["s"] = "x" * sizes[0]
    blob = _codec.encode(item, align=align)
    assert len(blob) % align == 0
    _, meta, start = _codec._header(blob)
    assert start % align == 0 and all(f[4] % align == 0 for f in meta["f"])
    out = _codec.decode(blob)
    assert all(same(item[k], out[k]) for k in item)


def test_decode_without_copy_returns_views_of_a_writable_aligned_buffer():
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    item = {"a": np.arange(5, dtype=np.int32), "t": t, "b": b"xyz", "n": 3}
    blob = _codec.encode(item, align=8)
    buf = np.zeros(len(blob) + 8, np.uint8)  # numpy memory is at least 8-aligned
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    out = _codec.decode(buf[: len(blob)], copy=False)
    assert np.shares_memory(out["a"], buf) and out["a"].flags.writeable
    assert buf.ctypes.data <= out["t"].data_ptr() < buf.ctypes.data + len(buf)
    assert same(out["t"], t) and out["b"] == b"xyz" and out["n"] == 3
    # a read-only blob (bytes) and a misaligned field give copies, never read-only tensors
    ro = _codec.decode(blob, copy=False)
    assert ro["a"].flags.writeable and same(ro["t"], t)
    shifted = np.zeros(len(blob) + 1, np.uint8)
    shifted[1:] = np.frombuffer(blob, np.uint8)
    out = _codec.decode(shifted[1:], copy=False)
    assert not np.shares_memory(out["a"], shifted) and same(out["t"], t)


def test_trailing_padding_is_refused_without_an_alignment_in_the_header():
    blob = _codec.encode({"a": np.arange(3, dtype=np.int8)})
    with pytest.raises(CorruptDataError, match="header describes"):
        _codec.decode(blob + b"\0")
    aligned = _codec.encode({"a": np.arange(3, dtype=np.int8)}, align=8)
    with pytest.raises(CorruptDataError, match="header describes"):
        _codec.decode(aligned + bytes(8))
    with pytest.raises(ValueError, match="power of two"):
        _codec.encode(b"x", align=3)


def test_decode_batch_of_one_large_item_is_not_overwritten_by_the_next_batch():
    """One row's columns are contiguous: they used to come back as views of the per-thread
    gather buffer (items > 256 KiB), so the next decode_batch overwrote the previous batch."""
    from tensortier.tiers import itemcodec

    a = itemcodec.encode({"x": np.full(300_000, 1, np.uint8), "t": torch.ones(3)})
    b = itemcodec.encode({"x": np.full(300_000, 2, np.uint8), "t": torch.zeros(3)})
    first, collated = itemcodec.decode_batch([a])
    itemcodec.decode_batch([b])
    assert collated and int(first["x"].min()) == 1 and first["t"].tolist() == [[1, 1, 1]]


def test_decode_batch_of_gathered_rows_equals_decode_of_blobs():
    from tensortier.tiers import itemcodec

    blobs = [
        itemcodec.encode({"x": np.arange(i, i + 5, dtype=np.int32), "b": b"ab"}) for i in range(4)
    ]
    mat = itemcodec.gather([memoryview(b) for b in blobs], len(blobs[0]))
    got, collated = itemcodec.decode_batch(mat)
    want, _ = itemcodec.decode_batch(blobs)
    assert collated and np.array_equal(got["x"], want["x"]) and got["b"] == want["b"] == [b"ab"] * 4
    odd = [
        itemcodec.encode({"x": np.zeros(2, np.int16)}),
        itemcodec.encode({"y": np.ones(2, np.int16)}),
    ]
    rows, collated = itemcodec.decode_batch(itemcodec.gather(odd, len(odd[0])))
    assert not collated and rows[0]["x"].tolist() == [0, 0] and rows[1]["y"].tolist() == [1, 1]


def _packed(blobs: list[bytes], shift: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blobs back to back (8-aligned each, plus ``shift``) in one writable buffer."""
    starts, at = [], 0
    for b in blobs:
        starts.append(at + shift)
        at += -(-(len(b) + shift) // 8) * 8
    raw = np.zeros(at + 16, np.uint8)
    buf = raw[(-raw.ctypes.data) % 8 :]
    for s, b in zip(starts, blobs):
        buf[s : s + len(b)] = np.frombuffer(b, np.uint8)
    return buf, np.array(starts), np.array([len(b) for b in blobs])


def _mixed_items(rng) -> list:
    items = []
    for i in range(60):
        k = i % 6
        if k == 0:
            items.append(rng.bytes(int(rng.integers(0, 300))))
        elif k == 1:
            items.append({"x": rng.standard_normal(int(rng.integers(0, 9))), "y": i, "t": "é" * i})
        elif k == 2:
            items.append(torch.arange(i, dtype=torch.bfloat16).reshape(-1, 1))
        elif k == 3:
            items.append({f"f{i % 11}": np.arange(i % 4, dtype="<i2"), "b": b"z" * i})
        elif k == 4:
            items.append(float(i) / 3)
        else:
            items.append({"e": np.empty((0, 3), "<f4"), "pt": torch.empty(0)})
    return items


@pytest.mark.parametrize("align,shift", [(8, 0), (8, 4), (1, 0), (1, 3)])
def test_decode_spans_equals_decode_of_each_blob(align, shift):
    """Many schemas (more than one call batches), views and copies, v1 and v2 headers."""
    items = _mixed_items(np.random.default_rng(align + shift))
    blobs = [_codec.encode(it, align=align) for it in items]
    buf, starts, lens = _packed(blobs, shift)
    got = _codec.decode_spans(buf, starts, lens)
    for s, n, g in zip(starts, lens, got):
        want = _codec.decode(buf[s : s + n], copy=False)
        if isinstance(want, dict):
            assert list(g) == list(want) and all(same(g[k], want[k]) for k in want)
        else:
            assert same(g, want)
        arrays = g.values() if isinstance(g, dict) else [g]
        for a, b in zip(arrays, want.values() if isinstance(want, dict) else [want]):
            if isinstance(a, np.ndarray) and a.size:  # views exactly where decode makes views
                assert np.shares_memory(a, buf) == np.shares_memory(b, buf)


def test_decode_spans_refuses_a_damaged_blob_as_decode_does():
    blobs = [_codec.encode({"a": np.arange(4.0), "s": "x"}, align=8) for _ in range(5)]
    buf, starts, lens = _packed(blobs)
    hdr = int(np.frombuffer(blobs[3][:4], "<u4")[0])
    at = int(starts[3]) + 4 + hdr - 8  # the last number of the header: the size of field "s"
    buf[at] = 200
    with pytest.raises(CorruptDataError):
        _codec.decode(buf[starts[3] : starts[3] + lens[3]], copy=False)
    with pytest.raises(CorruptDataError):
        _codec.decode_spans(buf, starts, lens)


def test_an_empty_tensor_payload_with_a_shape_of_elements_is_refused_not_junk_memory():
    """A header claiming shape [5] over 0 payload bytes (a damaged or crafted blob whose
    checksum holds) decoded to torch.empty(5): uninitialised memory handed out as data."""
    blob = _codec.encode(torch.empty(0, dtype=torch.float32))  # JSON header (version 1)
    (hlen,) = _codec._LEN.unpack_from(blob, 0)
    header = blob[4 : 4 + hlen].replace(b'"pt","float32",[0]', b'"pt","float32",[5]')
    assert header != blob[4 : 4 + hlen]
    bad = _codec._LEN.pack(len(header)) + header + blob[4 + hlen :]
    with pytest.raises(CorruptDataError, match="empty payload"):
        _codec.decode(bad)
    with pytest.raises(CorruptDataError, match="empty payload"):
        _codec.decode_batch([bad, bad])
    assert _codec.decode(blob).shape == (0,)  # the honest blob still decodes


def _rewrite_header(blob: bytes, old: bytes, new: bytes) -> bytes:
    (hlen,) = _codec._LEN.unpack_from(blob, 0)
    header = blob[4 : 4 + hlen].replace(old, new)
    assert header != blob[4 : 4 + hlen]
    return _codec._LEN.pack(len(header)) + header + blob[4 + hlen :]


@pytest.mark.parametrize(
    "item, old, new",
    [
        (torch.arange(3), b'"int64",[3]', b'"int64",[5]'),  # torch's reshape: RuntimeError
        ({"t": torch.arange(4)}, b'"int64",[4],0,32', b'"int64",[3],0,32'),
        ({"a": 1}, b'"s":false,', b""),  # no single-value flag: KeyError 's'
        ({"a": 1}, b'"s":false', b'"s":true'),  # a single value without its field: KeyError ''
    ],
)
def test_a_header_that_does_not_fit_its_payload_is_corrupt_data(item, old, new):
    """A damaged or crafted header whose checksum holds failed with torch's RuntimeError or a
    KeyError, from decode and decode_batch, instead of CorruptDataError."""
    bad = _rewrite_header(_codec.encode(item), old, new)
    with pytest.raises(CorruptDataError):
        _codec.decode(bad)
    with pytest.raises(CorruptDataError):
        _codec.decode_batch([bad, bad])


def test_a_nested_or_meta_tensor_is_refused_naming_the_fix():
    """The stores' rule (check_storable): a nested tensor failed with torch's reshape error, a meta
    one with NotImplementedError from a copy."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"field 'x': nested tensors .* t\.unbind\(\)"):
        _codec.encode({"x": nested})
    with pytest.raises(TypeError, match="field 'x': a meta tensor has no values"):
        _codec.encode({"x": torch.ones(3, device="meta")})
