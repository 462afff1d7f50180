"""Rate limiting (Reverb's SampleToInsertRatio): rules, blocking and release, timeouts."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.errors import ConfigError, CorruptDataError, RateLimitTimeout, SpillDirError
from tensortier.rl import Prioritized, RateLimit, ReplayBuffer
from tensortier.rl.rate_limiter import RateLimiter


def _until(pred, what: str, limit: float = 30.0) -> None:
    """Poll ``pred`` (a counted event) until it holds; the limit only guards against a hang."""
    end = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.001)


@settings(max_examples=60, deadline=None)
@given(
    spi=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    min_size=st.integers(1, 20),
    slack=st.integers(0, 30),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 8)), min_size=1, max_size=300),
)
def test_limiter_keeps_the_ratio_and_never_deadlocks(spi, min_size, slack, ops):
    batch = 8
    eb = (batch + spi) / 2 + slack  # room for one batch on each side
    lim = RateLimiter(RateLimit(spi, min_size_to_sample=min_size, error_buffer=eb))
    size = 0
    for is_insert, n in ops:
        # no deadlock: one side can always go on
        assert lim.can_insert(1, size) or lim.can_sample(batch, size) or lim.can_sample(1, size)
        if is_insert and lim.can_insert(n, size):
            lim.inserted(n)
            size += n
            if size > min_size:
                assert lim.diff <= lim.cfg.max_diff
        elif not is_insert and lim.can_sample(n, size):
            lim.sampled(n)
            assert size >= min_size and lim.diff >= lim.cfg.min_diff
        s = lim.stats
        assert s.samples == 0 or s.samples <= s.inserts * spi - lim.cfg.min_diff


def test_inserts_block_and_are_released_by_samples():
    """spi=2, error_buffer=4, min size 1: max_diff=6, so inserts stop at 3 items until sampled;
    each sample of 2 items releases exactly one insert (counted, not timed)."""
    rl = RateLimit(2.0, min_size_to_sample=1, error_buffer=4, timeout=None)
    buf = ReplayBuffer(1000, rate_limit=rl, seed=0)
    done, errors = [], []

    def collector():
        try:
            for i in range(8):
                buf.add({"i": i})
                done.append(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=collector)
    t.start()
    waits = lambda: buf.stats["rate_limiter"]["insert_waits"]  # noqa: E731
    _until(lambda: waits() == 1, "the first blocked insert")
    assert len(buf) == 3 and len(done) == 3  # (3 inserts) * 2 - 0 = 6 <= max_diff; a 4th: 8 > 6
    for k in range(1, 5):
        buf.sample(2)  # diff drops by 2: exactly one more insert fits
        _until(lambda k=k: waits() == k + 1, f"insert blocked again after sample {k}")
        assert len(buf) == 3 + k
    buf.sample(2)  # releases the last insert
    t.join(30)
    assert not t.is_alive() and not errors and len(buf) == 8
    st_ = buf.stats["rate_limiter"]
    assert st_["inserts"] == 8 and st_["samples"] == 10 and st_["insert_waits"] == 5
    buf.close()


def test_samples_block_until_min_size_then_follow_inserts():
    rl = RateLimit(1.0, min_size_to_sample=5, error_buffer=3, timeout=None)
    buf = ReplayBuffer(100, rate_limit=rl, seed=0)
    with pytest.raises(RateLimitTimeout, match="min_size_to_sample=5") as info:
        buf.sample(1, timeout=0)
    assert info.value.op == "sample" and info.value.size == 0
    buf.extend({"i": i} for i in range(5))
    # min_diff = 5 - 3 = 2: diff = 5 - samples - n >= 2 admits 3 samples of 1
    for _ in range(3):
        buf.sample(1, timeout=0)
    with pytest.raises(RateLimitTimeout, match="inserting is behind"):
        buf.sample(1, timeout=0)
    got = []
    t = threading.Thread(target=lambda: got.append(buf.sample(1)))
    t.start()
    _until(lambda: buf.stats["rate_limiter"]["sample_waits"] == 3, "the blocked sample")
    assert not got
    buf.add({"i": 5})  # one insert releases one sample
    t.join(30)
    assert len(got) == 1 and len(got[0]) == 1
    buf.close()


def test_insert_timeout_names_the_fix_and_adds_nothing():
    rl = RateLimit(1.0, min_size_to_sample=1, error_buffer=2, timeout=0)
    buf = ReplayBuffer(100, rate_limit=rl)
    buf.extend([{"i": 0}, {"i": 1}, {"i": 2}])  # max_diff 3
    with pytest.raises(RateLimitTimeout, match="sampling is behind.*error_buffer") as info:
        buf.add({"i": 3})
    assert info.value.op == "insert" and info.value.inserts == 3 and len(buf) == 3
    assert isinstance(info.value, TimeoutError)
    buf.sample(1)
    buf.add({"i": 3}, timeout=0)
    assert len(buf) == 4 and buf.stats["rate_limiter"]["insert_timeouts"] == 1
    buf.close()


def test_batches_that_can_never_be_admitted_are_refused():
    buf = ReplayBuffer(1000, rate_limit=RateLimit(1.0, error_buffer=4))
    with pytest.raises(ConfigError, match="error_buffer to at least"):
        buf.sample(16)
    with pytest.raises(ConfigError, match="chunks of at most 7"):
        buf.extend({"i": i} for i in range(20))
    assert len(buf) == 0
    buf.close()
    for bad in (dict(samples_per_insert=0), dict(samples_per_insert=2, error_buffer=1)):
        with pytest.raises(ConfigError, match="RateLimit"):
            RateLimit(**bad)
    with pytest.raises(ConfigError, match="min_size_to_sample"):
        RateLimit(1.0, min_size_to_sample=0)
    with pytest.raises(ConfigError, match="rate_limit must be"):
        ReplayBuffer(10, rate_limit=4)


def test_ratio_holds_over_a_threaded_run():
    """A collector and a learner racing: samples stay within spi * inserts -/+ the window."""
    spi, eb, batch = 4.0, 40.0, 16
    rl = RateLimit(spi, min_size_to_sample=10, error_buffer=eb, timeout=60)
    buf = ReplayBuffer(10_000, sampler=Prioritized(), rate_limit=rl, seed=0)
    n = 400
    seen = []

    def collector():
        for i in range(0, n, 4):
            buf.extend({"obs": np.full(8, j, np.float32)} for j in range(i, i + 4))

    t = threading.Thread(target=collector)
    t.start()
    lim = buf._limiter
    while True:
        try:
            b = buf.sample(batch, timeout=0.5 if t.is_alive() else 0)
        except RateLimitTimeout:
            if not t.is_alive():
                break
            continue
        buf.update_priorities(b.indices, np.ones(batch))
        with buf._lock:
            seen.append((lim.stats.inserts, lim.stats.samples))
    t.join(30)
    s = buf.stats["rate_limiter"]
    assert s["inserts"] == n and len(buf) == n
    offset = spi * rl.min_size_to_sample
    for ins, smp in seen:
        assert spi * ins - offset - eb - batch <= smp <= spi * ins - offset + eb
    # at the end the learner drained what the ratio allows: within one batch of the lower edge
    assert spi * n - offset - eb - batch <= s["samples"] <= spi * n - offset + eb
    buf.close()


def test_prefetch_respects_the_limiter():
    rl = RateLimit(1.0, min_size_to_sample=1, error_buffer=4, timeout=0.3)
    buf = ReplayBuffer(100, rate_limit=rl, prefetch=2, seed=0)
    buf.extend({"i": i} for i in range(4))  # diff 4, min_diff -3: 7 samples of 1 fit
    got = 0
    with pytest.raises(RateLimitTimeout, match="inserting is behind"):
        while True:
            buf.sample(1)
            got += 1
    assert got == 7 and buf.stats["rate_limiter"]["samples"] == 7
    buf.close()


def test_a_failed_insert_or_sample_is_not_counted(tmp_path):
    """The limiter counted an insert before the store took it: each add that failed (here the
    spill directory is missing) still raised ``inserts``, until a collector retrying its add
    was refused with "sampling is behind" by a buffer holding one item. Samples likewise."""
    rl = RateLimit(samples_per_insert=4, min_size_to_sample=1, error_buffer=8, timeout=0.1)
    buf = ReplayBuffer(8, host_budget="1KiB", spill_dir=tmp_path / "missing", rate_limit=rl, seed=0)
    buf.add(np.zeros(10))  # fits in RAM
    for _ in range(5):
        with pytest.raises(SpillDirError, match="mkdir"):
            buf.add(np.zeros(1000))  # must spill
    assert len(buf) == 1 and buf.stats["rate_limiter"]["inserts"] == 1
    (tmp_path / "missing").mkdir()
    buf.add(np.zeros(1000))  # the retry is admitted and counted once
    assert buf.stats["rate_limiter"]["inserts"] == 2

    (seg,) = (tmp_path / "missing").glob("tt-replay-*/seg-*")  # the spilled item's record
    good = seg.read_bytes()
    seg.write_bytes(good[:-8] + b"\xff" * 8)  # damage its payload's last bytes
    with pytest.raises(CorruptDataError):
        buf.sample(8)  # draws the spilled item
    assert buf.stats["rate_limiter"]["samples"] == 0
    seg.write_bytes(good)
    assert len(buf.sample(8)) == 8 and buf.stats["rate_limiter"]["samples"] == 8
    buf.close()
