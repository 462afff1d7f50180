import math
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.errors import ConfigError
from tensortier.rl import Prioritized, ReplayBuffer
from tensortier.rl.sampler import SumMinTree


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty), so the test fails only on a real mismatch."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=70),
    updates=st.lists(st.tuples(st.integers(0, 69), st.floats(0, 50)), max_size=30),
)
def test_sum_and_min_tree_match_brute_force(values, updates):
    tree = SumMinTree(70)
    leaves = np.zeros(70)
    leaves[: len(values)] = values
    tree.set(np.arange(70), leaves)
    if updates:
        idx = np.array([u[0] for u in updates])
        val = np.array([u[1] for u in updates])
        tree.set(idx, val)  # duplicates: last wins
        for i, v in updates:
            leaves[i] = v
    assert tree.total == pytest.approx(leaves.sum(), rel=1e-12, abs=1e-12)
    pos = leaves[leaves > 0]
    assert tree.min_positive == (pos.min() if len(pos) else math.inf)
    if tree.total > 0:
        mass = np.linspace(0, tree.total, 50, endpoint=False)
        found = tree.find(mass)
        assert (leaves[found] > 0).all()
        cum = np.cumsum(leaves)
        expected = np.searchsorted(cum, mass, side="right")
        # ties at a boundary may resolve to either neighbour; compare cumulative ranges
        ok = (cum[found] - leaves[found] <= mass + 1e-9) & (mass <= cum[found] + 1e-9)
        assert ok.all(), (found, expected)


@settings(max_examples=15, deadline=None)
@given(
    capacity=st.sampled_from([5_000, 20_000, 200_000]),
    seed=st.integers(0, 2**32 - 1),
    batch=st.sampled_from([3, 256, 1000]),
)
def test_multi_level_trees_match_brute_force(capacity, seed, batch):
    """Capacities with dense and gathered sum levels and one or two min levels: batched updates
    (zeros, repeated slots, single few-slot updates) keep every level equal to a recount."""
    rng = np.random.default_rng(seed)
    tree = SumMinTree(capacity)
    leaves = np.zeros(capacity)
    for _ in range(5):
        slots = rng.integers(0, capacity, batch)
        vals = rng.random(batch) * rng.choice([1e-3, 1.0, 1e3], batch)
        vals[rng.random(batch) < 0.1] = 0.0
        tree.set(slots, vals, zeros_later=bool(rng.random() < 0.5))  # zeros mapped now or later
        leaves[slots] = vals  # numpy: the last value of a repeated slot wins, as in the tree
    full = np.zeros(len(tree.sums[0]))
    full[:capacity] = leaves
    for level in tree.sums:  # each sum level is the sum of its children, leaves included
        assert level.sum() == pytest.approx(leaves.sum(), rel=1e-9)
        assert np.allclose(level, full.reshape(len(level), -1).sum(axis=1), rtol=1e-12)
    mins = np.full(len(tree.mins[0]), np.inf)
    mins[:capacity] = np.where(leaves > 0, leaves, np.inf)
    pos = leaves[leaves > 0]
    assert tree.min_positive == pos.min()  # read first: it maps zeros that set() left
    for level in tree.mins:  # node q of n: the min of leaves q, q + n, q + 2n, ...
        assert np.array_equal(level, mins.reshape(-1, len(level)).min(axis=0))
    mass = (np.arange(64) + rng.random(64)) * (tree.total / 64)
    found = tree.find(np.minimum(mass, np.nextafter(tree.total, 0)))
    assert (leaves[found] > 0).all()


