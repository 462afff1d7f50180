"""How every benchmark area measures: quiet start, interleaved rounds, medians, spreads, noise.

Times taken while other jobs share the cores cannot carry a claim (issue 27: one plan measured
0.28, 0.42 and 0.76 s in one sweep). So every area runs through a :class:`Session`, which

1. records the load average (1/5/15 min) and the CPU count before and after the run;
2. waits, at most ``--quiet-wait`` seconds, for the 1-minute load to drop below ``--quiet-load``
   before the first measurement (a machine still busy after the wait is reported, not hidden);
3. runs the variants interleaved in rounds, A B C A B C ... (``--rounds``), so the slow minutes of
   a shared host hit every variant alike, and samples the load during the run;
4. reports per variant and timed metric the median, min, max and spread (max/min - 1);
5. takes ratios between variants within one round, then their median and spread over rounds;
6. marks the result ``noisy`` with its reasons when a variant's spread exceeds 10%, when the
   1-minute load during the run exceeded the CPU count, when the machine was not quiet at the
   start, or when a single round leaves the spread unknown.

Memory figures survive load and are never part of the noise verdict; only the metrics an area
names as timed are. Nothing here asserts a speed: the verdict is data in the JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

SPREAD_LIMIT = 0.10  # within-variant spread above this marks a result noisy
QUIET_WAIT_S = 120.0  # the longest wait for a quiet machine before the first measurement
POLL_S = 2.0  # load sampling period during a run (the kernel updates it every 5 s)


def default_quiet_load(cpus: int) -> float:
    """The 1-minute load below which a machine counts as quiet: a quarter of its cores, at
    least 0.5 (a single busy process elsewhere keeps a 2-core machine above it)."""
    return max(0.5, 0.25 * cpus)


def add_args(
    p: argparse.ArgumentParser,
    rounds: int,
    *,
    quick_rounds: int = 1,
    aliases: tuple[str, ...] = (),
    dest: str = "rounds",
) -> None:
    """The harness options of an area; ``rounds`` is the area's default number of rounds
    (``aliases``/``dest``: an area whose older option already meant rounds keeps it)."""
    p.add_argument(
        "--rounds",
        *aliases,
        dest=dest,
        type=int,
        default=None,
        help=f"every variant once per round, interleaved (default {rounds}, {quick_rounds} with "
        "--quick); spreads need at least 2",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=QUIET_WAIT_S,
        help="seconds to wait at most for the 1-minute load to drop below --quiet-load before "
        f"measuring (default {QUIET_WAIT_S:.0f}; 0 starts at once)",
    )
    p.add_argument(
        "--quiet-load",
        type=float,
        default=None,
        help="1-minute load that counts as quiet (default max(0.5, CPUs/4))",
    )
    p.set_defaults(harness_rounds=(rounds, quick_rounds, dest))


def rounds_of(args: argparse.Namespace) -> int:
    """``--rounds`` if given, else the area's default (its quick default with ``--quick``)."""
    full, quick, dest = getattr(args, "harness_rounds", (3, 1, "rounds"))
    if getattr(args, dest, None):
        return getattr(args, dest)
    return quick if getattr(args, "quick", False) else full


