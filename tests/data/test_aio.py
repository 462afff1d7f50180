"""Batched O_DIRECT reads (``data/_aio.py``): a piece's runs go out in one submission, the records
equal those of the ``preadv`` path, truncation is still caught, and contexts do not outlive their
threads."""

import gc
import os

import numpy as np
import pytest

from tensortier.data import Catalog, _aio
from tests.data._records import record, same

N = 3000


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("aio") / "cat"
    Catalog.build(path, (record(i) for i in range(N)), io_threads=2, batch_bytes="64KiB").close()
    cat = Catalog.open(path)
    if not cat.direct_io() or _aio.context() is None:
        pytest.skip("no O_DIRECT or no Linux AIO here: reads use preadv (covered elsewhere)")
    cat.close()
    return path


def epoch(path, **kw):
    cat = Catalog.open(path, direct=True)
    loader = cat.epochs(
        batch=256, seed=7, shuffle="full", prefetch_budget="256KiB", io_threads=2, **kw
    )
    got = {}
    for b in loader:
        got.update(zip(b.indices.tolist(), b.data))
    stats = loader.stats()
    loader.close()
    cat.close()
    return got, stats


def aio_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("[aio]" in line for line in f)


def test_a_piece_is_one_submission_and_reads_what_preadv_reads(built, monkeypatch):
    calls = {"submit": 0, "blocks": 0, "preadv": 0}
    read, preadv = _aio.Context.read, os.preadv

    def counted_read(self, cbs):
        calls["submit"] += 1
        calls["blocks"] += len(cbs)
        return read(self, cbs)

    def counted_preadv(*a):
        calls["preadv"] += 1
        return preadv(*a)

    monkeypatch.setattr(_aio.Context, "read", counted_read)
    monkeypatch.setattr(os, "preadv", counted_preadv)
    got, stats = epoch(built)
    assert len(got) == N and all(same(got[i], record(i)) for i in range(N))
    assert 0 < calls["submit"] <= stats.pieces  # pieces of one run use preadv
    assert calls["blocks"] + calls["preadv"] == stats.reads + 1  # + the O_DIRECT probe at open
    assert calls["preadv"] < calls["blocks"] / 4
    monkeypatch.setattr(_aio, "context", lambda: None)  # no AIO: the same records by preadv
    again, _ = epoch(built)
    assert again.keys() == got.keys() and all(same(again[i], got[i]) for i in got)


def test_a_truncated_segment_is_caught_by_batched_reads(built, tmp_path, monkeypatch):
    import shutil

    from tensortier.data._format import INDEX, INDEX_DTYPE

    path = tmp_path / "cat"
    shutil.copytree(built, path)
    rows = np.fromfile(path / INDEX, INDEX_DTYPE)
    mine = np.flatnonzero(rows["seg"] == 1)
    cut = int(rows["off"][mine[len(mine) // 3]]) + 4100  # past a page boundary, mid-record
    os.truncate(path / "seg-00000001.ttr", cut)
    lost = {int(i) for i in mine if int(rows["off"][i]) + int(rows["len"][i]) > cut}
    submits = []
    read = _aio.Context.read
    monkeypatch.setattr(
        _aio.Context, "read", lambda self, cbs: submits.append(1) or read(self, cbs)
    )
    cat = Catalog.open(path, direct=True)
    report = cat.verify(chunk_bytes=256 << 10)
    cat.close()
    assert submits and {i for i, _, _ in report.bad} == lost
    assert all("truncated" in why for _, _, why in report.bad)


def test_contexts_end_with_their_threads(built):
    before = aio_maps()
    got, _ = epoch(built)
    assert len(got) == N
    gc.collect()
    assert aio_maps() == before  # each I/O thread's context was destroyed when it ended
