"""Rate limiting between collectors and learners: Reverb's ``SampleToInsertRatio``.

The limiter keeps two counters, ``inserts`` and ``samples`` (items, not calls), and admits a call
only if it keeps ``diff = inserts * samples_per_insert - samples`` inside
``[min_diff, max_diff] = spi * min_size_to_sample -/+ error_buffer``:

- an insert of ``n`` items is admitted while the buffer holds at most ``min_size_to_sample``
  items after it, or while ``(inserts + n) * spi - samples <= max_diff`` (else sampling is
  behind: the inserter waits);
- a sample of ``n`` items is admitted when the buffer holds at least ``min_size_to_sample``
  items and ``inserts * spi - samples - n >= min_diff`` (else inserting is behind).

These are Reverb's ``CanInsert``/``CanSample`` with batch sizes. Over any run, therefore,
``samples`` stays within ``spi * inserts`` -/+ (``error_buffer`` + a batch). A waiting caller
holds only its own batch (memory stays bounded: there is no queue in front of the buffer); it
waits on its owner's ``threading.Condition`` and gets :class:`~tensortier.errors.RateLimitTimeout`
after ``timeout`` seconds, with nothing inserted or sampled.

The limiter owns counters and rules, not a lock or a store: its owner holds its own lock around
every call and tells it the store's size, so a sharded buffer can keep one limiter for all shards
(the sum of their sizes) and reuse it unchanged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tensortier._units import check_int
from tensortier.errors import ConfigError, RateLimitTimeout


def _number(name: str, v: Any, low: float, *, strict: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ConfigError(f"RateLimit: {name} must be a number, got {v!r}")
    v = float(v)
    if not np.isfinite(v) or v < low or (strict and v == low):
        op = ">" if strict else ">="
        raise ConfigError(f"RateLimit: {name} must be finite and {op} {low:g}, got {v!r}")
    return v


@dataclass(frozen=True)
class RateLimit:
    """How many samples each inserted item allows (``ReplayBuffer(rate_limit=...)``).

    ``samples_per_insert``: target sampled items per inserted item (e.g. 4 for a learner that
    should see each transition about four times). ``min_size_to_sample``: items stored before the
    first sample. ``error_buffer``: how far ``samples`` may drift from the target, in sampled
    items; it must leave room for one batch on each side (``2 * error_buffer >= batch +
    samples_per_insert`` for samples of ``batch`` items, checked at each call), default
    ``max(1, samples_per_insert) * 100``. ``timeout``: seconds an insert or a sample waits for the
    other side before raising RateLimitTimeout (``None`` waits until it is admitted: then only
    another thread can release it, the caller's choice).
    """

    samples_per_insert: float
    min_size_to_sample: int = 1
    error_buffer: float | None = None
    timeout: float | None = 60.0

    def __post_init__(self) -> None:
        spi = _number("samples_per_insert", self.samples_per_insert, 0, strict=True)
        m = self.min_size_to_sample
        msg = (
            f"RateLimit: min_size_to_sample must be an int >= 1 (items before the first sample), "
            f"got {m!r}"
        )
        check_int(m, msg, minimum=1, numpy=True)
        if self.error_buffer is None:
            object.__setattr__(self, "error_buffer", max(1.0, spi) * 100)
        eb = _number("error_buffer", self.error_buffer, 0)
        if eb < max(1.0, spi):
            raise ConfigError(
                f"RateLimit: error_buffer must be >= max(1, samples_per_insert) = "
                f"{max(1.0, spi):g} (room for one insert), got {eb:g}; raise error_buffer"
            )
        if self.timeout is not None:
            _number("timeout", self.timeout, 0)

    @property
    def min_diff(self) -> float:
        return self.samples_per_insert * self.min_size_to_sample - float(self.error_buffer)

    @property
    def max_diff(self) -> float:
        return self.samples_per_insert * self.min_size_to_sample + float(self.error_buffer)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LimiterStats:
    inserts: int = 0
    samples: int = 0
    insert_waits: int = 0  # calls that had to wait at least once
    sample_waits: int = 0
    insert_timeouts: int = 0
    sample_timeouts: int = 0
    waited_s: float = 0.0


class RateLimiter:
    """Counters and admission rules of one :class:`RateLimit` (see the module doc).

    Not thread-safe by itself: every method runs under the owner's lock, the one ``cond`` (a
    ``threading.Condition`` on that lock) that :meth:`wait` waits on and that the owner notifies
    after each insert, sample and removal.
    """

    def __init__(self, cfg: RateLimit, *, inserts: int = 0, samples: int = 0):
        if not isinstance(cfg, RateLimit):
            raise ConfigError(
                f"rate_limit must be tt.rl.RateLimit(samples_per_insert, ...) or None, got {cfg!r}"
            )
        self.cfg = cfg
        self.stats = LimiterStats(inserts=inserts, samples=samples)

    @classmethod
    def balanced(cls, cfg: RateLimit, size: int) -> RateLimiter:
        """A limiter for a buffer reopened with ``size`` items: as if they were inserted and
        sampled at the target ratio (``diff`` in the middle of its window)."""
        spi = cfg.samples_per_insert
        samples = int(max(0.0, (size - cfg.min_size_to_sample) * spi))
        return cls(cfg, inserts=size, samples=samples)

    @property
    def diff(self) -> float:
        return self.stats.inserts * self.cfg.samples_per_insert - self.stats.samples

    def can_insert(self, n: int, size: int) -> bool:
        if size + n <= self.cfg.min_size_to_sample:
            return True
        st = self.stats
        return (st.inserts + n) * self.cfg.samples_per_insert - st.samples <= self.cfg.max_diff

    def can_sample(self, n: int, size: int) -> bool:
        if size < self.cfg.min_size_to_sample:
            return False
        return self.diff - n >= self.cfg.min_diff

    def check_insert(self, n: int) -> None:
        """ConfigError if an insert of ``n`` items could never be admitted after the warm-up."""
        spi = self.cfg.samples_per_insert
        if n * spi + 1 > 2 * float(self.cfg.error_buffer):
            raise ConfigError(
                f"an insert of {n} items needs {n * spi:g} of the rate limiter's window of "
                f"2 * error_buffer = {2 * float(self.cfg.error_buffer):g} sampled items; insert "
                f"in chunks of at most {int((2 * float(self.cfg.error_buffer) - 1) // spi)} or "
                f"raise RateLimit.error_buffer"
            )

    def check_sample(self, n: int) -> None:
        """ConfigError if a sample of ``n`` items could never be admitted."""
        spi = self.cfg.samples_per_insert
        if n + spi > 2 * float(self.cfg.error_buffer):
            raise ConfigError(
                f"a sample of {n} items needs {n + spi:g} of the rate limiter's window of "
                f"2 * error_buffer = {2 * float(self.cfg.error_buffer):g}; raise "
                f"RateLimit.error_buffer to at least {(n + spi) / 2:g} or sample smaller batches"
            )

    def inserted(self, n: int) -> None:
        self.stats.inserts += n

    def sampled(self, n: int) -> None:
        self.stats.samples += n

    def wait(
        self,
        cond: threading.Condition,
        op: str,
        n: int,
        size_fn,
        timeout: float | None,
        check=None,
    ) -> None:
        """Wait on ``cond`` (held) until ``op`` ("insert" or "sample") of ``n`` items is admitted.

        ``size_fn()`` gives the owner's current size; ``check()`` (optional) raises when the owner
        closes. RateLimitTimeout after ``timeout`` seconds (``None``: no limit; woken by the
        owner's notifications, re-checked every second).
        """
        can = self.can_insert if op == "insert" else self.can_sample
        if can(n, size_fn()):
            return
        st = self.stats
        if op == "insert":
            st.insert_waits += 1
        else:
            st.sample_waits += 1
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self.timeout_error(op, n, size_fn(), timeout)
                cond.wait(1.0 if left is None else min(left, 1.0))
                if check is not None:
                    check()
                if can(n, size_fn()):
                    return
        finally:
            st.waited_s += time.monotonic() - t0

    def timeout_error(self, op: str, n: int, size: int, timeout: float | None) -> RateLimitTimeout:
        st, cfg = self.stats, self.cfg
        if op == "insert":
            st.insert_timeouts += 1
            why = (
                f"sampling is behind: {st.samples} items sampled for {st.inserts} inserted, "
                f"{cfg.samples_per_insert:g} per insert wanted (error_buffer "
                f"{float(cfg.error_buffer):g}); sample more (or faster), lower "
                f"samples_per_insert, raise error_buffer, or pass a longer timeout"
            )
        else:
            st.sample_timeouts += 1
            if size < cfg.min_size_to_sample:
                why = (
                    f"the buffer holds {size} items, fewer than min_size_to_sample="
                    f"{cfg.min_size_to_sample}; add items (start the collectors) or pass a "
                    f"longer timeout"
                )
            else:
                why = (
                    f"inserting is behind: {st.samples} items sampled for {st.inserts} "
                    f"inserted, {cfg.samples_per_insert:g} per insert wanted (error_buffer "
                    f"{float(cfg.error_buffer):g}); insert more (add collectors), raise "
                    f"samples_per_insert or error_buffer, or pass a longer timeout"
                )
        return RateLimitTimeout(
            f"rate-limited {op} of {n} items waited {timeout:g} s: {why}",
            op=op,
            waited=float(timeout or 0.0),
            inserts=st.inserts,
            samples=st.samples,
            size=size,
        )

    def as_dict(self) -> dict:
        return {**asdict(self.stats), "diff": self.diff, "config": self.cfg.to_dict()}
