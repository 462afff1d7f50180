"""Opening a 10M-record catalog costs O(1) time and memory: the index is mapped, never parsed.

The index is synthetic (a sparse 200 MB file) so CI does not write 10M records; only its last row
points at a real record, which proves the mapping reaches the end.
"""

import gc
import os

import psutil

from tensortier.data import Catalog
from tensortier.data._format import INDEX, INDEX_DTYPE, Manifest, write_manifest
from tensortier.tiers import itemcodec
from tensortier.tiers.segments import Segments

N = 10_000_000


def synthetic(path) -> None:
    os.makedirs(path)
    segs = Segments(str(path), segment_size=1 << 20)
    crcs: list[int] = []
    [(seg, off, length)] = segs.append([(N - 1, 0, itemcodec.encode(b"the last", align=8))], crcs)
    sizes = dict(segs.size)
    segs.close(remove=False)
    row = __import__("numpy").zeros(1, INDEX_DTYPE)
    row["seg"], row["off"], row["len"], row["crc"] = seg, off, length, crcs[0]
    with open(os.path.join(path, INDEX), "wb") as f:
        f.truncate(N * INDEX_DTYPE.itemsize)  # sparse: no disk space, no page cache
        f.seek((N - 1) * INDEX_DTYPE.itemsize)
        f.write(row.tobytes())
    write_manifest(str(path), Manifest(N, length - 24, sizes, 0, 1, "synthetic"))


def test_opening_10m_records_takes_constant_memory(tmp_path):
    path = tmp_path / "ten-million"
    synthetic(path)
    gc.collect()
    proc = psutil.Process()
    before = proc.memory_info().rss
    cat = Catalog.open(path)
    assert len(cat) == N and cat[N - 1] == b"the last" and cat[-1] == b"the last"
    grown = proc.memory_info().rss - before
    assert grown < 64 << 20, f"opening grew RSS by {grown / 2**20:.1f} MiB"
    cat.close()
