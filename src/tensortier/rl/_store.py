"""The storage under ReplayBuffer and MemoryBank: keyed item blobs in RAM up to a budget, then on disk.

Keys. An item's key is ``seq * max_items + slot``: ``seq`` counts adds, so keys grow in insertion
order (FIFO order is key order) and are never reused, and ``slot = key % max_items`` finds the
item's row in the index arrays without a dict. A key whose slot now holds another key is stale.

Index (per slot, numpy): key, disk location (segment, offset, length), a list entry for the RAM
copy, the free-slot stack, the slot each of the last ``max_items`` adds used (to tell an index
never issued from a stale one); RAM order and FIFO order are numpy rings of keys (removed keys are
skipped lazily, the FIFO ring is compacted past 2x max_items). With the replay buffer's use counts
and sum/min trees that is about 110 bytes per slot (~105 MiB for 1M slots), the
"small overhead per item" outside the RAM budget; :func:`check_args` refuses a ``max_items`` whose
index does not fit in the memory available.

Tiering. Item bytes in RAM stay under ``host_budget``: an item added as encoded parts (see
``itemcodec.encode_parts``) is joined once into a ``bytes`` object; an item added as ``bytes`` is
kept as that object; each counts as its length + 33 bytes of object header. An add that would exceed it first moves the oldest RAM items to the active segment
in one batched write (non-durable) or just drops their RAM copies (durable buffers write every
item through to disk when it is added, so an acknowledged add survives a crash).

Copies. :meth:`ItemStore.pin` hands out what a copy of every live item needs (keys, RAM
references, disk locations) and keeps those locations valid (no compaction, no file deleted) until
:meth:`ItemStore.unpin`, so a save copies the bytes without holding the owner's lock.

This module owns bytes and their location; it knows nothing of sampling or priorities, and it is
not thread-safe (its owner holds a lock).
"""

from __future__ import annotations

import json
import operator
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil

from tensortier._lifetime import DirLock, Finalizer, private_dir, reclaim_stale, remove_private_dir
from tensortier._units import check_int, format_size, index_array, is_int
from tensortier.errors import (
    ConfigError,
    CorruptDataError,
    NodeLostError,
    SpillDirError,
    TierFullError,
)
from tensortier.rl._remote_spill import RemoteSpill
from tensortier.tiers.placement import check_remote
from tensortier.tiers.segments import TOMBSTONE, Segments

_OBJ = 33  # sys.getsizeof(b"") : per-bytes-object header counted against the RAM budget
_META = "store.json"
_FORMAT_VERSION = 2  # 2: records checksum their header too (see tiers/segments.py); 1 is still read
# index bytes per slot (of max_items), allocated up front: key 8, location 16, RAM reference 8, free
# stack 8, issued ring 8, FIFO ring up to 4 keys amortised (32)
SLOT_BYTES = 80
_NONE = np.empty(0, np.int64)
_NONE.flags.writeable = False
_I64 = np.dtype(np.int64)  # a singleton: ``is`` beats ``==`` on the update hot path


def _size(blob: Any) -> int:
    """Bytes of an item given as ``bytes`` (or another buffer) or as a list of byte parts."""
    return sum(map(len, blob)) if type(blob) is list else len(blob)


def _flat(blob: Any) -> Any:
    """The item as one buffer (parts are joined: the disk and durable paths)."""
    return b"".join(blob) if type(blob) is list else blob


def _est(n: int) -> int:
    """Budget an item of ``n`` bytes takes in RAM: a bytes object with its header."""
    return n + _OBJ


def as_index_array(indices: Any, name: str = "indices") -> np.ndarray:
    """``indices`` (an int, a sequence, an array or a tensor of ints) as a 1-D int64 array."""
    if type(indices) is np.ndarray and indices.dtype is _I64 and indices.ndim == 1:
        return indices  # what sample() returns: nothing to convert or check
    return index_array(
        indices, f"{name} must be an int or a 1-D sequence of ints (as returned by add())"
    )


