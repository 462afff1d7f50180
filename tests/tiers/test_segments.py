"""Segment files: whole-record checksums, format-1 records, bounded descriptors, read-only scans."""

import hashlib
import os
import zlib

import numpy as np
import pytest

from tensortier.errors import CorruptDataError
from tensortier.tiers.segments import MAGIC_V1, REC, TOMBSTONE, Segments, coalesce, payload_of


def write(root, records, **kw) -> Segments:
    segs = Segments(str(root), **kw)
    segs.append(records)
    segs.close(remove=False)
    return segs


def scan(root, **kw) -> list[tuple[int, int, int, int, int]]:
    segs = Segments(str(root), **kw)
    try:
        return list(segs.scan())
    finally:
        segs.close(remove=False)


def offset_of(path, i: int) -> int:
    with open(path, "rb") as f:
        data = f.read()
    off = 0
    for _ in range(i):
        off += REC.size + REC.unpack_from(data, off)[1]
    return off


def flip(path, at: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


@pytest.mark.parametrize(
    "field,at,mask",
    [("length", 4, 0x01), ("flags", 12, 0x01), ("key", 16, 0x04), ("key", 23, 0x80)],
)
def test_a_flipped_bit_in_any_header_field_is_detected(tmp_path, field, at, mask):
    # before format 2 the CRC covered the payload only: a flags bit made an item a tombstone
    # and a key bit moved it to another index, both accepted silently
    write(tmp_path, [(k, 0, bytes([k]) * 40) for k in range(10)])
    path = str(tmp_path / "seg-00000000.ttr")
    flip(path, offset_of(path, 3) + at, mask)
    with pytest.raises(CorruptDataError, match="offset"):
        scan(tmp_path)


def test_read_many_checks_the_header_too(tmp_path):
    segs = Segments(str(tmp_path))
    locs = np.array(segs.append([(k, 0, bytes([k]) * 40) for k in range(4)]), np.int64)
    flip(segs.path(0), int(locs[2, 1]) + 16, 0x01)  # key 2 -> key 3
    assert segs.read_many(locs[:2]) == [bytes([0]) * 40, bytes([1]) * 40]
    with pytest.raises(CorruptDataError, match="failed its check"):
        segs.read_many(locs[2:3])
    segs.close(remove=True)


def test_format_1_records_are_still_read(tmp_path):
    def v1(key: int, flags: int, payload: bytes) -> bytes:
        return REC.pack(MAGIC_V1, len(payload), zlib.crc32(payload), flags, key) + payload

    with open(tmp_path / "seg-00000000.ttr", "wb") as f:
        f.write(v1(0, 0, b"a" * 10) + v1(1, 0, b"b" * 7) + v1(0, TOMBSTONE, b""))
    segs = Segments(str(tmp_path))
    got = list(segs.scan())
    assert [(k, fl) for k, fl, *_ in got] == [(0, 0), (1, 0), (0, TOMBSTONE)]
    locs = np.array([got[1][2:]], np.int64)
    assert segs.read_many(locs) == [b"b" * 7]
    segs.append([(2, 0, b"c" * 5)])  # new records are format 2, in the same file
    segs.close(remove=False)
    assert [k for k, *_ in scan(tmp_path)] == [0, 1, 0, 2]


def test_a_format_1_item_turned_tombstone_is_still_caught(tmp_path):
    # format 1 cannot checksum flags, but a tombstone never has a payload
    payload = b"x" * 12
    rec = REC.pack(MAGIC_V1, len(payload), zlib.crc32(payload), TOMBSTONE, 0) + payload
    good = REC.pack(MAGIC_V1, 3, zlib.crc32(b"yyy"), 0, 1) + b"yyy"
    (tmp_path / "seg-00000000.ttr").write_bytes(rec + good)
    with pytest.raises(CorruptDataError):
        scan(tmp_path)


def test_readonly_scan_refuses_a_torn_tail_and_changes_nothing(tmp_path):
    write(tmp_path, [(k, 0, b"z" * 30) for k in range(5)])
    path = tmp_path / "seg-00000000.ttr"
    with open(path, "ab") as f:
        f.write(b"TTR2\x10\x00")  # half a header: a torn tail
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(CorruptDataError, match="left unchanged"):
        scan(tmp_path, readonly=True)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert len(scan(tmp_path)) == 5  # the owner's (writable) scan truncates it, as before


def test_open_descriptors_stay_bounded_with_many_segments(tmp_path):
    segs = Segments(str(tmp_path), segment_size=256, max_open=4)
    locs = np.array(segs.append([(k, 0, bytes([k % 256]) * 300) for k in range(200)]), np.int64)
    assert len(segs.segments) == 200 and segs.stats.open_files <= 4
    order = np.random.default_rng(0).permutation(200)
    got = segs.read_many(locs[order])
    assert got == [bytes([k % 256]) * 300 for k in order.tolist()]
    assert segs.stats.open_files <= 4
    fds = len(os.listdir("/proc/self/fd"))
    segs.close(remove=True)
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- shared with tt.data
def test_parallel_writers_number_their_segments_apart_and_report_crcs(tmp_path):
    writers = [Segments(str(tmp_path), segment_size=100, first=w, step=3) for w in range(3)]
    crcs: list[int] = []
    locs = writers[1].append([(i, 0, bytes([i]) * 90) for i in range(4)], crcs=crcs)
    assert [seg for seg, _, _ in locs] == [1, 4, 7, 10]  # one record fills a 100-byte segment
    assert len(crcs) == 4
    writers[0].append([(9, 0, b"x")])
    writers[2].append([(8, 0, b"y")])
    assert sorted(int(n[4:12]) for n in os.listdir(tmp_path)) == [0, 1, 2, 4, 7, 10]
    for w in writers:
        w.close(remove=False)
    keys = sorted(k for k, *_ in scan(tmp_path))
    assert keys == [0, 1, 2, 3, 8, 9]


def test_crcs_reported_by_append_are_the_records_checksums(tmp_path):

    segs = Segments(str(tmp_path))
    crcs: list[int] = []
    [(seg, off, length)] = segs.append([(5, 0, b"payload")], crcs=crcs)
    with open(segs.path(seg), "rb") as f:
        data = f.read()
    assert bytes(payload_of(data, off, length, key=5, crc=crcs[0])) == b"payload"
    assert payload_of(data, off, length, key=6) is None  # another record's index
    assert payload_of(data, off, length, crc=crcs[0] ^ 1) is None  # another record's checksum
    assert payload_of(data, off, length + 1) is None  # past the end
    segs.close(remove=True)


def test_coalesce_groups_neighbours_per_segment_and_restarts_in_each_file():

    seg = np.array([1, 0, 0, 1, 0])
    off = np.array([0, 1000, 0, 10_000_000, 50])
    length = np.array([100, 24, 50, 30, 900])
    runs = [(s, a, b, sorted(r.tolist())) for s, a, b, r in coalesce(seg, off, length, gap=100)]
    # segment 0: [0,50) [50,950) [1000,1024) are within 100 bytes of each other; segment 1's
    # records are 10 MB apart: two reads, even though segment 0's reach is far past offset 0
    assert runs == [(0, 0, 1024, [1, 2, 4]), (1, 0, 100, [0]), (1, 10_000_000, 10_000_030, [3])]
    assert list(coalesce(seg[:0], off[:0], length[:0])) == []


@pytest.mark.parametrize("sizes", [[1, 5000, 3, 4096 - 24, 70000], [4072] * 5, [0, 0, 1]])
def test_direct_appends_write_the_same_files_as_buffered_ones(tmp_path, sizes):
    records = [(i, 0, bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    plain, direct = tmp_path / "plain", tmp_path / "direct"
    plain.mkdir()
    direct.mkdir()
    a = Segments(str(plain), segment_size=1 << 20)
    b = Segments(str(direct), segment_size=1 << 20, direct=True)
    for batch in (records[:2], records[2:3], records[3:]):  # partial pages carried between writes
        assert a.append(batch) == b.append(batch)
    with open(b.path(0), "rb") as f:
        padded = f.read()
    assert len(padded) % 4096 == 0 and len(padded) >= b.size[0]  # padded until sync/close
    b.sync()
    a.close(remove=False)
    b.close(remove=False)
    with open(a.path(0), "rb") as f, open(b.path(0), "rb") as g:
        assert f.read() == g.read()
    assert scan(direct) == scan(plain)


def test_format_3_records_use_crc32c_and_are_read_and_checked_like_format_2(tmp_path):
    import crc32c

    from tensortier.tiers.segments import MAGIC_C, record_crc32c

    segs = Segments(str(tmp_path), checksum="crc32c")
    crcs: list[int] = []
    [(seg, off, length)] = segs.append([(7, 0, b"hello")], crcs=crcs)
    segs.append([(7, TOMBSTONE, b"")])
    with open(segs.path(seg), "rb") as f:
        data = f.read()
    magic, plen, crc, flags, key = REC.unpack_from(data, 0)
    assert magic == MAGIC_C and crc == crcs[0] == record_crc32c(5, 0, 7, b"hello")
    assert crc == crc32c.crc32c(b"hello", crc32c.crc32c(data[4:8] + data[12:24]))
    assert segs.read_many(np.array([[seg, off, length]])) == [b"hello"]
    segs.close(remove=False)
    assert [(k, fl) for k, fl, *_ in scan(tmp_path)] == [(7, 0), (7, TOMBSTONE)]
    raw = bytearray(data)
    raw[REC.size + 1] ^= 1
    with open(segs.path(seg), "wb") as f:
        f.write(raw)
    reader = Segments(str(tmp_path), readonly=True)
    with pytest.raises(CorruptDataError):
        list(reader.scan())
    reader.close(remove=False)


@pytest.mark.parametrize("direct", [False, True])
def test_a_payload_given_in_pieces_is_written_as_the_joined_payload(tmp_path, direct):
    """A tuple of buffers is one record's payload back to back: same bytes, same CRCs."""
    pieces = [(b"ab", b"", b"c" * 5000), (b"x" * 9000,), (b"head", memoryview(b"tail"))]
    outs = []
    for name, records in (
        ("joined", [(k, 0, b"".join(p)) for k, p in enumerate(pieces)]),
        ("pieces", [(k, 0, tuple(p)) for k, p in enumerate(pieces)]),
    ):
        crcs: list[int] = []
        segs = Segments(str(tmp_path / name), direct=direct, checksum="crc32c", segment_size=8000)
        (tmp_path / name).mkdir()
        locs = segs.append(records, crcs)
        segs.close(remove=False)
        files = sorted((tmp_path / name).iterdir())
        outs.append((locs, crcs, [f.read_bytes() for f in files]))
    assert outs[0] == outs[1] and len(outs[0][2]) == 2  # the segment rolled between records


def test_direct_writes_of_slightly_growing_chunks_reuse_one_staging_buffer(tmp_path):
    """A builder's batches are ``batch_bytes`` plus part of a record, so each differs by a few KB;
    a staging buffer sized to the exact chunk was replaced (and page-faulted anew) by every
    larger one. With headroom, one buffer serves them all, and the records read back intact."""
    segs = Segments(str(tmp_path), segment_size=1 << 30, checksum="crc32c", direct=True)
    rng = np.random.default_rng(3)
    stages, key, written, rows = [], 0, [], []
    for extra in (0, 8_000, 40_000, 100_000, 150_000):
        payloads = [rng.bytes(n) for n in (2 << 20, extra + 1)]
        locs = segs.append([(key + i, 0, p) for i, p in enumerate(payloads)])
        written += payloads
        rows.append(np.asarray(locs))
        key += 2
        if not any(segs._stage.base is s.base for s in stages):
            stages.append(segs._stage)
    assert len(stages) == 1
    segs.sync()
    with open(segs.path(segs.segments[0]), "rb") as f:
        raw = f.read()
    at = [off + REC.size for _, off, _ in np.concatenate(rows).tolist()]
    assert [raw[a : a + len(d)] for a, d in zip(at, written)] == written
    segs.close(remove=False)
