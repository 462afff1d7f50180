"""Typed errors shared by every tier and client.

Each message says what was received and what to do about it; the attributes carry the values so
code can react without parsing text.
"""

from __future__ import annotations


class TensortierError(Exception):
    """Base class of every error tensortier raises on purpose."""

    def __reduce__(self):
        # Pickle the attributes too (Ray carries an actor's errors to the caller this way); the
        # default re-calls __init__ with the message only, which fails on keyword-only fields.
        return (_rebuild, (type(self), self.args), self.__dict__)


def _rebuild(cls: type[TensortierError], args: tuple) -> TensortierError:
    err = cls.__new__(cls, *args)
    err.args = args
    return err


class ConfigError(TensortierError, ValueError):
    """A setting that cannot be used as given (a malformed size, an unknown mode)."""


class RecordTypeError(TensortierError, TypeError):
    """A record, or one field of it, has a type that cannot be stored without pickle.

    ``record``: its position in the input; ``field``: the key of the field at fault (None when
    it is the record itself, or not one field). Raised by ``tt.data.Catalog.build`` before the
    build finishes; the build's files are removed.
    """

    def __init__(self, message: str, *, record: int, field: object = None):
        super().__init__(message)
        self.record = record
        self.field = field


class BudgetError(TensortierError):
    """A memory budget cannot be met; ``minimum`` is the smallest budget that can, when known."""

    def __init__(self, message: str, *, budget: int | None = None, minimum: int | None = None):
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum


class TierFullError(TensortierError):
    """A tier has no room for a request: its budget or capacity is used up, or the disk is full.

    The store that raised it stays usable: nothing was half-written, and freeing data or raising
    the budget lets the same request succeed.
    """

    def __init__(
        self,
        message: str,
        *,
        tier: str,
        requested: int,
        in_use: int | None = None,
        limit: int | None = None,
    ):
        super().__init__(message)
        self.tier = tier
        self.requested = requested
        self.in_use = in_use
        self.limit = limit


class SpillDirError(TensortierError):
    """The spill directory is missing, not a directory, or not writable."""

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


class CorruptDataError(TensortierError):
    """Stored data failed validation (checksum, size, or format) and was not used."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class PermissionDeniedError(TensortierError, PermissionError):
    """A file of a durable artifact (a catalog, a saved buffer) cannot be read by this process.

    ``path`` names the file; the message gives its mode and owner and how to share it. Also a
    ``PermissionError``, so code that caught the raw error keeps working.
    """

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


class NodeLostError(TensortierError):
    """A remote memory node died or left the cluster, and the data it held is gone.

    ``node`` is the node's Ray id; ``nodes`` every lost node the failed call met (``node``
    first). The store that raised it stays usable on its other nodes.
    """

    def __init__(
        self, message: str, *, node: str, tier: str = "remote", nodes: tuple[str, ...] = ()
    ):
        super().__init__(message)
        self.node = node
        self.tier = tier
        self.nodes = tuple(nodes) or (node,)


class ClosedError(TensortierError):
    """An operation was attempted on an object after its ``close()`` (a store, engine,
    offloader, optimizer, checkpointer, buffer or catalog), or on a Ray service that is gone."""


class RateLimitTimeout(TensortierError, TimeoutError):
    """A rate-limited insert or sample waited ``timeout`` seconds for the other side to catch up.

    ``op`` is ``"insert"`` or ``"sample"``; ``inserts``, ``samples`` and ``size`` are the
    limiter's counts when it gave up. Nothing was inserted or sampled by the failed call.
    """

    def __init__(
        self, message: str, *, op: str, waited: float, inserts: int, samples: int, size: int
    ):
        super().__init__(message)
        self.op = op
        self.waited = waited
        self.inserts = inserts
        self.samples = samples
        self.size = size


class ShardLostError(TensortierError):
    """A shard of a sharded replay buffer died (its actor or its node); its items are unreachable.

    ``shard`` is its number, ``node`` the Ray node it ran on. The buffer keeps serving from the
    other shards; ``restart_shard(shard)`` brings a durable shard back with its items.
    """

    def __init__(self, message: str, *, shard: int, node: str | None = None):
        super().__init__(message)
        self.shard = shard
        self.node = node
