"""Epoch orders: permutations, equal rank splits (pad/drop), block locality, determinism."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.data._order import Order, OrderSpec, permute


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 5000), key=st.integers(0, 2**64 - 1))
def test_permute_is_a_bijection_of_range_n(n, key):
    p = permute(np.arange(n), n, key)
    assert np.array_equal(np.sort(p), np.arange(n))


def test_permute_depends_on_the_key_and_shuffles():
    n = 10_000
    a, b = permute(np.arange(n), n, 1), permute(np.arange(n), n, 2)
    assert not np.array_equal(a, b)
    # a shuffle: most records move far, position and record are uncorrelated
    assert np.mean(np.abs(a - np.arange(n)) > n // 10) > 0.7
    assert abs(np.corrcoef(a, np.arange(n))[0, 1]) < 0.05
    # any position on its own gives the same record as the whole array
    assert np.array_equal(permute(np.array([5, 9999, 0]), n, 1), a[[5, 9999, 0]])


def epoch(spec: OrderSpec, e: int) -> list[np.ndarray]:
    return [Order(spec, e, r).indices(0, spec.per_rank) for r in range(spec.world_size)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    world=st.integers(1, 9),
    shuffle=st.sampled_from(["full", "block", "none"]),
    block=st.integers(1, 40),
    window=st.integers(1, 5),
    seed=st.integers(0, 100),
)
def test_rank_splits_are_equal_and_cover_the_epoch(n, world, shuffle, block, window, seed):
    pad = OrderSpec(n, seed, shuffle, block, window, world, "pad")
    parts = epoch(pad, 3)
    assert {len(p) for p in parts} == {-(-n // world)}  # exactly equal counts
    flat = np.concatenate(parts)
    assert set(flat.tolist()) == set(range(n))  # every record, the padding repeats a few
    assert len(flat) - n == (-n) % world
    if n >= world:
        drop = OrderSpec(n, seed, shuffle, block, window, world, "drop")
        parts = epoch(drop, 3)
        assert {len(p) for p in parts} == {n // world}
        flat = np.concatenate(parts)
        assert len(np.unique(flat)) == len(flat) == n // world * world  # disjoint


def test_orders_are_deterministic_and_change_every_epoch():
    spec = OrderSpec(5000, 7, "full", 10, 4, 2, "pad")
    assert np.array_equal(Order(spec, 0, 1).indices(0, 2500), Order(spec, 0, 1).indices(0, 2500))
    assert not np.array_equal(
        Order(spec, 0, 1).indices(0, 2500), Order(spec, 1, 1).indices(0, 2500)
    )
    # a stream can be computed in pieces: resuming needs no state but the position
    o = Order(spec, 4, 0)
    assert np.array_equal(
        np.concatenate([o.indices(0, 1000), o.indices(1000, 2500)]), o.indices(0, 2500)
    )
    dropped = [
        Order(OrderSpec(1001, 7, "full", 1, 1, 2, "drop"), e, 0).indices(0, 500) for e in range(4)
    ]
    assert len({frozenset(range(1001)) - frozenset(d.tolist()) for d in dropped}) > 1


@pytest.mark.parametrize("n,block,window", [(10_000, 25, 4), (997, 10, 3), (64, 64, 1)])
def test_block_shuffle_reads_a_few_blocks_per_window(n, block, window):
    spec = OrderSpec(n, 1, "block", block, window, 1, "pad")
    o = Order(spec, 0, 0)
    idx = o.indices(0, n)
    wins = o.windows(0, n)
    assert np.array_equal(np.sort(idx), np.arange(n))
    for w in np.unique(wins):
        blocks = np.unique(idx[wins == w] // block)
        assert len(blocks) <= window  # a window is `window` runs of neighbours
        # and every record of those blocks is in the window
        assert sum(min(n, (b + 1) * block) - b * block for b in blocks) == int((wins == w).sum())
    # records inside a window are shuffled, not in file order
    first = idx[wins == wins[0]]
    if len(first) > 5:
        assert not np.array_equal(first, np.sort(first))
