"""Persistence of a ReplayBuffer: ``save``/``load`` of a copy, and a durable buffer's reopen and checkpoints.

One format for all three paths: the items as segment records, ``state.npz`` (keys, priority
leaves, use counts, episode/step/version) and ``buffer.json`` (config, sampler state, add count),
read and written by ``_saved.py``; nothing is pickled (``PROTOCOLS.md``, "Saving and loading").

- ``save(dir)``: the buffer holds its lock only while :meth:`Persistence.begin_save` records the
  state and pins the items (:meth:`ItemStore.pin`); :func:`write_copy` then copies the bytes outside
  the lock, and a failed copy removes what it wrote.
- ``load(dir)``: :meth:`Persistence.restore_saved` puts a validated copy's items back under their
  keys in a new buffer, with their priorities and use counts.
- ``durable=True``: :meth:`Persistence.restore_durable` gives the items the store recovered from
  its segments the priorities of the last :meth:`Persistence.checkpoint` (newer ones the max).

This module reaches the items only through the store's methods (``pin``/``unpin``, ``restore``,
``finish_restore``, ``recovered``), never its index arrays, and takes no lock: the buffer does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensortier import _modes
from tensortier.errors import ConfigError, CorruptDataError, SpillDirError
from tensortier.rl import _saved
from tensortier.rl._api import ReplayConfig
from tensortier.rl._slot_meta import FIELDS, SlotMeta
from tensortier.rl._store import ItemStore, Pinned
from tensortier.rl.sampler import LEAF_MAX, check_priority
from tensortier.tiers.segments import Segments

log = logging.getLogger(__name__)
LOAD_FIX = "load another copy (the saved files were left unchanged)"


@dataclass
class SaveJob:
    """What ``save`` copies once the lock is released: the state recorded and the items pinned."""

    arrays: dict[str, np.ndarray]
    meta: dict
    pinned: Pinned


def check_directory(directory: Any, what: str) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(f"{what}: directory must be a path, got {type(directory).__name__}")
    return os.fspath(directory)


def prepare_dir(dirname: str, mode: int) -> bool:
    """Create ``dirname`` (or take an empty one) with the directory mode matching ``mode``;
    whether it was made here (a failed save then removes it)."""
    made = not os.path.lexists(dirname)
    try:
        os.makedirs(dirname, exist_ok=True)
        if os.listdir(dirname):
            raise ConfigError(f"save: {dirname!r} is not empty; pass a new or empty directory")
        _modes.set_dir(dirname, mode)
    except OSError as exc:
        raise SpillDirError(
            f"save: cannot use {dirname!r} as the save directory ({exc.strerror}); pass a "
            f"writable, new or empty directory",
            path=dirname,
        ) from exc
    return made


def write_copy(dirname: str, job: SaveJob, segment_size: int, mode: int, made: bool) -> None:
    """Write the items and state of ``job`` to ``dirname`` (no lock needed); on failure remove
    what was written (and ``dirname`` if ``made``)."""
    try:
        out = Segments(dirname, segment_size=segment_size, mode=mode)
        try:
            with contextlib.closing(job.pinned.chunks()) as parts:
                for keys, blobs in parts:
                    out.append([(k, 0, b) for k, b in zip(keys, blobs)])
            out.sync()
        finally:
            out.close(remove=False)
        _saved.write(dirname, job.arrays, job.meta, mode)
    except BaseException as exc:
        _remove_saved(dirname, made)
        if isinstance(exc, OSError):
            raise SpillDirError(
                f"save: cannot write to {dirname!r} ({exc.strerror}); free space there or "
                f"pass another directory (nothing was left behind)",
                path=dirname,
            ) from exc
        raise


def _remove_saved(dirname: str, made: bool) -> None:
    """Undo a failed save: remove the files it wrote (the directory was empty), and the
    directory if the save made it."""
    try:
        names = os.listdir(dirname)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(dirname, name))
    if made:
        with contextlib.suppress(OSError):
            os.rmdir(dirname)


class Persistence:
    """Records and restores one buffer's state; the buffer calls it with its lock held."""

    def __init__(
        self,
        config: ReplayConfig,
        store: ItemStore,
        sampler: Any,
        meta: SlotMeta,
        rng: np.random.Generator,
    ):
        self.config = config
        self.store = store
        self.sampler = sampler
        self.meta = meta
        self.rng = rng

    # ------------------------------------------------------------------ recording
    def _state(self, keys: np.ndarray) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, meta) of the items ``keys`` (oldest first) and of the sampler."""
        slots = keys % self.config.max_items
        arrays = {
            "keys": keys,
            "leaves": np.asarray(self.sampler.leaves(slots), np.float64),
            **self.meta.arrays(slots),
        }
        meta = {
            "format": _saved.FORMAT,
            "version": _saved.VERSION,
            "config": self.config.to_dict(),
            "sampler_state": self.sampler.state(),
            "seq": int(self.store.seq),
            "policy_version": int(self.meta.policy_version),
        }
        return arrays, meta

    def begin_save(self) -> SaveJob:
        """(lock held) Record the state and pin the items; end with ``store.unpin(job.pinned)``."""
        pinned = self.store.pin()
        arrays, meta = self._state(pinned.keys)
        if self.config.seed is not None:
            # a seeded buffer's copy goes on with the same stream (as TorchRL's state_dict):
            # the generator's state, and the uniform sampler's draw order, which evictions and
            # deletes permute (the key order alone would rebuild another one)
            meta["rng"] = {"seed": self.config.seed, "state": self.rng.bit_generator.state}
            positions = getattr(self.sampler, "positions", None)
            pos = None if positions is None else positions(pinned.keys % self.config.max_items)
            if pos is not None and np.array_equal(np.sort(pos), np.arange(len(pos))):
                arrays[_saved.DRAW_POS] = pos  # (else load rebuilds the order from the keys)
        return SaveJob(arrays, meta, pinned)

    def checkpoint(self) -> None:
        """(lock held) Durable buffers: priorities and use counts next to the segments."""
        root = self.store.root
        assert root is not None
        _saved.write(root, *self._state(self.store.order()))

    # ------------------------------------------------------------------ restoring
    def restore_saved(
        self, dirname: str, arrays: dict[str, np.ndarray], meta: dict, resume_rng: bool = False
    ) -> None:
        """Fill this (new, empty) buffer with the copy in ``dirname``, validated by
        ``_saved.read``: items under their keys, priorities, use counts, sampler state, and with
        ``resume_rng`` the saved generator state."""
        keys = arrays["keys"]
        _load_items(self.store, dirname, keys)
        self.store.finish_restore(meta["seq"])
        slots = keys % self.config.max_items
        order = arrays.get(_saved.DRAW_POS)
        if order is not None and hasattr(self.sampler, "positions"):
            self.sampler.add(slots[np.argsort(order)])  # the saved uniform draw order
        else:
            self.sampler.add(slots, arrays["leaves"])
        self.meta.load(slots, arrays, meta.get("policy_version", -1))
        self._load_sampler_state(meta, dirname, LOAD_FIX)
        if resume_rng:
            self.rng.bit_generator.state = meta["rng"]["state"]  # validated by _saved.read

    def restore_durable(self) -> None:
        """Sampler entries for the items the store recovered from its segments: the priorities
        and use counts of the last checkpoint, the max priority for items added after it."""
        keys = self.store.recovered
        slots = keys % self.config.max_items
        root = self.store.root
        assert root is not None
        state, meta_file = _saved.STATE, _saved.META
        have = [os.path.exists(os.path.join(root, name)) for name in (state, meta_file)]
        leaves = None
        if any(have) and not all(have):  # a crash during the first checkpoint()
            log.warning(
                "tensortier: %s has only one of %s and %s; reopening without priorities",
                root,
                state,
                meta_file,
            )
        elif all(have):
            leaves = self._checkpointed(root, keys, slots)
        self.sampler.add(slots, leaves)

    def _checkpointed(self, root: str, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Leaves of the recovered ``keys`` from the checkpoint in ``root`` (use counts and
        episode/step/version restored on the way)."""
        fix = (
            f"remove {_saved.STATE} and {_saved.META} from {root!r} to reopen the items at the "
            f"max priority with fresh use counts"
        )
        meta, was, saved = _saved.read(root, fix=fix)
        _check_alpha(meta["sampler_state"], was, self.sampler.cfg, root)
        self._load_sampler_state(meta, root, fix)
        saved_keys = saved["keys"]
        pos = np.searchsorted(saved_keys, keys)
        pos = np.minimum(pos, max(len(saved_keys) - 1, 0))
        known = saved_keys[pos] == keys if len(saved_keys) else np.zeros(len(keys), bool)
        leaves = np.full(len(keys), getattr(self.sampler, "max_priority", 1.0))
        leaves = leaves ** getattr(self.sampler.cfg, "alpha", 1.0)
        weights = _reweighted(saved["leaves"][pos[known]], was, self.sampler.cfg, root)
        if weights is not None:  # else: no priorities were recorded, items get the max
            leaves[known] = weights
        # episode, step and version of items added since the checkpoint stay -1 (unknown)
        sub = {k: saved[k][pos[known]] for k in ("uses", *FIELDS) if k in saved}
        self.meta.load(slots[known], sub, meta.get("policy_version", -1))
        return leaves

    def _load_sampler_state(self, meta: dict, root: str, fix: str) -> None:
        try:
            self.sampler.load_state(meta["sampler_state"])
        except (TypeError, ValueError) as exc:
            raise CorruptDataError(
                f"{os.path.join(root, _saved.META)}: sampler_state is not valid ({exc}); {fix}",
                path=root,
            ) from exc


