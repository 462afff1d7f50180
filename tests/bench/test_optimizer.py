import pytest

from tests._helpers import run_benchmark


@pytest.mark.slow
def test_bench_optimizer_runs_and_writes_json(tmp_path):
    data = run_benchmark(
        tmp_path / "o.json",
        "optimizer --quick --params 3e5 --width 128 --steps 2 --no-kernels "
        "--variants torch-foreach,torch-fused,tt-host,tt-disk",
        tmp_path,
    )
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"torch-foreach", "torch-fused", "tt-host", "tt-disk"}
    for v in ("tt-host", "tt-disk"):
        assert "error" not in rows[v], rows[v]
        assert rows[v]["max_abs_diff_vs_torch"] < 1e-5
        assert rows[v]["bit_identical_to_torch_fused"] is True  # the same kernel
        assert rows[v]["update_alone_ms"] > 0
    assert set(data["interleaved"]["rows"]) == {"torch-fused", "tt-host", "tt-disk"}
    assert data["summary"]["disk_vs_host_step"] > 0
    m = data["measurement"]  # --quick: one round (the harness's own tests interleave more)
    assert m["order"] == ["torch-foreach", "torch-fused", "tt-host", "tt-disk"]
    assert rows["tt-host"]["step_ms_stats"]["n"] == 1 and rows["tt-host"]["noisy"] is True
    inter = data["interleaved"]["rows"]["tt-disk"]["stats"]["step_ms"]
    assert inter["n"] == 2 and inter["min"] == data["interleaved"]["rows"]["tt-disk"]["step_ms"]


def test_parameters_that_differ_from_fused_adamw_by_one_bit_fail_the_check(tmp_path):
    """tensortier runs torch's fused kernel: its parameters must equal AdamW(fused=True)'s bit
    for bit; the only check was a max difference from the foreach AdamW (< 1e-5 passed)."""
    import numpy as np

    from benchmarks.optimizer import _compare

    fused = np.linspace(-1, 1, 64, dtype=np.float32)
    off = fused.copy()
    off[7] = np.nextafter(off[7], np.float32(2))
    for name, a in {
        "torch-foreach": off,
        "torch-fused": fused,
        "tt-host": fused,
        "tt-disk": off,
    }.items():
        np.save(tmp_path / f"{name}.npy", a)
    rows = [{"variant": v} for v in ("torch-foreach", "torch-fused", "tt-host", "tt-disk")]
    _compare(rows, str(tmp_path))
    by = {r["variant"]: r for r in rows}
    assert by["tt-host"]["bit_identical_to_torch_fused"] is True
    assert by["tt-disk"]["bit_identical_to_torch_fused"] is False
    assert 0 < by["tt-host"]["max_abs_diff_vs_torch"] < 1e-6  # the old check passed both
    assert "bit_identical_to_torch_fused" not in by["torch-foreach"]


def test_a_rows_memory_figures_come_from_the_same_worst_round(tmp_path):
    """``peak_rss_bytes`` was the worst round's and ``optimizer_rss_bytes`` the median round's:
    a row whose optimizer share did not belong to its peak."""
    from benchmarks import _harness as harness
    from benchmarks.optimizer import _rows

    def run(step, peak, opt):
        return {"variant": "tt-host", "step_ms": step, "iter_ms": step, "exposed_ms": 1.0,
                "peak_rss_bytes": peak, "optimizer_rss_bytes": opt}  # fmt: skip

    per_round = [{"tt-host": run(1.0, 900, 500)}, {"tt-host": run(2.0, 700, 300)},
                 {"tt-host": run(3.0, 800, 400)}]  # fmt: skip
    session = harness.Session("t", 3, poll=None, loadavg=lambda: (0.1, 0.1, 0.1), cpus=2)
    (row,) = _rows(session, per_round, ["tt-host"], str(tmp_path))
    assert row["step_ms"] == 2.0  # the median round
    assert row["peak_rss_bytes"] == 900 and row["optimizer_rss_bytes"] == 500


class _Stats:
    kernel_seconds = 0.0
    launched_in_backward = host_state_bytes = 0
    steps = 1


class _PhasedAdamW:
    """An OffloadedAdamW stand-in whose kernels take 1 s during backward, 2 s in step()."""

    def __init__(self, params):
        self.params, self.st, self.overlap = list(params), _Stats(), True
        self.params[0].register_post_accumulate_grad_hook(self._in_backward)

    def _in_backward(self, _p):
        self.st.kernel_seconds += 1.0

    def stats(self):
        return self.st

    def step(self):
        self.st.kernel_seconds += 2.0

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def close(self):
        pass


def test_kernel_ms_in_backward_counts_only_the_kernels_that_ran_during_backward(
    tmp_path, monkeypatch
):
    """``kernel_ms_in_backward`` was every kernel second of the timed steps, those step() ran
    included; it is now the kernels of the backward alone, step()'s beside it."""
    import argparse

    from benchmarks import optimizer

    monkeypatch.setattr(optimizer, "_optimizer", lambda v, params, args: _PhasedAdamW(params))
    args = argparse.Namespace(child="tt-host", params=600, width=16, batch=2, steps=2,
                              out=str(tmp_path / "p.npy"), dir=str(tmp_path))  # fmt: skip
    row = optimizer._child(args)
    assert row["kernel_ms_in_backward"] == 1000.0 and row["kernel_ms_in_step"] == 2000.0
