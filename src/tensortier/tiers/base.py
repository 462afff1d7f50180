"""The storage contract of the tiers (``STORE.md``): :class:`Store`, :class:`Handle`, and the
pieces the stores share.

A store keeps whole tensors somewhere off the device (a disk tier's files, other machines' RAM)
and hands out a *handle* per tensor. Every call that moves bytes returns a
:class:`~concurrent.futures.Future`; ``free`` never blocks, so finalizers and done-callbacks may
call it. :class:`~tensortier.tiers.disk.DiskStore` and
:class:`~tensortier.tiers.remote.RemoteStore` implement it (through :class:`StoreBase`); the
transfer engine (``TransferEngine.to_store``/``from_store``), the optimizer's state streaming
(``optim/_states.py``), parameter streaming and the replay buffer's remote spill call it. The host
pool (``tiers/host.py``) is an allocator of pinned blocks, not a store of handles: it does not
follow this contract.

This module never does I/O itself and imports no store.
"""

from __future__ import annotations

import abc
import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import torch

from tensortier._lifetime import defer


@runtime_checkable
class Handle(Protocol):
    """Where one tensor lives in a store. Valid until ``free``; never persisted."""

    @property
    def id(self) -> int: ...  # process-wide: a handle of one store never matches another's

    @property
    def nbytes(self) -> int: ...  # bytes of tensor data

    @property
    def length(self) -> int: ...  # bytes a ``get(into=)`` buffer must hold (>= nbytes)

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@runtime_checkable
class Store(Protocol):
    """A tensor store with asynchronous, bit-identical round trips.

    - ``put(t)``: a future of the handle; ``t`` is a CPU tensor of any dtype, shape and strides
      (not modified in place until the future is done). A store that knows at once it has no
      room raises :class:`~tensortier.errors.TierFullError` from the call; a failure found later
      fails the future, and nothing of the tensor stays stored.
    - ``put_many(ts)``: a future of the handles, in order; on failure what was stored is freed.
    - ``get(h, into=None)``: a future of a CPU tensor bit-identical to the one put. ``into``: a
      contiguous CPU ``uint8`` tensor of at least ``h.length`` bytes, 64-byte aligned, to land in.
      A stale handle raises ``KeyError`` from the call.
    - ``get_many(hs)``: a future of the tensors, in order; fails with the first error.
    - ``free(h)``: give the space back; never blocks; ``KeyError`` when not live; a no-op after
      ``close``.
    - ``close()``: wait for running I/O, then release everything (files, remote objects).
    - ``tier`` names the tier (``"disk"``, ``"remote"``); ``stats`` is a dataclass with
      ``as_dict()``; ``h in store`` tells whether ``h`` is live there.
    """

    tier: str
    stats: Any

    def put(self, tensor: torch.Tensor) -> Future: ...

    def put_many(self, tensors: Sequence[torch.Tensor]) -> Future: ...

    def get(self, handle: Any, *, into: torch.Tensor | None = None) -> Future: ...

    def get_many(self, handles: Sequence[Any]) -> Future: ...

    def free(self, handle: Any) -> None: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    def __contains__(self, handle: object) -> bool: ...

    def __len__(self) -> int: ...


def shut_down_io(
    executor: ThreadPoolExecutor, cleanup: Callable[[ThreadPoolExecutor], None]
) -> bool:
    """End ``executor`` for a store's ``cleanup(executor)``: queued jobs are cancelled, running ones
    finish. Returns False when the caller is one of its own I/O threads (``close()`` from a
    done-callback of the store's future): joining would join itself ("cannot join current
    thread"), so ``cleanup`` is handed to the reaper thread, which waits for that job too."""
    if threading.current_thread() in getattr(executor, "_threads", ()):
        defer(cleanup, executor)
        return False
    executor.shutdown(wait=True, cancel_futures=True)
    return True


def check_many(items: object, where: str, what: str, single: type | tuple) -> None:
    """``put_many``/``get_many``/``prefetch`` take a list or tuple: a lone tensor would otherwise be
    iterated row by row (each row stored as its own tensor), and a lone handle fail obscurely."""
    if isinstance(items, single) or not isinstance(items, (list, tuple)):
        raise TypeError(f"{where}: expected a list or tuple of {what}, got {type(items).__name__}")


def running() -> Future:
    """A future in the running state, for a store to resolve."""
    done: Future = Future()
    done.set_running_or_notify_cancel()
    return done


def failed(error: BaseException) -> Future:
    """A future that already failed with ``error``."""
    done: Future = Future()
    done.set_exception(error)
    return done


