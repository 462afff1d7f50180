"""The surface a ReplayBuffer shares with its served and sharded handles: what it returns and takes.

Owns :class:`Batch` (what ``sample`` returns), :class:`ReplayConfig` (the buffer's settings, checked
once by :func:`check_replay_args` before anything is allocated), the ``DEFAULT`` timeout sentinel
and the checks of the arguments the sampling and priority methods take. Nothing here holds state or
touches storage, so ``replay.py``, ``serve.py`` and ``sharded.py`` can all use it without importing
one another's internals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensortier._units import check_int, parse_size
from tensortier.errors import ConfigError
from tensortier.rl._store import check_args, check_tier
from tensortier.rl.rate_limiter import RateLimit
from tensortier.rl.sampler import Prioritized, Uniform

DEFAULT: Any = object()  # timeout not given: 0 for sample() (None for add), or the RateLimit's
# per slot of capacity, beyond the store's index: use count 4, sampler (sum + min trees 17, or the
# uniform sampler's dense live array and positions 16)
SLOT_BYTES = 48  # + episode, step and policy version, 8 bytes each
_F64 = np.dtype(np.float64)  # a singleton: ``is`` beats ``==`` on the update hot path


@dataclass
class Batch:
    """A sample: ``items`` (a dict of stacked arrays/tensors when ``collated``, else a list of items),
    their ``indices`` (int64) and importance ``weights`` (float32, all 1 for uniform sampling).

    With ``sample(B, seq_len=T)``: fields are (B, T, ...) (a list of B lists when not collated),
    ``indices`` and ``mask`` are (B, T) and ``weights`` (B,), one per slice."""

    items: Any
    indices: np.ndarray
    weights: np.ndarray
    collated: bool
    mask: np.ndarray | None = None  # sample(seq_len=T): (B, T), False on padded positions

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class ReplayConfig:
    max_items: int
    host_budget: int
    spill_dir: str | None
    sampler: Uniform | Prioritized
    max_uses: int | None
    durable: bool
    fsync: bool
    prefetch: int
    seed: int | None
    segment_size: int

    def to_dict(self) -> dict:
        # the keys saved with a buffer (ReplayBuffer.save's meta.json): kept as first written
        return {
            "capacity": self.max_items,
            "ram_budget": self.host_budget,
            "sampler": self.sampler.to_dict(),
            "max_uses": self.max_uses,
            "segment_size": self.segment_size,
        }


def check_replay_args(
    max_items: Any,
    *,
    host_budget: Any,
    spill_dir: Any,
    sampler: Any,
    max_uses: Any,
    durable: Any,
    fsync: Any,
    prefetch: Any,
    seed: Any,
    segment_size: Any,
    rate_limit: Any,
    tier: Any,
    remote: Any,
) -> tuple[ReplayConfig, tuple[str, ...]]:
    """``ReplayBuffer``'s arguments as a :class:`ReplayConfig` and the spill tiers, or the
    ConfigError naming the first bad one (see ``ReplayBuffer.__init__``)."""
    max_items = check_args(
        "ReplayBuffer",
        max_items,
        spill_dir=spill_dir,
        durable=durable,
        fsync=fsync,
        extra_slot_bytes=SLOT_BYTES,
    )
    durable, fsync = bool(durable), bool(fsync)
    tiers = check_tier("ReplayBuffer", tier, remote, durable)
    if max_uses is not None:
        max_uses = check_int(
            max_uses,
            f"max_uses must be None or an int >= 1 (draws before an item is removed), got "
            f"{max_uses!r}",
            minimum=1,
            numpy=True,
        )
    prefetch = check_int(
        prefetch,
        f"prefetch must be an int >= 0 (batches drawn ahead), got {prefetch!r}",
        minimum=0,
        numpy=True,
    )
    if seed is not None:
        seed = check_int(
            seed, f"seed must be None or an int >= 0, got {seed!r}", minimum=0, numpy=True
        )
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise ConfigError(
            f"rate_limit must be None or tt.rl.RateLimit(samples_per_insert, ...), got "
            f"{rate_limit!r}"
        )
    sampler = Uniform() if sampler is None else sampler
    if not isinstance(sampler, (Uniform, Prioritized)):
        raise ConfigError(
            f"sampler must be tt.rl.Uniform() or tt.rl.Prioritized(...), got {sampler!r}"
        )
    config = ReplayConfig(
        # what is stored and how it is drawn
        max_items=max_items,
        sampler=sampler,
        max_uses=max_uses,
        prefetch=prefetch,
        seed=seed,
        # where it is stored
        host_budget=parse_size(host_budget, name="host_budget"),
        spill_dir=None if spill_dir is None else os.fspath(spill_dir),
        durable=durable,
        fsync=fsync,
        segment_size=parse_size(segment_size, name="segment_size", allow_zero=False),
    )
    return config, tiers


def check_batch_size(batch_size: Any) -> int:
    return check_int(
        batch_size,
        f"batch_size must be an int >= 1 (items drawn per sample, with replacement), got "
        f"{batch_size!r}",
        minimum=1,
        numpy=True,
    )


def check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ConfigError(
            f"timeout must be None (wait for an add) or seconds >= 0, got {timeout!r}"
        )
    return float(timeout)


def check_sequence_args(seq_len: Any, max_staleness: Any, eta: Any) -> None:
    if seq_len is not None:
        check_int(
            seq_len,
            f"seq_len must be None or an int >= 1 (steps per slice), got {seq_len!r}",
            minimum=1,
            numpy=True,
        )
    if max_staleness is not None:
        check_int(
            max_staleness,
            f"max_staleness must be None or an int >= 0 (policy versions behind "
            f"policy_version), got {max_staleness!r}",
            minimum=0,
            numpy=True,
        )
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1:
        raise ConfigError(f"eta must be a number in [0, 1] (R2D2 uses 0.9), got {eta!r}")


def item_meta(n: int, episode: Any, step: Any, version: Any) -> tuple | None:
    """(episode, step, version) as int64 arrays of ``n`` values (-1 where not given); None when
    none is given."""
    if episode is None and step is None and version is None:
        return None
    out = []
    for name, v in (("episode", episode), ("step", step), ("version", version)):
        if v is None:
            out.append(np.full(n, -1, np.int64))
            continue
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        arr = np.asarray(v)
        if arr.ndim == 0:
            arr = np.full(n, arr)
        if (
            arr.shape != (n,)
            or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0)
            or (arr.size and arr.min() < 0)
        ):
            raise ConfigError(
                f"{name} must be an int >= 0 or one such int per item ({n} items), got {v!r:.80}"
            )
        out.append(arr.astype(np.int64, copy=False))
    return tuple(out)


def priority_array(priorities: Any, keys: np.ndarray) -> np.ndarray:
    """``priorities`` (numbers, an array or a tensor) as float64, one per index in ``keys``."""
    if (
        type(priorities) is np.ndarray
        and priorities.dtype is _F64
        and priorities.shape == keys.shape
    ):
        return priorities  # nothing to convert or check
    if hasattr(priorities, "detach"):  # float64, as numpy input: float32 rounds 1e-300 to 0
        priorities = priorities.detach().cpu().double().numpy()
    try:
        prios = np.asarray(priorities, np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"priorities must be numbers, one per index, got {type(priorities).__name__}"
        ) from exc
    if prios.ndim == 0 and keys.shape == (1,):
        prios = prios.reshape(1)  # update_priorities(index, priority), as buf[index] takes one
    if prios.shape != keys.shape:
        raise ConfigError(
            f"priorities must have one value per index: got shape {prios.shape} for "
            f"{keys.shape[0]} indices (flatten with .reshape(-1))"
        )
    return prios
