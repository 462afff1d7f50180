import json

import pytest

from tensortier.cli import main


@pytest.mark.slow
def test_bench_catalog_runs_every_peer_and_writes_ratios(tmp_path):
    out = tmp_path / "catalog.json"
    pytest.importorskip("datasets")
    pytest.importorskip("lmdb")
    main(
        ["bench", "catalog", "--quick", "--records", "300", "--index-records", "100000",
         "--orders", "full", "--dir", str(tmp_path), "--json", str(out)]
    )  # fmt: skip
    data = json.loads(out.read_text())
    rows = {(r["phase"], r["peer"], r["order"]): r for r in data["rows"]}
    for peer in ("tensortier", "datasets", "lmdb"):
        assert rows[("build", peer, "-")]["gbps"] > 0
        for order in ("full",):
            row = rows[("read", peer, order)]
            assert row["intact"] and row["gbps"] > 0 and row["cpu_seconds"] >= 0
    assert {"read_full_vs_dd", "read_full_vs_datasets", "build_vs_disk_tier_write"} <= set(
        data["ratios"]
    )
    assert data["open"]["records"] == 100000 and data["open"]["rss_growth_mib"] < 64
    assert [p.name for p in tmp_path.iterdir()] == ["catalog.json"]  # the stores were removed
