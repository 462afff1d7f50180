from tests._helpers import run_benchmark


def test_bench_activations_quick_writes_rows(tmp_path):
    data = run_benchmark(
        tmp_path / "act.json",
        f"activations --quick --variants plain,tt-disk --spill-dir {tmp_path}",
    )
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"plain", "tt-disk"}
    for r in rows.values():
        assert r["peak_bytes"] > 0 and r["step_s"] > 0 and "device" in r
        assert r["grads_match"] is True  # lossless offload: bit-identical gradients
        # honest per-step peaks: every step against the memory before the first one, so no
        # step reads as free because an earlier step's retained heap hid it
        (run,) = r["rounds"]
        assert len(run["step_peaks_bytes"]) == 2 and min(run["step_peaks_bytes"]) > 0
        assert r["peak_bytes"] == max(run["step_peaks_bytes"]) >= r["peak_steady_bytes"] > 0
        assert r["step_s_stats"]["n"] == 1 and r["noisy"]  # one round cannot show its spread
    m = data["measurement"]
    assert m["order"] == ["plain", "tt-disk"] and m["load_before"]["cpus"] == m["cpus"]
    assert "1 round: spread unknown" in m["noisy_reasons"]
    assert m["ratios"]["tt-disk_time_vs_plain"]["median"] == rows["tt-disk"]["time_vs_plain"]
    assert rows["tt-disk"]["offload"]["bytes_offloaded"]["disk"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["act.json"]  # spill files cleaned up