# --------------------------------------------------------------------------- pure rules
def schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The interleaved order: every variant once per round, the same order in every round."""
    return [(r, v) for r in range(rounds) for v in variants]


def spread_stats(values: Iterable[float]) -> dict:
    """Median, min, max, spread (max/min - 1) and count of some measurements (errors left out)."""
    xs = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "spread": None}
    lo, hi = min(xs), max(xs)
    spread = hi / lo - 1 if lo > 0 else (0.0 if hi == lo else math.inf)
    return {"n": len(xs), "median": statistics.median(xs), "min": lo, "max": hi, "spread": spread}


def round_ratios(
    per_round: Sequence[dict[str, dict]], num: str, den: str, metric: str, den_metric: str = ""
) -> dict:
    """``num``'s ``metric`` over ``den``'s (``den_metric``, default the same) within each round,
    then their median and spread; rounds where either side failed are left out."""
    values = []
    for got in per_round:
        a, b = got.get(num) or {}, got.get(den) or {}
        x, y = a.get(metric), b.get(den_metric or metric)
        if x is not None and y:
            values.append(x / y)
    return {**spread_stats(values), "per_round": values, "of": f"{num}/{den} {metric}"}


def noise_reasons(
    spreads: dict[str, float | None],
    *,
    load_max: float,
    cpus: int,
    rounds: int,
    quiet_at_start: bool = True,
    limit: float = SPREAD_LIMIT,
) -> list[str]:
    """Why a result is noisy (empty: it is not). ``spreads`` maps a variant's timed metric to
    its within-variant spread."""
    reasons = []
    for name, spread in spreads.items():
        if spread is not None and spread > limit:
            reasons.append(f"{name} spread {spread:.1%} > {limit:.0%}")
    if load_max > cpus:
        reasons.append(f"1-minute load reached {load_max:.2f} > {cpus} CPUs during the run")
    if not quiet_at_start:
        reasons.append("the machine was not quiet when the run started")
    if rounds < 2:
        reasons.append(f"{rounds} round: spread unknown")
    return reasons


# --------------------------------------------------------------------------- the session
def load_sample(loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg) -> dict:
    one, five, fifteen = loadavg()
    return {"load_1m": one, "load_5m": five, "load_15m": fifteen, "cpus": os.cpu_count() or 1}


@dataclass
class Session:
    """One area's run under the rules of this module (see its docstring).

    ``loadavg``, ``sleep`` and ``clock`` are injectable so the rules can be tested with
    synthetic loads; ``poll`` None disables the background sampler (tests sample explicitly).
    """

    area: str
    rounds: int
    quiet_wait: float = QUIET_WAIT_S
    quiet_load: float | None = None
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    poll: float | None = POLL_S
    order: list[str] = field(default_factory=list)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    waited_s: float = 0.0
    quiet_at_start: bool = True
    load_max: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def from_args(cls, area: str, args: argparse.Namespace, **kw) -> Session:
        return cls(
            area,
            rounds_of(args),
            quiet_wait=getattr(args, "quiet_wait", QUIET_WAIT_S),
            quiet_load=getattr(args, "quiet_load", None),
            **kw,
        )

    @property
    def threshold(self) -> float:
        return self.quiet_load if self.quiet_load is not None else default_quiet_load(self.cpus)

    def sample(self) -> float:
        """Reads the 1-minute load now and keeps the highest seen during the run."""
        one = self.loadavg()[0]
        self.load_max = max(self.load_max, one)
        return one

    def wait_quiet(self) -> None:
        """Sleeps until the 1-minute load is below the threshold, at most ``quiet_wait`` s."""
        start = self.clock()
        while self.loadavg()[0] >= self.threshold:
            left = self.quiet_wait - (self.clock() - start)
            if left <= 0:
                self.quiet_at_start = False
                break
            self.sleep(min(5.0, left))
        self.waited_s = self.clock() - start

    def __enter__(self) -> Session:
        self.before = load_sample(self.loadavg)
        if self.quiet_wait > 0:
            self.wait_quiet()
        else:
            self.quiet_at_start = self.loadavg()[0] < self.threshold
        if not self.quiet_at_start:
            print(f"{self.area}: the 1-minute load stays >= {self.threshold:.2f}: measuring anyway")
        self.load_max = 0.0  # the run starts now: the wait's load is not the run's
        self.sample()
        if self.poll:
            self._thread = threading.Thread(target=self._monitor, daemon=True)
            self._thread.start()
        return self

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll):
            self.sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        self.after = load_sample(self.loadavg)

    def run(
        self, variants: Sequence[str], measure: Callable[[str, int], dict]
    ) -> list[dict[str, dict]]:
        """``measure(variant, round)`` for every variant in every round, interleaved; one dict
        per round, variant -> its result (an exception becomes ``{"error": ...}``)."""
        per_round: list[dict[str, dict]] = [{} for _ in range(self.rounds)]
        for r, v in schedule(variants, self.rounds):
            self.order.append(v)
            try:
                per_round[r][v] = measure(v, r)
            except Exception as exc:  # one variant failing must not lose the others' figures
                per_round[r][v] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            self.sample()
        return per_round

    def report(self, timed: dict[str, dict[str, dict]], ratios: dict[str, dict] | None = None):
        """The ``measurement`` block of the JSON: the load and wait, the order, per variant its
        timed metrics' stats (``timed``: variant -> metric -> :func:`spread_stats`), the ratios
        and the noise verdict."""
        spreads = {f"{v} {m}": s.get("spread") for v, ms in timed.items() for m, s in ms.items()}
        reasons = noise_reasons(
            spreads,
            load_max=self.load_max,
            cpus=self.cpus,
            rounds=self.rounds,
            quiet_at_start=self.quiet_at_start,
        )
        return {
            "rounds": self.rounds,
            "order": self.order,
            "cpus": self.cpus,
            "load_before": self.before,
            "load_after": self.after,
            "load_max_1m": self.load_max,
            "quiet_load": self.threshold,
            "quiet_wait_s": self.quiet_wait,
            "waited_s": self.waited_s,
            "quiet_at_start": self.quiet_at_start,
            "spread_limit": SPREAD_LIMIT,
            "variants": timed,
            "ratios": ratios or {},
            "noisy": bool(reasons),
            "noisy_reasons": reasons,
        }

    def row_fields(self, metrics: dict[str, dict]) -> dict:
        """The harness fields of one row: ``<metric>_stats`` and its own ``noisy`` verdict."""
        reasons = noise_reasons(
            {m: s.get("spread") for m, s in metrics.items()},
            load_max=self.load_max,
            cpus=self.cpus,
            rounds=self.rounds,
            quiet_at_start=self.quiet_at_start,
        )
        out = {f"{m}_stats": s for m, s in metrics.items()}
        return {**out, "noisy": bool(reasons), "noisy_reasons": reasons}


def variant_stats(
    per_round: Sequence[dict[str, dict]], variant: str, metrics: Iterable[str]
) -> dict[str, dict]:
    """Per metric, :func:`spread_stats` of ``variant``'s values over the rounds."""
    return {
        m: spread_stats(got[variant].get(m) for got in per_round if variant in got) for m in metrics
    }


def median_run(runs: Sequence[dict], key: str) -> dict:
    """The run whose ``key`` is the (lower) median: a whole, consistent row to report."""
    ok = [r for r in runs if r.get(key) is not None and "error" not in r]
    if not ok:
        return runs[-1] if runs else {}
    ok.sort(key=lambda r: r[key])
    return ok[(len(ok) - 1) // 2]


def require(checks: dict[str, bool]) -> None:
    """Exits non-zero naming every correctness check that failed (``checks``: what was checked
    -> whether it held). Called once the JSON is written: variants whose results differ did
    not do the same work, so their figures cannot be compared, and a table alone hides that."""
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise SystemExit(
            "correctness check failed (the figures above are not comparable): " + "; ".join(failed)
        )


def summary_line(measurement: dict) -> str:
    load = measurement["load_before"].get("load_1m", float("nan"))
    head = (
        f"measurement: {measurement['rounds']} interleaved rounds, load {load:.2f} before, "
        f"max {measurement['load_max_1m']:.2f} during, {measurement['cpus']} CPUs"
    )
    if measurement["noisy"]:
        return f"{head}; NOISY: " + "; ".join(measurement["noisy_reasons"])
    return f"{head}; not noisy"
