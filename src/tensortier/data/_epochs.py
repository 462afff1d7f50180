"""``EpochConfig``: the settings of a catalog's epochs, written once and checked once.

``Catalog.epochs(...)``, ``Loader(...)`` and ``EpochDataset(...)`` all take these as keyword
arguments; each builds one :class:`EpochConfig` and passes it on (``Loader`` to its dataset, the
dataset to the read-ahead stream), so a setting is named, defaulted and documented here only.
:meth:`EpochConfig.checked` validates every field against the catalog (ConfigError naming the value
and the fix) and fills in what depends on it: rank and world size from ``torch.distributed``, the
block size from the mean record size, the read-ahead budget in bytes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tensortier._renamed import renamed
from tensortier._units import SizeLike, parse_size
from tensortier.data._order import EVENS, SHUFFLES, OrderSpec
from tensortier.errors import ConfigError

BLOCK_BYTES = 1 << 20  # default block of block shuffle: about 1 MiB of records
WHAT = "Catalog.epochs"  # how messages name the call (Loader and EpochDataset take the same)


@dataclass(frozen=True, kw_only=True)
class EpochConfig:
    """How one rank reads a catalog's epochs.

    ``batch`` records per batch; ``seed``; ``rank``/``world_size`` (default: from
    ``torch.distributed`` when initialised, else 0/1); ``shuffle`` "full", "block" (``block``
    records per block, default about 1 MiB of records; ``window`` blocks shuffled together) or
    "none" (True and False mean "full" and "none"); ``even`` "pad" or "drop" (equal counts per
    rank, never resampled: ``_order.py``); ``drop_last`` drops the final partial batch;
    ``prefetch_budget`` bytes read ahead; ``io_threads`` (read threads); ``transform(record)`` and ``collate(list)`` run
    where records are read (I/O threads or workers); ``epoch`` where iteration starts.
    """

    batch: int
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    shuffle: str | bool = "full"
    block: int | None = None
    window: int = 8
    even: str = "pad"
    drop_last: bool = False
    prefetch_budget: SizeLike = "512MiB"
    io_threads: int = 16
    transform: Callable | None = None
    collate: Callable | None = None
    epoch: int = 0

    @classmethod
    def of(cls, options: dict[str, Any]) -> EpochConfig:
        """The config of keyword arguments ``options``; TypeError naming one it does not know
        (or a missing ``batch``), as a misspelled keyword argument would."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{WHAT}() got an unexpected keyword argument {unknown[0]!r}")
        if "batch" not in options:
            raise TypeError(f"{WHAT}() missing 1 required keyword-only argument: 'batch'")
        return cls(**options)

    def checked(self, records: int, payload_bytes: int) -> EpochConfig:
        """This config validated for a catalog of ``records`` records (``payload_bytes`` in all),
        with rank, world size, shuffle, block and prefetch_budget (bytes) resolved."""
        check_int("batch", self.batch, 1, "pass the records per batch, e.g. batch=256")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"{WHAT}: seed={self.seed!r} must be an int")
        rank, world_size = rank_and_world(WHAT, self.rank, self.world_size)
        shuffle = self.shuffle
        if shuffle is True:
            shuffle = "full"
        elif shuffle is False:
            shuffle = "none"
        if shuffle not in SHUFFLES:
            raise ConfigError(
                f"{WHAT}: shuffle={shuffle!r}; pass 'full' (any record anywhere), 'block' "
                f"(blocks of neighbours, for locality) or 'none' (index order)"
            )
        block = self.block
        if block is None:
            mean = payload_bytes / records if records else 1.0
            block = max(1, round(BLOCK_BYTES / max(mean, 1.0)))
        check_int("block", block, 1, "pass the records per block of block shuffle")
        check_int("window", self.window, 1, "pass the blocks shuffled together")
        self._check_even(records, world_size)
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"{WHAT}: drop_last={self.drop_last!r} must be True or False")
        prefetch_budget = parse_size(
            self.prefetch_budget, name=f"{WHAT}: prefetch_budget", allow_zero=False
        )
        check_int("io_threads", self.io_threads, 1, "4-16 keep an NVMe busy")
        for name, fn in (("transform", self.transform), ("collate", self.collate)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{WHAT}: {name}={fn!r} must be callable or None")
        return dataclasses.replace(
            self,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            block=block,
            prefetch_budget=prefetch_budget,
        )

    def _check_even(self, records: int, world_size: int) -> None:
        if self.even not in EVENS:
            raise ConfigError(
                f"{WHAT}: even={self.even!r}; pass 'pad' (every rank gets ceil(n/world_size) "
                f"records, a few read twice) or 'drop' (n//world_size each, a few skipped per "
                f"epoch)"
            )
        if self.even == "drop" and records < world_size:
            raise ConfigError(
                f"{WHAT}: a catalog of {records} records gives no record to each of world_size="
                f"{world_size} ranks with even='drop'; use even='pad'"
            )

    def spec(self, records: int) -> OrderSpec:
        """The order of a :meth:`checked` config over ``records`` records."""
        assert self.world_size is not None and self.block is not None
        return OrderSpec(
            records, self.seed, str(self.shuffle), self.block, self.window, self.world_size,
            self.even,
        )  # fmt: skip


# EpochConfig(prefetch=) was bytes: the old name of prefetch_budget=, mapped as epochs, Loader and
# EpochDataset map it (prefetch= counts batches in the vocabulary).
EpochConfig.__init__ = renamed(prefetch="prefetch_budget")(EpochConfig.__init__)  # type: ignore[method-assign]


def check_int(name: str, value: Any, low: int, fix: str, what: str = WHAT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what}: {name}={value!r} must be an int >= {low}; {fix}")
    return value


def rank_and_world(what: str, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): each one not given comes from torch.distributed when it is
    initialised (as ``DistributedSampler``); without it, a world size > 1 needs a rank."""
    source = {"rank": "", "world_size": ""}
    if dist.is_available() and dist.is_initialized():
        if rank is None:
            rank, source["rank"] = dist.get_rank(), " (from torch.distributed)"
        if world_size is None:
            world_size, source["world_size"] = dist.get_world_size(), " (from torch.distributed)"
    elif rank is None and world_size is None and _launched_world() > 1:
        raise ConfigError(
            f"{what}: the launcher set WORLD_SIZE={_launched_world()} (torchrun) but "
            f"torch.distributed is not initialised yet, so every rank would read the whole "
            f"catalog in the same order; call torch.distributed.init_process_group() before "
            f"making the loader, or pass rank= and world_size= (world_size=1 to read it all here)"
        )
    elif rank is None and world_size not in (None, 1):
        raise ConfigError(
            f"{what}: world_size={world_size!r} but no rank, and torch.distributed is not "
            f"initialised; pass rank= (this process's data-parallel rank), or initialise the "
            f"process group first (every rank would read the same share otherwise)"
        )
    world_size = 1 if world_size is None else world_size
    rank = 0 if rank is None else rank
    check_int("world_size", world_size, 1, "pass the number of data-parallel ranks", what)
    check_int("rank", rank, 0, "pass this process's rank", what)
    if rank >= world_size:
        raise ConfigError(
            f"{what}: rank={rank}{source['rank']} must be below world_size={world_size}"
            f"{source['world_size']}; pass rank= and world_size= of the data-parallel group"
        )
    return rank, world_size


def _launched_world() -> int:
    """WORLD_SIZE that torchrun (or any env:// launcher) set for this process; 1 if none."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else 1