def gather(futures: Sequence[Future], undo: Callable[[Any], None] | None = None) -> Future:
    """A future of the results of ``futures``, in order, once all are done. If any failed, it
    fails with the first error, after ``undo(result)`` of each that succeeded (freeing what was
    stored). It resolves on the thread that finishes the last of them."""
    out = running()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if not errors:
            out.set_result([f.result() for f in futures])
            return
        try:
            if undo is not None:
                for f in futures:
                    if f.exception() is None:
                        undo(f.result())
        finally:
            out.set_exception(errors[0])

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(one_done)
    return out


class StoreBase(Store):
    """What the handle stores share: ``put_many``/``get_many`` from ``put``/``get``, the
    synchronous ``write``/``read``, membership, ``with``, and the never-blocking half of ``free``.

    A subclass sets ``tier`` and ``_handle_type``, keeps ``_live`` (handle id -> handle),
    ``_freed`` (a deque drained by ``_drain_freed_locked`` under ``_lock``) and ``_finalizer``
    (``_lifetime.Finalizer``: alive until ``close``), and implements the abstract methods: a
    store missing one fails at construction (``TypeError`` naming it), not at its first use.
    ``Store``'s metaclass is an ``ABCMeta``, so the protocol and the ABC are one class tree."""

    tier: str = ""
    _handle_type: type = object
    _live: dict
    _freed: collections.deque
    _lock: threading.Lock
    _finalizer: Any

    @abc.abstractmethod
    def put(self, tensor: torch.Tensor) -> Future: ...

    @abc.abstractmethod
    def get(self, handle: Any, *, into: torch.Tensor | None = None) -> Future: ...

    @abc.abstractmethod
    def free(self, handle: Any) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def put_many(self, tensors: Sequence[torch.Tensor]) -> Future:
        """``put`` of each tensor; a future of their handles. A synchronous error (a full tier)
        is raised at once, and the tensors already started are freed once written."""
        check_many(tensors, f"{type(self).__name__}.put_many(tensors)", "tensors", torch.Tensor)
        futures: list[Future] = []
        try:
            for t in tensors:
                futures.append(self.put(t))
        except BaseException:
            for f in futures:  # started before the error: freed once written
                f.add_done_callback(self._free_written)
            raise
        return gather(futures, self._free_if_live)

    def get_many(self, handles: Sequence[Any]) -> Future:
        """``get`` of each handle; a future of the tensors, in order."""
        kind = self._handle_type
        single = () if kind is object else kind  # () matches nothing
        check_many(handles, f"{type(self).__name__}.get_many(handles)", f"{kind.__name__}s", single)
        return gather([self.get(h) for h in handles])

    def write(self, tensor: torch.Tensor) -> Any:
        """Synchronous :meth:`put`."""
        return self.put(tensor).result()

    def read(self, handle: Any) -> torch.Tensor:
        """Synchronous :meth:`get`."""
        return self.get(handle).result()

    def __contains__(self, handle: object) -> bool:
        return isinstance(handle, self._handle_type) and self._live.get(handle.id) is handle

    def __len__(self) -> int:
        return len(self._live)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __reduce__(self):
        raise TypeError(
            f"a {type(self).__name__} belongs to the process that made it (its I/O threads and "
            f"what it holds) and cannot be pickled, e.g. for a Ray task or actor; send the "
            f"tensors (store.read(handle)), or make a store in the process that uses it"
        )

    def __exit__(self, *exc) -> None:
        self.close()

    def _free_if_live(self, handle: Any) -> None:
        if handle in self:
            self.free(handle)

    def _free_written(self, future: Future) -> None:
        if future.exception() is None:
            self._free_if_live(future.result())

    def _unlive(self, handle: Any) -> None:
        """Take ``handle`` out of the live set; ``KeyError`` if it is not live (of two racing
        frees, one wins: ``dict.pop`` is atomic)."""
        if self._live.get(handle.id) is not handle:  # ids are process-wide: no foreign match
            raise KeyError(f"{handle} is not live in this store (freed twice?)")
        if self._live.pop(handle.id, None) is None:
            raise KeyError(f"{handle} is not live in this store (freed twice?)")

    def _drain_soon(self) -> None:
        """Drain the freed queue now if the lock is free at once, else the next holder does."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain_freed_locked()
            finally:
                self._lock.release()

    def _take_freed(self) -> Iterator[Any]:
        """The entries ``free`` queued, oldest first, until the queue is empty (lock held)."""
        while True:
            try:
                yield self._freed.popleft()
            except IndexError:
                return

    @abc.abstractmethod
    def _drain_freed_locked(self) -> None:
        """Give back the space of the handles ``free`` queued (``_take_freed``), lock held."""
