"""Where a client's bytes go: a :class:`Placement`, validated once and opened once (issue 26).

A placement names the ordered tiers a client may use (``("host", "disk")``: RAM first, then the
disk), the spill directory, the byte budgets and the remote pool. Building one checks every part
and raises :class:`~tensortier.errors.ConfigError` naming the value and the fix; ``open_disk`` and
``open_remote`` then make the stores. :func:`check_remote` is the one rule for ``remote=`` that
every client follows (the activation offloader, the optimizer, the replay buffer and memory bank,
and the planner): an open :class:`~tensortier.tiers.remote.RemoteStore` (the caller's, left open),
or, where the client makes and closes the pool itself, a dict of its arguments with a budget.

Each client maps its tier choice (``tier=``: one tier, or ordered tiers) to tiers here; this
module never moves a byte.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

from tensortier._units import SizeLike, parse_size
from tensortier.errors import ConfigError
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.remote import RemoteStore  # Ray is imported only when a store is made

TIERS = ("host", "disk", "remote")


def check_remote(remote: Any, *, where: str, needed: bool, args: bool = True) -> None:
    """The one rule for ``remote=``: ``None`` (unless ``needed``), an open RemoteStore, or (with
    ``args``) a dict of RemoteStore's arguments with a ``budget``. ``where`` names the client
    and setting in the message (``"Offloader(tier='remote')"``)."""
    if remote is None and not needed:
        return
    if isinstance(remote, RemoteStore):
        if remote.closed:
            raise ConfigError("remote=RemoteStore(...) is closed; pass an open store")
        return
    if args and isinstance(remote, dict) and "budget" in remote:
        _check_remote_args(remote, where)
        return
    or_dict = ", or a dict of its arguments with a budget" if args else ""
    eg_dict = " or remote={'budget': '8GiB'}" if args else ""
    raise ConfigError(
        f"{where} needs remote=tt.tiers.RemoteStore(budget) (after ray.init){or_dict}; got "
        f"remote={remote!r}. E.g. remote=RemoteStore(budget='8GiB'){eg_dict}"
    )


def _check_remote_args(args: dict, where: str) -> None:
    """A dict of RemoteStore's arguments: its names and budget checked now, not when the client
    first opens the pool (then a raw ``unexpected keyword argument``)."""
    known = [n for n in inspect.signature(RemoteStore.__init__).parameters if n != "self"]
    unknown = [k for k in args if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: remote={args!r} names {unknown}, which RemoteStore does not take; pass a "
            f"dict of its arguments ({', '.join(known)}), e.g. remote={{'budget': '8GiB'}}"
        )
    parse_size(args["budget"], name="remote budget", allow_zero=False)


@dataclass(frozen=True)
class Placement:
    """Ordered tiers, spill directory, byte budgets and remote pool of one client.

    ``tiers``: distinct names from :data:`TIERS`, in the order bytes spill through them.
    ``directory``: where the disk tier makes its private directory (``None``: the system's
    temporary directory). ``host_budget``: bytes of RAM (parsed here). ``disk_budget``: bytes
    the disk tier may preallocate (checked here, passed to the store as given, so its messages
    quote the user's value). ``remote``: see :func:`check_remote`; ``remote_args=False`` for
    clients that only take an open store. ``where`` names the client in messages.
    """

    tiers: tuple[str, ...]
    directory: str | os.PathLike | None = None
    host_budget: SizeLike | None = None
    disk_budget: SizeLike | None = None
    remote: Any = field(default=None, repr=False, compare=False)  # a store's repr has stats
    where: str = "tensortier"
    remote_args: bool = True

    def __post_init__(self) -> None:
        tiers = (self.tiers,) if isinstance(self.tiers, str) else tuple(self.tiers)
        if not tiers or any(t not in TIERS for t in tiers) or len(set(tiers)) != len(tiers):
            raise ConfigError(
                f"{self.where}: tiers={self.tiers!r}; pass distinct tiers from {TIERS}, in the "
                f"order bytes spill through them, e.g. ('host', 'disk')"
            )
        object.__setattr__(self, "tiers", tiers)
        if self.host_budget is not None:
            budget = parse_size(self.host_budget, name="host_budget", allow_zero=False)
            object.__setattr__(self, "host_budget", budget)
        if self.disk_budget is not None:
            parse_size(self.disk_budget, name="disk_budget", allow_zero=False)
        check_remote(self.remote, where=self.where, needed="remote" in tiers, args=self.remote_args)

    def open_disk(self, *, owner: str, **options: Any) -> DiskStore:
        """The disk tier's store under ``directory`` (``options``: DiskStore's, e.g.
        ``io_threads``); the caller closes it."""
        return DiskStore(self.directory, budget=self.disk_budget, owner=owner, **options)

    def open_remote(self, **defaults: Any) -> tuple[RemoteStore, bool]:
        """The remote pool and whether it was made here (then the caller closes it): the
        caller's store as it is, or one made from the arguments (``defaults`` fill what they
        do not name, e.g. ``io_threads``)."""
        if isinstance(self.remote, RemoteStore):
            return self.remote, False
        if self.remote is None:
            raise ConfigError(f"{self.where}: no remote pool was given; pass remote=")
        return RemoteStore(**{**defaults, **self.remote}), True
