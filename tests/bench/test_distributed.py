"""`python -m benchmarks distributed`: the summary computes the issue's targets from per-rank rows
(the worst rank of each), keeps the best of repeated runs, and explains a peer that cannot run."""

from benchmarks.distributed import _better, _summary


def _row(variant, rank, **kw):
    return {"variant": variant, "rank": rank, **kw}


def test_summary_uses_the_worst_rank_and_explains_missing_peers():
    rows = [
        _row("ddp-tt", 0, optimizer_state_bytes=50, optimizer_rss_bytes=5, iter_ms=10, step_ms=2),
        _row("ddp-tt", 1, optimizer_state_bytes=55, optimizer_rss_bytes=5, iter_ms=12, step_ms=3),
        _row("ddp-tt-unsharded", 0, optimizer_state_bytes=100, optimizer_rss_bytes=10),
        _row("ddp-torch-fused", 0, iter_ms=12, step_ms=1),
        _row("checkpoint", 0, stall_vs_dcp_save=0.05, persist_vs_dd=0.95),
        _row("checkpoint", 1, stall_vs_dcp_save=0.08, persist_vs_dd=0.91),
        _row("fsdp2-cpuoffload", 0, error="RuntimeError: Cannot access accelerator device"),
    ]
    s = _summary(rows)
    assert s["host_state_vs_unsharded"] == 0.55
    assert s["iter_vs_ddp-torch-fused"] == 1.0 and s["step_vs_ddp-torch-fused"] == 3.0
    assert s["stall_vs_dcp_save"] == 0.08 and s["persist_vs_dd"] == 0.91
    assert "accelerator" in s["why_fsdp2_cpuoffload_cannot_run"]


def test_best_run_is_kept():
    assert _better({"iter_ms": 1}, {"iter_ms": 2})
    assert not _better({"stall_s": 3}, {"stall_s": 2})
    assert _better({"iter_ms": 9}, {"error": "x"}) and not _better({"error": "x"}, {"iter_ms": 9})
