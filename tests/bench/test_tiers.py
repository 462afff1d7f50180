import pytest

from tests._helpers import run_benchmark


def test_bench_tiers_writes_rows_against_dd(tmp_path):
    data = run_benchmark(
        tmp_path / "tiers.json",
        "tiers --quick --size 32MiB --tensor-size 8MiB --rounds 2",
        tmp_path,
    )
    assert data["benchmark"] == "tiers" and "device" in data["env"]
    paths = {r["path"]: r for r in data["rows"]}
    assert {
        "host->disk dd O_DIRECT (limit)",
        "host->disk (tensortier)",
        "disk->host dd O_DIRECT (limit)",
        "disk->host (tensortier)",
    } <= set(paths)
    for row in data["rows"]:
        assert row["bytes"] == 32 << 20 and row["gbps"] > 0 and row["ratio_vs_limit"] > 0
    assert data["direct_io_and_intact"] is True
    m = data["measurement"]  # dd and the tier interleaved, ratios within a round
    assert m["order"] == ["dd", "tensortier", "dd", "tensortier"]
    assert len(m["ratios"]["write_vs_dd"]["per_round"]) == 2
    assert (
        paths["host->disk (tensortier)"]["ratio_vs_limit"] == m["ratios"]["write_vs_dd"]["median"]
    )
    assert paths["disk->host (tensortier)"]["gbps_stats"]["n"] == 2
    assert paths["host->disk (tensortier)"]["peak_extra_rss"] >= 32 << 20  # the data written
    assert [p.name for p in tmp_path.iterdir()] == ["tiers.json"]  # scratch files cleaned up


def test_bench_tiers_remote_writes_rows_against_ray(tmp_path):
    pytest.importorskip("ray")
    data = run_benchmark(tmp_path / "remote.json", "tiers --remote --size 4MiB --repeat 1")
    assert data["benchmark"] == "tiers-remote" and data["intact"] is True
    assert data["measurement"]["load_before"]["cpus"] > 0
    paths = [r["path"] for r in data["rows"]]
    assert paths[:4] == [
        "host->remote ray.put + remote ray.get (limit)",
        "host->remote (tensortier)",
        "remote->host ray.get (limit)",
        "remote->host (tensortier)",
    ]
    for row in data["rows"][:4]:
        assert row["bytes"] == 4 << 20 and row["gbps"] > 0 and row["ratio_vs_limit"] > 0
    # the peers of the same run: Ray's spilling, batched small tensors, prefetch
    assert any("Ray object spilling" in p for p in paths) and any("put_many" in p for p in paths)
    assert any("get_many" in p for p in paths) and any(", prefetch" in p for p in paths)
    for row in data["rows"][4:]:
        assert row["gbps"] > 0 and ("remote_vs_spilling" in row or "speedup_vs_each" in row)


def test_bytes_read_back_wrong_fail_the_run_after_the_json(tmp_path, monkeypatch):
    """Corrupted read-backs exit non-zero (they were a printed warning), and a missing O_DIRECT,
    which changes what is measured but not the data, is reported apart from them."""
    import argparse
    import json

    from benchmarks import tiers

    monkeypatch.setattr(tiers, "dd_bandwidth", lambda d, n: (1.0, 1.0))
    monkeypatch.setattr(tiers, "tier_bandwidth", lambda d, n, t: (1.0, 1.0, False, True))
    p = argparse.ArgumentParser()
    tiers.add_args(p)
    out = tmp_path / "tiers.json"
    args = p.parse_args(
        ["--quick", "--dir", str(tmp_path), "--quiet-wait", "0", "--json", str(out)]
    )
    with pytest.raises(SystemExit, match="read back every byte"):
        tiers.run(args)
    data = json.loads(out.read_text())
    assert data["intact"] is False and data["direct_io"] is True


def test_the_cuda_rows_are_measured_in_the_rounds_with_their_noise_fields(tmp_path, monkeypatch):
    """The CUDA rows were a best of 3 taken after the rounds: no spread, no noise verdict, no
    same-round ratio. They now run in every round beside dd and the disk tier."""
    import argparse
    import json

    from benchmarks import tiers

    speeds = iter([(10.0, 20.0), (30.0, 20.0)])  # round 1: engine 0.5x; round 2: 1.5x

    def cuda(nbytes):
        tt, torch_ = next(speeds)
        return {"d2h_torch_gbps": torch_, "d2h_tt_gbps": tt,
                "h2d_torch_gbps": torch_, "h2d_tt_gbps": tt}  # fmt: skip

    from benchmarks import _common

    monkeypatch.setattr(tiers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_common, "device_name", lambda: "a GPU")
    monkeypatch.setattr(tiers, "cuda_bandwidth", cuda)
    monkeypatch.setattr(tiers, "dd_bandwidth", lambda d, n: (1.0, 1.0))
    monkeypatch.setattr(tiers, "tier_bandwidth", lambda d, n, t: (1.0, 1.0, True, True))
    p = argparse.ArgumentParser()
    tiers.add_args(p)
    out = tmp_path / "tiers.json"
    argv = ["--quick", "--rounds", "2", "--dir", str(tmp_path), "--quiet-wait", "0"]
    tiers.run(p.parse_args([*argv, "--json", str(out)]))
    data = json.loads(out.read_text())
    assert data["measurement"]["order"] == ["dd", "tensortier", "cuda"] * 2
    rows = {r["path"]: r for r in data["rows"]}
    tt = rows["device->host (tensortier)"]
    assert tt["gbps_stats"]["n"] == 2 and tt["gbps_stats"]["spread"] == 2.0
    assert tt["noisy"] and "gbps spread 200.0% > 10%" in tt["noisy_reasons"]
    assert tt["ratio_vs_limit"] == 1.0 and tt["ratio_vs_limit_spread"] == 2.0  # 0.5x and 1.5x
    assert rows["host->device pinned copy_ (torch)"]["gbps_stats"]["median"] == 20.0
    assert "cuda d2h_tt_gbps" in " ".join(data["measurement"]["noisy_reasons"])
