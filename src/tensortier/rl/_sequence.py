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

from typing import Any

import numpy as np

from tensortier.rl.sampler import is_weights

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
    return pos, is_weights(weights[pos], float(weights[weights > 0].min()), beta)


def draw_slices(
    slots: np.ndarray,
    episode: np.ndarray,
    step: np.ndarray,
    prio: np.ndarray | None,
    alpha: float,
    n: int,
    seq_len: int,
    pad: bool,
    eta: float,
    rng: np.random.Generator,
    beta: float | None,
    fresh: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` slices of ``seq_len`` steps among the items in ``slots`` (``prio``: their sampling
    weights p**alpha, aligned with ``slots``, or None for uniform sampling): the drawn slots
    (n, seq_len), the slices' importance weights and the mask of real (unpadded) steps.

    ``episode`` and ``step`` are indexed by slot (-1: not given; such items are never drawn).
    IndexError when no slice can be drawn (``fresh``: ``slots`` were filtered by staleness)."""
    keep = (episode[slots] >= 0) & (step[slots] >= 0)
    slots = slots[keep]
    order, left = runs(episode[slots], step[slots])
    slots = slots[order]
    starts = np.arange(len(slots)) if pad else np.flatnonzero(left >= seq_len)
    if not len(starts):
        raise IndexError(
            f"cannot sample slices of seq_len={seq_len}: no episode has {seq_len} "
            f"consecutive steps in the buffer ({len(slots)} items with episode and "
            f"step{' and fresh enough' if fresh else ''}); add "
            f"longer episodes, lower seq_len or pass pad=True"
        )
    if prio is not None:
        raw = prio[keep][order]
        if alpha > 0:
            raw = raw ** (1.0 / alpha)
        sp = slice_priorities(raw, left, starts, seq_len, eta)
        w = sp**alpha if alpha != 1 else sp
    else:
        w = np.ones(len(starts))
    pos, weights = draw(w, n, rng, beta)
    first = starts[pos]
    steps = np.arange(seq_len)
    mask = steps[None, :] < left[first][:, None]
    offs = np.minimum(steps[None, :], left[first][:, None] - 1)
    return slots[first[:, None] + offs], weights, mask


def fold(items: Any, collated: bool, n: int, seq_len: int) -> Any:
    """Decoded items of ``n * seq_len`` drawn slots as ``n`` slices: stacked fields (and a
    stacked array) as (n, seq_len, ...), lists (bytes fields, uncollated items) as n lists."""
    if collated and isinstance(items, dict):
        return {k: _fold(v, n, seq_len) for k, v in items.items()}
    if collated:
        return _fold(items, n, seq_len)
    return [items[i * seq_len : (i + 1) * seq_len] for i in range(n)]


def _fold(v: Any, n: int, seq_len: int) -> Any:
    if isinstance(v, list):
        return [v[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    return v.reshape(n, seq_len, *v.shape[1:])
