import pytest

from tests._helpers import run_benchmark


@pytest.mark.slow
def test_bench_replay_runs_peers_and_writes_ratios(tmp_path):
    data = run_benchmark(
        tmp_path / "replay.json",
        "replay --quick --items 600 --batches 4 --rounds 2 --item-bytes 2KB --spill-items 800 "
        "--spill-budget 256KiB --skip torchrl,rllib,ray,sharded,params,nodes",
        tmp_path,
    )
    rows = {(r["section"], r["peer"]): r for r in data["rows"]}
    assert {("main", "tensortier"), ("main", "deque"), ("spill", "tensortier")} <= set(rows)
    main_row = rows[("main", "tensortier")]
    assert "error" not in main_row and main_row["add_per_s"] > 0 and main_row["peak_rss"] > 0
    assert rows[("spill", "tensortier")]["stats"]["disk_items"] > 0
    assert "vs_deque_sample_items_per_s" in data["ratios"]
    # the main run's peers interleaved in rounds, ratios within a round, medians in the rows
    m = data["measurement"]
    assert m["order"] == ["tensortier", "deque"] * 2
    ratio = m["ratios"]["vs_deque_add_per_s"]
    assert len(ratio["per_round"]) == 2 and data["ratios"]["vs_deque_add_per_s"] == ratio["median"]
    assert main_row["add_per_s"] == main_row["add_per_s_stats"]["median"]
