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


def test_gradients_that_differ_from_plain_fail_the_run_after_the_json(tmp_path, monkeypatch):
    """A variant whose gradients differ from plain's did other work: the run says so and exits
    non-zero (the rows kept ``grads_match: false`` in a table nobody reads)."""
    import argparse
    import json

    import pytest

    from benchmarks import activations

    def fake_spawn(args, variant, env):
        return {
            "variant": variant, "peak_bytes": 10, "peak_first_bytes": 10, "peak_steady_bytes": 10,
            "step_peaks_bytes": [10, 10], "step_times_s": [1.0], "step_s": 1.0,
            "grad_sha256": "a" if variant == "plain" else "b", "loss": 1.0,
        }  # fmt: skip

    monkeypatch.setattr(activations, "_spawn", fake_spawn)
    p = argparse.ArgumentParser()
    activations.add_args(p)
    out = tmp_path / "act.json"
    args = p.parse_args(["--variants", "tt-host", "--quiet-wait", "0", "--json", str(out)])
    with pytest.raises(SystemExit, match="tt-host: gradients bit-identical"):
        activations.run(args)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["plain"]["grads_match"] and not rows["tt-host"]["grads_match"]
