"""Numpy scalars come back from a catalog as numpy scalars of their dtype, bit for bit (format
version 2); a version-1 catalog, which stored them as 0-d arrays, still reads as it did."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tensortier.data import Catalog, CatalogDataset, EpochDataset
from tensortier.data._format import READABLE, VERSION
from tensortier.errors import ConfigError
from tensortier.tiers import itemcodec
from tests.data._records import same
from tests.data._v1_records import v1_records

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "catalog-v1")


def _nan(bits: int, dtype) -> np.generic:
    """A nan with a payload (``bits`` as the float's bytes): kept only by a byte copy."""
    width = np.dtype(dtype).itemsize * 8
    return np.array(bits, f"<u{width // 8}").view(dtype)[()]


SCALARS = [
    np.bool_(True),
    np.bool_(False),
    *(np.iinfo(t).min + np.zeros((), t)[()] for t in (np.int8, np.int16, np.int32, np.int64)),
    *(t(np.iinfo(t).max) for t in (np.uint8, np.uint16, np.uint32, np.uint64, np.int64)),
    np.float16(-0.0),
    np.float32(0.5),
    np.float64(-0.0),
    np.float64(np.inf),
    _nan(0x7E01, np.float16),
    _nan(0x7FC00001, np.float32),
    _nan(0xFFF8000000000123, np.float64),
    np.longdouble("1.25"),
    np.complex64(complex(-0.0, np.nan)),
    np.complex128(1 + 2j),
    np.datetime64("2020-01-02T03:04:05", "s"),
    np.timedelta64(-7, "ms"),
]


def exact(want, got) -> bool:
    """The same numpy scalar: type, dtype and every byte of its value (through ``np.asarray``,
    which zeroes the padding of a ``longdouble``: its 6 unused bytes hold garbage)."""
    return (
        type(got) is type(want)
        and isinstance(got, np.generic)
        and got.dtype == want.dtype
        and np.asarray(got).tobytes() == np.asarray(want).tobytes()
    )


def records() -> list:
    """Every scalar alone, then dicts of them (the RL-style record of the report)."""
    recs: list = list(SCALARS)
    recs += [{"reward": np.float32(0.5), "step": np.int64(3), "done": np.bool_(False)}] * 3
    recs += [{f"f{i}": s for i, s in enumerate(SCALARS)}]
    return recs


def check(want, got) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for k in want:
            assert exact(want[k], got[k]), (k, want[k], got[k])
    else:
        assert exact(want, got), (want, got)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    c = Catalog.build(tmp_path_factory.mktemp("s") / "c", records(), batch_bytes=256)
    yield c
    c.close()


def test_random_access_gives_numpy_scalars_bit_for_bit(cat):
    recs = records()
    assert cat.manifest.version == VERSION == 2 and cat.info()["format_version"] == 2
    for i, want in enumerate(recs):
        check(want, cat[i])
    for got_list in (cat[:], cat.read(np.arange(len(recs))[::-1])[::-1], list(cat)):
        for want, got in zip(recs, got_list, strict=True):
            check(want, got)


def test_epochs_and_dataloaders_give_numpy_scalars(cat):
    """The read-ahead path (``decode_spans``) as well as random access."""
    recs = records()
    for batch in cat.epochs(batch=4, shuffle=False):
        for i, got in zip(batch.indices.tolist(), batch.data):
            check(recs[i], got)
    seen = 0
    for batch in DataLoader(EpochDataset(cat, batch=5, seed=3), batch_size=None):
        for i, got in zip(batch.indices.tolist(), batch.data):
            check(recs[i], got)
            seen += 1
    assert seen == len(recs)
    loader = DataLoader(CatalogDataset(cat), batch_size=4, collate_fn=list)
    for b, batch in enumerate(loader):
        for j, got in enumerate(batch):
            check(recs[4 * b + j], got)


def test_a_0d_array_still_comes_back_as_a_0d_array(tmp_path):
    recs = [np.array(7, np.int16), {"a": np.array(np.nan, np.float32)}]
    with Catalog.build(tmp_path / "c", recs) as c:
        assert all(same(w, g) for w, g in zip(recs, c[:], strict=True))
        assert type(c[0]) is np.ndarray and c[0].shape == ()


def test_a_version_1_catalog_reads_as_it_did(tmp_path):
    """Files an earlier build wrote (format 1, numpy scalars as 0-d arrays) open and read with
    every check; their numpy scalars come back as the 0-d arrays version 1 stored."""
    copy = tmp_path / "v1"
    shutil.copytree(FIXTURE, copy)
    with open(copy / "catalog.json") as f:
        assert json.load(f)["version"] == 1
    want = [
        {k: np.asarray(v) for k, v in r.items()} if isinstance(r, dict) and "step" in r else r
        for r in v1_records()
    ]
    want = [np.asarray(r) if isinstance(r, np.generic) else r for r in want]
    with Catalog.open(copy) as c:
        assert c.manifest.version == 1 in READABLE and c.verify().ok
        assert all(same(w, g) for w, g in zip(want, c[:], strict=True))
        assert all(same(want[i], b.data[0]) for b in c.epochs(batch=1) for i in b.indices)


def test_a_newer_version_is_refused_with_upgrade(tmp_path):
    with Catalog.build(tmp_path / "c", [np.float32(1)]) as c:
        path = os.path.join(c.directory, "catalog.json")
    with open(path) as f:
        meta = json.load(f)
    assert meta["version"] == 2
    with open(path, "w") as f:
        json.dump(dict(meta, version=3), f)
    with pytest.raises(ConfigError, match="format version 3.*upgrade tensortier"):
        Catalog.open(tmp_path / "c")


def test_the_codec_keeps_0d_arrays_unless_asked_and_decodes_scalars_in_batches():
    """``tt.rl`` keeps its format (numpy scalars as 0-d arrays); ``numpy_scalars=True`` stores
    them as themselves, and every decoder (one blob, spans, a collated batch) reads that."""
    item = {"r": _nan(0x7FC00001, np.float32), "s": np.int64(-3), "t": torch.ones(2)}
    assert type(itemcodec.decode(itemcodec.encode(item))["r"]) is np.ndarray
    blob = itemcodec.encode(item, align=8, numpy_scalars=True)
    assert blob == b"".join(itemcodec.encode_aligned_parts(item, 8, numpy_scalars=True))
    got = itemcodec.decode(blob)
    assert exact(item["r"], got["r"]) and exact(item["s"], got["s"])
    buf = np.frombuffer(blob * 3, np.uint8).copy()
    spans = itemcodec.decode_spans(buf, np.arange(3) * len(blob), np.full(3, len(blob)))
    assert all(exact(item["r"], g["r"]) and exact(item["s"], g["s"]) for g in spans)
    batch, collated = itemcodec.decode_batch([blob, blob])
    assert collated and batch["s"].dtype == np.int64 and batch["s"].tolist() == [-3, -3]


def test_a_scalar_field_whose_header_has_a_shape_is_refused():
    blob = bytearray(itemcodec.encode({"a": np.float32(1)}, align=8, numpy_scalars=True))
    # the same blob with kind "np" and a shape of one element is fine; "ns" with a shape is not
    bad = itemcodec.encode({"a": np.ones(1, np.float32)}, align=8).replace(b'"np"', b'"ns"')
    assert itemcodec.decode(bytes(blob))["a"] == np.float32(1)
    with pytest.raises(Exception, match="shape"):
        itemcodec.decode(bad)


def test_numpy_strings_come_back_as_the_str_and_bytes_they_are(tmp_path):
    """``np.str_``/``np.bytes_`` subclass ``str``/``bytes``: stored as those, every byte kept (a
    fixed-width numpy string would drop the trailing NUL)."""
    recs = [{"s": np.str_("héllo\x00"), "b": np.bytes_(b"a\x00")}]
    with Catalog.build(tmp_path / "c", recs) as c:
        got = c[0]
    assert type(got["s"]) is str and got["s"] == "héllo\x00"
    assert type(got["b"]) is bytes and got["b"] == b"a\x00"
