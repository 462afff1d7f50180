"""The build lays records out itself (issue 27 #3): its files must be the ones the per-record
path writes (each record encoded alone with ``itemcodec.encode``, appended by ``Segments.append``),
byte for byte, and the ones the build wrote before (golden digests)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortier.data import Catalog
from tensortier.data._format import INDEX_DTYPE
from tensortier.data._sources import coerce
from tensortier.tiers import itemcodec
from tensortier.tiers.segments import Segments
from tests.data._layout import SETTINGS, combined, golden_records
from tests.data._records import same


def reference_files(root, recs, io_threads: int, batch_bytes: int, segment_size: int) -> dict:
    """The segment files and index of ``recs`` by the per-record path: every record encoded
    alone, batches cut where the blobs reach ``batch_bytes`` (or 65536 records), batch ``b``
    appended by writer ``b % io_threads`` with ``Segments.append``."""
    os.makedirs(root)
    segs = [
        Segments(str(root), segment_size=segment_size, first=w, step=io_threads, checksum="crc32c")
        for w in range(io_threads)
    ]
    rows, batch, size, batches = [], [], 0, 0

    def flush() -> None:
        nonlocal batch, size, batches
        crcs: list[int] = []
        locs = segs[batches % io_threads].append(batch, crcs)
        for (seg, off, n), crc in zip(locs, crcs):
            rows.append((seg, n, off, crc))  # INDEX_DTYPE's order
        batch, size, batches = [], 0, batches + 1

    for key, rec in enumerate(recs):
        try:
            blob = itemcodec.encode(rec, align=8, numpy_scalars=True)
        except (TypeError, ValueError):
            blob = itemcodec.encode(coerce(rec), align=8, numpy_scalars=True)
        batch.append((key, 0, blob))
        size += len(blob)
        if size >= batch_bytes or len(batch) >= 65536:
            flush()
    if batch:
        flush()
    out = {}
    for s in segs:
        s.sync()
        for n in s.segments:
            with open(s.path(n), "rb") as f:
                out[os.path.basename(s.path(n))] = f.read()
        s.close(remove=False)
    out["index.bin"] = np.array(rows, INDEX_DTYPE).tobytes()
    return out


def built_files(root) -> dict:
    out = {}
    for n in sorted(os.listdir(root)):
        if n.startswith("seg-") or n == "index.bin":
            with open(os.path.join(root, n), "rb") as f:
                out[n] = f.read()
    return out


def check_build(tmp, recs, io_threads: int, batch_bytes: int, segment_size: int) -> None:
    """Build ``recs``; the files equal the per-record path's and every record reads back."""
    new = os.path.join(tmp, "new")
    cat = Catalog.build(
        new, recs, io_threads=io_threads, batch_bytes=batch_bytes, segment_size=segment_size
    )
    want = reference_files(os.path.join(tmp, "ref"), recs, io_threads, batch_bytes, segment_size)
    got = built_files(new)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name
    # lists come back as arrays, numpy scalars as themselves (format 2)
    expect = [coerce(r) if isinstance(r, list) else r for r in recs]
    assert all(same(a, b) for a, b in zip(cat[:], expect)) and len(cat) == len(recs)
    assert cat.verify().ok
    cat.close()


