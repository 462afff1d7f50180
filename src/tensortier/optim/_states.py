"""Where a bucket's optimizer state lives between steps: host RAM, the disk tier, or remote memory.

A bucket's state is three flat vectors of its master dtype: the master weights and Adam's two
moments. Every slot (parameter) starts on a 64-byte boundary (:func:`slot_layout`), like a fresh
CPU allocation, so the fused kernel sees each slot exactly as it sees a parameter of
``torch.optim.AdamW(fused=True)``.

Protocol (both tiers). ``load(id, shadow=...)`` hands the update a writable (master, exp_avg,
exp_avg_sq) triple; ``save`` records the result as *pending*; ``drop(id)`` forgets one bucket's
pending result (a speculation that turned out wrong); ``commit`` makes every pending result of
the step the committed state at once, ``abort`` drops them all. ``read`` always returns the
committed state.

Host protocol. ``load(shadow=True)`` copies the committed state into the bucket's *spare* buffer
(allocated on first use, so only optimizers that speculate pay for it) and returns the spare;
``commit`` swaps spare and committed. The committed state is never written by a shadow update,
so dropping a speculation costs nothing and is exact. ``load(shadow=False)`` returns the
committed buffers for an in-place update (the non-speculative path, 12 B/param with fp32
masters). A buffer whose master a device copy is still reading (parameter write-back on CUDA)
carries that copy's event; it is synchronised before the buffer is written again.

Disk protocol (no partial step). Saved states go to *fresh* extents; the extents of the last
committed step stay untouched until ``commit`` has seen every write of this step succeed, then
the old extents are freed. A failed write (``TierFullError``) therefore leaves the committed
state whole, and the optimizer writes parameters back only after ``commit``. The price is disk
space for two copies of the state during a step. Every load reads the committed extents, so a
speculative update never changes what a redo reads.

Host memory bound (disk). All I/O goes through ``depth`` ring buffers of one bucket's state
each, so the optimizer's host memory is ``depth * 3 * bucket_bytes`` whatever the model size.
Reads run ahead (``prefetch``) and writes behind (a buffer returns to the ring when its write
completes), both through the disk store's futures.

Remote memory (``tier="remote"``). :class:`DiskStates` streams from any store with the disk
tier's interface (``put``/``get(into=)``/``free``, futures, handles): a
:class:`~tensortier.tiers.remote.RemoteStore` holds the extents in other nodes' RAM under the same
protocol. A lost memory node fails the reads of its buckets with ``NodeLostError`` (raised by
``load``, so from ``step()``); a caller-owned store is left open by ``close``.

Waits: ring-buffer takes poll with a timeout and steal read-aheads (no deadlock); disk futures
complete or fail through the disk store; CUDA events complete once the copies queued before them
ran (they cannot hang unless the device does).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from tensortier._units import align_up, format_size, format_size_up
from tensortier.errors import ConfigError, TierFullError
from tensortier.tiers.disk import DiskHandle, DiskStore
from tensortier.tiers.host import PAGE, aligned_empty

if TYPE_CHECKING:  # Ray is imported only when a RemoteStore is made
    from tensortier.tiers.remote import RemoteStore

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # master, exp_avg, exp_avg_sq
ALIGN = 64  # bytes: c10's CPU allocator alignment, and ATen's fused-kernel task unit


def slot_layout(numels: list[int], element_size: int) -> tuple[list[int], int]:
    """Element offsets of consecutive slots, each on a 64-byte boundary, and the padded total."""
    unit = max(1, ALIGN // element_size)
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off = align_up(off + n, unit)
    return offsets, off


class _HostBuf:
    """One copy of a bucket's state: the master (pinned for CUDA write-back) and the moments.

    ``master=False``: the parameters are the masters (``HostStates.add``); the master vector
    stays empty until a shadow update needs one (``ensure_master``).
    """

    __slots__ = (
        "master",
        "exp_avg",
        "exp_avg_sq",
        "event",
        "nbytes",
        "gen",
        "copy_of",
        "_pin",
        "_views",
    )

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, master: bool = True):
        es = torch.empty((), dtype=dtype).element_size()
        self._pin = pin
        self.master = torch.empty(0, dtype=dtype)
        mv = aligned_empty(2 * numel * es, alignment=ALIGN).view(dtype)
        mv.zero_()
        self.exp_avg, self.exp_avg_sq = mv[:numel], mv[numel:]
        self.event = None  # CUDA event of the last device copy reading ``master``
        self.nbytes = 2 * numel * es
        self.gen = 0  # bumped whenever the content is about to change in place
        self.copy_of: tuple | None = None  # (buffer, its gen) this one is an exact copy of
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if master:
            self.ensure_master()

    def ensure_master(self) -> torch.Tensor:
        """The master vector, allocated (zeroed) on first use."""
        numel, dtype = self.exp_avg.numel(), self.exp_avg.dtype
        if self.master.numel() != numel:
            es = self.master.element_size()
            self.master = aligned_empty(numel * es, pin=self._pin, alignment=ALIGN).view(dtype)
            self.master.zero_()
            self.nbytes += numel * es
        return self.master

    @property
    def state(self) -> State:
        return self.master, self.exp_avg, self.exp_avg_sq

    def moments(self, slots) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The slots' views of exp_avg and exp_avg_sq, made once (slicing costs ~1 us a view)."""
        ms, vs = [], []
        for s in slots:
            key = (s.offset, s.numel)
            views = self._views.get(key)
            if views is None:
                sl = slice(s.offset, s.offset + s.numel)
                views = self._views[key] = (self.exp_avg[sl], self.exp_avg_sq[sl])
            ms.append(views[0])
            vs.append(views[1])
        return ms, vs

    def ready_to_write(self) -> None:
        """Wait until no device copy reads this buffer any more (a CUDA event: cannot hang)."""
        ev, self.event = self.event, None
        if ev is not None:
            ev.synchronize()