def check_items(items: Any, what: str) -> Any:
    """``items`` for ``extend``; TypeError for one whose iteration is not its items: a dict (a
    TorchRL-style batch) gives its keys and a str or bytes its characters, which were stored as
    items."""
    if isinstance(items, (Mapping, str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"{what}.extend takes a list (or any iterable) of items, got a "
            f"{type(items).__name__}, whose iteration would store its keys or characters; pass "
            f"add(item) for one item, or a list of items"
        )
    return items


def not_picklable(what: str) -> TypeError:
    """The error for pickling a store (to a Ray task or actor, another process): its locks,
    files and threads belong to this process."""
    return TypeError(
        f"a {what} belongs to the process that made it and cannot be pickled (for a Ray task or "
        f"actor, or another process); pass the handle of tt.rl.serve({what.lower()}) instead, "
        f"which pickles and reaches the store from any process or node"
    )


_TIERS = {("disk",), ("remote",), ("remote", "disk")}


def check_tier(what: str, tier: Any, remote: Any, durable: bool) -> tuple[str, ...]:
    """``tier`` (where items past ``host_budget`` go: "disk", "remote" or a list of those, in
    order) as a tuple of tiers."""
    tiers = ("remote", "disk") if tier == "remote" else (tier,) if isinstance(tier, str) else tier
    try:
        tiers = tuple(tiers)
    except TypeError:
        tiers = (tier,)
    if tiers not in _TIERS:
        raise ConfigError(
            f"{what}: tier must be 'disk', 'remote' (RAM -> remote pool -> disk) or a list of "
            f"tiers in order: ['remote', 'disk'] or ['remote'], got {tier!r}"
        )
    if "remote" in tiers:  # the pool items evicted from RAM go to: the caller's, left open
        check_remote(remote, where=f"{what}: tier={tier!r}", needed=True, args=False)
        if durable:
            raise ConfigError(
                f"{what}: durable=True writes every item to spill_dir when it is added, so RAM "
                f"evictions never spill; use tier='disk' (the default) with durable=True"
            )
    elif remote is not None:
        raise ConfigError(
            f"{what}: remote= is given but tier={tier!r} does not use it; pass "
            f"tier=['remote', 'disk']"
        )
    return tiers


def check_args(
    what: str,
    max_items: Any,
    *,
    spill_dir: Any,
    durable: Any,
    fsync: Any,
    extra_slot_bytes: int = 0,
) -> int:
    """Validate the arguments every item store takes, before anything is allocated.

    Returns ``max_items`` as an int. The index is allocated up front (about ``SLOT_BYTES +
    extra_slot_bytes`` per slot), so a ``max_items`` whose index cannot fit in the memory available now
    is refused here instead of failing (or swapping) inside numpy.
    """
    msg = f"{what}: max_items must be an int >= 1 (the most items it holds), got {max_items!r}"
    check_int(max_items, msg, minimum=1, numpy=True)
    per_slot = SLOT_BYTES + extra_slot_bytes
    need = int(max_items) * per_slot
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(
            f"{what}: max_items={int(max_items)} needs about {format_size(need)} of index in RAM "
            f"({per_slot} bytes per slot, allocated up front), but only {format_size(available)} "
            f"is available; lower max_items (items beyond host_budget live on disk, their index "
            f"does not)"
        )
    if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
        raise ConfigError(
            f"{what}: spill_dir must be a path (str or os.PathLike) or None, got "
            f"{type(spill_dir).__name__} {spill_dir!r}"
        )
    for name, value in (("durable", durable), ("fsync", fsync)):
        if not isinstance(value, (bool, np.bool_)):
            raise ConfigError(f"{what}: {name} must be True or False, got {value!r}")
    if durable and spill_dir is None:
        raise ConfigError(
            f"{what}: durable=True needs spill_dir, the directory whose segments survive a restart"
        )
    return int(max_items)


class KeyQueue:
    """Keys in insertion order (a growable numpy ring); invalid keys are skipped by the reader."""

    def __init__(self, n: int = 1024):
        self.buf = np.empty(max(n, 16), np.int64)
        self.head = self.tail = 0

    def __len__(self) -> int:
        return self.tail - self.head

    def push(self, keys: np.ndarray | list[int]) -> None:
        keys = np.asarray(keys, np.int64)
        if self.tail + len(keys) > len(self.buf):
            live = self.buf[self.head : self.tail]
            new = np.empty(max(2 * (len(live) + len(keys)), 16), np.int64)
            new[: len(live)] = live
            self.buf, self.head, self.tail = new, 0, len(live)
        self.buf[self.tail : self.tail + len(keys)] = keys
        self.tail += len(keys)

    def push_one(self, key: int) -> None:
        if self.tail < len(self.buf):
            self.buf[self.tail] = key
            self.tail += 1
        else:
            self.push([key])

    def view(self) -> np.ndarray:
        return self.buf[self.head : self.tail]

    def filter(self, mask: np.ndarray) -> None:
        """Keep only keys where ``mask`` (aligned with :meth:`view`) is True."""
        kept = self.view()[mask]
        self.buf = np.empty(max(2 * len(kept), 16), np.int64)
        self.buf[: len(kept)] = kept
        self.head, self.tail = 0, len(kept)


@dataclass
class StoreStats:
    items: int = 0
    ram_items: int = 0
    ram_bytes: int = 0
    peak_ram_bytes: int = 0
    disk_items: int = 0
    spilled_items: int = 0
    evicted_items: int = 0
    disk_reads: int = 0
    remote_items: int = 0  # items held in the remote pool (tier=["remote", ...])
    remote_reads: int = 0
    lost_items: int = 0  # remote items dropped because their memory node was lost
    spill_bytes: int = 0  # bytes of items written out of RAM (spills and items too big for it)
    spill_ns: int = 0  # time spent writing them (the write path's own bandwidth)

    def as_dict(self) -> dict:
        return asdict(self)


class _Files:
    """What a store's cleanup needs, with no reference to the store (see ``LIFETIME.md``)."""

    def __init__(self, private: bool):
        self.segments: Segments | None = None
        self.remote: RemoteSpill | None = None  # its batches are freed (never blocks)
        self.private = private  # a private spill directory: removed with its files
        self.lock: DirLock | None = None  # durable: one writer per directory

    def close(self) -> None:
        remote, self.remote = self.remote, None
        if remote is not None:
            remote.close()
        segs, self.segments = self.segments, None
        if segs is not None:
            segs.close(remove=self.private)
            if self.private:
                remove_private_dir(segs.root)
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()  # last: the files are closed before another writer may open them


@dataclass
class Pinned:
    """Items held for a copy outside the owner's lock (:meth:`ItemStore.pin`)."""

    keys: np.ndarray
    ram: list  # RAM or remote bytes per key; None where the item is only on disk
    locs: np.ndarray  # (n, 3): segment, offset, length
    segments: Segments | None  # pinned: none of its files is deleted until unpin

    def chunks(self, step: int = 2048) -> Iterator[tuple[list[int], list]]:
        """(keys, blobs) of the items, ``step`` at a time. Disk bytes are read through
        descriptors of our own: the store's LRU belongs to the threads holding the lock."""
        src = None
        if self.segments is not None:
            src = Segments(self.segments.root, readonly=True)
        try:
            for i in range(0, len(self.keys), step):
                part = self.ram[i : i + step]
                need = [j for j, b in enumerate(part) if b is None]
                if need:
                    assert src is not None
                    for j, d in zip(need, src.read_many(self.locs[i : i + step][need])):
                        part[j] = d
                yield self.keys[i : i + step].tolist(), part
        finally:
            if src is not None:
                src.close(remove=False)


class ItemStore:
    """Keyed item blobs in RAM up to ``host_budget``, then in segment files (see the module doc).

    ``what`` names the owner in messages ("ReplayBuffer", "MemoryBank"). Files are removed (a
    private spill directory) or released (a durable directory's lock) by :meth:`close`, or by the
    reaper thread when the store is garbage collected.
    """

    def __init__(
        self,
        max_items: int,
        host_budget: int,
        spill_dir: str | os.PathLike | None,
        *,
        durable: bool = False,
        fsync: bool = False,
        segment_size: int = 64 << 20,
        owner: str = "tt-rl",
        what: str = "store",
        tiers: tuple[str, ...] = ("disk",),
        remote: Any = None,
    ):
        self.cap = max_items
        self.budget = host_budget
        self.durable = durable
        self.what = what
        self.keys = np.full(max_items, -1, np.int64)
        self.seg = np.full(max_items, -1, np.int32)
        self.off = np.zeros(max_items, np.int64)
        self.len = np.zeros(max_items, np.int32)
        self.ram: list[Any] = [None] * max_items  # RAM copy per slot: a bytes object
        self.free = np.arange(max_items - 1, -1, -1, dtype=np.int64)  # stack of free slots
        self.nfree = max_items
        self.seq = 0
        # slot used by each of the last `max_items` adds (by seq % max_items; -1: not known), so an
        # index that add() never returned is told apart from one that went stale
        self.issued_slot = np.full(max_items, -1, np.int64)
        self.fifo = KeyQueue()
        self.ram_order = KeyQueue()
        self.stats = StoreStats()
        self.compaction_paused = 0
        self.spill_dir = spill_dir
        self._owner = owner
        self._files = _Files(private=not durable)
        self._finalizer = Finalizer(self, self._files.close)
        self.tiers = tiers
        self.rspill: RemoteSpill | None = None
        if "remote" in tiers:
            self.rspill = self._files.remote = RemoteSpill(remote, what=what)
        self.on_drop = None  # called with the slots of lost items before they are removed
        self.recovered: np.ndarray = np.empty(0, np.int64)
        self.segment_size = segment_size
        self.fsync = fsync
        if durable:
            if spill_dir is None:
                raise ConfigError(
                    f"{what}: durable=True needs spill_dir, the directory whose segments survive "
                    f"a restart"
                )
            try:
                self._open_durable(os.fspath(spill_dir))
            except BaseException:
                self._finalizer()
                raise
        elif spill_dir is not None and os.path.isdir(spill_dir):
            reclaim_stale(spill_dir)  # spill areas of processes that died (even by SIGKILL)

    @property
    def segments(self) -> Segments | None:
        return self._files.segments

    @property
    def root(self) -> str | None:
        """The directory of the segment files (a durable store's ``spill_dir``); None before
        a non-durable store first spills."""
        segs = self._files.segments
        return None if segs is None else segs.root

    # ------------------------------------------------------------------ setup
    def _open_durable(self, root: str) -> None:
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise SpillDirError(
                f"{self.what}: cannot create the durable directory spill_dir={root!r} "
                f"({exc.strerror}); pass a writable spill_dir",
                path=root,
            ) from exc
        try:
            self._files.lock = DirLock(root, what=f"durable {self.what}")
        except SpillDirError as exc:
            cause = exc.__cause__
            reason = cause.strerror if isinstance(cause, OSError) else str(exc)
            raise SpillDirError(
                f"{self.what}: durable spill_dir={root!r} is not writable ({reason}); a durable "
                f"buffer writes its segments there: make it writable or pass another spill_dir "
                f"(to read a saved copy from a read-only place, use ReplayBuffer.load)",
                path=root,
            ) from exc
        self._check_meta(root)
        self._files.segments = Segments(root, segment_size=self.segment_size, fsync=self.fsync)
        self._recover()

    def _check_meta(self, root: str) -> None:
        path = os.path.join(root, _META)
        if os.path.exists(path):
            try:
                with open(path) as f:
                    meta = json.load(f)
                if not isinstance(meta, dict):
                    raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
            except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
                raise CorruptDataError(
                    f"{path} is damaged ({exc}); it records the max_items of the durable buffer "
                    f"in {root!r}: restore it, or rewrite it as "
                    f'{{"format": "tensortier-rl-segments", "version": {_FORMAT_VERSION}, '
                    f'"capacity": <its max_items>}}',
                    path=path,
                ) from exc
            version = meta.get("version")
            if meta.get("format") != "tensortier-rl-segments" or not isinstance(version, int):
                raise CorruptDataError(
                    f"{path} does not describe a tensortier durable buffer; pass another spill_dir",
                    path=path,
                )
            if version > _FORMAT_VERSION:
                raise CorruptDataError(
                    f"the durable buffer in {root!r} has format version {version}, newer than "
                    f"this tensortier reads ({_FORMAT_VERSION}); upgrade tensortier",
                    path=path,
                )
            if meta.get("capacity") != self.cap:
                raise ConfigError(
                    f"durable buffer in {root!r} was created with max_items={meta.get('capacity')}, "
                    f"got max_items={self.cap}; reopen it with the same max_items"
                )
            if version == _FORMAT_VERSION:
                return
        self._write_meta(path)

    def _write_meta(self, path: str) -> None:
        tmp = path + ".tmp"
        meta = {
            "format": "tensortier-rl-segments",
            "version": _FORMAT_VERSION,
            "capacity": self.cap,  # the on-disk key (format compatibility): max_items
        }
        try:
            with open(tmp, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, path)
        except OSError as exc:
            raise SpillDirError(
                f"{self.what}: cannot write {path!r} ({exc.strerror}); make spill_dir writable "
                f"or pass another one",
                path=os.path.dirname(path),
            ) from exc

    def _disk(self) -> Segments:
        if self._files.segments is None:
            self._files.segments = Segments(
                private_dir(self.spill_dir, self._owner),
                segment_size=self.segment_size,
                fsync=self.fsync,
            )
        return self._files.segments

    def _recover(self) -> None:
        """Rebuild the index from the segments: the last record of each key wins."""
        segs = self.segments
        assert segs is not None
        latest: dict[int, tuple[int, int, int, int]] = {}
        for key, flags, seg, off, length in segs.scan():
            latest[key] = (flags, seg, off, length)
        live = sorted(k for k, v in latest.items() if v[0] != TOMBSTONE)
        if len(live) > self.cap:
            live = live[-self.cap :]
        if latest:
            self.seq = max(latest) // self.cap + 1
        for key in live:
            _, seg, off, length = latest[key]
            slot = key % self.cap
            if self.keys[slot] > key:  # (cannot happen with intact tombstones) newest wins
                continue
            if self.keys[slot] < 0:
                self.stats.items += 1
            self.keys[slot], self.seg[slot], self.off[slot], self.len[slot] = key, seg, off, length
        for slot in np.nonzero(self.keys >= 0)[0]:
            segs.add_live(int(self.seg[slot]), int(self.len[slot]))
        self._rebuild_free()
        self._note_issued(np.fromiter(latest, np.int64, len(latest)))
        used = self.keys >= 0
        order = np.sort(self.keys[used])
        self.fifo.push(order)
        self.stats.disk_items = int(used.sum())
        self.recovered = order
        for seg in segs.candidates(0.5):
            self._compact(seg)

    def _rebuild_free(self) -> None:
        empty = np.nonzero(self.keys < 0)[0][::-1]
        self.free = np.empty(self.cap, np.int64)
        self.free[: len(empty)] = empty
        self.nfree = len(empty)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return self.cap - self.nfree

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys``; -1 where a key is not live (removed, evicted or never issued)."""
        keys = np.asarray(keys, np.int64)
        slots = np.where(keys >= 0, keys % self.cap, 0)
        ok = (keys >= 0) & (self.keys[slots] == keys)
        return np.where(ok, slots, -1)

    def issued(self, keys: np.ndarray) -> np.ndarray:
        """False where a key was certainly never handed out by this store.

        Exact for keys of the last ``max_items`` adds (the store remembers which slot each used);
        an older key that is no longer live cannot be told from a stale one and counts as issued.
        """
        keys = np.asarray(keys, np.int64)
        seqs = keys // self.cap
        ok = (keys >= 0) & (seqs < self.seq)
        recent = ok & (seqs >= self.seq - self.cap)
        known = self.issued_slot[np.where(recent, seqs % self.cap, 0)]
        return ok & ~(recent & (known >= 0) & (known != keys % self.cap))

    def _note_issued(self, keys: np.ndarray) -> None:
        """Remember the slots of ``keys`` among the last ``max_items`` adds (after a reload)."""
        seqs = keys // self.cap
        recent = seqs >= self.seq - self.cap
        self.issued_slot[seqs[recent] % self.cap] = keys[recent] % self.cap

    def live_slots(self, keys: np.ndarray, added_by: str = "add()") -> np.ndarray:
        """Slots of ``keys``; KeyError naming the first key that is not live, and why."""
        slots = self.slots(keys)
        bad = slots < 0
        if bad.any():
            first = int(keys[np.argmax(bad)])
            if self.issued(np.array([first]))[0]:
                why = f"it was deleted, evicted or used up (or never returned by {added_by})"
            else:
                why = f"it was never returned by {added_by} on this {self.what}"
            raise KeyError(
                f"index {first} is not in the {self.what} ({int(bad.sum())} of {len(keys)} "
                f"missing): {why}"
            )
        return slots

    def contains(self, index: object) -> bool:
        if not is_int(index, numpy=True):
            return False
        return bool(self.slots(np.array([index], np.int64))[0] >= 0)

    def remote_blobs(self) -> dict[int, bytes]:
        """The bytes of every item in the remote pool, by slot; items lost meanwhile are dropped."""
        while self.rspill is not None and self.rspill.loc:
            slots = np.fromiter(self.rspill.loc, np.int64, len(self.rspill.loc))
            try:
                return dict(zip(slots.tolist(), self.blobs(slots)))
            except NodeLostError:
                continue  # those items were dropped; fetch the rest
        return {}

    def blobs(self, slots: np.ndarray) -> list[bytes]:
        """Item blobs of live ``slots``, RAM copies first, the rest in one sorted disk pass."""
        idx = slots.tolist()
        if len(idx) > 1:
            out = list(operator.itemgetter(*idx)(self.ram))
        else:
            out = [self.ram[s] for s in idx]
        if None in out:
            missing = [i for i, b in enumerate(out) if b is None]
            rs = self.rspill
            if rs is not None and rs.loc:
                far = [i for i in missing if idx[i] in rs.loc]
                if far:
                    try:
                        datas = rs.read([idx[i] for i in far])
                    except NodeLostError as exc:
                        self._lose(np.asarray(exc.lost, np.int64))  # type: ignore[attr-defined]
                        raise
                    self.stats.remote_reads += len(far)
                    for i, d in zip(far, datas):
                        out[i] = d
                    missing = [i for i in missing if out[i] is None]
        if None in out:
            rows = slots[missing]
            locs = np.stack([self.seg[rows], self.off[rows], self.len[rows]], axis=1)
            datas = self._disk().read_many(locs)
            self.stats.disk_reads += len(missing)
            for i, d in zip(missing, datas):
                out[i] = d
        return out

    def order(self) -> np.ndarray:
        """Live keys, oldest first."""
        q = self.fifo.view()
        return q[self.keys[q % self.cap] == q]

    # ------------------------------------------------------------------ copies
    def pin(self) -> Pinned:
        """What a copy of every live item needs once the owner's lock is released: their keys
        (oldest first), references to their RAM (or remote) bytes and their disk locations.
        Until :meth:`unpin`, no compaction moves a record and no segment file is deleted, so the
        locations stay valid while adds, samples and removals go on."""
        far = self.remote_blobs()  # items of a lost node are dropped first
        keys = self.order()
        slots = keys % self.cap
        ram = [far.get(s, self.ram[s]) for s in slots.tolist()]
        locs = np.stack([self.seg[slots], self.off[slots], self.len[slots]], axis=1)
        self.compaction_paused += 1
        segs = self.segments
        if segs is not None:
            segs.pinned += 1
        return Pinned(keys, ram, locs, segs)

    def unpin(self, pinned: Pinned) -> None:
        """End :meth:`pin`: files emptied meanwhile are deleted, compaction resumes."""
        self.compaction_paused -= 1
        if pinned.segments is not None:
            pinned.segments.pinned -= 1  # the files pinned, even if the store spilled since
        if self.segments is not None:
            self.segments.sweep()
        self._maybe_compact()

    # ------------------------------------------------------------------ changes
    def update(self, index: Any, blob: bytes, added_by: str = "add()") -> None:
        """Overwrite the live item ``index`` (KeyError if it is not live), see :meth:`replace`."""
        [slot] = self.live_slots(as_index_array(index, "index"), added_by)
        self.replace(int(slot), blob)

    def add(self, blobs: list[bytes], on_evict=None) -> tuple[np.ndarray, np.ndarray]:
        """Store ``blobs``; returns (their keys, slots of items evicted to make room).

        ``on_evict(slots)`` runs as soon as items are evicted (before any write), so the caller's
        sampler stays consistent even if a write then fails. A failed add stores none of
        ``blobs`` (the error, e.g. TierFullError or SpillDirError, propagates).
        """
        n = len(blobs)
        if n > self.cap:
            raise ConfigError(f"cannot add {n} items at once to a store of max_items={self.cap}")
        if n == 1 and self.nfree and not self.durable:
            key = self.add_one(blobs[0])
            return np.array([key], np.int64), _NONE
        # the slots n single adds would take: free slots first (top of the stack first), then
        # the slots of the oldest items, evicted in FIFO order, so extend == repeated add
        k = min(n, self.nfree)
        slots = self.free[self.nfree - k : self.nfree][::-1].copy()
        self.nfree -= k
        evicted = _NONE
        if n > k:
            try:
                evicted = self._evict(n - k)
            except BaseException:
                self.free[self.nfree : self.nfree + k] = slots[::-1]
                self.nfree += k
                raise
            if on_evict is not None:
                on_evict(evicted)
            self.nfree -= len(evicted)  # remove() pushed them; take them back, oldest first
            slots = np.concatenate([slots, evicted])
        seqs = self.seq + np.arange(n, dtype=np.int64)
        keys = seqs * self.cap + slots
        self.seq += n
        self.issued_slot[seqs % self.cap] = slots
        self.keys[slots] = keys
        self.seg[slots] = -1
        try:
            if self.durable:
                blobs = [_flat(b) for b in blobs]
                locs = self._disk().append([(int(k), 0, b) for k, b in zip(keys.tolist(), blobs)])
                for s, (seg, off, ln) in zip(slots.tolist(), locs):
                    self.seg[s], self.off[s], self.len[s] = seg, off, ln
                self.stats.disk_items += n
            self._to_ram(slots, keys, blobs)
        except BaseException:
            self._undo_add(slots)
            raise
        self.fifo.push(keys)
        if len(self.fifo) > 2 * self.cap + 1024:
            q = self.fifo.view()
            self.fifo.filter(self.keys[q % self.cap] == q)
        self.stats.items += n
        return keys, evicted

    def add_one(self, blob: Any) -> int:
        """:meth:`add` of one blob into a free slot of a non-durable store, in Python scalars
        (a handful of numpy calls on 1-element arrays would cost more than the item's copy)."""
        slot = int(self.free[self.nfree - 1])
        self.nfree -= 1
        seq = self.seq
        key = seq * self.cap + slot
        self.seq = seq + 1
        self.issued_slot[seq % self.cap] = slot
        self.keys[slot] = key
        self.seg[slot] = -1
        n = _size(blob)
        st = self.stats
        try:
            if st.ram_bytes + _est(n) > self.budget:
                self._to_ram(np.array([slot], np.int64), np.array([key], np.int64), [blob])
            else:
                st.ram_bytes += self._place(slot, blob, n)
                st.ram_items += 1
                if st.ram_bytes > st.peak_ram_bytes:
                    st.peak_ram_bytes = st.ram_bytes
                self.ram_order.push_one(key)
        except BaseException:
            self._undo_add(np.array([slot], np.int64))
            raise
        self.fifo.push_one(key)
        if self.fifo.tail - self.fifo.head > 2 * self.cap + 1024:
            q = self.fifo.view()
            self.fifo.filter(self.keys[q % self.cap] == q)
        st.items += 1
        return key

    def _undo_add(self, slots: np.ndarray) -> None:
        """Forget half-added ``slots`` (a write failed): their slots go back to the free list."""
        for s in slots.tolist():
            self._drop_ram(s)
            if self.rspill is not None and s in self.rspill.loc:
                self.rspill.release(s)
                self.stats.remote_items -= 1
            if self.seg[s] >= 0 and self.segments is not None:
                self.segments.release(int(self.seg[s]), int(self.len[s]))
                self.stats.disk_items -= 1
                self.seg[s] = -1
        self.keys[slots] = -1
        self.free[self.nfree : self.nfree + len(slots)] = slots[::-1]
        self.nfree += len(slots)

    def restore(self, keys: np.ndarray, blobs: list[bytes]) -> None:
        """Put items back under their saved keys (a load into an empty store)."""
        slots = keys % self.cap
        if (self.keys[slots] >= 0).any() or len(np.unique(slots)) != len(slots):
            raise CorruptDataError("two saved items map to one slot: the saved index is damaged")
        self.keys[slots] = keys
        self.seg[slots] = -1
        self.seq = max(self.seq, int(keys.max()) // self.cap + 1) if len(keys) else self.seq
        if self.durable:
            locs = self._disk().append([(int(k), 0, b) for k, b in zip(keys.tolist(), blobs)])
            for s, (seg, off, ln) in zip(slots.tolist(), locs):
                self.seg[s], self.off[s], self.len[s] = seg, off, ln
        self._to_ram(slots, keys, blobs)
        self.fifo.push(keys)
        self.stats.items += len(keys)
        self._rebuild_free()

    def finish_restore(self, seq: int) -> None:
        """After :meth:`restore`: continue keys after ``seq`` adds; remember the live keys' slots."""
        self.seq = max(self.seq, seq)
        self.issued_slot[:] = -1
        self._note_issued(self.order())

    def _place(self, s: int, blob: Any, n: int) -> int:
        """Keep ``blob`` (``n`` bytes) as slot ``s``'s RAM copy (parts are joined once); returns
        the budget it takes."""
        self.ram[s] = _flat(blob)
        return n + _OBJ

    def _drop_ram(self, s: int) -> None:
        """Forget slot ``s``'s RAM copy (if any)."""
        blob = self.ram[s]
        if blob is None:
            return
        self.ram[s] = None
        self.stats.ram_bytes -= len(blob) + _OBJ
        self.stats.ram_items -= 1

    def _to_ram(self, slots: np.ndarray, keys: np.ndarray, blobs: list) -> None:
        sizes = [_size(b) for b in blobs]
        need = sum(_est(n) for n in sizes)
        st = self.stats
        if st.ram_bytes + need > self.budget:
            # spill a little more than needed (1/16 of the budget, at most 16 MiB) so writes
            # are large and rare
            self._spill(st.ram_bytes + need - self.budget + min(self.budget // 16, 16 << 20))
        spill = []
        ram_keys = []
        # (the loop of _place, inlined with locals: it runs once per item of every extend)
        ram, join = self.ram, b"".join
        used, budget, placed = st.ram_bytes, self.budget, 0
        for s, k, b, n in zip(slots.tolist(), keys.tolist(), blobs, sizes):
            if used + n + _OBJ > budget:
                if self.seg[s] < 0:  # larger than what is left of the budget: straight out
                    spill.append((s, k, _flat(b)))
                continue
            ram[s] = join(b) if type(b) is list else b
            used += n + _OBJ
            placed += 1
            ram_keys.append(k)
        st.ram_bytes = used
        st.ram_items += placed
        self.ram_order.push(ram_keys)
        st.peak_ram_bytes = max(st.peak_ram_bytes, st.ram_bytes)
        if spill:
            self._write([s for s, _, _ in spill], [k for _, k, _ in spill], [b for *_, b in spill])

    def _lose(self, slots: np.ndarray) -> None:
        """Drop items whose remote copy is gone (their node was lost)."""
        slots = slots[self.keys[slots] >= 0]
        if self.on_drop is not None:
            self.on_drop(slots)
        self.remove(slots)
        self.stats.lost_items += len(slots)

    def _write(self, slots: list[int], keys: list[int], blobs: list) -> None:
        """Write items out of RAM: to the remote pool first when configured, then to disk."""
        rs = self.rspill
        if rs is not None:
            t0 = time.perf_counter_ns()
            rest = rs.put(slots, blobs)
            self.stats.spill_ns += time.perf_counter_ns() - t0
            placed = len(slots) - len(rest)
            self.stats.spill_bytes += sum(len(blobs[i]) for i in range(len(slots))) - sum(
                len(blobs[i]) for i in rest
            )
            self.stats.remote_items += placed
            self.stats.spilled_items += placed
            if rest and "disk" not in self.tiers:
                undo = set(rest)
                for i, s in enumerate(slots):
                    if i not in undo:
                        rs.release(s)
                self.stats.remote_items -= placed
                self.stats.spilled_items -= placed
                why = (
                    "no room for"
                    if rs.closed is None
                    else "been closed (or Ray shut down), so it cannot take"
                )
                raise TierFullError(
                    f"{self.what}: the remote pool has {why} {len(rest)} items evicted "
                    f"from RAM (tier=['remote'] has no disk tier after it); give the pool more "
                    f"room, keep it open while the {self.what} is used, or pass "
                    f"tier=['remote', 'disk']",
                    tier="remote",
                    requested=sum(len(blobs[i]) for i in rest),
                )
            if not rest:
                return
            slots = [slots[i] for i in rest]
            keys = [keys[i] for i in rest]
            blobs = [blobs[i] for i in rest]
        t0 = time.perf_counter_ns()
        locs = self._disk().append([(k, 0, b) for k, b in zip(keys, blobs)])
        self.stats.spill_ns += time.perf_counter_ns() - t0
        self.stats.spill_bytes += sum(ln for _, _, ln in locs)
        for s, (seg, off, ln) in zip(slots, locs):
            self.seg[s], self.off[s], self.len[s] = seg, off, ln
        self.stats.disk_items += len(slots)
        self.stats.spilled_items += len(slots)

    def _spill(self, nbytes: int) -> None:
        """Move the oldest RAM items out of RAM until ``nbytes`` are freed: one gathered write
        of the ones not on disk yet, then their RAM copies are dropped (a failed write changes
        nothing)."""
        q = self.ram_order.view()
        freed, i, drop, out_s, out_k, out_b = 0, 0, [], [], [], []
        while freed < nbytes and i < len(q):
            key = int(q[i])
            i += 1
            s = key % self.cap
            blob = self.ram[s]
            if self.keys[s] != key or blob is None:
                continue
            if self.seg[s] < 0:
                out_s.append(s)
                out_k.append(key)
                out_b.append(blob)
            drop.append(s)
            freed += len(blob) + _OBJ
        if out_s:
            self._write(out_s, out_k, out_b)
            # (items already on disk just lose their RAM copy)
        self.ram_order.head += i
        for s in drop:
            self._drop_ram(s)

    def replace(self, slot: int, blob: bytes) -> None:
        """Overwrite the item in ``slot`` (same key): in RAM if it is there, else a new disk record."""
        key = int(self.keys[slot])
        old = self.ram[slot]
        if old is not None:
            fits = self.stats.ram_bytes - len(old) + len(blob) <= self.budget
            self._drop_ram(slot)
            if fits:
                self.ram[slot] = blob
                self.stats.ram_bytes += len(blob) + _OBJ
                self.stats.ram_items += 1
                if self.durable:
                    self._relocate(slot, key, blob)
                return
        if self.rspill is not None and slot in self.rspill.loc:
            self.rspill.release(slot)  # the new bytes go to disk like any replaced spilled item
            self.stats.remote_items -= 1
        self._relocate(slot, key, blob)

    def _relocate(self, slot: int, key: int, blob: bytes) -> None:
        segs = self._disk()
        old_seg, old_len = int(self.seg[slot]), int(self.len[slot])
        [(seg, off, ln)] = segs.append([(key, 0, blob)])
        self.seg[slot], self.off[slot], self.len[slot] = seg, off, ln
        if old_seg >= 0:
            segs.release(old_seg, old_len)
        else:
            self.stats.disk_items += 1
        self._maybe_compact()

    def remove(self, slots: np.ndarray, *, evicted: bool = False) -> None:
        """Forget live ``slots``; their disk space comes back through compaction."""
        if len(slots) == 0:
            return
        segs = self.segments
        keys = self.keys[slots].copy()
        if self.durable and segs is not None:
            segs.append([(int(k), TOMBSTONE, b"") for k in keys.tolist()])
        rs = self.rspill
        ram = self.ram
        for s in slots.tolist():
            if ram[s] is not None:
                self._drop_ram(s)
            if rs is not None and s in rs.loc:
                rs.release(s)
                self.stats.remote_items -= 1
        disk = slots[self.seg[slots] >= 0]
        if len(disk) and segs is not None:
            for sg, ln in zip(self.seg[disk].tolist(), self.len[disk].tolist()):
                segs.release(sg, ln)
            self.stats.disk_items -= len(disk)
            self.seg[disk] = -1
        self.keys[slots] = -1
        self.free[self.nfree : self.nfree + len(slots)] = slots
        self.nfree += len(slots)
        self.stats.items -= len(slots)
        if evicted:
            self.stats.evicted_items += len(slots)
        self._maybe_compact()

    def _evict(self, n: int) -> np.ndarray:
        """Remove the ``n`` oldest items (FIFO); returns their slots."""
        if n <= 0:
            return _NONE
        q = self.fifo.view()
        w = min(len(q), 2 * n + 64)
        while True:  # a window of the FIFO, widened until it holds n live keys
            win = q[:w]
            live = np.flatnonzero(self.keys[win % self.cap] == win)
            if len(live) >= n or w == len(q):
                break
            w = min(len(q), 2 * w)
        live = live[:n]
        self.fifo.head += int(live[-1]) + 1 if len(live) == n else w
        slots = win[live] % self.cap
        self.remove(slots, evicted=True)
        return slots

    # ------------------------------------------------------------------ compaction
    def _maybe_compact(self) -> None:
        if self.segments is None or self.compaction_paused:
            return
        for seg in self.segments.candidates(0.5):
            self._compact(seg)

    def _compact(self, seg: int) -> None:
        """Copy ``seg``'s live records (and tombstones still needed) to the active segment."""
        segs = self.segments
        assert segs is not None
        if seg == segs.active:
            return
        slots = np.nonzero((self.seg == seg) & (self.keys >= 0))[0]
        tomb = segs.needed_tombstones(seg)
        payloads = []
        if len(slots):
            locs = np.stack([self.seg[slots], self.off[slots], self.len[slots]], axis=1)
            payloads = segs.read_many(locs)
        records = [(int(self.keys[s]), 0, p) for s, p in zip(slots.tolist(), payloads)]
        records += [(k, TOMBSTONE, b"") for k in tomb]
        if records and segs.size.get(segs.active, 0) >= segs.segment_size:
            segs.active = -1  # roll before copying, so the copy does not land in a candidate
        locs = segs.append(records)
        for s, (nseg, off, ln) in zip(slots.tolist(), locs):
            self.seg[s], self.off[s], self.len[s] = nseg, off, ln
        segs.stats.compactions += 1
        segs.stats.bytes_compacted += sum(ln for _, _, ln in locs)
        segs.drop(seg)

    def close(self) -> None:
        self._finalizer()
        self.ram = [None] * self.cap
