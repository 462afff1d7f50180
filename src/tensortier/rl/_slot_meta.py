"""What a replay buffer knows of each item beside its bytes and priority, per slot of capacity.

Owns the use counts (``max_uses``) and each item's episode, step and policy version (int64, -1
when not given), plus the newest policy version seen. Arrays are indexed by slot, as the store's
index and the sampler's trees are; the buffer writes them under its lock. Nothing here knows of
storage or sampling.
"""

from __future__ import annotations

import numpy as np

FIELDS = ("episode", "step", "version")


class SlotMeta:
    """Per-slot use count, episode, step and policy version of one buffer's items."""

    def __init__(self, capacity: int):
        self.uses = np.zeros(capacity, np.int32)
        self.episode = np.full(capacity, -1, np.int64)
        self.step = np.full(capacity, -1, np.int64)
        self.version = np.full(capacity, -1, np.int64)
        self.policy_version = -1  # the largest version added or set; never goes back

    def clear_one(self, slot: int) -> None:
        """A new item in ``slot`` (Python scalars: the single-add fast path)."""
        self.uses[slot] = 0
        self.episode[slot] = self.step[slot] = self.version[slot] = -1

    def added(self, slots: np.ndarray, meta: tuple | None) -> None:
        """New items in ``slots`` with ``meta`` = (episode, step, version) arrays, or None."""
        self.uses[slots] = 0
        if meta is None:
            self.episode[slots] = self.step[slots] = self.version[slots] = -1
            return
        self.episode[slots], self.step[slots], self.version[slots] = meta
        top = int(meta[2].max()) if len(meta[2]) else -1
        if top > self.policy_version:
            self.policy_version = top

    def count_uses(self, slots: np.ndarray, max_uses: int) -> np.ndarray:
        """Count one draw of each of ``slots`` (repeats count again); the slots used up."""
        np.add.at(self.uses, slots, 1)
        return np.unique(slots[self.uses[slots] >= max_uses])

    def fresh(self, slots: np.ndarray, max_staleness: int | None) -> tuple[np.ndarray, str]:
        """The ``slots`` whose policy version is within ``max_staleness`` of the newest (items
        without a version are excluded then), and why none may be left."""
        if max_staleness is None:
            return slots, "the buffer is empty"
        cutoff = self.policy_version - max_staleness
        ver = self.version[slots]
        why = (
            f"no item has a policy version >= {cutoff} (policy_version "
            f"{self.policy_version} - max_staleness {max_staleness}; items added "
            f"without version= are excluded)"
        )
        return slots[(ver >= 0) & (ver >= cutoff)], why

    def arrays(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Use counts, episodes, steps and versions of ``slots`` (what a save records)."""
        return {
            "uses": self.uses[slots].copy(),
            "episode": self.episode[slots],
            "step": self.step[slots],
            "version": self.version[slots],
        }

    def load(self, slots: np.ndarray, arrays: dict, policy_version: int) -> None:
        """Restore what :meth:`arrays` recorded for ``slots`` (fields absent from older files,
        or from items added after a durable checkpoint, stay as they are)."""
        for name in ("uses", *FIELDS):
            if name in arrays:
                getattr(self, name)[slots] = arrays[name]
        self.policy_version = max(self.policy_version, int(policy_version))
