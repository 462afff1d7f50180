"""Items spilled from RAM into a :class:`~tensortier.tiers.remote.RemoteStore` pool.

Batches. A spill sends its items in groups of up to ``group_bytes`` (1 MiB), one remote object per
group: one round trip per item would cost more than the item, and Ray keeps objects below about
100 KiB in the caller's own process instead of on the memory node. An item's location is (batch,
offset, length); a batch's object is freed when its last item leaves. A read fetches each batch
it needs once (Ray then caches the object on this node, so later reads of the batch are local).

Faults. A put the pool refuses (``TierFullError``) or that fails (its node died, a timeout) leaves
its items to the next tier: :meth:`put` returns them, nothing is lost (they are still in RAM). A
read from a lost node raises :class:`NodeLostError` with ``lost`` set to every slot of the
batches that node held (the message names every lost node the read met; ``node`` is the first):
the owner drops those items (non-durable items have no other copy) and counts them. Every remote call has the pool's timeout, so nothing here waits forever.

A closed pool. The pool is the caller's: closed (or its Ray session ended, ``ray.shutdown()``)
while the owner still holds items in it, every one of them is gone. The first read that meets it
raises :class:`NodeLostError` (``node`` is "") with ``lost`` set to every remote slot, and warns
once: the owner drops them all and counts them, like a lost node, and goes on without the pool
(later spills go to the next tier; with none, ``closed`` lets its TierFullError say why).

Not thread-safe (the store's owner holds a lock); :meth:`close` never blocks (it only frees).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future

import numpy as np
import torch

from tensortier.errors import ClosedError, NodeLostError, TierFullError
from tensortier.tiers.base import Store

_GROUP = 1 << 20


class RemoteSpill:
    """Spilled items in ``remote``, any :class:`~tensortier.tiers.base.Store` (a RemoteStore
    here): only ``put``, ``get`` and ``free`` are used."""

    def __init__(self, remote: Store, group_bytes: int = _GROUP, *, what: str = "store"):
        self.remote = remote
        self.what = what  # the owner, for messages
        self.closed: ClosedError | None = None  # why the pool refused, once it was closed
        self.group_bytes = group_bytes
        self.loc: dict[int, tuple[int, int, int]] = {}  # slot -> (batch, offset, length)
        self.batches: dict[int, tuple[object, set[int]]] = {}  # batch -> (handle, its slots)
        self._next = 0
        self.bytes = 0  # bytes of live items held remotely

    def __contains__(self, slot: int) -> bool:
        return slot in self.loc

    def put(self, slots: list[int], blobs: list) -> list[int]:
        """Send items; returns the positions (in ``slots``) of those the pool did not take."""
        groups, cur, size = [], [], 0
        for i, b in enumerate(blobs):
            if cur and size + len(b) > self.group_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += len(b)
        if cur:
            groups.append(cur)
        rest: list[int] = []
        pending: list[tuple[list[int], np.ndarray, Future]] = []
        full = False
        for g in groups:
            if full:
                rest += g
                continue
            sizes = [len(blobs[i]) for i in g]
            buf = np.empty(sum(sizes), np.uint8)
            np.concatenate([np.frombuffer(blobs[i], np.uint8) for i in g], out=buf)
            try:
                fut = self.remote.put(torch.from_numpy(buf))
            except ClosedError as exc:
                self.closed, full = exc, True
                rest += g
                continue
            except TierFullError:
                full = True  # later groups would not fit either (or the pool is gone)
                rest += g
                continue
            pending.append((g, buf, fut))
        for g, _buf, fut in pending:  # _buf: kept alive until its put is done
            try:
                handle = fut.result()
            except (TierFullError, NodeLostError, TimeoutError, ClosedError):
                rest += g
                continue
            except Exception:  # a Ray error on the way: the next tier takes the items
                rest += g
                continue
            bid = self._next
            self._next += 1
            members = {slots[i] for i in g}
            self.batches[bid] = (handle, members)
            off = 0
            for i in g:
                n = len(blobs[i])
                self.loc[slots[i]] = (bid, off, n)
                off += n
                self.bytes += n
        return sorted(rest)

    def read(self, slots: list[int]) -> list[bytes]:
        """Item bytes of remote ``slots``; NodeLostError (``.lost``: the slots gone) on loss."""
        need: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            need.setdefault(self.loc[s][0], []).append(i)
        try:
            futs = {bid: self.remote.get(self.batches[bid][0]) for bid in need}
        except ClosedError as exc:
            raise self._pool_gone(exc) from exc
        out: list = [None] * len(slots)
        lost: list[int] = []
        errors: dict[str, NodeLostError] = {}  # lost node -> its first error, in order met
        for bid, fut in futs.items():
            try:
                data = fut.result().numpy()
            except ClosedError as exc:
                raise self._pool_gone(exc) from exc
            except NodeLostError as exc:
                errors.setdefault(exc.node, exc)
                lost += sorted(self.batches[bid][1])
                continue
            for i in need[bid]:
                _, off, n = self.loc[slots[i]]
                out[i] = data[off : off + n].tobytes()
        if errors:
            first = next(iter(errors.values()))
            where = (
                f"memory node {first.node}, which was"
                if len(errors) == 1
                else f"memory nodes {', '.join(errors)}, which were"
            )
            err = NodeLostError(
                f"{len(lost)} spilled items were held on {where} lost: they are dropped "
                f"(counted in stats['lost_items']); the rest stay",
                node=first.node,
                nodes=tuple(errors),
            )
            err.lost = lost  # type: ignore[attr-defined]
            raise err from first
        return out

    def _pool_gone(self, cause: ClosedError) -> NodeLostError:
        """The error (and one-time warning) for a pool closed under its items: all are lost."""
        self.closed = cause
        lost = sorted(self.loc)
        msg = (
            f"{len(lost)} items this {self.what} spilled to its remote pool are lost: the "
            f"RemoteStore was closed, or Ray shut down, while the {self.what} still held items "
            f"in it ({cause}). They are dropped (counted in stats['lost_items']) and the "
            f"{self.what} goes on without the pool. Close the {self.what} before its RemoteStore "
            f"and before ray.shutdown()"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        err = NodeLostError(msg, node="")
        err.lost = lost  # type: ignore[attr-defined]
        return err

    def release(self, slot: int) -> None:
        """Forget ``slot``'s remote copy; frees its batch with the batch's last item."""
        bid, _, n = self.loc.pop(slot)
        self.bytes -= n
        handle, members = self.batches[bid]
        members.discard(slot)
        if not members:
            del self.batches[bid]
            _free(self.remote, handle)

    def close(self) -> None:
        batches, self.batches = self.batches, {}
        self.loc = {}
        for handle, _ in batches.values():
            _free(self.remote, handle)


def _free(remote, handle) -> None:
    try:
        remote.free(handle)  # never blocks
    except KeyError:  # already gone with a closed pool
        pass
