import json

import pytest

import benchmarks.catalog as bench
from tests._helpers import run_benchmark


def _job_in_process(**spec) -> dict:
    """``run_job`` without the fresh interpreter (each costs seconds of imports); the JSON round
    trips are kept so what a job takes and returns still has to survive ``--job``."""
    return json.loads(json.dumps(bench.job(json.loads(json.dumps(spec)))))


@pytest.mark.slow
def test_bench_catalog_runs_every_peer_and_writes_ratios(tmp_path, monkeypatch):
    out = tmp_path / "catalog.json"
    pytest.importorskip("datasets")
    pytest.importorskip("lmdb")
    monkeypatch.setattr(bench, "run_job", _job_in_process)
    data = run_benchmark(
        out,
        "catalog --quick --records 300 --index-records 100000 --orders full --rounds 2",
        tmp_path,
    )
    rows = {(r["phase"], r["peer"], r["order"]): r for r in data["rows"]}
    for peer in ("tensortier", "datasets", "lmdb"):
        assert rows[("build", peer, "-")]["gbps"] > 0
        for order in ("full",):
            row = rows[("read", peer, order)]
            assert row["intact"] and row["gbps"] > 0 and row["cpu_seconds"] >= 0
        assert rows[("random", peer, "uniform")]["records_per_s"] > 0
    assert {"read_full_vs_dd", "read_full_vs_datasets", "build_vs_disk_tier_write"} <= set(
        data["ratios"]
    )
    m = data["measurement"]  # builds, reads and random reads each interleaved in 2 rounds
    assert m["order"][:5] == ["dd", "disk tier write", "tensortier", "datasets", "lmdb"]
    assert len(m["order"]) == 2 * 5 + 2 * 4 + 2 * 3
    ratio = m["ratios"]["read_full_vs_dd"]
    assert len(ratio["per_round"]) == 2 and data["ratios"]["read_full_vs_dd"] == ratio["median"]
    assert rows[("read", "tensortier", "full")]["gbps_stats"]["n"] == 2
    assert data["open"]["records"] == 100000 and data["open"]["rss_growth_mib"] < 64
    assert [p.name for p in tmp_path.iterdir()] == ["catalog.json"]  # the stores were removed


def test_a_job_runs_in_a_fresh_process(tmp_path):
    """The bench runs every build and read through ``--job`` in its own interpreter."""
    spec = {"n": 50, "low": 100, "high": 2000, "args": {"build_io_threads": 2}}
    root = str(tmp_path / "tt")
    built = bench.run_job(kind="build", peer="tensortier", root=root, **spec)
    assert built["seconds"] > 0 and built["bytes"] > 0 and built["peak_rss"] > 0
    from tensortier.data import Catalog

    with Catalog.open(root) as cat:
        recs = bench.Records(50, 100, 2000)
        assert len(cat) == 50 and [bytes(cat[i]) for i in range(50)] == [bytes(r) for r in recs]


def test_a_read_returning_another_record_of_the_same_size_is_not_intact(tmp_path):
    """Reads are checked byte for byte: the length check alone passed a store that returned
    the wrong record of the right size (here every record has the same size)."""
    lmdb = pytest.importorskip("lmdb")
    import argparse
    import struct

    import numpy as np

    recs = bench.Records(20, 64, 64)
    root = str(tmp_path / "lmdb")
    bench.build_lmdb(root, recs)
    args, idx = argparse.Namespace(batch=8), np.arange(20)
    assert bench.read_lmdb(root, args, idx, recs)["intact"] is True
    assert bench.random_reads("lmdb", root, recs, count=200)["intact"] is True
    env = lmdb.open(root)
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", 3), txn.get(struct.pack(">Q", 4)))
    env.close()
    assert bench.read_lmdb(root, args, idx, recs)["intact"] is False
    assert bench.random_reads("lmdb", root, recs, count=200)["intact"] is False  # unchecked before


def test_catalog_cpu_writes_its_spreads_load_versions_and_peak_and_checks_the_bytes(
    tmp_path, monkeypatch
):
    """``benchmarks.catalog_cpu`` printed medians only: no JSON, load, versions, spread or
    peak, and the records it read were counted by length. A wrong record now fails the run."""
    from benchmarks import catalog_cpu

    out = tmp_path / "cpu.json"
    argv = ["--dir", str(tmp_path), "--records", "40", "--rounds", "2", "--io-threads", "2"]
    catalog_cpu.main([*argv, "--quiet-wait", "0", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["intact"] is True and data["peak_rss"] > 0 and data["env"]["versions"]
    assert data["measurement"]["rounds"] == 2 and data["measurement"]["load_before"]["cpus"] > 0
    rows = {r["phase"]: r for r in data["rows"]}
    assert rows["build process"]["n"] == 2 and "spread" in rows["random us/record"]
    monkeypatch.setattr(bench.Records, "match", lambda self, indices, got: False)
    with pytest.raises(SystemExit, match="byte for byte"):
        catalog_cpu.main([*argv, "--quiet-wait", "0", "--json", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.json"]
