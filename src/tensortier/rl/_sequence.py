"""Slices of consecutive steps and staleness filters for ``ReplayBuffer.sample`` (numpy only).

Items may carry ``episode``, ``step`` and ``version`` (ints >= 0; -1 when not given). A *run* is a
maximal set of live items of one episode with consecutive steps; a slice of ``seq_len`` T starts at
any item and takes the next T steps of its run, so it never crosses an episode end (nor a gap left
by an evicted, deleted or never added step). ``pad=False``: only starts with at least T steps left
in their run are drawn (episodes shorter than T in the buffer are never drawn). ``pad=True``: any
item may start a slice; positions past its run's last step repeat that step's index and have
``mask`` False.

Priorities (R2D2, Kapturowski et al. 2019): a slice's priority is ``eta * max(p) + (1 - eta) *
mean(p)`` over the raw priorities ``p`` of its real (unpadded) steps, and it is drawn with
probability proportional to that priority ** alpha; importance weights are ``(P / P_min) **
-beta`` over the slices that can be drawn, as for single items. Uniform buffers draw every valid
start with equal probability and weights 1.

Cost: O(live items * log) per call (a sort by episode and step, and a window over the priorities):
the same order as TorchRL's ``SliceSampler`` without its cache. Nothing here holds state.
"""

from __future__ import annotations

import numpy as np

_BLOCK = 8192  # rows of the (starts, seq_len) window processed at once (bounded memory)


def runs(episode: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, left): positions sorted by (episode, step), and for each sorted position the number
    of steps from it to the end of its run (1 for a run's last step)."""
    order = np.lexsort((step, episode))
    ep, st = episode[order], step[order]
    m = len(order)
    if m == 0:
        return order, np.empty(0, np.int64)
    brk = np.ones(m, bool)  # True where a new run starts
    brk[1:] = (ep[1:] != ep[:-1]) | (st[1:] != st[:-1] + 1)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], m)  # exclusive end of each run
    run_of = np.cumsum(brk) - 1
    left = ends[run_of] - np.arange(m)
    return order, left


def slice_priorities(
    prio: np.ndarray, left: np.ndarray, starts: np.ndarray, seq_len: int, eta: float
) -> np.ndarray:
    """eta * max + (1 - eta) * mean of ``prio`` (sorted order) over each slice from ``starts``."""
    out = np.empty(len(starts), np.float64)
    padded = np.concatenate([prio, np.zeros(seq_len)])
    cols = np.arange(seq_len)
    for i in range(0, len(starts), _BLOCK):
        s = starts[i : i + _BLOCK]
        win = padded[s[:, None] + cols]  # (block, seq_len)
        n = np.minimum(left[s], seq_len)
        real = cols < n[:, None]
        hi = np.where(real, win, -np.inf).max(axis=1)
        mean = np.where(real, win, 0.0).sum(axis=1) / n
        out[i : i + _BLOCK] = eta * hi + (1 - eta) * mean
    return out


def draw(
    weights: np.ndarray, n: int, rng: np.random.Generator, beta: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` positions drawn with probability proportional to ``weights`` (uniformly when they
    are all 0, or when ``beta`` is None: uniform sampling), and their importance weights."""
    total = float(weights.sum()) if beta is not None else 0.0
    if not total > 0:
        return rng.integers(0, len(weights), n), np.ones(n, np.float32)
    cum = np.cumsum(weights)
    u = (np.arange(n) + rng.random(n)) * (total / n)  # stratified, as the sum tree draws
    pos = np.searchsorted(cum, np.minimum(u, np.nextafter(cum[-1], 0)), "right")
    pos = pos[rng.permutation(n)]
    w = weights[pos] / weights[weights > 0].min()
    return pos, (w ** (-beta)).astype(np.float32)
