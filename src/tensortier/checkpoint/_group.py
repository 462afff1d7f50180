"""Who a Checkpointer saves and restores with: one process, or every rank of a process group.

Save and restore are one path in ``checkpointer.py``: every question that involves the other
ranks goes through the group (is an automatic save due, are the ranks saving the same step and
parts, which checkpoints exist and which ones a save retires, which tensors this rank writes,
did any rank find a candidate unusable, does it fit every rank's objects). :class:`Solo`, a
world of one, answers each of them locally and communicates nothing; :class:`Group` answers
with one collective each on the ``main`` gloo group (the caller's thread; ``_ranks.py``).
Only the persist differs by group: one process writes format v1 and commits alone, many ranks
write format v2 and commit together (``_ranks.commit_ranks``, on the persist thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from tensortier import _dist
from tensortier.checkpoint import _ranks
from tensortier.checkpoint._validate import check_fits
from tensortier.errors import ConfigError

T = TypeVar("T")
Held = list[tuple[str, bool, int]]  # (name, is a DTensor shard, bytes) of each tensor to save


class Solo:
    """One process: the degenerate group, every answer local."""

    rank = 0
    world = 1
    many = False

    def agree(self, values: dict, what: str, fix: str) -> None:
        """Every rank built the same object (one process: nothing to compare)."""

    def from_rank0(self, error: BaseException | None, value: T) -> T:
        """Rank 0's outcome of a step only it runs: its ``value``, or its ``error`` raised."""
        if error is not None:
            raise error
        return value

    def decide(self, fn: Callable[[], T]) -> T:
        """``fn()`` run by rank 0 (it owns the directory), the same answer on every rank; a
        :class:`ConfigError` it raises is raised on every rank."""
        return fn()

    def any_true(self, flag: bool) -> bool:
        return flag

    def agree_save(self, step: int, parts: list[str], timeout_s: float) -> None:
        """Every rank saves ``step`` with the same parts, or ``ConfigError`` everywhere."""

    def all_ok(self, error: Exception | None, what: str) -> None:
        """Raise on every rank if one failed to ``what``: its own error on that rank, a
        ConfigError naming it on the others (one process: the error, if any)."""
        if error is not None:
            raise error

    def held(self, t: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
        """(what this rank writes of ``t``, its chunk of the global tensor or None)."""
        return t, None

    def prefix(self, per_rank: bool) -> str:
        """Name prefix of a tensor that differs per rank (RNG states, ``extra``)."""
        return ""

    def plan_writes(self, held: Held) -> tuple[set[str], dict[str, int]]:
        """(names this rank writes, the writer of each tensor several ranks hold)."""
        return {name for name, _, _ in held}, {}

    def share(self, saved_world: int) -> list[int]:
        """The saved ranks whose files this rank checksums in full at restore."""
        return list(range(saved_world))

    def unusable(self, error: str | None) -> str | None:
        """Why a restore candidate is unusable on some rank (None: usable on every rank)."""
        return error

    def fits(self, tree: dict, path: str, model, optimizer, scheduler, strict: bool) -> None:
        """``check_fits`` for every rank's objects, before any rank loads anything."""
        check_fits(tree, path, model, optimizer, scheduler, strict)


class Group(Solo):
    """Many ranks: each answer is agreed with one collective on the ``main`` group."""

    many = True

    def __init__(self, ranks: _ranks.Ranks):
        self.ranks = ranks
        self.rank, self.world = ranks.rank, ranks.world

    @classmethod
    def create(cls, process_group, timeout_s: float) -> Group:
        return cls(_ranks.Ranks.create(process_group, timeout_s))

    def agree(self, values: dict, what: str, fix: str) -> None:
        _dist.agree(values, what, self.ranks.main, fix=fix)

    def from_rank0(self, error: BaseException | None, value: T) -> T:
        told = _dist.gather_objects(
            (None if error is None else str(error), value), self.ranks.main
        )[0]
        if told[0] is not None:
            if error is not None:
                raise error
            raise ConfigError(f"rank 0 of the Checkpointer's group failed: {told[0]}")
        return told[1]

    def decide(self, fn: Callable[[], T]) -> T:
        result: tuple[str | None, object] = (None, None)
        if self.rank == 0:
            try:
                result = (None, fn())
            except ConfigError as exc:
                result = (str(exc), None)
        refused, value = _dist.broadcast_object(result, 0, self.ranks.main)
        if refused is not None:
            raise ConfigError(refused)
        return value

    def any_true(self, flag: bool) -> bool:  # every rank saves, or none (its timings differ)
        return _dist.any_true([flag], self.ranks.main)[0]

    def agree_save(self, step: int, parts: list[str], timeout_s: float) -> None:
        _ranks.agree_save(self.ranks, step, parts, timeout_s)

    def all_ok(self, error: Exception | None, what: str) -> None:
        told = _dist.gather_objects(
            None if error is None else f"{type(error).__name__}: {error}", self.ranks.main
        )
        if error is not None:
            raise error
        bad = next(((r, e) for r, e in enumerate(told) if e is not None), None)
        if bad is not None:
            raise ConfigError(
                f"rank {bad[0]} could not {what}, so no rank saved this step (the last "
                f"checkpoint is unchanged): {bad[1]}"
            )

    def held(self, t: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
        return _ranks.dtensor_local(t)

    def prefix(self, per_rank: bool) -> str:
        # RNG states and extra differ per rank, so their names say whose they are (a plain
        # tensor several ranks hold under one name is written once, by one)
        return f"{_ranks.rank_dir(self.rank)}/" if per_rank else ""

    def plan_writes(self, held: Held) -> tuple[set[str], dict[str, int]]:
        return _ranks.plan_writes(held, self.ranks)

    def share(self, saved_world: int) -> list[int]:
        return [k for k in range(saved_world) if k % self.world == self.rank]

    def unusable(self, error: str | None) -> str | None:
        errors = _dist.gather_objects(error, self.ranks.main)
        bad = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        return None if bad is None else f"{bad[1]} (found by rank {bad[0]})"

    def fits(self, tree: dict, path: str, model, optimizer, scheduler, strict: bool) -> None:
        """A checkpoint that does not fit one rank's objects is refused on every rank, never
        loaded on some only."""
        try:
            check_fits(tree, path, model, optimizer, scheduler, strict)
            misfit = None
        except ConfigError as exc:
            misfit = exc
        told = _dist.gather_objects(None if misfit is None else str(misfit), self.ranks.main)
        if misfit is not None:
            raise misfit
        bad = next(((r, e) for r, e in enumerate(told) if e is not None), None)
        if bad is not None:
            raise ConfigError(
                f"rank {bad[0]} cannot restore this checkpoint, so no rank loaded it: {bad[1]}"
            )
