import json

import pytest

from benchmarks.__main__ import main


@pytest.mark.slow
def test_bench_optimizer_runs_and_writes_json(tmp_path):
    out = tmp_path / "o.json"
    main(
        [
            "optimizer", "--quick", "--params", "3e5", "--width", "128", "--steps", "2",
            "--variants", "torch-foreach,tt-host,tt-disk", "--no-kernels", "--dir", str(tmp_path), "--json", str(out),
            "--quiet-wait", "0",
        ]
    )  # fmt: skip
    data = json.loads(out.read_text())
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
