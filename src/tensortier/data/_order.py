"""Epoch orders: which record each position of each rank's stream reads, from a seed alone.

Permutation. A keyed Feistel network on the next even power of two above ``n``, walked until it
lands in ``[0, n)`` ("cycle walking"), is a bijection of ``[0, n)`` that maps any position to its
record in O(1) time and memory. So an order never materialises 10M indices, a resumed epoch
starts at its position directly, and the same seed gives the same order on every machine and
numpy version (only integer arithmetic of our own; no generator whose stream numpy may change).

Modes. ``full``: every record anywhere. ``block``: the catalog is cut into blocks of ``block``
consecutive records; blocks are permuted, consecutive groups of ``window`` permuted blocks form a
window, and records are shuffled within their window. A window is read as ``window`` large
sequential reads; a batch mixes records of several distant places. ``none``: index order.

Ranks. Each of ``world_size`` ranks gets the same count: ``even="drop"`` takes ``n // world_size``
each (the last ``n % world_size`` positions of the epoch's order are skipped: different records
each epoch); ``even="pad"`` takes ``ceil(n / world_size)`` each, the positions past ``n`` wrapping
to the start of the order (a few records read twice per epoch). Never resampled. Rank ``r`` gets
the contiguous positions ``[r * k, (r + 1) * k)`` of the global order, which keeps block locality.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHUFFLES = ("full", "block", "none")
EVENS = ("pad", "drop")
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-distributed 64-bit hash (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int) -> int:
    """A 64-bit key from integers (seed, epoch, salt...)."""
    h = np.array([0x9E3779B97F4A7C15], np.uint64)
    for p in parts:
        h = _mix(h ^ np.array([p & _MASK64], np.uint64))
    return int(h[0])


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    sh = np.uint64(half)
    left, right = x >> sh, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << sh) | right


def permute(pos: np.ndarray, n: int, key: int) -> np.ndarray:
    """Where a keyed pseudo-random permutation of ``[0, n)`` sends each of ``pos`` (int64)."""
    pos = np.asarray(pos, np.int64)
    if n <= 1:
        return pos.copy()
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    keys = _mix(np.array([key], np.uint64) + np.arange(1, 5, dtype=np.uint64))
    y = _feistel(pos.astype(np.uint64), bits // 2, keys)
    out = y >= n
    while out.any():  # cycle walking: apply again until inside [0, n) (a permutation: it ends)
        y[out] = _feistel(y[out], bits // 2, keys)
        out = y >= n
    return y.astype(np.int64)


@dataclass(frozen=True)
class OrderSpec:
    """Everything that decides an epoch's order (and must match to resume a saved position)."""

    n: int
    seed: int
    shuffle: str
    block: int
    window: int
    world_size: int
    even: str

    @property
    def per_rank(self) -> int:
        if self.even == "drop":
            return self.n // self.world_size
        return -(-self.n // self.world_size)


class Order:
    """One rank's order of one epoch: :meth:`indices` maps stream positions to record indices."""

    def __init__(self, spec: OrderSpec, epoch: int, rank: int):
        self.spec, self.epoch, self.rank = spec, epoch, rank
        self.length = spec.per_rank
        self._key = derive_key(spec.seed, epoch, 0x5EED)
        if spec.shuffle == "block" and spec.n:
            nb = -(-spec.n // spec.block)
            self._blocks = permute(np.arange(nb), nb, derive_key(spec.seed, epoch, 0xB10C))
            sizes = np.full(nb, spec.block, np.int64)
            sizes[self._blocks == nb - 1] = spec.n - (nb - 1) * spec.block  # the short last block
            per_window = np.add.reduceat(sizes, np.arange(0, nb, spec.window))
            self._wstart = np.concatenate([[0], np.cumsum(per_window)])
            self._bsizes = sizes

    def _global(self, a: int, b: int) -> np.ndarray:
        """Global order positions of this rank's stream positions ``[a, b)`` (pad wraps)."""
        p = self.rank * self.length + np.arange(a, b, dtype=np.int64)
        return p % self.spec.n if self.spec.n else p

    def windows(self, a: int, b: int) -> np.ndarray | None:
        """Window of each position in ``[a, b)`` (block mode; None otherwise)."""
        if self.spec.shuffle != "block":
            return None
        return np.searchsorted(self._wstart, self._global(a, b), side="right") - 1

    def indices(self, a: int, b: int) -> np.ndarray:
        """Record indices at this rank's stream positions ``[a, b)``."""
        g = self._global(a, b)
        mode = self.spec.shuffle
        if mode == "none" or self.spec.n <= 1:
            return g
        if mode == "full":
            return permute(g, self.spec.n, self._key)
        w = np.searchsorted(self._wstart, g, side="right") - 1
        out = np.empty(len(g), np.int64)
        bs, win = self.spec.block, self.spec.window
        for wid in np.unique(w).tolist():
            sel = np.flatnonzero(w == wid)
            blocks = self._blocks[wid * win : (wid + 1) * win]
            sizes = self._bsizes[wid * win : (wid + 1) * win]
            records = np.concatenate([np.arange(b * bs, b * bs + s) for b, s in zip(blocks, sizes)])
            local = permute(g[sel] - self._wstart[wid], len(records), self._key ^ (wid + 1))
            out[sel] = records[local]
        return out
