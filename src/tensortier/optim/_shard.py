"""How ``OffloadedAdamW`` splits its state across data-parallel ranks, and brings updates back.

ZeRO-1/2 partition (DeepSpeed's "ZeRO-Offload" with the update on the host). Every rank builds
the same buckets of whole parameters (``bucket_size`` each, as without sharding); inside a bucket
each rank *owns* a part of every parameter and keeps master weights and Adam moments for that
part only, so the host state per rank is 1/N of the unsharded optimizer's, within a bucket.

Which part. A parameter is cut like ``DTensor``'s ``Shard(0)`` (``torch.chunk`` of its rows: rank
r owns rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / N)``), so its state *is* a DTensor's local
shard and DCP can save and reshard it. The cut is used only when it falls on a 64-byte boundary
of the master dtype: the fused AdamW kernel takes a scalar path for the last ``numel % width``
elements of each tensor it is given, and a cut elsewhere would send other elements through it,
changing bits (measured: 58 of 200 random splits differed; 0 of 200 at 64-byte multiples, with
AVX-512, AVX2 and the default ATen build). Parameters that cannot be cut that way (small, odd
row sizes, non-contiguous) are owned whole by the least-loaded rank. Frozen parameters are owned
by nobody.

Bringing updates back. Every bucket's updated values are exchanged with one asynchronous
``all_gather`` of a byte buffer (the same fixed layout on every rank: per rank a failure byte and
a flag byte per piece, then each piece at a 64-byte offset, in the parameter's dtype), then copied
into the parameters. Only pieces that were updated this step (flag set) are written, so a parameter
without a gradient keeps whatever it holds, as with ``torch.optim.AdamW``.

This module never runs an update and never holds optimizer state.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tensortier import _dist
from tensortier._units import align_up

ALIGN = 64  # bytes: the fused kernel's vector unit (see _kernel.py) and the gather layout's


@dataclass(frozen=True)
class Piece:
    """Flat elements ``[start, stop)`` of parameter ``index`` of a bucket."""

    index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def row_cuts(p: torch.Tensor, world: int, unit: int) -> list[tuple[int, int]] | None:
    """Per rank, the flat range ``Shard(0)`` gives it; None if a cut is not a multiple of ``unit``."""
    if p.dim() == 0 or not p.is_contiguous() or p.shape[0] == 0:
        return None
    rows, n = p.shape[0], p.numel()
    chunk = -(-rows // world) * (n // rows)
    if chunk % unit:
        return None
    return [(min(r * chunk, n), min((r + 1) * chunk, n)) for r in range(world)]


def partition(
    params: list[torch.Tensor], world: int, unit: int, load: list[int], element_size: int
) -> list[list[Piece]]:
    """Pieces of ``params`` each rank owns; ``load`` (bytes per rank) is updated, for balance."""
    out: list[list[Piece]] = [[] for _ in range(world)]
    for i, p in enumerate(params):
        if not p.requires_grad:
            continue
        cuts = row_cuts(p, world, unit) if p.numel() else None
        if cuts is None:  # owned whole by the least-loaded rank (lowest rank on ties)
            owner = min(range(world), key=lambda r: (load[r], r))
            if not p.numel():  # an empty piece: its step and empty moments, as torch.optim keeps
                out[owner].append(Piece(i, 0, 0))
                continue
            cuts = [(0, p.numel()) if r == owner else (0, 0) for r in range(world)]
        for r, (a, b) in enumerate(cuts):
            if b > a:
                out[r].append(Piece(i, a, b))
                load[r] += (b - a) * element_size
    return out


def flat_view(p: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's elements of ``p`` (a parameter or its gradient) as a 1-D tensor."""
    if piece.start == 0 and piece.stop == p.numel():
        return p.reshape(-1)
    return p.reshape(-1)[piece.start : piece.stop]


