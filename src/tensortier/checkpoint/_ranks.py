"""Checkpoints of many ranks: who writes what, the collective commit, the resharding reader.

Format v2 (PROTOCOL.md, "Many ranks"): ``step-N/rank-RRRRR/shard-XXXXX.safetensors`` per rank and
one global ``manifest.json`` written by rank 0 after every rank's files are durable. The manifest
holds, per saved rank, its tensor table (file, dtype, local shape, nbytes, CRC32C), its state tree
and, for DTensor shards, each shard's global shape and offsets; ``replicated`` names the one rank
that wrote each tensor several ranks hold (DDP's model and a replicated optimizer's state).

Restoring reads every tensor as a *global* tensor made of chunks (a replicated tensor is one chunk,
a DTensor's shards are several) and assembles exactly the region the restoring rank needs: the
full tensor for plain targets, the local shard for DTensor targets (FSDP2 parameters, a sharded
OffloadedAdamW's state). That is how a checkpoint of N ranks restores on M ranks.

Collectives run on two gloo groups made by the Checkpointer: ``main`` (the caller's thread: the
agreement on step and parts, save decisions, write plans, restore agreement) and ``bg`` (the persist thread: the commit). Each is
used by one thread at a time on every rank, in the same order, so they never interleave.
Nothing here is unpickled: object collectives carry only JSON-like values this module built.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
from dataclasses import dataclass

import torch

from tensortier import _dist
from tensortier.checkpoint import _faults
from tensortier.checkpoint._format import MANIFEST, read_tensors
from tensortier.checkpoint._persist import commit, disk_full, fsync_dir, retire
from tensortier.errors import ConfigError, CorruptDataError

log = logging.getLogger("tensortier.checkpoint")

VERSION = 2
RANK_FILE = re.compile(r"^rank-\d{5}/shard-\d{5}\.safetensors$")


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


@dataclass
class Ranks:
    """This Checkpointer's view of the process group: its rank, size and two private groups."""

    rank: int
    world: int
    main: object  # gloo group for the caller's thread
    bg: object  # gloo group for the persist thread

    @classmethod
    def create(cls, process_group, timeout_s: float) -> Ranks:
        dist = torch.distributed
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        timeout = datetime.timedelta(seconds=timeout_s)
        main = dist.new_group(ranks, timeout=timeout, backend="gloo")
        bg = dist.new_group(ranks, timeout=timeout, backend="gloo")
        return cls(dist.get_rank(main), dist.get_world_size(main), main, bg)