@settings(max_examples=20, deadline=None)
@given(
    capacity=st.sampled_from([70, 5_000, 20_000, 200_000]),
    alpha=st.sampled_from([0.6, 1.0, 2.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_update_priorities_matches_a_plain_reference_bit_for_bit(capacity, alpha, seed):
    """Through the public API: after batches of updates (repeated indices, zeros, stale
    indices, a few-item batch) every stored weight is exactly ``p**alpha`` of the last priority
    given (numpy's power, as a user would compute it), every min-tree node is the exact min of
    its positive leaves once read, and every sum node is the sum of its children."""
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer(capacity, sampler=Prioritized(alpha=alpha), seed=0)
    n = min(capacity, 3000)
    keys = np.array(buf.extend({"i": i} for i in range(n)))
    weights = {int(k): 1.0 for k in keys}  # new items: initial_priority**alpha
    newer = np.array(buf.extend({"i": i} for i in range(n // 10)))  # evicts when full
    weights.update({int(k): buf._sampler.max_priority**alpha for k in newer})
    live = set(buf.indices().tolist())
    for size in (256, 3, 1000, 256):
        idx = rng.choice(np.concatenate([keys, newer]), size)  # repeats; stale when evicted
        prios = rng.random(size) * rng.choice([1e-3, 1.0, 1e3], size)
        prios[rng.random(size) < 0.1] = 0.0
        buf.update_priorities(idx, prios)
        for k, w in zip(idx.tolist(), (prios**alpha).tolist()):
            if k in live:
                weights[k] = w  # the last value of a repeated index wins
    order = buf.indices()
    expected = np.array([weights[k] for k in order.tolist()])
    assert np.array_equal(buf.priorities(order), expected)
    tree = buf._sampler.tree
    leaves = np.zeros(len(tree.sums[0]))
    leaves[order % capacity] = expected
    mins = np.full(len(tree.mins[0]), np.inf)
    mins[order % capacity] = np.where(expected > 0, expected, np.inf)
    assert tree.min_positive == mins.min()  # read first, as sample() does: zeros become +inf
    for level in tree.mins:  # node q of n: the min of leaves q, q + n, q + 2n, ...
        assert np.array_equal(level, mins.reshape(-1, len(level)).min(axis=0))
    below = leaves
    for level in tree.sums[1:]:  # BLAS may round a row differently in another batch size
        assert np.allclose(level, below.reshape(len(level), -1).sum(axis=1), rtol=1e-12, atol=0)
        below = level
    buf.close()


@pytest.mark.parametrize(
    "bad, match",
    [
        (-1e-300, ">= 0"),
        (-np.inf, "finite"),
        (np.nan, "finite"),
        (-np.nan, "finite"),
        (np.inf, "finite"),
    ],
)
def test_a_bad_priority_among_ones_below_the_max_is_refused_and_changes_nothing(bad, match):
    """Batches below the running max take a one-compare check; one bad value among them is
    refused with the same typed error as always, and nothing changes."""
    buf = ReplayBuffer(300, sampler=Prioritized(alpha=0.6), seed=0)
    keys = np.array(buf.extend({"i": i} for i in range(300)))
    buf.update_priorities(keys[:1], [1e6])  # the running max: the batch below stays under it
    before = buf.priorities(keys).copy()
    prios = np.full(256, 0.5)
    prios[100] = bad
    with pytest.raises(ConfigError, match=match):
        buf.update_priorities(keys[:256], prios)
    assert np.array_equal(buf.priorities(keys), before)
    assert buf._sampler.max_priority == 1e6
    prios[100], prios[101] = -0.0, 5e-324  # valid: weight 0 (never drawn) and a subnormal
    buf.update_priorities(keys[:256], prios)
    assert np.array_equal(buf.priorities(keys[:256]), prios**0.6)
    assert buf._sampler.tree.min_positive == 5e-324**0.6
    assert 100 not in buf.sample(4096).indices
    buf.close()


def _python_lines(call) -> int:
    """Python lines ``call()`` runs (a per-item loop would make this grow with the batch)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_update_priorities_has_no_per_item_python_loop():
    """Structural, not timed: the Python lines an update runs do not grow with the batch (every
    tree level is one vectorised step), from validation to the last tree level."""

    buf = ReplayBuffer(200_000, sampler=Prioritized(alpha=0.6), seed=0)
    keys = buf.extend([{"x": np.int64(i)} for i in range(8192)])
    assert len(buf._sampler.tree.mins) == 3 and buf._sampler.tree.depth == 2
    buf.update_priorities(keys, np.full(len(keys), 0.5))  # applies the queued adds first

    def lines(n: int) -> int:
        prios = np.random.default_rng(n).random(n) * 0.5 + 0.01  # below the max: same branches
        return _python_lines(lambda: buf.update_priorities(keys[:n], prios))

    assert lines(256) == lines(8192) == lines(256)
    assert lines(256) < 150


def test_stale_and_unknown_updates_have_no_per_item_python_loop():
    """Structural, not timed: with stale indices in the batch (the slow path: issued-index
    lookup, stale count) the Python lines an update runs do not grow with the batch either."""

    buf = ReplayBuffer(4096, sampler=Prioritized(alpha=0.6), seed=0)
    old = buf.extend([{"x": np.int64(i)} for i in range(4096)])
    new = buf.extend([{"x": np.int64(i)} for i in range(2048)])  # old[:2048] are now stale
    buf.update_priorities(new, np.full(len(new), 0.5))  # applies the queued adds first

    def lines(n: int) -> int:
        keys = np.concatenate([old[: n // 2], new[: n // 2]])
        return _python_lines(lambda: buf.update_priorities(keys, np.full(n, 0.5)))

    assert lines(64) == lines(2048) == lines(64)
    assert buf.stats["stale_updates"] == 32 + 1024 + 32
    with pytest.raises(KeyError, match="never returned by add"):
        buf.update_priorities(np.array([new[0], -5]), [1.0, 1.0])
    buf.close()


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 7.0])
def test_the_priority_limit_is_exact_on_both_sides(alpha):
    """update_priorities refuses a priority just past (1e290)**(1/alpha), and takes one just
    below it, whatever shortcut the check takes for small priorities."""
    limit = math.exp(math.log(1e290) / alpha)
    buf = ReplayBuffer(4, sampler=Prioritized(alpha=alpha), seed=0)
    keys = [buf.add({"i": i}) for i in range(4)]
    with pytest.raises(ConfigError, match="at most"):
        buf.update_priorities(keys[:1], [limit * (1 + 1e-9)])
    buf.update_priorities(keys[:1], [limit * (1 - 1e-9)])
    buf.update_priorities(keys, [0.5, 1.0, 2.0, 1e3])  # far below: the shortcut
    assert np.isfinite(buf._sampler.tree.total)
    buf.close()


def test_prioritized_draws_match_priorities_chi_square():
    n = 40
    buf = ReplayBuffer(n, host_budget="1MiB", sampler=Prioritized(alpha=0.7, beta=0.5), seed=123)
    idx = buf.extend([np.int64(i) for i in range(n)])
    prios = np.linspace(0.05, 3.0, n) ** 1.5
    prios[7] = 0.0  # never drawn
    buf.update_priorities(idx, prios)
    draws = np.concatenate([buf.sample(256).indices for _ in range(400)])
    counts = np.bincount(np.searchsorted(idx, draws), minlength=n)
    p = prios**0.7 / (prios**0.7).sum()
    assert counts[7] == 0
    live = p > 0
    expected = p[live] * len(draws)
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    assert stat < chi2_critical(int(live.sum()) - 1), stat
    # and the wrong exponent is detectably wrong: the test can fail
    p1 = prios / prios.sum()
    wrong = ((counts[live] - p1[live] * len(draws)) ** 2 / (p1[live] * len(draws))).sum()
    assert wrong > chi2_critical(int(live.sum()) - 1)
    buf.close()


def test_uniform_draws_are_uniform_chi_square():
    n = 30
    buf = ReplayBuffer(n, host_budget="1MiB", seed=5)
    idx = buf.extend([np.int64(i) for i in range(n)])
    del buf[int(idx[3])]
    draws = np.concatenate([buf.sample(200).indices for _ in range(150)])
    assert int(idx[3]) not in set(draws.tolist())
    counts = np.array([(draws == k).sum() for k in np.delete(idx, 3)])
    expected = len(draws) / (n - 1)
    stat = ((counts - expected) ** 2 / expected).sum()
    assert stat < chi2_critical(n - 2)
    assert (buf.sample(10).weights == 1).all()
    buf.close()


def test_importance_weights_match_formula():
    alpha, beta = 0.6, 0.4
    buf = ReplayBuffer(16, sampler=Prioritized(alpha=alpha, beta=beta), seed=0)
    idx = buf.extend([np.float32(i) for i in range(10)])
    prios = np.arange(1, 11, dtype=np.float64)
    buf.update_priorities(idx, prios)
    batch = buf.sample(64)
    p = prios**alpha / (prios**alpha).sum()
    n = len(prios)
    w = (n * p) ** (-beta)
    w /= w.max()
    expected = w[np.searchsorted(idx, batch.indices)]
    np.testing.assert_allclose(batch.weights, expected, rtol=1e-6)
    buf.close()


def test_beta_anneals_linearly_to_final():
    buf = ReplayBuffer(8, sampler=Prioritized(beta=0.4, beta_final=1.0, beta_steps=10), seed=0)
    buf.extend([np.float32(i) for i in range(4)])
    assert buf.beta == pytest.approx(0.4)
    for _ in range(5):
        buf.sample(2)
    assert buf.beta == pytest.approx(0.7)
    for _ in range(20):
        buf.sample(2)
    assert buf.beta == pytest.approx(1.0)
    buf.close()


def test_new_items_get_running_max_priority():
    buf = ReplayBuffer(8, sampler=Prioritized(alpha=1.0), seed=0)
    a = buf.add(np.float32(0))
    buf.update_priorities([a], [5.0])
    b = buf.add(np.float32(1))
    assert buf.priorities([b])[0] == pytest.approx(5.0)
    buf.update_priorities([a], [0.5])  # max stays the largest ever seen
    c = buf.add(np.float32(2))
    assert buf.priorities([c])[0] == pytest.approx(5.0)
    buf.close()


@pytest.mark.parametrize(
    "kwargs", [{"alpha": -1}, {"beta": float("nan")}, {"beta_steps": -2}, {"initial_priority": 0}]
)
def test_bad_sampler_settings(kwargs):
    with pytest.raises(ConfigError):
        Prioritized(**kwargs)


def test_priorities_whose_weight_sum_would_overflow_are_refused():
    """Two finite priorities of 1e308 (alpha=1) made the tree total inf: one of two equal items
    was never drawn and every weight was 0. Refused now, naming the limit, nothing changed."""
    buf = ReplayBuffer(10, sampler=Prioritized(alpha=1.0), seed=0)
    keys = [buf.add({"i": i}) for i in range(10)]  # full: every slot counts in the sum
    before = buf.priorities(keys).copy()
    with pytest.raises(ConfigError, match=r"at most 1e\+290 with alpha=1.0.*got 1e\+308"):
        buf.update_priorities(keys[:2], [1e308, 1e308])
    np.testing.assert_array_equal(buf.priorities(keys), before)
    # at the limit the total stays finite and the sampler stays correct
    buf.update_priorities(keys, np.full(10, 1e290))
    buf.update_priorities(keys[:2], [1e290, 1e290])
    buf.update_priorities(keys[2:], np.full(8, 1e289))
    assert np.isfinite(buf._sampler.tree.total)
    batch = buf.sample(2800)
    counts = np.bincount(batch.items["i"], minlength=10)
    expected = np.array([1e290, 1e290] + [1e289] * 8) / 2.8e290 * 2800
    assert ((counts - expected) ** 2 / expected).sum() < chi2_critical(9)
    np.testing.assert_allclose(batch.weights[batch.items["i"] < 2], 10.0**-0.4, rtol=1e-6)
    assert buf._sampler.max_priority == 1e290  # new items get a weight that still sums finitely
    buf.close()


def test_the_priority_limit_follows_alpha():
    buf = ReplayBuffer(4, sampler=Prioritized(alpha=0.5), seed=0)
    keys = [buf.add({"i": i}) for i in range(4)]
    buf.update_priorities(keys, np.full(4, 1e308))  # p**0.5 = 1e154: fine
    assert np.isfinite(buf._sampler.tree.total)
    assert set(buf.sample(64).indices.tolist()) == set(keys)
    buf.close()
    with pytest.raises(ConfigError, match="initial_priority must be at most"):
        Prioritized(alpha=2.0, initial_priority=1e200)
    Prioritized(alpha=0.0, initial_priority=1e308)  # every weight is 1


def test_torch_float64_priorities_are_used_as_given_like_numpy_ones():
    """A float64 tensor of |td_error| was cast to float32: 1e-300 became 0 (never drawn again),
    1e50 became inf (refused as "NaN or inf") and every value lost half its digits."""
    import torch

    prios = np.array([0.1234567890123, 1e-300, 1e50, 3.0])
    bufs = [ReplayBuffer(8, sampler=Prioritized(alpha=0.6), seed=0) for _ in range(3)]
    for buf in bufs:
        buf.extend([np.float32(i) for i in range(4)])
    idx = bufs[0].indices()
    bufs[0].update_priorities(idx, prios)
    bufs[1].update_priorities(torch.from_numpy(idx), torch.from_numpy(prios))
    np.testing.assert_array_equal(bufs[1].priorities(idx), prios**0.6)
    np.testing.assert_array_equal(bufs[1].priorities(idx), bufs[0].priorities(idx))
    half = torch.tensor([0.5, 0.25, 2.0, 1.0], dtype=torch.bfloat16)  # still accepted
    bufs[2].update_priorities(idx, half)
    np.testing.assert_array_equal(bufs[2].priorities(idx), np.array([0.5, 0.25, 2, 1]) ** 0.6)
    for buf in bufs:
        buf.close()


@pytest.mark.parametrize("seq", [False, True])
def test_importance_weights_of_priorities_spanning_more_than_308_decades(seq):
    """(p_i / p_min) ** -beta overflowed to inf in float64 (with a RuntimeWarning), so the
    weight came out 0 even where beta is small enough for it to be ~1e-3."""
    beta = 0.01
    buf = ReplayBuffer(4, sampler=Prioritized(alpha=1.0, beta=beta), seed=0)
    idx = buf.extend([np.float32(i) for i in range(2)], episode=0, step=[0, 1])
    buf.update_priorities(idx, [1e-300, 1e10])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = buf.sample(64, max_staleness=None, seq_len=1) if seq else buf.sample(64)
    indices = b.indices.reshape(-1)
    assert set(indices.tolist()) == {int(idx[1])}  # 1e-300 is drawn with probability 1e-310
    expected = np.float32(10.0 ** (-310 * beta))  # (1e10 / 1e-300) ** -0.01
    np.testing.assert_allclose(b.weights, expected, rtol=1e-6)
    buf.close()


def test_one_index_takes_one_scalar_priority_and_a_batch_still_needs_one_each():
    """``update_priorities(i, p)`` (TorchRL's ``update_priority(index, priority)``) was refused
    with "got shape () for 1 indices (flatten with .reshape(-1))", a fix that does not apply."""
    import torch

    buf = ReplayBuffer(8, sampler=Prioritized(alpha=1.0), seed=0)
    k = buf.extend([np.float32(i) for i in range(3)])
    buf.update_priorities(int(k[0]), 0.5)
    buf.update_priorities(k[1], np.float32(0.25))  # a numpy int index
    buf.update_priorities(torch.tensor(k[2]), torch.tensor(0.125, dtype=torch.float64))
    np.testing.assert_array_equal(buf.priorities(k), [0.5, 0.25, 0.125])
    with pytest.raises(ConfigError, match="one value per index"):
        buf.update_priorities(k, 0.5)  # a mean loss for a batch is a mistake, not a broadcast
    np.testing.assert_array_equal(buf.priorities(k), [0.5, 0.25, 0.125])
    buf.close()
