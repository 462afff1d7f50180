"""Damage is detected and localised: the record index and the file are named, the rest reads."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from tensortier.data import Catalog
from tensortier.data._format import INDEX_DTYPE
from tensortier.errors import ConfigError, CorruptDataError
from tests.data._records import record, same

N = 2000


@pytest.fixture
def built(tmp_path):
    path = tmp_path / "cat"
    Catalog.build(path, (record(i) for i in range(N)), io_threads=2, batch_bytes="32KiB").close()
    return path


def rows(path) -> np.ndarray:
    return np.fromfile(path / "index.bin", INDEX_DTYPE)


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def readable_except(cat, bad: set[int]) -> None:
    for i in range(N):
        if i in bad:
            with pytest.raises(CorruptDataError, match=rf"record {i} in .*seg-"):
                cat[i]
        else:
            assert same(cat[i], record(i))


@pytest.mark.parametrize("where", ["payload", "header", "last byte"])
def test_a_flipped_bit_names_the_record_and_the_file_and_nothing_else_fails(built, where):
    victim = 1234
    r = rows(built)[victim]
    seg = built / f"seg-{int(r['seg']):08d}.ttr"
    at = {"payload": 24 + 10, "header": 8, "last byte": int(r["len"]) - 1}[where]
    flip(seg, int(r["off"]) + at)
    cat = Catalog.open(built)
    with pytest.raises(CorruptDataError, match=str(seg)) as err:
        cat[victim]
    assert err.value.path == str(seg)
    readable_except(cat, {victim})
    with pytest.raises(CorruptDataError, match=f"record {victim} "):
        cat.read([0, victim, 5])
    with pytest.raises(CorruptDataError, match=f"record {victim} "):
        for _ in cat.epochs(batch=64, shuffle="block"):
            pass
    report = cat.verify()
    assert not report.ok and [(i, f) for i, f, _ in report.bad] == [(victim, str(seg))]
    assert report.records == N and report.problems == []


def test_a_truncated_segment_fails_only_the_records_it_lost(built):
    r = rows(built)
    seg_no = int(r["seg"][-1])
    seg = built / f"seg-{seg_no:08d}.ttr"
    mine = np.flatnonzero(r["seg"] == seg_no)
    cut = int(r["off"][mine[len(mine) // 2]]) + 30  # in the middle of a record
    os.truncate(seg, cut)
    lost = {int(i) for i in mine if int(r["off"][i]) + int(r["len"][i]) > cut}
    cat = Catalog.open(built)  # opening does not read the segments
    with pytest.raises(CorruptDataError, match="truncated"):
        cat[min(lost)]
    readable_except(cat, lost)
    report = cat.verify()
    assert {i for i, _, _ in report.bad} == lost
    assert any("manifest says" in p for p in report.problems)


def test_a_missing_segment_file_and_a_damaged_index_row_are_localised(built):
    r = rows(built)
    os.unlink(built / "seg-00000001.ttr")
    gone = {int(i) for i in np.flatnonzero(r["seg"] == 1)}
    index = built / "index.bin"
    victim = int(np.flatnonzero(r["seg"] == 0)[3])
    flip(index, victim * INDEX_DTYPE.itemsize + 8)  # its offset now points elsewhere
    cat = Catalog.open(built)
    with pytest.raises(CorruptDataError, match="missing"):
        cat[min(gone)]
    with pytest.raises(CorruptDataError, match=f"record {victim} "):
        cat[victim]
    report = cat.verify()
    assert {i for i, _, _ in report.bad} == gone | {victim}
    assert any("index.bin does not match" in p for p in report.problems)
    assert any("missing" in p for p in report.problems)


def test_damaged_manifest_or_index_size_refuse_to_open(built, tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(built, other)
    (other / "index.bin").write_bytes((other / "index.bin").read_bytes()[:-20])
    with pytest.raises(CorruptDataError, match="index.bin has"):
        Catalog.open(other)
    meta = json.loads((built / "catalog.json").read_text())
    for damage in (
        lambda m: m.update(records=-1),
        lambda m: m.update(segments=[[0, 1], [0, 2]]),
        lambda m: m["index"].update(dtype=[["seg", "<u8"]]),
        lambda m: m.update(format="something else"),
        lambda m: m.update(records="many"),
    ):
        bad = json.loads(json.dumps(meta))
        damage(bad)
        (built / "catalog.json").write_text(json.dumps(bad))
        with pytest.raises(CorruptDataError, match="catalog.json"):
            Catalog.open(built)
    (built / "catalog.json").write_text("{not json")
    with pytest.raises(CorruptDataError, match="cannot be read"):
        Catalog.open(built)
    newer = dict(meta, version=99)
    (built / "catalog.json").write_text(json.dumps(newer))
    with pytest.raises(ConfigError, match="upgrade tensortier"):
        Catalog.open(built)


def test_every_single_bit_flip_of_the_index_is_corrupt_data_or_the_right_record(tmp_path):
    """All 8 x 20 x 8 single-bit flips of an index, every access path: the right record or a
    CorruptDataError naming a record, never another exception (OverflowError, EINVAL,
    struct.error from a huge offset or a length below the header) and never wrong data."""
    path = tmp_path / "cat"
    recs = [bytes([65 + i]) * (40 + 8 * i) for i in range(8)]
    Catalog.build(path, recs, io_threads=2, batch_bytes="64").close()
    index = path / "index.bin"
    clean = index.read_bytes()
    outcomes = set()
    for bit in range(len(clean) * 8):
        data = bytearray(clean)
        data[bit // 8] ^= 1 << (bit % 8)
        index.write_bytes(bytes(data))
        with Catalog.open(path) as cat:
            accesses = [(lambda i=i: [cat[i]], [recs[i]]) for i in range(8)]
            accesses.append((lambda: cat.read(range(8)), recs))
            for access, want in accesses:
                try:
                    got = access()
                except CorruptDataError as exc:
                    assert re.search(r"record \d in ", str(exc)), (bit, str(exc))
                    outcomes.add("corrupt")
                else:
                    assert got == want, bit  # never another record's bytes
                    outcomes.add("ok")
            report = cat.verify()
            assert not report.ok, bit  # the index CRC catches every flip
            try:
                batches = list(cat.epochs(batch=3, shuffle="none", io_threads=1))
            except CorruptDataError:
                outcomes.add("corrupt")
            else:
                assert [r for b in batches for r in b.data] == recs, bit
    assert outcomes == {"corrupt", "ok"}
    index.write_bytes(clean)
    assert Catalog.open(path).verify().ok