def _check_alpha(state: dict, was: Any, now: Any, root: str) -> None:
    """ConfigError naming the checkpointed alpha when the checkpoint's max priority (the
    largest priority ever set there) has a weight past ``LEAF_MAX`` with ``now``'s alpha."""
    a_was, a_now = getattr(was, "alpha", None), getattr(now, "alpha", None)
    top = state.get("max_priority")
    if a_now is None or a_was in (None, a_now) or type(top) not in (int, float):
        return  # nothing converted, or a malformed max that load_state reports
    if not 0 < top < np.inf:
        return
    try:
        check_priority(float(top), a_now, "the checkpoint's max priority")
    except ConfigError as exc:
        raise ConfigError(
            f"{root!r}: {exc}; or reopen with alpha={a_was}, as checkpointed"
        ) from None


def _reweighted(leaves: np.ndarray, was: Any, now: Any, root: str) -> np.ndarray | None:
    """Checkpointed weights ``p**alpha`` of sampler config ``was`` as weights of ``now``: a
    durable buffer may reopen with another alpha. None when ``was`` recorded no priorities
    (uniform, or alpha 0 where every weight is 1)."""
    a_was, a_now = getattr(was, "alpha", 0.0), getattr(now, "alpha", None)
    if a_now is None or a_was == a_now:
        return leaves
    if a_was == 0:
        return None
    out = leaves ** (a_now / a_was)
    if len(out) and out.max() > LEAF_MAX:  # (each priority is at most the max, checked first)
        raise ConfigError(
            f"the checkpoint in {root!r} has weights past {LEAF_MAX:g} with alpha={a_now}; "
            f"reopen with alpha={a_was}, as checkpointed"
        )
    return out


def _load_items(store: ItemStore, dirname: str, keys: np.ndarray) -> None:
    """Put the saved items ``keys`` back into ``store`` from the segments in ``dirname``."""
    src = Segments(dirname, readonly=True)
    try:
        by_key = {k: (seg, off, ln) for k, fl, seg, off, ln in src.scan() if fl == 0}
        missing = [int(k) for k in keys.tolist() if k not in by_key]
        if missing:
            raise CorruptDataError(
                f"{dirname!r}: {len(missing)} saved items have no record (first: "
                f"{missing[0]}); {LOAD_FIX}",
                path=dirname,
            )
        step = 2048
        for i in range(0, len(keys), step):
            part = keys[i : i + step]
            locs = np.array([by_key[int(k)] for k in part.tolist()], np.int64).reshape(-1, 3)
            store.restore(part, src.read_many(locs))
    except PermissionError as exc:
        raise _modes.denied(exc.filename or dirname, exc, "ReplayBuffer.load") from exc
    except OSError as exc:
        raise CorruptDataError(
            f"cannot read the saved segments in {dirname!r} ({exc}); {LOAD_FIX}", path=dirname
        ) from exc
    finally:
        src.close(remove=False)