def dtensor_local(t: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
    """(the tensor to write, its chunk of the global tensor or None for a plain tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return t, None
    if not isinstance(t, DTensor):
        return t, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return local, {"shape": list(t.shape), "offsets": list(offsets)}


def held_elsewhere(t: torch.Tensor) -> bool:
    """A DTensor whose local chunk the rank at coordinate 0 of a replicated mesh dimension also
    holds (tensor parallel's ``Replicate`` bias, HSDP's replica groups): that rank writes it, as
    DCP deduplicates it. Written by every holder, its chunks would overlap."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    if not isinstance(t, DTensor):
        return False
    coordinate = t.device_mesh.get_coordinate() or ()
    return any(not p.is_shard() and c != 0 for p, c in zip(t.placements, coordinate))


def plan_writes(held: list[tuple[str, bool, int]], ranks: Ranks) -> tuple[set[str], dict[str, int]]:
    """Which of this rank's tensors it writes, and the writer of every replicated tensor.

    ``held``: (name, is a DTensor shard, bytes) of every tensor this rank's state holds. A plain
    tensor held by several ranks is taken to be replicated (as DCP does) and written once, by
    the holder with the fewest bytes assigned so far, largest tensors first, so the writing is
    spread across ranks. Shards and tensors only this rank holds are its own to write.
    """
    everyone = _dist.gather_objects(held, ranks.main)
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for r, items in enumerate(everyone):
        for name, shard, nbytes in items:
            if not shard:
                holders.setdefault(name, []).append(r)
                size[name] = nbytes
    load = [0] * ranks.world
    for r, items in enumerate(everyone):
        load[r] += sum(n for name, shard, n in items if shard or len(holders.get(name, ())) == 1)
    replicated: dict[str, int] = {}
    for name in sorted((n for n, h in holders.items() if len(h) > 1), key=lambda n: (-size[n], n)):
        writer = min(holders[name], key=lambda r: (load[r], r))
        replicated[name] = writer
        load[writer] += size[name]
    mine = {
        name for name, shard, _ in held if shard or replicated.get(name, ranks.rank) == ranks.rank
    }
    return mine, replicated


def agree_save(ranks: Ranks, step: int, parts: list[str], timeout_s: float) -> None:
    """Before anything is written (``main`` group): every rank is saving ``step`` with the same
    ``parts``, so rank 0 can never commit a manifest naming shards another rank wrote for another
    step or without a part, and retention never retires the last good checkpoint for it.

    A rank that does not arrive within ``timeout_s`` is named (gloo's monitored barrier); ranks
    that disagree raise :class:`ConfigError` on every rank, naming each rank's step and parts.
    """
    _arrive(ranks, step, timeout_s)
    everyone = _dist.gather_objects((step, list(parts)), ranks.main)
    if all(e == everyone[0] for e in everyone):
        return
    groups: dict[tuple, list[int]] = {}
    for r, (s, p) in enumerate(everyone):
        groups.setdefault((s, tuple(p)), []).append(r)
    said = "; ".join(
        f"{_who(rs)}: step {s} with {'+'.join(p) or 'no model/optimizer/scheduler'}"
        for (s, p), rs in groups.items()
    )
    raise ConfigError(
        f"checkpoint not saved: the ranks called save() differently ({said}). Every rank must "
        f"save the same step with the same model/optimizer/scheduler arguments; nothing was "
        f"written and the previous checkpoint is still the newest"
    )


def _arrive(ranks: Ranks, step: int, timeout_s: float) -> None:
    """Wait until every rank called save for ``step``; name the ranks that did not."""
    try:
        torch.distributed.monitored_barrier(
            ranks.main, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True
        )
    except RuntimeError as exc:  # gloo's text; rank 0 learns who is missing
        late = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
        if ranks.rank == 0 and late:
            missing = [int(r) for r in late.group(1).replace(" ", "").split(",") if r]
            head = f"{_who(missing)} did not call save()/maybe_save() for step {step}"
        elif ranks.rank == 0:
            head = f"not every rank called save()/maybe_save() for step {step}"
        else:
            head = (
                f"rank {ranks.rank} is saving step {step}, but rank 0 did not confirm that every "
                f"rank is (rank 0 did not call save()/maybe_save() for step {step}, or rank 0's "
                f"error names the rank that did not)"
            )
        raise ConfigError(
            f"{head} within commit_timeout={timeout_s:g}s. Every rank must call save() with the "
            f"same step (maybe_save(): the same step, so that the same steps are due). Nothing "
            f"was written; this Checkpointer's process group is unusable now: restart the job "
            f"from the last checkpoint (gloo: {exc})"
        ) from exc


def _who(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def commit_ranks(
    root: str,
    step: int,
    report: dict,
    ranks: Ranks,
    abandoned: list[int],
    base: dict,
    retain,
) -> None:
    """The collective commit (persist thread, ``bg`` group): every rank reports its durable files;
    rank 0 writes the global manifest and renames, then tells every rank the outcome.

    ``report``: {"error": None or text, "tensors", "state", "chunks"} of this rank. Raises on
    every rank if any rank failed (the previous checkpoint stays the newest).
    """
    _faults.point("rank-reported")
    try:
        reports = _dist.gather_objects(report, ranks.bg)
    except RuntimeError as exc:  # a rank's process ended or lost its connection
        raise _lost(
            step, "before every rank reported its shards: it was not committed", exc
        ) from exc
    outcome = None
    own: BaseException | None = None  # rank 0's commit error, raised as itself there
    final = os.path.join(root, f"step-{step}")
    tmp = final + ".incomplete"
    if ranks.rank == 0:
        bad = [r for r, rep in enumerate(reports) if rep["error"] is not None]
        if bad:
            outcome = f"rank {bad[0]} could not write its shards: {reports[bad[0]]['error']}"
        else:
            try:
                if abandoned:
                    retire(root, abandoned)
                body = dict(base)
                body["version"] = VERSION
                body["world_size"] = ranks.world
                body["ranks"] = [
                    {"tensors": rep["tensors"], "state": rep["state"], "chunks": rep["chunks"]}
                    for rep in reports
                ]
                body["replicated"] = reports[0]["replicated"]
                body["tensors"] = {}
                commit(root, tmp, final, body)
                retain(step)
            except BaseException as exc:  # noqa: BLE001 - sent to every rank, raised below
                outcome = f"rank 0 could not commit: {exc!r}"
                own = disk_full(exc, step, root)  # a full disk is TierFullError, as in one process
                if own is not exc:
                    own.__cause__ = exc
        if outcome is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        outcome = _dist.broadcast_object(outcome, 0, ranks.bg)
    except RuntimeError as exc:
        if ranks.rank != 0:
            said = "before rank 0 said whether it was committed"
        else:
            said = "after rank 0 " + ("committed it" if outcome is None else "refused it")
        raise _lost(step, said, exc) from exc
    if own is not None:
        raise own
    if outcome is not None:
        raise RuntimeError(
            f"checkpoint of step {step} was not committed: {outcome}. The previous checkpoint "
            f"is still the newest on every rank"
        )


def _lost(step: int, when: str, exc: BaseException) -> RuntimeError:
    """The commit's collective failed: gloo's own text only says a peer hung up."""
    return RuntimeError(
        f"checkpoint of step {step}: a rank left the commit {when} (its process ended or lost "
        f"its connection; see that rank's log). This Checkpointer's process group is unusable "
        f"now: restart the job; restore() takes the newest complete checkpoint (gloo: {exc})"
    )


def write_rank_dir(root: str, step: int, rank: int) -> str:
    """``step-N.incomplete/rank-R/``, empty (a leftover of a failed attempt is removed)."""
    folder = os.path.join(root, f"step-{step}.incomplete", rank_dir(rank))
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, mode=0o755)
    return folder


def sync_rank_dir(folder: str) -> None:
    fsync_dir(folder)


# ---------------------------------------------------------------------------- restore
@dataclass
class Chunk:
    rank: int
    info: dict
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def _chunk_place(chunk: object, shape: tuple) -> tuple[tuple | None, tuple]:
    """(offsets, global shape) of a saved chunk of local ``shape``; (None, ()) if the manifest's
    entry is malformed: not a mapping of int lists of the tensor's rank, or not inside the
    global tensor (a crafted manifest with a valid checksum must fail as damage, typed)."""
    if not chunk:
        return (0,) * len(shape), shape
    if not isinstance(chunk, dict):
        return None, ()
    offsets, full = chunk.get("offsets"), chunk.get("shape")
    values = [offsets, full, list(shape)]
    if not all(isinstance(v, list) and len(v) == len(shape) for v in values) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for v in values for n in v
    ):
        return None, ()
    if any(o + n > f for o, n, f in zip(offsets, shape, full)):
        return None, ()
    return tuple(offsets), tuple(full)