# every golden setting's files, as the per-record build wrote them (sha256 of the segment files
# and the index, tests/data/_layout.combined), before the build laid records out itself; format 1
# stored the one numpy scalar of golden_records() as a 0-d array, so these are the files of the
# records with that scalar made a 0-d array
GOLDEN = {
    SETTINGS[0]: "9373a29b97198320ff1723dd0818ea090b3825b70587cc75608a3abfacb649d0",
    SETTINGS[1]: "77a507aca19db5fa304bbe93c31218e66d1687a2f832eb63578c84b5ca6a6982",
    SETTINGS[2]: "b10350ea0fc8287bfd0747a6068350901323fa3bbd15474ba708d238745cc581",
}
# format 2 (numpy scalars stored as themselves, item kind "ns"): golden_records() as they are
GOLDEN_2 = {
    SETTINGS[0]: "66d7908f18ef128e9606c23476e329a368e107caa4227f38b66fc6cb72647cc7",
    SETTINGS[1]: "71387f4db4131b084e0b23f797977427e260217701b1d25c996d68e233894a91",
    SETTINGS[2]: "f14c3396b4b59a2a2b57672d1a411b07a82740322643e53917da76545dfd9582",
}


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_the_build_writes_the_files_the_per_record_build_wrote(tmp_path, setting):
    """Golden digests taken from the build before this one (the per-record layout) and the
    per-record path of today's code: the same bytes, for every record type; format 2 changed
    only the numpy scalar's record."""
    io_threads, batch_bytes, segment_size = setting
    recs = golden_records()
    as_v1 = [np.asarray(r) if isinstance(r, np.generic) else r for r in recs]
    for records, golden, name in ((as_v1, GOLDEN, "v1"), (recs, GOLDEN_2, "v2")):
        Catalog.build(
            tmp_path / name,
            records,
            io_threads=io_threads,
            batch_bytes=batch_bytes,
            segment_size=segment_size,
        ).close()
        assert combined(tmp_path / name) == golden[setting], name
    from tensortier._units import parse_size

    check_build(tmp_path / "x", recs, io_threads, parse_size(batch_bytes), parse_size(segment_size))


_DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64, ">i4"]
_TORCH = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8, torch.bool]


@st.composite
def a_record(draw):
    """bytes, str, numbers, lists of numbers, arrays and tensors of many dtypes and shapes
    (0-d, empty, not contiguous, bf16), and dicts of them."""
    kind = draw(st.integers(0, 8))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    if kind == 0:
        return draw(st.binary(max_size=3000))
    if kind == 1:
        return draw(st.text(max_size=300))
    if kind == 2:
        return draw(
            st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.booleans())
        )
    if kind == 3:
        return draw(st.lists(st.integers(-1000, 1000), min_size=1, max_size=20))
    if kind in (4, 5):
        dt = np.dtype(draw(st.sampled_from(_DTYPES)))
        arr = (np.arange(int(np.prod(shape)), dtype=np.int64) * 37 % 251).astype(dt)
        arr = arr.reshape(shape)
        if not shape and draw(st.booleans()):
            return arr[()]  # a numpy scalar
        if kind == 5 and arr.ndim >= 2:
            arr = arr.T  # not contiguous
        return arr
    if kind in (6, 7):
        dt = draw(st.sampled_from(_TORCH))
        t = (torch.arange(int(np.prod(shape)) * 2) % 7).to(dt)[::2].reshape(shape)
        return t.transpose(0, -1) if kind == 7 and t.dim() >= 2 else t
    return {"a": draw(st.binary(max_size=200)), "b": torch.ones(shape, dtype=torch.bfloat16)}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    recs=st.lists(a_record(), max_size=60),
    io_threads=st.integers(1, 3),
    batch_bytes=st.sampled_from([1, 700, 5000, 1 << 20]),
    segment_size=st.sampled_from([1, 3000, 9000, 1 << 20]),
)
def test_any_records_give_the_per_record_files(tmp_path_factory, recs, io_threads, batch_bytes,
                                              segment_size):  # fmt: skip
    check_build(tmp_path_factory.mktemp("b"), recs, io_threads, batch_bytes, segment_size)


def test_a_record_larger_than_the_batch_and_the_segment_grows_the_stage(tmp_path):
    """Records of several MB in batches of a few KB: each takes a stage of its own size."""
    rng = np.random.default_rng(5)
    recs = [rng.bytes(3 << 20), b"x", rng.standard_normal(700_000), "é" * 1_000_000, b""]
    check_build(tmp_path, recs, 2, 4096, 1 << 20)


