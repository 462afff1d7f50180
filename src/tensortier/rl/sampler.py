"""How a replay buffer picks items: uniformly, or proportionally to priority (PER, Schaul et al. 2016).

Both samplers index *slots* of the store (see ``_store.py``) and are vectorised: one call handles a
whole batch of adds, removals, draws or priority updates with numpy, never a per-item Python loop
on the hot path. Configs are dataclasses (``Uniform()``, ``Prioritized(alpha, beta)``); the state
they build lives in the buffer and is saved with it as plain numpy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import numpy as np

from tensortier._units import check_int
from tensortier.errors import ConfigError

# Largest sampling weight p**alpha of one item: the sum over 10**17 of them stays below float64's
# largest value (1.8e308), so the sum-tree total of any buffer, and of all shards together, is
# finite. Past it the total is inf and sampling silently picks one item with weight 0.
LEAF_MAX = 1e290

# called directly: ndarray.min goes through a Python wrapper (~0.1 us a call)
_min_reduce = np.minimum.reduce
_count_nonzero = np.count_nonzero
_F64 = np.dtype(np.float64)


def check_priority(top: float, alpha: float, what: str = "priorities") -> None:
    """ConfigError when priority ``top`` (finite, >= 0) has a weight ``top**alpha`` above
    :data:`LEAF_MAX` (computed in logs: the power itself may overflow)."""
    if top > 0 and alpha * math.log(top) > math.log(LEAF_MAX):
        limit = math.exp(math.log(LEAF_MAX) / alpha)
        raise ConfigError(
            f"{what} must be at most {limit:.3g} with alpha={alpha} (p**alpha up to "
            f"{LEAF_MAX:g}, so the sum over the buffer stays finite); got {top:.3g}: scale them "
            f"down (|td_error| rarely needs more than 1e6)"
        )


def is_weights(leaves: np.ndarray, low: float, beta: float) -> np.ndarray:
    """Importance weights ``(leaves / low) ** -beta`` (float32) of drawn leaves ``>= low > 0``.

    Computed as ``(low / leaves) ** beta``: the ratio is at most 1, so it cannot overflow (leaves
    spanning more than 308 decades made ``leaves / low`` inf, and the weight 0 whatever ``beta``);
    where it underflows towards 0 the weights are computed in logs."""
    r = low / leaves
    if _min_reduce(r) > 1e-300:
        return (r**beta).astype(np.float32)
    return np.exp(beta * (math.log(low) - np.log(leaves))).astype(np.float32)


@dataclass(frozen=True)
class Uniform:
    """Every stored item is equally likely; importance weights are all 1."""

    def to_dict(self) -> dict:
        return {"kind": "uniform"}


@dataclass(frozen=True)
class Prioritized:
    """Proportional prioritized replay: P(i) = p_i^alpha / sum_k p_k^alpha.

    Importance weights are w_i = (N P(i))^-beta / max_j w_j = (p_i / p_min)^(-alpha beta).
    ``beta`` rises linearly to ``beta_final`` over ``beta_steps`` calls to ``sample`` when
    ``beta_steps > 0`` (annealing toward 1 removes the bias PER introduces, as in the paper).
    New items get the largest priority seen so far (``initial_priority`` before any update), so
    each is sampled soon after it arrives.
    """

    alpha: float = 0.6
    beta: float = 0.4
    beta_final: float = 1.0
    beta_steps: int = 0
    initial_priority: float = 1.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "beta_final", "initial_priority"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ConfigError(f"Prioritized: {name} must be a number, got {v!r}")
        msg = f"Prioritized: beta_steps must be an int (sample() calls), got {self.beta_steps!r}"
        check_int(self.beta_steps, msg, numpy=True)
        if not (np.isfinite(self.alpha) and self.alpha >= 0):
            raise ConfigError(f"Prioritized: alpha must be >= 0, got {self.alpha}")
        for name in ("beta", "beta_final"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0):
                raise ConfigError(f"Prioritized: {name} must be >= 0, got {v}")
        if self.beta_steps < 0:
            raise ConfigError(f"Prioritized: beta_steps must be >= 0, got {self.beta_steps}")
        if not (np.isfinite(self.initial_priority) and self.initial_priority > 0):
            raise ConfigError(
                f"Prioritized: initial_priority must be > 0, got {self.initial_priority}"
            )
        check_priority(float(self.initial_priority), float(self.alpha), "initial_priority")

    def to_dict(self) -> dict:
        return {"kind": "prioritized", **asdict(self)}


def sampler_from_dict(d: dict) -> Uniform | Prioritized:
    """The sampler config ``to_dict`` wrote; ConfigError for anything else."""
    if not isinstance(d, dict):
        raise ConfigError(f"a sampler config is a dict, got {type(d).__name__}")
    d = dict(d)
    kind = d.pop("kind", None)
    if kind == "uniform":
        return Uniform()
    if kind == "prioritized":
        unknown = set(d) - {f.name for f in fields(Prioritized)}
        if unknown:
            raise ConfigError(f"unknown Prioritized settings {sorted(unknown)}")
        return Prioritized(**d)
    raise ConfigError(f"unknown sampler kind {kind!r}; expected 'uniform' or 'prioritized'")


class SumMinTree:
    """Sum-tree and min-tree over ``capacity`` leaves, each a few numpy calls per level.

    Sum-tree: each node has 32 children (a row of the level below) and the top level holds up to
    1024 nodes that are reduced directly, so a million leaves need two levels of nodes. A batched
    update or descent is then a handful of numpy calls per level (gather a (batch, 32) block of
    children, reduce or cumsum it) instead of twenty levels of a binary tree. Parents are
    recomputed from their children on every update, so sums never drift.

    Min-tree: order does not matter for a min, so node ``q`` of a level with ``n`` nodes has the
    8 children ``q, q + n, ..., q + 7n`` below: they are a column of the level below seen as
    (8, n), and a batch of parents is one ``take`` of a (8, batch) block reduced along axis 0,
    which numpy vectorises (a row-wise min of 8 or 32 is several times slower). Levels stop at
    ``MIN_TOP`` nodes, which ``min_positive`` reduces (once per draw, not per update); their width
    is rounded up to a power of two (extra leaves are +inf), so a parent index is a bitwise and.
    A min does not depend on grouping, so this layout gives the exact min of the leaves.
    """

    B = 32  # set() shifts by 5 instead of dividing by B
    TOP = 1024
    MIN_B = 8
    MIN_TOP = 16384

    def __init__(self, capacity: int):
        depth = 0
        while -(-capacity // self.B**depth) > self.TOP:
            depth += 1
        top = -(-capacity // self.B**depth)
        self.depth = depth
        self.sums = [np.zeros(top * self.B ** (depth - j), np.float64) for j in range(depth + 1)]
        self._sums2d = [a.reshape(-1, self.B) for a in self.sums[:-1]]  # children as rows
        self._ones = np.ones(self.B)
        # sum levels small next to a batch are recomputed whole (one matrix-vector product)
        self._dense_from = next(
            (j for j in range(1, depth + 1) if len(self.sums[j]) <= self.TOP // 4), depth + 1
        )
        levels = 0
        while -(-capacity // self.MIN_B**levels) > self.MIN_TOP:
            levels += 1
        width = -(-capacity // self.MIN_B**levels)
        if levels:  # a power of two, so a node's index is ``slot & (width - 1)``, not a division
            width = 1 << (width - 1).bit_length()
        # leaves are +inf where the sum-tree has 0 (never drawn), so they never win a min (a 0
        # that set(zeros_later=True) wrote stays until min_positive next reads the tree)
        self.mins = [np.full(width * self.MIN_B ** (levels - j), np.inf) for j in range(levels + 1)]
        self._mins2d = [a.reshape(self.MIN_B, -1) for a in self.mins[:-1]]  # children as columns
        # what set() walks, bound once: (children as rows, parents) per gathered sum level, the
        # same for the dense ones, (children as columns, parents, width - 1) per min level
        dense = self._dense_from
        self._sparse_levels = [(self._sums2d[j - 1], self.sums[j]) for j in range(1, dense)]
        self._dense_levels = [(self._sums2d[j - 1], self.sums[j]) for j in range(dense, depth + 1)]
        self._min_levels = [
            (self._mins2d[j - 1], self.mins[j], len(self.mins[j]) - 1) for j in range(1, levels + 1)
        ]

    @property
    def total(self) -> float:
        return float(self.sums[-1].sum())

    @property
    def min_positive(self) -> float:
        """The smallest positive leaf (+inf when none is positive)."""
        low = float(self.mins[-1].min())
        if low == 0:  # set(zeros_later=True) wrote a zero leaf as it was: map it now
            self._zero_mins_to_inf()
            low = float(self.mins[-1].min())
        return low

    def _zero_mins_to_inf(self) -> None:
        """Min-tree leaves that are 0 become +inf and their ancestors are recomputed. Only
        the branches under a zero node are visited: a node is 0 exactly when a leaf below is."""
        nodes = np.flatnonzero(self.mins[-1] == 0)
        for j in range(len(self.mins) - 2, -1, -1):  # children of q: q + k * width, k < MIN_B
            width = len(self.mins[j + 1])
            below = (nodes + width * np.arange(self.MIN_B)[:, None]).ravel()
            nodes = below[self.mins[j][below] == 0]
        self.mins[0][nodes] = np.inf
        self._min_parents(nodes)

    def _min_parents(self, slots: np.ndarray) -> None:
        """Recompute the min-tree ancestors of leaves ``slots``, one vectorised step a level."""
        q = slots
        for children, parents, mask in self._min_levels:
            q = q & mask  # % width: widths are powers of two
            parents[q] = _min_reduce(children.take(q, 1), 0)

    def leaves(self, slots: np.ndarray) -> np.ndarray:
        return self.sums[0][slots]

    def set(self, slots: np.ndarray, values: np.ndarray, zeros_later: bool = False) -> None:
        """Set leaves (values >= 0; 0 means never drawn) and recompute their ancestors.

        ``zeros_later``: write ``values`` to the min-tree as they are, without a pass that maps
        zeros to +inf; ``min_positive`` maps any zero it finds (rare: a priority of 0) instead.
        Each level is one vectorised step over the whole batch, never a per-item loop.
        """
        n = len(slots)
        if n == 0:
            return
        if type(values) is not np.ndarray or values.dtype is not _F64:  # (a singleton)
            values = np.asarray(values, np.float64)
        if n <= 4:  # single adds: slices beat fancy indexing
            self._set_few(slots.tolist(), values.tolist())
            return
        # numpy assigns repeated indices in order, so the last value of a repeated slot wins;
        # repeated parents are recomputed twice from the same children, which is harmless
        self.sums[0][slots] = values
        p = slots
        ones = self._ones
        # methods, not np.take/np.matmul: their Python wrappers cost ~0.5 us a call; dot and
        # matmul both run BLAS dgemv here, so the sums are bit for bit the same
        for children, parents in self._sparse_levels:
            p = p >> 5  # // B (slots are >= 0): a shift costs half an integer division
            parents[p] = children.take(p, 0).dot(ones)
        for children, parents in self._dense_levels:
            children.dot(ones, parents)
        self.mins[0][slots] = values if zeros_later else np.where(values > 0, values, np.inf)
        self._min_parents(slots)

    def _set_few(self, slots: list[int], values: list[float]) -> None:
        B = self.B
        for slot, v in zip(slots, values):
            self.sums[0][slot] = v
            p = slot // B
            for j in range(1, self.depth + 1):
                self.sums[j][p] = self.sums[j - 1][p * B : p * B + B].sum()
                p //= B
            self.mins[0][slot] = v if v > 0 else np.inf
            q = slot
            for j in range(1, len(self.mins)):
                n = len(self.mins[j])
                q %= n
                self.mins[j][q] = self.mins[j - 1][q::n].min()

    @staticmethod
    def _pick(children: np.ndarray, cum: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Index of the child whose cumulative range holds u (in place: u becomes the offset)."""
        c = (cum <= u[:, None]).sum(axis=1) if cum.ndim == 2 else np.searchsorted(cum, u, "right")
        width = children.shape[-1]
        over = c >= width  # rounding left u at or past the end: take the last non-empty child
        if over.any():
            ch = (
                children[over]
                if children.ndim == 2
                else np.broadcast_to(children, (int(over.sum()), width))
            )
            cu = cum[over] if cum.ndim == 2 else np.broadcast_to(cum, ch.shape)
            last = width - 1 - np.argmax(ch[:, ::-1] > 0, axis=1)
            c[over] = last
            rows = np.arange(len(last))
            u[over] = cu[rows, last] - 0.5 * ch[rows, last]  # the middle of that child
        below = np.maximum(c - 1, 0)
        prev = cum[np.arange(len(u)), below] if cum.ndim == 2 else cum[below]
        u -= np.where(c > 0, prev, 0.0)
        return c

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf slots holding cumulative ``mass`` (vectorised descent); never a zero leaf."""
        u = mass.astype(np.float64, copy=True)
        top = self.sums[-1]
        node = self._pick(top, np.cumsum(top), u)
        for j in range(self.depth - 1, -1, -1):
            children = self._sums2d[j][node]
            node = node * self.B + self._pick(children, np.cumsum(children, axis=1), u)
        return node


class UniformState:
    """Live slots kept dense (swap-remove), so a uniform draw is one random integer per item."""

    def __init__(self, capacity: int, cfg: Uniform):
        self.cfg = cfg
        self.live = np.empty(capacity, np.int64)
        self.pos = np.full(capacity, -1, np.int64)
        self.n = 0

    def add(self, slots: np.ndarray, leaves: np.ndarray | None = None) -> None:
        k = len(slots)
        self.live[self.n : self.n + k] = slots
        self.pos[slots] = np.arange(self.n, self.n + k)
        self.n += k

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """Where ``slots`` (all live) sit in the dense draw array: a save keeps that order."""
        return self.pos[slots].copy()

    def add_one(self, slot: int) -> None:
        """:meth:`add` of one slot, in Python scalars."""
        n = self.n
        self.live[n] = slot
        self.pos[slot] = n
        self.n = n + 1

    def remove(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            p = self.pos[s]
            if p < 0:
                continue
            last = self.live[self.n - 1]
            self.live[p] = last
            self.pos[last] = p
            self.pos[s] = -1
            self.n -= 1

    def sample(
        self, n: int, rng: np.random.Generator, live: Callable[[], np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        return self.live[rng.integers(0, self.n, n)], np.ones(n, np.float32)

    def update(
        self,
        slots: np.ndarray,
        priorities: np.ndarray,
        top: float | None = None,
        low: float | None = None,
    ) -> None:
        pass  # uniform sampling ignores priorities

    def check(self, top: float) -> None:
        pass  # any finite priority is fine: they are ignored

    def below_max(self, priorities: np.ndarray) -> bool:
        return False  # no max is kept: update_priorities validates the priorities in full

    def update_below_max(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        pass  # never called (below_max is False)

    def leaves(self, slots: np.ndarray) -> np.ndarray:
        return np.ones(len(slots))

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class PrioritizedState:
    """Priorities in a :class:`SumMinTree`.

    Adds and removals are queued (slot, leaf) and applied in one vectorised ``set`` before
    anything reads the tree (``tree`` flushes), so a stream of single adds costs a list append
    each instead of a tree walk each; the queue is applied in order (a later entry for a slot
    wins) and never holds more than ``_PENDING`` entries.
    """

    _PENDING = 4096

    def __init__(self, capacity: int, cfg: Prioritized):
        self.cfg = cfg
        self._alpha = cfg.alpha
        self._tree = SumMinTree(capacity)
        self._pend_slots: list[int] = []
        self._pend_leaves: list[float] = []
        self.max_priority = cfg.initial_priority
        self.samples = 0  # sample() calls, for beta annealing
        # priorities up to this are certainly within check_priority's limit (a factor e below
        # it, far past rounding), so check() skips the logarithms for them
        limit_log = math.log(LEAF_MAX) / cfg.alpha if cfg.alpha > 0 else math.inf
        self._safe_top = math.exp(min(limit_log, 709.0) - 1.0)

    @property
    def max_priority(self) -> float:
        return self._max_priority

    @max_priority.setter
    def max_priority(self, value: float) -> None:
        self._max_priority = value
        self._new_leaf = float(value) ** self._alpha  # the leaf of a new item
        self._max_bits = np.float64(value).view(np.uint64)  # for below_max

    @property
    def tree(self) -> SumMinTree:
        """The tree with every queued add and removal applied."""
        if self._pend_slots:
            slots = np.array(self._pend_slots, np.int64)
            leaves = np.array(self._pend_leaves, np.float64)
            self._pend_slots, self._pend_leaves = [], []
            self._tree.set(slots, leaves)
        return self._tree

    def _queue(self, slots: list[int], leaf: float) -> None:
        self._pend_slots += slots
        self._pend_leaves += [leaf] * len(slots)
        if len(self._pend_slots) > self._PENDING:
            self.tree  # noqa: B018 (flushes)

    @property
    def beta(self) -> float:
        c = self.cfg
        if c.beta_steps <= 0:
            return c.beta
        frac = min(1.0, self.samples / c.beta_steps)
        return c.beta + frac * (c.beta_final - c.beta)

    def add(self, slots: np.ndarray, leaves: np.ndarray | None = None) -> None:
        if leaves is None:
            self._queue(slots.tolist(), self._new_leaf)
        else:
            self.tree.set(slots, leaves)

    def add_one(self, slot: int) -> None:
        """:meth:`add` of one slot: a queued entry (see the class doc)."""
        self._pend_slots.append(slot)
        self._pend_leaves.append(self._new_leaf)
        if len(self._pend_slots) > self._PENDING:
            self.tree  # noqa: B018 (flushes)

    def remove(self, slots: np.ndarray) -> None:
        self._queue(slots.tolist(), 0.0)

    def sample(
        self, n: int, rng: np.random.Generator, live: Callable[[], np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` slots drawn by priority, and their importance weights.

        Priority 0 means "never drawn" while any item has a positive priority. When every live
        item has priority 0 there is no distribution to draw from; then items are drawn
        uniformly from ``live()`` (the live slots) with weights 1, as Reverb's prioritized
        selector and TorchRL's sampler (which adds eps to every priority) both end up doing.
        """
        total = self.tree.total
        if not total > 0:
            slots = live() if live is not None else np.empty(0, np.int64)
            if len(slots) == 0:
                raise IndexError("cannot sample: no live item")
            self.samples += 1
            return slots[rng.integers(0, len(slots), n)], np.ones(n, np.float32)
        # stratified: one draw in each of n equal slices of the total mass
        mass = (np.arange(n) + rng.random(n)) * (total / n)
        np.minimum(mass, np.nextafter(total, 0), out=mass)
        slots = self.tree.find(mass)
        slots = slots[rng.permutation(n)]  # strata come out in slot order; do not leak that
        leaf = self.tree.leaves(slots)
        weights = is_weights(leaf, self.tree.min_positive, self.beta)
        self.samples += 1
        return slots, weights

    def check(self, top: float) -> None:
        """ConfigError (nothing changed) when priorities up to ``top`` could overflow the tree."""
        if top > self._safe_top:
            check_priority(top, self.cfg.alpha)

    def below_max(self, priorities: np.ndarray) -> bool:
        """Whether every priority is in [0, max_priority): then each is valid (finite, >= 0,
        within :func:`check_priority`'s limit, as the max is) and none is a new max. One compare:
        as unsigned ints, the bits of floats >= +0 sort as the floats do, and a negative (sign
        bit), NaN or inf sorts above every finite float. Float64 arrays only."""
        bits = priorities.view(np.uint64)
        return _count_nonzero(bits < self._max_bits) == len(bits)

    def update_below_max(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """:meth:`update` of priorities for which :meth:`below_max` held (no new max; a zero
        among them reaches the min-tree as it is, which maps it when it is next read)."""
        tree = self.tree if self._pend_slots else self._tree  # queued adds first
        a = self._alpha
        tree.set(slots, priorities if a == 1 else priorities**a, True)

    def update(
        self,
        slots: np.ndarray,
        priorities: np.ndarray,
        top: float | None = None,
        low: float | None = None,
    ) -> None:
        """Set priorities; for a slot given twice the last value wins, as with single updates.

        ``top``/``low``: the largest/smallest priority when the caller already has them."""
        # queued adds first: they carry the old max priority
        tree = self.tree if self._pend_slots else self._tree
        if not len(priorities):
            return
        top = float(priorities.max()) if top is None else top
        if top > self._max_priority:
            self.max_priority = top
        a = self._alpha
        low = float(priorities.min()) if low is None else low
        # the smallest leaf is low**a (the power is monotonic); 0 when it underflows, as in numpy
        tree.set(slots, priorities if a == 1 else priorities**a, zeros_later=low**a > 0)

    def leaves(self, slots: np.ndarray) -> np.ndarray:
        """p_i^alpha of ``slots``: what is saved, so a reload draws from the same distribution."""
        return self.tree.leaves(slots)

    def state(self) -> dict:
        return {"max_priority": self.max_priority, "samples": self.samples}

    def load_state(self, state: dict) -> None:
        """Restore what :meth:`state` returned; ValueError (nothing changed) if it is malformed."""
        top = state.get("max_priority", self.cfg.initial_priority)
        samples = state.get("samples", 0)
        if isinstance(top, bool) or not isinstance(top, (int, float)) or not 0 < top < np.inf:
            raise ValueError(f"max_priority must be a finite number > 0, got {top!r}")
        try:
            check_priority(float(top), self.cfg.alpha, "max_priority")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        msg = f"samples must be an int >= 0, got {samples!r}"
        check_int(samples, msg, minimum=0, error=ValueError)
        self.tree  # noqa: B018 (queued adds keep the leaf they were given)
        self.max_priority = float(top)
        self.samples = samples


def make_state(capacity: int, cfg: Uniform | Prioritized) -> UniformState | PrioritizedState:
    if isinstance(cfg, Prioritized):
        return PrioritizedState(capacity, cfg)
    if isinstance(cfg, Uniform):
        return UniformState(capacity, cfg)
    raise ConfigError(
        f"sampler must be tt.rl.Uniform() or tt.rl.Prioritized(...), got {type(cfg).__name__}"
    )
