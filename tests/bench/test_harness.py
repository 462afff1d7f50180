"""The measurement rules of ``benchmarks/_harness.py`` with synthetic timings and loads: the
interleaved order, per-round ratios, spreads and the noise verdict (no real timing here)."""

import pytest

from benchmarks import _harness as h


class FakeMachine:
    """A load average that follows a script, and a clock that only sleeping advances."""

    def __init__(self, loads):
        self.loads, self.now, self.slept = list(loads), 0.0, []

    def loadavg(self):
        one = self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]
        return (one, one, one)

    def sleep(self, s):
        self.slept.append(s)
        self.now += s

    def clock(self):
        return self.now


def _session(machine, rounds=3, **kw):
    kw.setdefault("cpus", 2)
    return h.Session(
        "test", rounds, loadavg=machine.loadavg, sleep=machine.sleep, clock=machine.clock,
        poll=None, **kw,
    )  # fmt: skip


def test_variants_run_interleaved_in_rounds():
    assert h.schedule(["a", "b", "c"], 2) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c"),
    ]  # fmt: skip
    calls = []
    with _session(FakeMachine([0.1]), rounds=3) as s:
        per_round = s.run(["A", "B"], lambda v, r: calls.append((v, r)) or {"t": 1.0})
    assert calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert s.order == ["A", "B", "A", "B", "A", "B"] and len(per_round) == 3


def test_a_failing_variant_keeps_the_others():
    def measure(v, r):
        if v == "B" and r == 1:
            raise RuntimeError("boom")
        return {"t": 2.0 if v == "B" else 1.0}

    with _session(FakeMachine([0.1]), rounds=2) as s:
        per_round = s.run(["A", "B"], measure)
    assert per_round[1]["B"] == {"error": "RuntimeError: boom"}
    assert h.variant_stats(per_round, "B", ["t"])["t"]["n"] == 1
    assert h.round_ratios(per_round, "B", "A", "t")["per_round"] == [2.0]


def test_stats_report_median_min_max_and_spread():
    s = h.spread_stats([1.0, 1.2, 1.1, None, float("nan")])
    assert s == {"n": 3, "median": 1.1, "min": 1.0, "max": 1.2, "spread": pytest.approx(0.2)}
    assert h.spread_stats([])["median"] is None


def test_ratios_come_from_the_same_round():
    # the host slows down 2x in round 2: medians of each variant would give 1.5/1.5 = 1.0 of
    # nothing, the same-round ratio stays exactly 0.5
    per_round = [{"A": {"t": 1.0}, "B": {"t": 2.0}}, {"A": {"t": 2.0}, "B": {"t": 4.0}}]
    r = h.round_ratios(per_round, "A", "B", "t")
    assert r["per_round"] == [0.5, 0.5] and r["median"] == 0.5 and r["spread"] == 0
    assert r["of"] == "A/B t"


def test_a_spread_over_ten_percent_marks_the_result_noisy():
    per_round = [{"A": {"t": 1.0}, "B": {"t": 1.0}}, {"A": {"t": 1.05}, "B": {"t": 1.2}}]
    with _session(FakeMachine([0.1]), rounds=2) as s:
        pass
    timed = {v: h.variant_stats(per_round, v, ["t"]) for v in ("A", "B")}
    m = s.report(timed)
    assert m["noisy"] and m["noisy_reasons"] == ["B t spread 20.0% > 10%"]
    assert s.row_fields(timed["A"]) == {"t_stats": timed["A"]["t"], "noisy": False,
                                        "noisy_reasons": []}  # fmt: skip
    assert s.row_fields(timed["B"])["noisy"] is True


def test_load_above_the_core_count_marks_the_result_noisy():
    # quiet at the start, then another job pushes the 1-minute load to 3.5 on 2 CPUs
    machine = FakeMachine([0.2, 0.2, 0.2, 3.5, 0.4])
    with _session(machine, rounds=2) as s:
        s.run(["A"], lambda v, r: {"t": 1.0})
    m = s.report({"A": {"t": h.spread_stats([1.0, 1.0])}})
    assert m["load_max_1m"] == 3.5 and m["noisy"]
    assert m["noisy_reasons"] == ["1-minute load reached 3.50 > 2 CPUs during the run"]
    assert m["load_before"]["load_1m"] == 0.2 and m["load_after"]["load_1m"] == 0.4


def test_the_start_waits_for_a_quiet_machine_but_not_forever():
    machine = FakeMachine([1.5, 1.5, 1.2, 0.9, 0.3])  # before, then the wait's reads
    with _session(machine, quiet_wait=120) as s:
        pass
    assert s.quiet_at_start and s.waited_s == 15 and machine.slept == [5, 5, 5]

    busy = FakeMachine([1.9])
    with _session(busy, quiet_wait=12) as s:
        pass
    assert not s.quiet_at_start and s.waited_s == 12 and busy.slept == [5, 5, 2]
    m = s.report({})
    assert m["noisy"] and "the machine was not quiet when the run started" in m["noisy_reasons"]


def test_no_wait_asked_records_whether_the_machine_was_quiet():
    machine = FakeMachine([1.9])
    with _session(machine, quiet_wait=0) as s:
        pass
    assert machine.slept == [] and not s.quiet_at_start


def test_one_round_cannot_show_its_spread():
    with _session(FakeMachine([0.1]), rounds=1) as s:
        pass
    m = s.report({"A": {"t": h.spread_stats([1.0])}})
    assert m["noisy_reasons"] == ["1 round: spread unknown"]


def test_rounds_default_per_area_and_quick():
    import argparse

    p = argparse.ArgumentParser()
    h.add_args(p, rounds=5, quick_rounds=2)
    assert h.rounds_of(p.parse_args([])) == 5
    assert h.rounds_of(argparse.Namespace(**vars(p.parse_args([])), quick=True)) == 2
    assert h.rounds_of(p.parse_args(["--rounds", "7"])) == 7
    args = p.parse_args(["--quiet-wait", "0", "--quiet-load", "1.5"])
    s = h.Session.from_args("x", args, cpus=2)
    assert (s.rounds, s.quiet_wait, s.threshold) == (5, 0, 1.5)
    assert h.default_quiet_load(2) == 0.5 and h.default_quiet_load(16) == 4


def test_the_median_run_is_a_whole_row():
    runs = [{"t": 3, "x": "c"}, {"t": 1, "x": "a"}, {"error": "e"}, {"t": 2, "x": "b"}]
    assert h.median_run(runs, "t") == {"t": 2, "x": "b"}
    assert h.median_run([{"t": 1}, {"t": 2}], "t") == {"t": 1}
    assert h.median_run([{"error": "e"}], "t") == {"error": "e"}


def test_a_failed_correctness_check_exits_non_zero_and_names_it():
    h.require({"a matches": True, "b matches": True})  # all held: nothing happens
    with pytest.raises(SystemExit) as got:
        h.require({"a matches": True, "b gradients bit-identical to plain": False})
    assert "b gradients bit-identical to plain" in str(got.value)
    assert "a matches" not in str(got.value) and got.value.code != 0


def test_every_result_names_the_versions_that_produced_it():
    """The JSON named torch's version only: not tensortier's, its commit, nor the peers'."""
    import os

    from benchmarks._common import ROOT, environment

    v = environment()["versions"]
    assert v["tensortier"] and v["numpy"]
    if os.path.exists(os.path.join(ROOT, ".git")):  # a checkout (not an unpacked archive)
        assert len(v["commit"].split("-")[0]) == 40  # its HEAD
