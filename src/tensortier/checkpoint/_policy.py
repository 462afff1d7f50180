"""When to checkpoint with ``every="auto"``: CheckFreq's rule on measured costs.

CheckFreq (FAST'21) picks the interval k so that the time a checkpoint costs the training loop,
divided by the time of k iterations, stays under the allowed overhead p: k = cost / (p * t_iter).
Here the cost is *measured*, not modelled: every call of ``maybe_save`` timestamps one iteration,
iterations with no checkpoint activity give the baseline t_iter (a running median), and each
checkpoint's cost is the extra time of the iterations it touched (the blocking part of the
snapshot, waits before the optimizer step, and the slowdown while persisting in the background),
but never less than what is measured without noise: the seconds the loop was blocked plus, when
the state lives in host memory and so competes with training for the same cores, the CPU seconds
of the background copy and persist.
The rule is applied to running totals, so one-off costs such as the first snapshot's buffer
allocation are amortised too: a checkpoint starts only when the total cost so far plus the
expected cost of this one fits in p times the steps run. A checkpoint never starts while the
previous one is persisting. Costs are an exponential moving average, so the interval re-tunes when
they change.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class AutoInterval:
    max_overhead: float
    warmup: int = 3  # clean iterations measured before the first checkpoint
    smoothing: float = 0.5  # weight of the newest cost in the moving average
    clean: deque = field(default_factory=lambda: deque(maxlen=64))
    cost_avg: float | None = None
    total_cost: float = 0.0
    steps: int = 0  # iterations observed
    open_cost: float | None = None  # cost accumulated by the checkpoint being accounted

    @property
    def t_iter(self) -> float | None:
        return statistics.median(self.clean) if self.clean else None

    def observe(self, seconds: float, *, busy: bool) -> None:
        """One iteration took ``seconds``; ``busy`` if a checkpoint was active during it."""
        self.steps += 1
        if not busy:
            self.clean.append(seconds)
        elif self.open_cost is not None and self.t_iter is not None:
            self.open_cost += seconds - self.t_iter

    def started(self) -> None:
        self.open_cost = 0.0

    def finished(self, floor: float = 0.0) -> float:
        """The checkpoint being accounted is persisted; returns its cost.

        ``floor`` is a cost known without timing noise (blocked seconds, plus on CPU the CPU
        seconds of the background work); the cost is the larger of it and the measured excess.
        """
        cost = max(0.0, floor, self.open_cost or 0.0)
        self.open_cost = None
        self.total_cost += cost
        a = self.smoothing
        self.cost_avg = cost if self.cost_avg is None else a * cost + (1 - a) * self.cost_avg
        return cost

    def due(self) -> bool:
        t = self.t_iter
        if t is None or len(self.clean) < self.warmup or self.open_cost is not None:
            return False
        expected = self.cost_avg or 0.0
        return self.total_cost + expected <= self.max_overhead * self.steps * t

    @property
    def interval(self) -> int | None:
        """Steady-state steps between checkpoints (CheckFreq's k), once a cost was measured."""
        t = self.t_iter
        if self.cost_avg is None or not t:
            return None
        return max(1, math.ceil(self.cost_avg / (self.max_overhead * t)))