class Index:
    """Where every saved tensor's chunks are, for a v1 (one process) or v2 (many ranks) body."""

    def __init__(self, body: dict, path: str):
        self.path = path
        if body.get("version") == VERSION:
            self.world = body.get("world_size")
            self.ranks = body.get("ranks")
            self.replicated = body.get("replicated")
            if (
                not isinstance(self.world, int)
                or not isinstance(self.ranks, list)
                or len(self.ranks) != self.world
                or not all(
                    isinstance(r, dict)
                    and isinstance(r.get("tensors"), dict)
                    and isinstance(r.get("chunks"), dict)
                    for r in self.ranks
                )
                or not isinstance(self.replicated, dict)
            ):
                raise CorruptDataError("malformed multi-rank manifest", path=path)
        else:
            self.world = 1
            self.ranks = [{"tensors": body["tensors"], "state": body.get("state"), "chunks": {}}]
            self.replicated = {}
        self.chunks: dict[str, list[Chunk]] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, global shape)
        for r, entry in enumerate(self.ranks):
            for name, info in entry["tensors"].items():
                if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
                    raise CorruptDataError(f"tensor {name!r}: bad entry in manifest", path=path)
                if self.world > 1 and not RANK_FILE.match(str(info.get("file", ""))):
                    raise CorruptDataError(f"tensor {name!r}: bad file entry", path=path)
                shape = tuple(info["shape"])
                offsets, full = _chunk_place(entry["chunks"].get(name), shape)
                if offsets is None:
                    raise CorruptDataError(f"tensor {name!r}: bad chunk entry", path=path)
                self.chunks.setdefault(name, []).append(Chunk(r, info, offsets, shape))
                self.meta.setdefault(name, (info.get("dtype"), full))

    def verify(self, saved_ranks: list[int]) -> None:
        """Read and checksum every file of these saved ranks; CorruptDataError names the rank."""
        for r in saved_ranks:
            try:
                read_tensors(self.path, {"tensors": self.ranks[r]["tensors"]}, allow_ranks=True)
            except CorruptDataError as exc:
                who = f"rank {r}'s shard" if self.world > 1 else "shard"
                raise CorruptDataError(f"{who}: {exc}", path=exc.path or self.path) from exc

    def region(
        self,
        name: str,
        offsets: tuple[int, ...] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The elements ``[offsets, offsets + shape)`` of saved tensor ``name`` (default: all)."""
        from tensortier.checkpoint._tree import dtype_from_name

        dtype_name, full = self.meta[name]
        dtype = dtype_from_name(dtype_name)
        offsets = offsets if offsets is not None else (0,) * len(full)
        shape = tuple(shape if shape is not None else full)
        out = torch.empty(shape, dtype=dtype)
        covered, seen = 0, set()
        for c in self.chunks[name]:
            if (c.offsets, c.shape) in seen:  # another holder's copy (replicated over a mesh
                continue  # dimension: older checkpoints have one from every holder)
            lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, shape, c.offsets, c.shape)]
            if any(h <= a for a, h in zip(lo, hi)) and len(shape):
                continue
            data = read_tensors(self.path, {"tensors": {name: c.info}}, allow_ranks=self.world > 1)[
                name
            ]
            src = data[tuple(slice(a - co, h - co) for a, h, co in zip(lo, hi, c.offsets))]
            out[tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offsets))] = src
            covered += src.numel()
            seen.add((c.offsets, c.shape))
            if not len(shape):
                break
        if covered != out.numel():
            raise CorruptDataError(
                f"tensor {name!r}: the saved chunks cover {covered} of {out.numel()} elements",
                path=self.path,
            )
        return out


class Ref:
    """A saved tensor named in a state tree, read only when (and where) it is needed."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Refs(dict):
    """The ``tensors`` mapping for ``_tree.decode``: every saved name decodes to a :class:`Ref`."""

    def __init__(self, names):
        super().__init__((n, Ref(n)) for n in names)


def materialize(obj, index: Index, like=None):
    """Replace every :class:`Ref` in ``obj`` by its tensor: the region ``like`` (a DTensor) holds
    on this rank as a DTensor of the same layout, or the full tensor."""
    if isinstance(obj, Ref):
        return _read_like(index, obj.name, like)
    if isinstance(obj, dict):
        return {
            k: materialize(v, index, like.get(k) if isinstance(like, dict) else None)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [materialize(v, index) for v in obj]
    if isinstance(obj, tuple):
        return tuple(materialize(v, index) for v in obj)
    return obj


def _read_like(index: Index, name: str, like) -> torch.Tensor:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # noqa: N806
    if not isinstance(like, DTensor) or tuple(like.shape) != index.meta[name][1]:
        return index.region(name)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    local = index.region(name, tuple(offsets), tuple(shape))
    return DTensor.from_local(
        local.to(like.to_local().device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def clear_incomplete(root: str, step: int) -> None:
    shutil.rmtree(os.path.join(root, f"step-{step}.incomplete"), ignore_errors=True)


MANIFEST_NAME = MANIFEST