def write_piece(p: torch.Tensor, piece: Piece, values: torch.Tensor) -> None:
    """Copy flat ``values`` into the piece of parameter ``p`` (in its dtype, on its device)."""
    if piece.start == 0 and piece.stop == p.numel():
        p.detach().copy_(values.view(p.shape))
    else:  # only contiguous parameters are cut (row_cuts), so this is a view
        p.detach().view(-1)[piece.start : piece.stop].copy_(values)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class GatherPlan:
    """The byte layout of one bucket's all-gather (identical on every rank)."""

    def __init__(self, params: list[torch.Tensor], pieces: list[list[Piece]]):
        self.params = params
        self.pieces = pieces
        self.offsets, self.segment = self._layout([p.element_size() for p in params])
        self._by_dtype: dict[torch.dtype, tuple[list[list[int]], int]] = {}

    def _layout(self, sizes: list[int]) -> tuple[list[list[int]], int]:
        """Per rank: a failure byte and a flag byte per piece, then each piece at a 64-byte
        offset; the common segment size."""
        offsets, seg = [], 0
        for mine in self.pieces:
            off = align_up(len(mine) + 1, ALIGN)
            offs = []
            for pc in mine:
                offs.append(off)
                off = align_up(off + pc.numel * sizes[pc.index], ALIGN)
            offsets.append(offs)
            seg = max(seg, off)
        return offsets, max(seg, ALIGN)

    def _for(self, dtype: torch.dtype) -> tuple[list[list[int]], int]:
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = self._layout([_size(dtype)] * len(self.params))
        return self._by_dtype[dtype]

    def offsets_for(self, dtype: torch.dtype) -> list[list[int]]:
        return self._for(dtype)[0]

    def segment_for(self, dtype: torch.dtype) -> int:
        return self._for(dtype)[1]


class Gathering:
    """One bucket's all-gather, issued (``Gatherer.start``) and not yet written out.

    ``failed``: after ``Gatherer.finish``, the lowest rank that set its failure byte, or None.
    """

    def __init__(self, plan: GatherPlan, dest, dtype: torch.dtype | None, flag_bytes: int):
        self.plan, self.dest, self.dtype = plan, dest, dtype
        self.offsets = plan.offsets if dtype is None else plan.offsets_for(dtype)
        self.flag_bytes = flag_bytes
        self.targets: dict[tuple[int, int], torch.Tensor] = {}  # (rank, k) -> destination bytes
        self.finish: list[tuple[int, Piece, torch.Tensor]] = []  # strided: written when complete
        self.written: set[int] = set()
        self.failed: int | None = None
        self.rounds_left = 0


@dataclass
class _Round:
    """One collective of a gathering: segment bytes ``[lo, lo + n)`` of every rank, in ``out``."""

    g: Gathering
    lo: int
    n: int
    buf: torch.Tensor  # the whole buffer (``out`` is its first ``n * world`` bytes)
    work: object  # torch.distributed's Work handle (async_op=True)


