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

Bringing updates back. After the step every bucket's updated values are exchanged with one
``all_gather`` of a byte buffer (the same fixed layout on every rank: per rank a flag byte per
piece, then each piece at a 64-byte offset, in the parameter's dtype), then copied into the
parameters. Only pieces that were updated this step (flag set) are written, so a parameter
without a gradient keeps whatever it holds, as with ``torch.optim.AdamW``.

This module never runs an update and never holds optimizer state.
"""

from __future__ import annotations

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
        if not p.requires_grad or p.numel() == 0:
            continue
        cuts = row_cuts(p, world, unit)
        if cuts is None:  # owned whole by the least-loaded rank (lowest rank on ties)
            owner = min(range(world), key=lambda r: (load[r], r))
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
        """Per rank: flag bytes, then each piece at a 64-byte offset; the common segment size."""
        offsets, seg = [], 0
        for mine in self.pieces:
            off = align_up(len(mine), ALIGN)
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


class Gatherer:
    """Runs the per-bucket all-gathers of updated values through one bounded, reused buffer.

    A bucket's segment is exchanged in rounds of at most ``max_bytes / world`` bytes per rank
    (64-byte multiples), so the buffer is ``max_bytes`` whatever the size of the largest
    parameter (a 50k x 4096 embedding would otherwise need its own 800 MB buffer); each round
    writes the bytes it brought straight into their destinations.
    """

    def __init__(self, group, world: int, rank: int, max_bytes: int = 4 << 20):
        self.group, self.world, self.rank = group, world, rank
        self.max_bytes = max_bytes
        self._bufs: dict[torch.device, torch.Tensor] = {}
        self.bytes_sent = 0
        self.collectives = 0

    def _buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for d, b in self._bufs.items() if d.type == "cpu")

    def gather(
        self,
        plan: GatherPlan,
        values: dict[int, torch.Tensor],
        dest=None,
        dtype: torch.dtype | None = None,
    ) -> set[int]:
        """Exchange this rank's updated pieces (``values``: position in ``plan.pieces[rank]`` ->
        new flat values) and write every rank's updated pieces into the parameters; returns the
        indices (in the bucket) of the parameters written. ``dest(index, piece)`` (a contiguous
        flat tensor to fill) and ``dtype`` replace the parameters and their dtype as the
        destination (state gathering). A collective: every rank calls it for every bucket, in the
        same order, even with nothing to send.
        """
        device = _dist.comm_device(self.group)
        seg = plan.segment if dtype is None else plan.segment_for(dtype)
        offsets = plan.offsets if dtype is None else plan.offsets_for(dtype)
        flag_bytes = align_up(max(len(p) for p in plan.pieces), ALIGN)
        chunk = max(flag_bytes, self.max_bytes // self.world // ALIGN * ALIGN, ALIGN)
        buf = self._buffer(device, min(seg, chunk) * self.world)
        mine = plan.pieces[self.rank]
        src: dict[int, torch.Tensor] = {}  # this rank's updated pieces as bytes
        for k, pc in enumerate(mine):
            v = values.get(k)
            if v is not None:
                dt = dtype or plan.params[pc.index].dtype
                src[k] = v.to(dt).contiguous().view(torch.uint8)
        flags: list[list[int]] = []
        targets: dict[tuple[int, int], torch.Tensor] = {}  # (rank, k) -> destination bytes
        finish: list[tuple[int, Piece, torch.Tensor]] = []
        written: set[int] = set()
        gather = getattr(torch.distributed, "all_gather_single", None)
        gather = gather or torch.distributed.all_gather_into_tensor
        for lo in range(0, seg, chunk):
            hi = min(lo + chunk, seg)
            n = hi - lo
            out = buf[: n * self.world]
            send = out[self.rank * n : (self.rank + 1) * n]
            if lo == 0:
                send[:flag_bytes].zero_()
                for k in src:
                    send[k] = 1
            for k, data in src.items():
                _copy_range(send, lo, hi, offsets[self.rank][k], data, to_window=True)
            gather(out, send, group=self.group)
            self.collectives += 1
            self.bytes_sent += n
            if lo == 0:
                flags = [
                    out[r * n : r * n + len(plan.pieces[r])].tolist() for r in range(self.world)
                ]
                for r, pieces in enumerate(plan.pieces):
                    for k, pc in enumerate(pieces):
                        if flags[r][k]:
                            targets[(r, k)] = self._target(plan, pc, dest, dtype, finish)
                            written.add(pc.index)
            for (r, k), t in targets.items():
                window = out[r * n : (r + 1) * n]
                _copy_range(window, lo, hi, offsets[r][k], t, to_window=False)
        for i, pc, tmp in finish:  # non-contiguous parameters: written once complete
            write_piece(plan.params[i], pc, tmp)
        return written

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