class HostStates:
    """Every bucket's state resident in host RAM; speculative updates go to a spare copy."""

    # CPU parameters of the master dtype can be their own masters: updated in place, as
    # torch.optim.AdamW does, with no master copy and no write-back (``add(master=False)``)
    params_as_masters = True

    def __init__(self, pin: bool = False) -> None:
        self._pin = pin
        self._meta: dict[int, tuple[int, torch.dtype, bool]] = {}
        self._committed: dict[int, _HostBuf] = {}
        self._spare: dict[int, _HostBuf] = {}
        self._pending: set[int] = set()

    def add(self, bucket_id: int, numel: int, dtype: torch.dtype, *, master: bool = True) -> None:
        """``master=False``: the bucket's parameters are its masters; the committed state holds
        only the moments, and a shadow update gets a master vector in the spare to copy them to."""
        self._meta[bucket_id] = (numel, dtype, master)
        self._committed[bucket_id] = _HostBuf(numel, dtype, self._pin, master)

    def has(self, bucket_id: int) -> bool:
        return True

    def load(self, bucket_id: int, shadow: bool = False) -> tuple[object, State, bool]:
        """(token, writable state, fresh). ``shadow``: a copy; the committed state stays as it is."""
        committed = self._committed[bucket_id]
        if not shadow:
            committed.ready_to_write()
            committed.gen += 1
            return committed, committed.state, False
        spare = self.prepare(bucket_id)
        spare.copy_of = None  # about to be written
        spare.ensure_master()  # parameters as masters: the update copies them in first
        return spare, spare.state, False

    def prepare(self, bucket_id: int) -> _HostBuf:
        """Make the spare an exact copy of the committed state, unless it already is one.

        The optimizer runs this on its worker right after a step (overlapping the next forward),
        so a speculative ``load`` during backward finds the copy made.
        """
        committed = self._committed[bucket_id]
        spare = self._spare.get(bucket_id)
        if spare is None:
            numel, dtype, master = self._meta[bucket_id]
            spare = self._spare[bucket_id] = _HostBuf(numel, dtype, self._pin, master)
        key = (committed, committed.gen)
        if spare.copy_of is None or spare.copy_of[0] is not committed or spare.copy_of[1] != key[1]:
            spare.ready_to_write()
            first = 0 if self._meta[bucket_id][2] else 1  # parameters as masters: moments only
            for dst, src in zip(spare.state[first:], committed.state[first:]):
                dst.copy_(src)
            spare.copy_of = key
        return spare

    def save(self, bucket_id: int, token: object, state: State) -> None:
        if token is not self._committed[bucket_id]:
            self._pending.add(bucket_id)

    def blank(self, bucket_id: int) -> tuple[object, State]:
        self._pending.discard(bucket_id)
        b = self._committed[bucket_id]
        b.ready_to_write()
        b.gen += 1
        for t in b.state:
            t.zero_()
        return b, b.state

    def discard(self, token: object) -> None:
        pass

    def drop(self, bucket_id: int) -> None:
        self._pending.discard(bucket_id)

    def read(self, bucket_id: int) -> State:
        return self._committed[bucket_id].state

    def latest(self, bucket_id: int) -> _HostBuf:
        """The buffer holding this step's result for the bucket (pending spare, else committed)."""
        if bucket_id in self._pending:
            return self._spare[bucket_id]
        return self._committed[bucket_id]

    def prefetch(self, bucket_ids: list[int]) -> None:
        pass

    def commit(self) -> None:
        for i in self._pending:
            self._committed[i], self._spare[i] = self._spare[i], self._committed[i]
            self._spare[i].copy_of = None
        self._pending.clear()

    def abort(self) -> None:
        self._pending.clear()

    def write_error(self) -> BaseException | None:
        return None  # nothing is written asynchronously

    def masters(self, bucket_ids: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
        for i in bucket_ids:
            yield i, self._committed[i].master

    @property
    def host_bytes(self) -> int:
        """Committed state plus the spares speculation allocated (a second copy of the state)."""
        return sum(b.nbytes for b in self._committed.values()) + sum(
            b.nbytes for b in self._spare.values()
        )

    def close(self) -> None:
        self._committed.clear()
        self._spare.clear()
        self._pending.clear()


class _Layout:
    """Byte layout of a ring buffer: [master | pad to page | exp_avg, exp_avg_sq | pad]."""

    def __init__(self, numel: int, dtype: torch.dtype):
        es = torch.empty((), dtype=dtype).element_size()
        self.numel, self.dtype = numel, dtype
        self.master_bytes = numel * es
        self.mv_offset = align_up(self.master_bytes, PAGE)
        self.total = self.mv_offset + align_up(2 * numel * es, PAGE)

    def views(self, buf: torch.Tensor) -> State:
        master = buf[: self.master_bytes].view(self.dtype)
        mv = buf[self.mv_offset : self.mv_offset + 2 * self.master_bytes].view(self.dtype)
        return master, mv[: self.numel], mv[self.numel :]

    def mv(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.mv_offset : self.mv_offset + 2 * self.master_bytes].view(self.dtype)


class DiskStates:
    """Bucket states in a :class:`DiskStore` (or a ``RemoteStore``: same interface), streamed
    through ``depth`` host ring buffers. ``owns_store``: ``close`` closes the store."""

    # masters are stored with the moments: parameters change only after ``commit`` (no partial step)
    params_as_masters = False

    def __init__(
        self, store: DiskStore | RemoteStore, depth: int, pin: bool = False, owns_store: bool = True
    ):
        if depth < 2:
            raise ConfigError(
                f"pipeline depth must be >= 2 (one buffer reading, one writing), got {depth}"
            )
        self.store, self.depth, self._pin = store, depth, pin
        self._owns_store = owns_store
        self._layouts: dict[int, _Layout] = {}
        self._committed: dict[int, tuple[DiskHandle, DiskHandle]] = {}
        self._pending: dict[int, tuple[Future, Future]] = {}
        self._reads: dict[int, tuple[torch.Tensor, Future, Future]] = {}
        self._ring: queue.Queue[torch.Tensor] = queue.Queue()
        self._buffer_bytes = 0
        self._lock = threading.Lock()

    def add(self, bucket_id: int, numel: int, dtype: torch.dtype, *, master: bool = True) -> None:
        layout = _Layout(numel, dtype)
        self._layouts[bucket_id] = layout
        if layout.total > self._buffer_bytes:  # (re)size the ring to the largest bucket
            self._drain_ring()
            self._buffer_bytes = layout.total
            for _ in range(self.depth):
                self._ring.put(aligned_empty(layout.total, pin=self._pin))

    def _drain_ring(self) -> None:
        for _ in range(self.depth if self._buffer_bytes else 0):
            self._ring.get()

    @property
    def host_bytes(self) -> int:
        return self.depth * self._buffer_bytes

    def has(self, bucket_id: int) -> bool:
        return bucket_id in self._committed

    # ------------------------------------------------------------ buffers
    def _take(self, avoid: int) -> torch.Tensor:
        """A free ring buffer; steals one from a read-ahead of another bucket rather than deadlock."""
        while True:
            try:
                return self._ring.get(timeout=0.05)
            except queue.Empty:
                with self._lock:
                    victim = next((i for i in self._reads if i != avoid), None)
                    read = self._reads.pop(victim) if victim is not None else None
                if read is not None:
                    buf, f1, f2 = read
                    for f in (f1, f2):
                        f.exception()
                    return buf

    def _release(self, buf: torch.Tensor) -> None:
        self._ring.put(buf)

    def _start_read(self, bucket_id: int, buf: torch.Tensor) -> tuple[Future, Future]:
        layout = self._layouts[bucket_id]
        hm, hmv = self._committed[bucket_id]  # never a pending copy: a redo starts from committed
        f1 = self.store.get(hm, into=buf[: layout.mv_offset])
        f2 = self.store.get(hmv, into=buf[layout.mv_offset :])
        return f1, f2

    # ------------------------------------------------------------ protocol
    def prefetch(self, bucket_ids: list[int]) -> None:
        """Start reading these buckets' states into free ring buffers, never waiting for one."""
        for i in bucket_ids:
            with self._lock:
                if i in self._reads or i in self._pending or i not in self._committed:
                    continue
            try:
                buf = self._ring.get_nowait()
            except queue.Empty:
                return
            f1, f2 = self._start_read(i, buf)
            with self._lock:
                self._reads[i] = (buf, f1, f2)

    def load(self, bucket_id: int, shadow: bool = True) -> tuple[object, State, bool]:
        """(token, state, fresh): a ring buffer holding the committed state; zeros when never saved.

        Always a copy (``shadow`` is implied): saves go to fresh extents.
        """
        layout = self._layouts[bucket_id]
        with self._lock:
            read = self._reads.pop(bucket_id, None)
        if read is not None:
            buf, f1, f2 = read
        else:
            buf = self._take(avoid=bucket_id)
            if not self.has(bucket_id):
                buf.zero_()
                return buf, layout.views(buf), True
            f1, f2 = self._start_read(bucket_id, buf)
        try:
            f1.result()
            f2.result()
        except BaseException:
            self._release(buf)
            raise
        return buf, layout.views(buf), False

    def blank(self, bucket_id: int) -> tuple[object, State]:
        """A zeroed ring buffer to fill with a state to ``save`` (used by ``load_state_dict``)."""
        buf = self._take(avoid=bucket_id)
        buf.zero_()
        return buf, self._layouts[bucket_id].views(buf)

    def discard(self, token: object) -> None:
        """Give back a buffer from ``load``/``blank`` that will not be saved."""
        self._release(token)

    def read(self, bucket_id: int) -> State:
        """A private copy of the committed state (zeros when never saved)."""
        token, state, _ = self.load(bucket_id)
        try:
            return tuple(t.clone() for t in state)
        finally:
            self._release(token)

    def save(self, bucket_id: int, token: object, state: State) -> None:
        """Write the state to fresh extents (write-behind); the buffer returns when both writes end.

        Takes ownership of ``token``: it goes back to the ring exactly once, also when this raises
        (so a caller never ``discard``s a token it passed here)."""
        buf = token
        layout = self._layouts[bucket_id]
        try:
            f1 = self.store.put(state[0])
            try:
                f2 = self.store.put(layout.mv(buf))
            except BaseException:
                f1.add_done_callback(
                    lambda f: f.exception() is None and self.store.free(f.result())
                )
                raise
        except TierFullError as exc:
            self._release(buf)
            raise self._too_small(exc) from exc
        except BaseException:
            self._release(buf)
            raise
        left = [2]

        def done(_f: Future) -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._release(buf)

        f1.add_done_callback(done)
        f2.add_done_callback(done)
        previous = self._pending.get(bucket_id)
        self._pending[bucket_id] = (f1, f2)
        if previous is not None:  # superseded within the step: its reads are over, free it
            for h in (f.result() for f in previous):
                self.store.free(h)

    def _too_small(self, exc: TierFullError) -> TierFullError:
        """The store's "free tensors or raise the budget" names nothing the optimizer's user can
        free: say what the budget must hold (a step writes a fresh copy of every bucket before it
        frees the old ones, so a failed step changes nothing; free space also fragments, hence
        the largest bucket on top)."""
        sizes = [layout.total for layout in self._layouts.values()]
        need = 2 * sum(sizes) + max(sizes)
        what = "disk_budget" if isinstance(self.store, DiskStore) else "the RemoteStore's budget"
        return TierFullError(
            f"OffloadedAdamW's states do not fit: {exc} A step writes a fresh copy of each "
            f"bucket's state before it frees the old one (a failed step changes nothing), so "
            f"{what} must hold the state ({format_size(sum(sizes))}) twice plus its largest "
            f"bucket: pass at least {format_size_up(need)}",
            tier=exc.tier,
            requested=exc.requested,
            in_use=exc.in_use,
            limit=exc.limit,
        )

    def drop(self, bucket_id: int) -> None:
        """Forget this bucket's pending save; its fresh extents are freed once their writes end."""
        pending = self._pending.pop(bucket_id, None)
        for f in pending or ():
            f.add_done_callback(lambda f: f.exception() is None and self.store.free(f.result()))

    def _settle(self) -> tuple[dict[int, tuple[DiskHandle, DiskHandle]], BaseException | None]:
        ok, error = {}, None
        for i, (f1, f2) in self._pending.items():
            handles = []
            for f in (f1, f2):
                exc = f.exception()
                if exc is None:
                    handles.append(f.result())
                elif error is None:
                    error = exc
            if len(handles) == 2:
                ok[i] = (handles[0], handles[1])
            else:
                for h in handles:
                    self.store.free(h)
        self._pending.clear()
        return ok, error

    def write_error(self) -> BaseException | None:
        """Wait for this step's writes; the first error, without committing or dropping anything
        (sharded optimizers agree across ranks on it before any rank commits)."""
        for futures in list(self._pending.values()):
            for f in futures:
                exc = f.exception()  # completes or fails through the disk store
                if exc is not None:
                    return exc
        return None

    def commit(self) -> None:
        """All writes of the step succeeded: free the old extents. Otherwise drop the new ones, raise."""
        ok, error = self._settle()
        if error is not None:
            for hs in ok.values():
                for h in hs:
                    self.store.free(h)
            raise error
        for i in ok:  # a read-ahead taken before this commit holds the old state: drop it
            with self._lock:
                read = self._reads.pop(i, None)
            if read is not None:
                read[1].exception()
                read[2].exception()
                self._release(read[0])
        for i, hs in ok.items():
            old = self._committed.get(i)
            self._committed[i] = hs
            if old is not None:
                for h in old:
                    self.store.free(h)

    def abort(self) -> None:
        ok, _ = self._settle()
        for hs in ok.values():
            for h in hs:
                self.store.free(h)

    def drop_prefetch(self) -> None:
        with self._lock:
            reads, self._reads = self._reads, {}
        for buf, f1, f2 in reads.values():
            f1.exception()
            f2.exception()
            self._release(buf)

    def masters(self, bucket_ids: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """Committed master weights of these buckets, read ``depth - 1`` buckets ahead."""
        self.drop_prefetch()
        inflight: deque = deque()
        todo = deque(i for i in bucket_ids if i in self._committed)
        try:
            while todo or inflight:
                while todo and len(inflight) < self.depth - 1:
                    i = todo.popleft()
                    buf = self._take(avoid=i)
                    layout = self._layouts[i]
                    hm = self._committed[i][0]
                    inflight.append((i, buf, self.store.get(hm, into=buf[: layout.mv_offset])))
                i, buf, fut = inflight.popleft()
                try:
                    fut.result()
                    yield i, self._layouts[i].views(buf)[0]
                finally:
                    self._release(buf)
        finally:  # consumer stopped early or a read failed: settle the rest, return their buffers
            for _, buf, fut in inflight:
                fut.exception()
                self._release(buf)

    def close(self) -> None:
        self.drop_prefetch()
        self.abort()
        if self._owns_store:
            self.store.close()
            return
        for hs in self._committed.values():  # the caller's store stays open: give its memory back
            for h in hs:
                if h in self.store:
                    self.store.free(h)
        self._committed.clear()