class Gatherer:
    """Runs the per-bucket all-gathers of updated values through a few bounded, reused buffers.

    A bucket's segment is exchanged in rounds of at most ``max_bytes / world`` bytes per rank
    (64-byte multiples), so a buffer is ``max_bytes`` whatever the size of the largest parameter
    (a 50k x 4096 embedding would otherwise need its own 800 MB buffer). Rounds are issued
    asynchronously (``async_op=True``: gloo runs them on its own thread, NCCL on its stream), at
    most ``depth`` in flight, and completed in issue order: a completed round's bytes are copied
    straight into their destinations. ``start`` issues a bucket, ``finish`` completes it, so a
    caller can update the next bucket while one is on the wire (``_zero.ShardedStep``).
    """

    def __init__(self, group, world: int, rank: int, max_bytes: int = 4 << 20, depth: int = 2):
        self.group, self.world, self.rank = group, world, rank
        self.max_bytes = max_bytes
        self.depth = depth
        self._free: list[torch.Tensor] = []  # buffers of the comm device not in flight
        self._inflight: deque[_Round] = deque()
        self.bytes_sent = 0
        self.collectives = 0

    @property
    def host_bytes(self) -> int:
        bufs = self._free + [r.buf for r in self._inflight]
        return sum(b.numel() for b in bufs if b.device.type == "cpu")

    def gather(
        self,
        plan: GatherPlan,
        values: dict[int, torch.Tensor],
        dest=None,
        dtype: torch.dtype | None = None,
    ) -> set[int]:
        """``start`` then ``finish``: the indices (in the bucket) of the parameters written."""
        g = self.start(plan, values, dest=dest, dtype=dtype)
        self.finish(g)
        return g.written

    def start(
        self,
        plan: GatherPlan,
        values: dict[int, torch.Tensor],
        *,
        failed: bool = False,
        dest=None,
        dtype: torch.dtype | None = None,
    ) -> Gathering:
        """Issue the exchange of this rank's updated pieces (``values``: position in
        ``plan.pieces[rank]`` -> new flat values, copied out before this returns) and of its
        failure byte ``failed``. ``finish`` writes every rank's updated pieces into the parameters,
        or into ``dest(index, piece)`` (a contiguous flat tensor to fill) in ``dtype`` (state
        gathering). A collective: every rank starts every bucket, in the same order, even with
        nothing to send.
        """
        device = _dist.comm_device(self.group)
        seg = plan.segment if dtype is None else plan.segment_for(dtype)
        flag_bytes = align_up(max(len(p) for p in plan.pieces) + 1, ALIGN)
        chunk = max(flag_bytes, self.max_bytes // self.world // ALIGN * ALIGN, ALIGN)
        g = Gathering(plan, dest, dtype, flag_bytes)
        src: dict[int, torch.Tensor] = {}  # this rank's updated pieces as bytes
        for k, pc in enumerate(plan.pieces[self.rank]):
            v = values.get(k)
            if v is not None:
                dt = dtype or plan.params[pc.index].dtype
                src[k] = v.to(dt).contiguous().view(torch.uint8)
        gather = getattr(torch.distributed, "all_gather_single", None)
        gather = gather or torch.distributed.all_gather_into_tensor
        for lo in range(0, seg, chunk):
            n = min(lo + chunk, seg) - lo
            buf = self._take(device, n * self.world)
            out = buf[: n * self.world]
            send = out[self.rank * n : (self.rank + 1) * n]
            if lo == 0:
                send[:flag_bytes].zero_()
                send[0] = int(failed)
                for k in src:
                    send[1 + k] = 1
            for k, data in src.items():
                _copy_range(send, lo, lo + n, g.offsets[self.rank][k], data, to_window=True)
            work = gather(out, send, group=self.group, async_op=True)
            self._inflight.append(_Round(g, lo, n, buf, work))
            g.rounds_left += 1
            self.collectives += 1
            self.bytes_sent += n
        return g

    def finish(self, g: Gathering) -> None:
        """Complete every round issued up to ``g``'s last (in issue order)."""
        while g.rounds_left:
            self._complete(self._inflight.popleft())

    def _take(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A buffer for a round: a free one, a new one, or the oldest round's once complete."""
        while len(self._inflight) >= self.depth:
            self._complete(self._inflight.popleft())
        for i, buf in enumerate(self._free):
            if buf.device == device and buf.numel() >= nbytes:
                return self._free.pop(i)
        if len(self._free) + len(self._inflight) >= self.depth:
            self._free.pop(0)  # too small or on another device: replaced
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _complete(self, r: _Round) -> None:
        """Wait for round ``r`` and copy every updated piece's bytes in it to its destination."""
        g, n = r.g, r.n
        r.work.wait()  # at most the process group's timeout
        out, plan = r.buf[: n * self.world], g.plan
        if r.lo == 0:
            heads = out.view(self.world, n)[:, : g.flag_bytes].tolist()
            g.failed = next((q for q in range(self.world) if heads[q][0]), None)
            for q, pieces in enumerate(plan.pieces):
                for k, pc in enumerate(pieces):
                    if heads[q][1 + k]:
                        g.targets[(q, k)] = self._target(plan, pc, g.dest, g.dtype, g.finish)
                        g.written.add(pc.index)
        for (q, k), t in g.targets.items():
            window = out[q * n : (q + 1) * n]
            _copy_range(window, r.lo, r.lo + n, g.offsets[q][k], t, to_window=False)
        self._free.append(r.buf)
        g.rounds_left -= 1
        if not g.rounds_left:
            for i, pc, tmp in g.finish:  # non-contiguous parameters: written once complete
                write_piece(plan.params[i], pc, tmp)

    @staticmethod
    def _target(plan, pc, dest, dtype, finish) -> torch.Tensor:
        """Where piece ``pc``'s bytes go: a byte view of its destination."""
        if dest is not None:
            return dest(pc.index, pc).view(torch.uint8)
        p = plan.params[pc.index].detach()
        if p.is_contiguous():
            return p.view(-1)[pc.start : pc.stop].view(torch.uint8)
        tmp = torch.empty(pc.numel, dtype=p.dtype, device=p.device)  # whole-owned, strided
        finish.append((pc.index, pc, tmp))
        return tmp.view(torch.uint8)


def _copy_range(window, lo, hi, offset, data, *, to_window: bool) -> None:
    """Copy between a round's window (segment bytes ``[lo, hi)``) and a piece's bytes ``data``
    (at ``offset`` in the segment): the overlap only."""
    a, b = max(lo, offset), min(hi, offset + data.numel())
    if a >= b:
        return
    if to_window:
        window[a - lo : b - lo].copy_(data[a - offset : b - offset])
    else:
        data[a - offset : b - offset].copy_(window[a - lo : b - lo])


def _destroy_group(group) -> None:
    """Release ``group`` on this rank (not a collective). Nothing to do when torch.distributed was
    torn down first: ``destroy_process_group()`` of the world already dropped every group."""
    try:
        torch.distributed.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": already gone
        pass


class GatherThread:
    """Deferred all-gathers (``defer_gather=True``): ``step()`` hands each updated bucket here and
    returns; a thread runs the gathers over a process group of its own and writes the parameters.

    Why a group of its own: a process group runs its collectives in issue order, so the user's
    own collectives (DDP's included) on the training group would queue behind the gathers; and
    collectives issued from a thread could interleave with those differently on each rank.
    A step's :meth:`check` (the ranks' agreement on its branch and failures) runs here too,
    ahead of its gathers. On their own group only this thread issues, in hand-over order
    (the same on every rank). A step's items are held until :meth:`release` (the next
    forward's first module, or any wait) or at most ``hold_s``, so nothing runs beside the rest
    of ``step()``. Items
    are numbered; ``wait(n)`` returns once item ``n`` and every
    earlier one are written. A failed gather is kept and raised by every later wait (parameters
    may be partly written: the run cannot go on); a check's error is raised once.
    """

    hold_s = 0.01  # the longest a step's gathers wait for a reader to release them

    def __init__(self, group, world: int, rank: int):
        self.gatherer = Gatherer(group, world, rank)
        self.group = group  # this thread's own (``_dist.new_group_like``): destroyed by close()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._go = threading.Event()  # set by release(): a step's check may run
        self._holding = False  # a step was handed over and not released yet
        self._drop = 0  # items still to skip (a check said the ranks took different branches)
        self._notice: tuple[int, BaseException] | None = None  # raised once, when item n is done
        self._cond = threading.Condition()
        self._issued = 0  # items handed over (numbered 1, 2, ...)
        self._done = 0  # items written
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tt-adamw-gather", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        return self._done < self._issued

    @property
    def held(self) -> bool:
        return self._holding

    def submit(
        self, plan: GatherPlan, values: dict[int, torch.Tensor], written: Callable[[], None]
    ) -> int:
        """Queue one bucket's gather, after its step's :meth:`check` (``values`` must stay
        unchanged until it is waited for); ``written`` runs on the thread once the parameters
        are written. Returns its number."""
        self._issued += 1
        self._queue.put(("gather", self._issued, plan, values, written))
        return self._issued

    def check(
        self,
        flags: list[float],
        count: int,
        judge: Callable[[list[float]], tuple[bool, BaseException | None]],
    ) -> int:
        """Queue a step's check, ahead of its ``count`` gathers; the thread holds it until
        :meth:`release` or ``hold_s``, then all-reduces (MAX) ``flags`` over its group, and
        ``judge(reduced)`` says whether to drop those gathers (issued by no rank) and what error
        the next wait raises once, after them."""
        self._issued += 1
        self._go.clear()  # the last step's release is spent (every wait releases)
        self._holding = True
        self._queue.put(("check", self._issued, flags, count, judge))
        return self._issued

    @property
    def busy(self) -> bool:
        """Gathers not yet written, or an error the next wait raises."""
        return self.pending or self._notice is not None

    def release(self) -> None:
        """Let the thread run the step handed over (the first read of a parameter does it;
        until then, at most ``hold_s``, the caller's ``step()`` and ``zero_grad()`` have the
        cores: measured on 2 gloo ranks on 2 cores, a thread woken inside ``step()`` competes
        with its tail for the core and the GIL)."""
        if self._holding:
            self._holding = False
            self._go.set()

    def wait(self, n: int | None = None) -> None:
        """Until item ``n`` (default: the last handed over) is written; raises a failed gather's
        error, or once a check's error when its step's gathers are done. Bounded: each
        collective waits at most the process group's timeout."""
        self.release()
        n = self._issued if n is None else n
        with self._cond:
            while self._done < n and self._error is None:
                self._cond.wait()
            notice = self._notice
            if notice is not None and self._done >= notice[0]:
                self._notice = None
        if self._error is not None:
            raise RuntimeError(
                "OffloadedAdamW: a deferred parameter all-gather failed; parameters may be "
                "partly updated: restore from a checkpoint"
            ) from self._error
        if notice is not None and self._done >= notice[0]:
            raise notice[1]

    def close(self) -> None:
        """Write what is pending, stop the thread, and destroy its process group (each optimizer
        makes one: without this, every closed or collected optimizer leaked a gloo group, its
        sockets and its threads)."""
        self.release()
        self._queue.put(None)
        self._thread.join()
        _destroy_group(self.group)

    def _run(self) -> None:
        inflight: deque[tuple[int, Gathering, Callable[[], None]]] = deque()
        while True:
            try:  # block only when nothing is on the wire
                item = self._queue.get(block=not inflight)
            except queue.Empty:
                item = ()
            try:
                if item and item[0] == "check" and self._error is None:  # ahead of its gathers
                    self._go.wait(self.hold_s)  # bounded: a rank that reads nothing (rank-0-only
                    # logging, then a barrier) would otherwise hold its peers' gathers forever
                    self._written(inflight, keep=0)
                    self._run_check(*item[1:])
                    self._mark(item[1])
                elif item and (self._drop or self._error is not None):
                    self._drop = max(0, self._drop - 1)  # the ranks disagreed: no rank issues it
                    self._mark(item[1])
                elif item:
                    _, n, plan, values, written = item
                    inflight.append((n, self.gatherer.start(plan, values), written))
                self._written(inflight, keep=1 if item else 0)  # the newest stays on the wire
            except BaseException as exc:  # every later wait raises it
                inflight.clear()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                if item:
                    self._mark(item[1])
            if item is None:
                return

    def _written(self, inflight: deque, keep: int) -> None:
        """Complete the oldest gathers (written while the next is on the wire) down to ``keep``."""
        while len(inflight) > keep:
            n, g, written = inflight.popleft()
            self.gatherer.finish(g)
            written()
            self._mark(n)

    def _run_check(self, n: int, flags: list[float], count: int, judge) -> None:
        """A step's check: all-reduce the ranks' flags; drop its ``count`` gathers or note the
        error the first wait after them raises, as ``judge`` says."""
        t = torch.tensor(flags, dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        drop, error = judge(t.tolist())
        self._drop = count if drop else 0
        if error is not None:
            with self._cond:
                self._notice = (n + count, error)

    def _mark(self, n: int) -> None:
        with self._cond:
            self._done = max(self._done, n)
            self._cond.notify_all()