def test_a_caller_reusing_its_array_after_yielding_it_changes_nothing(tmp_path):
    """Records are copied before the next one is asked for: a source that refills one array
    in place for every record stores each value."""

    def source():
        buf = np.zeros(1000, np.float32)
        t = torch.zeros(300, dtype=torch.bfloat16)
        for i in range(200):
            buf[:] = i
            t.fill_(i)
            yield buf if i % 2 else t

    with Catalog.build(tmp_path / "c", source(), batch_bytes="16KiB") as cat:
        for i, got in enumerate(cat[:]):
            assert float(got[0]) == i and float(got[-1]) == i


def test_a_one_element_tensor_of_stride_two_is_stored(tmp_path):
    """``x[::2]`` of two elements: ``contiguous()`` keeps its stride 2, which ``view(uint8)``
    refused (RuntimeError from the build); stored and read back bit for bit now."""
    for dt in (torch.bfloat16, torch.float32, torch.int64):
        x = torch.tensor([3.0, 4.0]).to(dt)[::2]
        assert x.stride() == (2,) and x.is_contiguous()
        with Catalog.build(tmp_path / str(dt), [x, {"t": x}]) as cat:
            assert torch.equal(cat[0], x.clone()) and cat[0].dtype == dt
            assert torch.equal(cat[1]["t"], x.clone())


def test_runs_of_bytes_and_str_meeting_other_types_give_the_per_record_files(tmp_path):
    rng = np.random.default_rng(3)
    recs: list = [rng.bytes(int(n)) for n in rng.integers(0, 30_000, 300)]
    recs += ["é\ud800" * 700, "", "x" * 9] * 20  # surrogates pass, as the codec stores them
    recs += [b"a" * 40, np.arange(7), b"b" * 41, "c", b"", torch.ones(3)] * 30  # switches
    check_build(tmp_path, recs, 2, 96 << 10, 1 << 20)


def test_where_o_direct_is_refused_the_stages_are_written_buffered(tmp_path, monkeypatch):
    """Without O_DIRECT (a filesystem that refuses it) the writer writes each chunk of the stage
    with pwrite: the same files."""
    monkeypatch.delattr(os, "O_DIRECT")
    rng = np.random.default_rng(8)
    recs = [rng.bytes(int(n)) for n in rng.integers(0, 9000, 200)] + golden_records()[:100]
    check_build(tmp_path, recs, 2, 20 << 10, 64 << 10)


def test_a_chunk_placed_anywhere_but_after_the_last_record_is_refused(tmp_path):
    """``write_staged`` trusts the builder's placement only where it is ``append``'s."""
    from tensortier.tiers.segments import aligned_buffer

    segs = Segments(str(tmp_path), segment_size=1 << 20, checksum="crc32c", direct=True)
    stage = aligned_buffer(1 << 16)
    segs.append([(0, 0, b"x" * 40)])
    for chunk in ((0, 0, 0, 64, 1), (0, 64, 0, 64, 1), (1, 0, 0, 64, 1)):  # offset, page, segment
        with pytest.raises(AssertionError, match="not where the next record goes"):
            segs.write_staged(stage, [chunk])
    segs.close(remove=True)


def test_arrays_and_tensors_the_fast_layout_skips_give_the_per_record_files(tmp_path):
    """Runs of contiguous arrays/tensors take the codec-free layout; what it leaves to the codec
    (subclasses, other byte orders, conjugate, negative or grad-tracking tensors, views) lays
    out the same bytes in between."""
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    recs: list = [np.full((4, 5), i, np.float32) for i in range(50)]
    recs += [torch.full((3, 7), i, dtype=torch.bfloat16) for i in range(50)]
    recs += [np.arange(6, dtype=">f8"), np.ma.masked_array([1, 2])]
    recs += [
        z,
        z.conj(),
        torch._neg_view(z),
        torch.ones(4, requires_grad=True),
        torch.arange(9)[2:],
    ]
    recs += [np.arange(10)[::3], np.zeros((2, 0, 3), np.int16), torch.zeros(0, 4), np.array(5.0)]
    recs += [np.float32(1.5), np.int64(3), torch.tensor(2.5), torch.tensor([7], dtype=torch.int8)]
    check_build(tmp_path, recs * 3, 2, 4 << 10, 16 << 10)
