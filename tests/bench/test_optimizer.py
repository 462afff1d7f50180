import pytest

from tests._helpers import run_benchmark


@pytest.mark.slow
def test_bench_optimizer_runs_and_writes_json(tmp_path):
    data = run_benchmark(
        tmp_path / "o.json",
        "optimizer --quick --params 3e5 --width 128 --steps 2 --no-kernels "
        "--variants torch-foreach,tt-host,tt-disk",
        tmp_path,
    )
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"torch-foreach", "tt-host", "tt-disk"}
    for v in ("tt-host", "tt-disk"):
        assert "error" not in rows[v], rows[v]
        assert rows[v]["max_abs_diff_vs_torch"] < 1e-5
        assert rows[v]["update_alone_ms"] > 0
    assert set(data["interleaved"]["rows"]) == {"tt-host", "tt-disk"}
    assert data["summary"]["disk_vs_host_step"] > 0
    m = data["measurement"]  # --quick: one round (the harness's own tests interleave more)
    assert m["order"] == ["torch-foreach", "tt-host", "tt-disk"]
    assert rows["tt-host"]["step_ms_stats"]["n"] == 1 and rows["tt-host"]["noisy"] is True
    inter = data["interleaved"]["rows"]["tt-disk"]["stats"]["step_ms"]
    assert inter["n"] == 2 and inter["min"] == data["interleaved"]["rows"]["tt-disk"]["step_ms"]
