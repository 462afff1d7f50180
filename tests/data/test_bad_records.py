"""A record the catalog cannot store is a typed ``RecordTypeError`` (a ``TypeError``) naming the
record, the field and the fix, and the build leaves nothing behind."""

from __future__ import annotations

import decimal
import os

import numpy as np
import pytest
import torch

from tensortier.data import Catalog
from tensortier.errors import ConfigError, RecordTypeError, TensortierError

POINT = np.zeros(2, dtype=[("x", "<i4"), ("y", "<f8")])

# (record, field at fault, words of the fix the message must hold)
CASES = [
    ({"meta": {"lang": "en"}, "text": "x"}, "meta", "flatten them into 'outer.inner' keys"),
    ({"price": decimal.Decimal("1.5")}, "price", "convert it to one of those"),
    ({"ok": b"x", "pts": POINT}, "pts", "store each of its fields as an array of its own"),
    ({"big": 2**70}, "big", "store it as a str"),
    ({"objs": np.array([1, "a"], dtype=object)}, "objs", "store text as str"),
    ({"x": None}, "x", "fill or drop nulls"),
    ({"ids": [1, None, 3]}, "ids", "holding a null"),
    ({"tags": ["a", "b"]}, "tags", "join strings into one str"),
    ({"w": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, "w", "convert it with .to()"),
    ({"sp": torch.eye(2).to_sparse()}, "sp", ".to_dense()"),
    ({"m": np.ma.array([1, 2], mask=[0, 1])}, "m", "mask would be lost"),
    (np.ma.array([1.5], mask=[1]), None, "np.ma.getmaskarray"),
    ({1: b"x"}, 1, "keyed by str"),
    ({2.5, 1.0}, None, "convert it to one of those"),
    (POINT, None, "store each of its fields"),
    ({}, None, "at least one field"),
]


@pytest.mark.parametrize(
    "rec,field,fix", CASES, ids=[repr(c[1]) + str(i) for i, c in enumerate(CASES)]
)
def test_an_unstorable_record_names_the_record_the_field_and_the_fix(tmp_path, rec, field, fix):
    path = tmp_path / "c"
    with pytest.raises(RecordTypeError) as err:
        Catalog.build(path, [b"ok", {"a": 1}, rec, b"never read"], batch_bytes=1)
    e = err.value
    assert isinstance(e, TensortierError) and isinstance(e, TypeError)  # old handlers still work
    assert e.record == 2 and e.field == field
    msg = str(e)
    assert "record 2 cannot be stored" in msg and fix in msg, msg
    if field is not None:
        assert repr(field) in msg
    else:
        assert "field ''" not in msg  # a record that is one value is not called field ''
    assert not path.exists()  # the build removed what it wrote (it made the directory)


def test_an_existing_empty_directory_is_left_empty(tmp_path):
    path = tmp_path / "mine"
    os.mkdir(path, 0o700)
    recs = (np.full(1000, i) for i in range(5000))  # batches written before the bad record

    def source():
        yield from recs
        yield {"x": {"nested": 1}}

    with pytest.raises(RecordTypeError, match="record 5000 cannot be stored"):
        Catalog.build(path, source(), batch_bytes="64KiB")
    assert os.listdir(path) == []


def test_a_record_over_4_gib_is_refused_before_it_is_copied(tmp_path):
    """The index holds a record's length in 32 bits. A 4 GiB record was copied whole into the
    stage, then failed with a bare ``struct.error`` from packing its header; now it is a
    ``ConfigError`` naming the record and the fix, before a byte of it is read (the record is
    a sparse file mapped: nothing of it is in memory)."""
    big = tmp_path / "sparse.bin"
    with open(big, "wb") as f:
        f.truncate(2**32)
    arr = np.memmap(big, dtype=np.uint8, mode="r")
    path = tmp_path / "c"
    with pytest.raises(ConfigError, match=r"record 1 is 4GiB encoded; .* split it"):
        Catalog.build(path, [b"ok", {"video": arr}])
    assert not path.exists()
