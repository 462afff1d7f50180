"""``Checkpointer``: two-phase checkpoints (snapshot to host RAM, persist in the background).

The snapshot copies model parameters and optimizer state into reused host images of the
safetensors files while the next forward and backward run (a thread on CPU, a side stream on
CUDA); only the next ``optimizer.step()`` waits for it (a global optimizer step pre-hook enforces
this for every torch optimizer, passed to ``maybe_save`` or not; anything else that changes
parameters or optimizer state in place, such as an EMA update, must call
``before_optimizer_step`` first, and a snapshot that such a change overtook fails with
:class:`ConfigError` instead of committing a torn checkpoint). Tensors that forward may change (buffers such as
BatchNorm statistics), RNG states, the scheduler and ``extra`` are captured before ``maybe_save``
returns. The persist runs on one background thread; at most one checkpoint is in flight, so the
host memory is one set of images, reused for every save. Errors of a background persist are
raised in the caller at the next ``maybe_save``/``save``/``wait``/``close``. The commit protocol,
the rollback rule and the rules for waits and finalizers are in PROTOCOL.md next to this file.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import os
import re
import shutil
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, field, fields

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tensortier import _dist
from tensortier._device import normalize_device
from tensortier._lifetime import DirLock, Finalizer
from tensortier._renamed import renamed_attribute
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, check_int, format_size, parse_size
from tensortier.checkpoint import _faults, _ranks, _replica
from tensortier.checkpoint._format import (
    FORMAT,
    STEP_DIR,
    VERSION,
    Entry,
    manifest_bytes,
    plan,
    read_manifest,
    read_tensors,
    write_header,
)
from tensortier.checkpoint._group import Group, Solo
from tensortier.checkpoint._persist import (
    CpuClock,
    disk_full,
    fsync_dir,
    persist,
    retire,
    step_dir,
    write_shards,
)
from tensortier.checkpoint._policy import AutoInterval
from tensortier.checkpoint._rng import rng_state, set_rng_state
from tensortier.checkpoint._tree import decode, encode
from tensortier.checkpoint._validate import align_model_keys, check_tree, refuse_partial
from tensortier.errors import BudgetError, ClosedError, ConfigError, CorruptDataError, SpillDirError
from tensortier.tiers.disk import _probe_direct, as_bytes
from tensortier.tiers.host import aligned_empty
from tensortier.transfer.streams import COMPUTE, SideStreams, consume

log = logging.getLogger("tensortier.checkpoint")
# debris of our own writes only (removed at start): the step names step_dir() makes
_STALE = re.compile(r"^step-(0|[1-9][0-9]*)\.(incomplete|deleting-[0-9]+)$", re.ASCII)
LOCK_FILE = ".tensortier-checkpoint.lock"
MAX_IO_THREADS = 256
PROGRESS_SECONDS = 60.0  # a wait for a persist logs a warning this often, so a stall shows


@dataclass
class CheckpointConfig:
    """Settings of a :class:`Checkpointer`; validated at construction."""

    keep: int = 3
    every: int | str = "auto"
    max_overhead: float = 0.035
    host_budget: SizeLike | None = None  # None: exactly what the state needs
    shard_size: SizeLike = "256MiB"
    io_threads: int = 4
    direct: bool | None = None  # O_DIRECT when the filesystem supports it
    warmup: int = 3  # clean iterations measured before the first "auto" checkpoint
    commit_timeout: float = 600.0  # many ranks: seconds a rank waits for the others to commit
    replicas: int = 0  # other Ray nodes that keep the newest checkpoint in RAM (0, 1 or 2)
    replica_timeout: float = 60.0  # seconds any one Ray call of a replica push or read may take
    read_only: bool = False  # restore only: no lock taken, nothing written (a read-only mount)

    def __post_init__(self) -> None:
        self.keep = check_int(
            self.keep,
            f"keep={self.keep!r}: keep at least 2 checkpoints, since the newest one may still be "
            f"writing (or be damaged) when you need to resume",
            minimum=2,
        )
        if self.every != "auto":
            msg = f"every={self.every!r}: pass a number of steps >= 1, or 'auto'"
            self.every = check_int(self.every, msg, minimum=1)
        if (
            not isinstance(self.max_overhead, numbers.Real)
            or isinstance(self.max_overhead, bool)
            or not 0 < self.max_overhead < 1
        ):
            raise ConfigError(
                f"max_overhead={self.max_overhead!r}: pass the allowed slowdown as a fraction, "
                f"e.g. 0.035 for 3.5%"
            )
        self.shard_bytes = parse_size(self.shard_size, name="shard_size", allow_zero=False)
        self.host_bytes = (
            None
            if self.host_budget is None
            else parse_size(self.host_budget, name="host_budget", allow_zero=False)
        )
        self.io_threads = check_int(
            self.io_threads,
            f"io_threads={self.io_threads!r}: pass an int from 1 to {MAX_IO_THREADS}, e.g. "
            f"io_threads=4 (the number of parallel writes per checkpoint)",
            minimum=1,
            maximum=MAX_IO_THREADS,
        )
        if not isinstance(self.read_only, bool):
            raise ConfigError(
                f"read_only={self.read_only!r}: pass True (restore only) or False (save and "
                f"restore)"
            )
        if self.direct is not None and not isinstance(self.direct, bool):
            raise ConfigError(
                f"direct={self.direct!r}: pass True, False, or None (O_DIRECT when the filesystem "
                f"supports it)"
            )
        if (
            not isinstance(self.commit_timeout, numbers.Real)
            or isinstance(self.commit_timeout, bool)
            or not self.commit_timeout > 0
        ):
            raise ConfigError(
                f"commit_timeout={self.commit_timeout!r}: pass the seconds a rank may wait for "
                f"the other ranks during a commit or restore, e.g. 600"
            )
        self.replicas = _replica.check_replicas(self.replicas, many_ranks=False)
        if (
            not isinstance(self.replica_timeout, numbers.Real)
            or isinstance(self.replica_timeout, bool)
            or not self.replica_timeout > 0
        ):
            raise ConfigError(
                f"replica_timeout={self.replica_timeout!r}: pass the seconds one Ray call of a "
                f"replica push or restore may take, e.g. 60"
            )
        self.warmup = check_int(
            self.warmup,
            f"warmup={self.warmup!r}: pass the number of clean iterations (an int >= 0) "
            f"measured before the first automatic checkpoint",
            minimum=0,
        )


@dataclass
class CheckpointState:
    """What :meth:`Checkpointer.restore` found. ``step`` is the first step to run next."""

    step: int
    saved_step: int
    path: str
    extra: object = None
    source: str = "disk"  # "replica": read from another node's RAM (replicas=), else "disk"
    fallback: str | None = None  # replicas=: why the replica was not used (None if it was)
    missing_keys: tuple[str, ...] = ()  # restore(strict=False): model keys the checkpoint lacks
    unexpected_keys: tuple[str, ...] = ()  # restore(strict=False): saved keys the model lacks


@dataclass
class _ReplicaTry:
    """restore() with replicas=: the replica is tried for the newest readable step only;
    ``fallback`` is why it was not used (None: not tried yet, or it was used)."""

    fallback: str | None = None


@dataclass
class CheckpointStats:
    saves: int = 0  # checkpoints started
    committed: int = 0  # checkpoints durable under their final name
    last_committed_step: int | None = None
    interval: int | None = None  # steps between checkpoints (every=K, or the auto choice)
    stall_seconds: float = 0.0  # total time the training loop was blocked by checkpointing
    last_stall_seconds: float = 0.0  # blocking in maybe_save + wait before the optimizer step
    last_snapshot_seconds: float = 0.0  # time to copy the state to host memory
    last_persist_seconds: float = 0.0  # time from the end of the snapshot to the durable rename
    last_persist_bytes: int = 0
    last_cost_seconds: float | None = None  # auto: measured loop slowdown caused by a checkpoint
    waited_for_persist: int = 0  # saves that had to wait for the previous persist (every=K)
    host_bytes: int = 0  # snapshot images held (reused by every save)
    replica_pushes: int = 0  # checkpoints whose in-memory replicas completed (replicas=)
    replica_push_failures: int = 0  # pushes that failed (the disk checkpoint stands)
    last_replica_error: str | None = None
    last_replica_seconds: float = 0.0  # time to send the newest checkpoint to its replicas
    # where that time went: seconds in "choose" (nodes), "start" (holders ready), "send", "commit"
    last_replica_phases: dict = field(default_factory=dict)
    replica_nodes: list = field(default_factory=list)  # nodes holding the newest replica
    replica_restores: int = 0  # restores read from a replica
    replica_fallbacks: int = 0  # restores with replicas= that fell back to disk
    # the newest restore from a replica: seconds in "find" (holders, manifests), "fetch" (waiting
    # for the bytes to reach this node's object store), "copy_verify" (copy out, CRC32C)
    last_replica_restore_phases: dict = field(default_factory=dict)
    last_fallback_reason: str | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=100))

    @property
    def last_persist_gbps(self) -> float:
        t = self.last_persist_seconds
        return self.last_persist_bytes / t / 1e9 if t else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["history"] = list(self.history)
        d["last_persist_gbps"] = self.last_persist_gbps
        return d


def _complete_steps(root: str) -> list[int]:
    steps = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


class _Captured:
    """One save's state tree with its tensors taken out: ``tensors`` holds (name, tensor, copy
    late) for each. Late tensors (parameters, optimizer state) change only at the next optimizer
    step, so they are copied in the background; the others (buffers, scheduler, RNG, extra)
    before ``maybe_save`` returns. Many ranks: a DTensor is taken as its local shard with its
    place in the global tensor (``chunks``); per-rank entries are named ``rank-R/...``."""

    def __init__(self, group: Solo, model: torch.nn.Module | None):
        self.group = group
        self.tensors: list[tuple[str, torch.Tensor, bool]] = []
        self.chunks: dict[str, dict] = {}  # many ranks: DTensor shards' place in the global tensor
        self.elsewhere: set[str] = set()  # many ranks: DTensor chunks another rank writes
        self._names: set[str] = set()
        self._params = (
            {_ranks.dtensor_local(p)[0].data_ptr() for p in model.parameters()}
            if model is not None
            else set()
        )

    def tree(self, model, optimizer, scheduler, extra, rng: bool) -> dict:
        """The state tree (tensors replaced by their names), in the manifest's order."""
        sync = getattr(optimizer, "synchronize", None)
        if callable(sync):  # OffloadedAdamW(defer_gather=True): the last step's gathers written
            sync()
        return {
            "model": encode(model.state_dict(), "model", self._adder(False, True))
            if model is not None
            else None,
            "optimizer": encode(optimizer.state_dict(), "optimizer", self._adder(True))
            if optimizer is not None
            else None,
            "scheduler": encode(scheduler.state_dict(), "scheduler", self._adder(False))
            if scheduler is not None
            else None,
            "rng": encode(rng_state(), "rng", self._adder(False, per_rank=True)) if rng else None,
            "extra": encode(extra, "extra", self._adder(False, per_rank=True)),
        }

    def _adder(self, background: bool, is_param: bool = False, per_rank: bool = False):
        prefix = self.group.prefix(per_rank)

        def add(path: str, t: torch.Tensor) -> str:
            name = prefix + path
            while name in self._names:
                name += "'"
            self._names.add(name)
            refuse_partial(t, name)
            if self.group.many and _ranks.held_elsewhere(t):
                self.elsewhere.add(name)
            t, chunk = self.group.held(t)
            if chunk is not None:
                self.chunks[name] = chunk
            late = background or (is_param and t.data_ptr() in self._params)
            self.tensors.append((name, t.detach(), late))
            return name

        return add


@dataclass(eq=False)
class _Save:
    """One checkpoint in flight: what its persist writes, and the copies it waits for."""

    step: int
    abandoned: list[int]  # a rollback: the abandoned run's checkpoints this save retires
    shards: list
    images: list[torch.Tensor]
    body: dict
    chunks: dict[str, dict]
    replicated: dict[str, int]  # many ranks: the writer of each tensor several ranks hold
    snapshot: Future  # the copy thread's late host copies; its result is when they ended
    cuda_done: dict  # per device: the event after its copies
    clock: CpuClock
    copy_started: float


class Checkpointer:
    """Crash-consistent, CheckFreq-style checkpoints of model, optimizer, scheduler, RNG and extra.

    >>> ck = Checkpointer("ckpts/", keep=3, every="auto", max_overhead=0.035)
    >>> state = ck.restore(model=model, optimizer=opt, scheduler=sched)   # None on a fresh start
    >>> ...  # loss.backward(); ck.before_optimizer_step(); opt.step()
    >>> ck.maybe_save(step, model=model, optimizer=opt, scheduler=sched, extra={"epoch": 3})
    >>> ck.close()                                                        # waits for the persist

    Only this object writes to ``directory`` (an exclusive lock is held until ``close``). One run
    per directory: after ``restore(step=k)`` (a rollback), the first save retires the checkpoints
    newer than ``k``, crash-consistently; saving below checkpoints of another run is refused.

    Many ranks (``torch.distributed`` initialised, ``process_group`` of more than one rank):
    create one on every rank with the same directory (a filesystem every rank sees) and call
    every method on every rank, ``save`` with the same step and the same model/optimizer/
    scheduler arguments (otherwise :class:`ConfigError` on every rank, nothing written). Each
    rank writes its own shards (DTensor and sharded-optimizer tensors as local shards; a tensor
    several ranks hold, written once by one of them), and rank 0 commits one global manifest
    after every rank's files are durable. ``restore`` works on any world size (PROTOCOL.md,
    "Many ranks").

    ``replicas=1`` or ``2`` (one process, ``ray.init`` first): after each commit the checkpoint is
    also held in the RAM of that many other Ray nodes, by detached actors that outlive this
    process; ``restore`` reads a verified replica of the newest step and falls back to disk
    otherwise (``CheckpointState.source``/``fallback``). See ``_replica.py``.

    Settings (the fields of :class:`CheckpointConfig`, with their defaults): ``keep=3``
    checkpoints kept (at least 2); ``every="auto"`` (or a number of steps: ``maybe_save`` saves
    when ``(step + 1) % every == 0``); ``max_overhead=0.035``, the slowdown ``"auto"`` allows;
    ``host_budget=None`` (the host image: exactly what the state needs); ``shard_size="256MiB"``;
    ``io_threads=4`` parallel writes; ``direct=None`` (O_DIRECT where the filesystem supports
    it); ``warmup=3`` iterations measured before the first ``"auto"`` checkpoint;
    ``commit_timeout=600.0`` seconds (many ranks); ``replicas=0`` and ``replica_timeout=60.0``;
    ``read_only=False`` (``True``: restore only, from a directory it must not write: no lock
    taken, nothing written, ``save`` refused).
    """

    root = renamed_attribute("root", "directory")  # the vocabulary's name; goes in 0.2

    def __init__(self, directory: str | os.PathLike, *, process_group=None, **settings):
        unknown = sorted(set(settings) - {f.name for f in fields(CheckpointConfig)})
        if unknown:
            raise TypeError(
                f"Checkpointer() got an unexpected keyword argument {unknown[0]!r}; its settings "
                f"are {', '.join(f.name for f in fields(CheckpointConfig))} (help(Checkpointer))"
            )
        self.config = CheckpointConfig(**settings)
        self.directory = _check_directory(directory)  # absolute, as given
        self._group = (
            Group.create(process_group, self.config.commit_timeout)
            if _dist.active(process_group)
            else Solo()
        )
        cfg = asdict(self.config)
        self._group.agree(
            {"directory": self.directory, **{k: cfg[k] for k in ("keep", "every", "shard_size")}},
            "Checkpointer",
            fix="pass the same directory and settings everywhere",
        )
        _prepare_directory(self.directory, self.config)
        cfg = self.config
        _replica.check_replicas(cfg.replicas, many_ranks=self._group.many)
        self._replicas = (
            _replica.Replicas(self.directory, cfg.replicas, cfg.replica_timeout)
            if cfg.replicas
            else None
        )
        self._dirlock, self.direct = self._lock_directory()
        self._stats = CheckpointStats(interval=cfg.every if isinstance(cfg.every, int) else None)
        self._auto = (
            AutoInterval(cfg.max_overhead, warmup=cfg.warmup) if cfg.every == "auto" else None
        )
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="tt-ckpt-io")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tt-ckpt-persist")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="tt-ckpt-snapshot")
        # GC only schedules this (reaper thread): it joins the threads, then drops the lock
        self._finalizer = Finalizer(
            self, _shutdown, self._io, self._worker, self._copier, self._dirlock
        )
        self._images: list[torch.Tensor] = []
        self._signature: tuple | None = None
        self._shards: list = []
        self._slots: dict[str, torch.Tensor] = {}
        self._snapshot: Future | None = None
        self._cuda_done: dict[torch.device, torch.cuda.Event] = {}  # per device: copies queued
        self._streams = SideStreams()  # one side stream per device (D2H), made on first use
        self._persist: Future | None = None
        self._persist_step: int | None = None
        # every optimizer's step waits for the snapshot, also one not passed to maybe_save/save
        self._hooks: list = [
            register_optimizer_step_pre_hook(functools.partial(_before_any_step, weakref.ref(self)))
        ]
        self._late: list[tuple[torch.Tensor, int]] = []  # (tensor, _version) copied late
        self._torn: str | None = None  # a late tensor changed before its copy was ordered
        self._last_call: float | None = None
        # the step this run continues from: the last one saved or restored (see _start's rollback)
        self._last_saved: int | None = None
        self._stall = 0.0
        self._background_cpu = 0.0  # CPU seconds of the last checkpoint's background work
        register_stats("checkpointer", self)  # tt.stats() lists it while it is open

    def _lock_directory(self) -> tuple[DirLock | None, bool]:
        """One writer per directory: the process (many ranks: rank 0, for the whole group) holds
        the lock, removes the debris of crashed runs and probes O_DIRECT; every rank raises if
        that failed, and uses rank 0's probe (one probe file, no race between ranks)."""
        lock, error, direct = None, None, self.config.direct
        if self.config.read_only:  # a reader: no lock, no debris removed, no probe file
            return None, False
        if self._group.rank == 0:
            try:
                lock = DirLock(self.directory, name=LOCK_FILE, what="Checkpointer")
                for name in os.listdir(self.directory):  # debris of a crashed run
                    if _STALE.match(name):
                        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                if direct is None:
                    direct = _probe_direct(self.directory)
            except BaseException as exc:
                if lock is not None:
                    lock.release()
                    lock = None
                error = exc
        return lock, bool(self._group.from_rank0(error, direct))

    # ------------------------------------------------------------------ public API
    def stats(self) -> CheckpointStats:
        """Counters and timings of this checkpointer, live (they keep counting)."""
        return self._stats

    @property
    def interval(self) -> int | None:
        """Steps between checkpoints: ``every``, or the adaptive choice once measured."""
        return self._stats.interval

    def checkpoints(self) -> list[str]:
        """Paths of the complete checkpoints, newest first (not yet verified)."""
        return [step_dir(self.directory, s) for s in _complete_steps(self.directory)]

    def maybe_save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: object | None = None,
        extra: object = None,
    ) -> bool:
        """Call after every optimizer step; starts a checkpoint of ``step`` when one is due.

        Returns whether a checkpoint was started. Raises the error of a failed background persist.
        """
        self._check_writer("maybe_save")
        step = _check_step(step, "maybe_save")
        self._raise_pending()
        now = time.monotonic()
        if self._auto is not None:
            busy = self._auto.open_cost is not None
            if self._last_call is not None:
                self._auto.observe(now - self._last_call, busy=busy)
            if busy and (self._persist is None or self._persist.done()):
                floor = self._stats.last_stall_seconds + self._background_cpu
                self._stats.last_cost_seconds = self._auto.finished(floor)
                self._stats.interval = self._auto.interval
                if self._stats.history:
                    self._stats.history[-1]["cost_s"] = self._stats.last_cost_seconds
                log.info(
                    "checkpoint cost %.3fs at %.3fs/iteration: interval now %s steps",
                    self._stats.last_cost_seconds,
                    self._auto.t_iter,
                    self._stats.interval,
                )
            self._last_call = now
            due = self._auto.due() and (self._persist is None or self._persist.done())
            due = self._group.any_true(due)  # every rank saves, or none (its timings differ)
        else:
            due = (step + 1) % int(self.config.every) == 0
        if not due or step == self._last_saved:
            return False
        self._start(step, model, optimizer, scheduler, extra, entered=now)
        if self._auto is not None:
            self._auto.started()
        return True

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: object | None = None,
        extra: object = None,
    ) -> None:
        """Start a checkpoint of ``step`` now (waiting for the previous persist if needed)."""
        self._check_writer("save")
        step = _check_step(step, "save")
        self._raise_pending()
        self._start(step, model, optimizer, scheduler, extra, entered=time.monotonic())

    def before_optimizer_step(self) -> None:
        """Wait until the snapshot has copied the parameters and optimizer state.

        Also runs automatically before every optimizer's ``step()`` (a global step pre-hook, so
        an optimizer never passed to ``maybe_save``, an EMA's for one, waits too).
        The CPU copy is a bounded memcpy (no I/O), so it is waited for without a timeout; CUDA
        copies are waited for on each device's current stream (the host does not block).
        """
        if self._snapshot is None and not self._cuda_done:
            return
        if self._cuda_done:  # anything queued before this barrier may precede the copies
            self._torn = self._torn or _changed(self._late)
            self._late = []
        t0 = time.monotonic()
        if self._snapshot is not None:
            snap, self._snapshot = self._snapshot, None
            snap.exception()  # wait; a failed copy is raised once, by the persist job's error
        for device, event in self._cuda_done.items():
            torch.cuda.current_stream(device).wait_event(event)
        self._cuda_done = {}
        waited = time.monotonic() - t0
        self._stall += waited
        self._stats.stall_seconds += waited
        self._stats.last_stall_seconds += waited

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint in flight is durable; raise its error if it failed.

        ``timeout`` (seconds): raise :class:`TimeoutError` if it is still being written by then
        (it stays in flight; call ``wait`` again). Without one, a warning is logged every minute
        of waiting, naming the step, so a stalled filesystem shows in the log.
        """
        self.before_optimizer_step()
        if self._persist is not None:
            _await(
                self._persist,
                timeout,
                f"the checkpoint of step {self._persist_step}",
                self.directory,
            )
        self._raise_pending()

    def restore(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: object | None = None,
        step: int | None = None,
        rng: bool = True,
        strict: bool = True,
    ) -> CheckpointState | None:
        """Load the newest checkpoint that verifies; ``None`` when there is none.

        Every checksum is checked before anything is loaded. A damaged checkpoint is skipped with
        a warning naming the defect; if every checkpoint is damaged, :class:`CorruptDataError`.
        ``strict=False`` loads the model keys both sides have, as ``load_state_dict(strict=False)``
        (fine-tuning with a new head); the state names the others. Shapes must still match.
        """
        self._check_open()
        if not isinstance(strict, bool):
            raise ConfigError(f"strict={strict!r}: pass True or False, as to load_state_dict")
        step = None if step is None else _check_step(step, "restore")
        self.wait()
        self._group.agree(  # else each rank would load the step it named: a mixed state
            {"step": step, "strict": strict},
            "restore",
            fix="pass the same restore(step=, strict=) everywhere",
        )
        steps = self._candidates(step)
        problems = []
        replica = _ReplicaTry()
        for s in steps:
            path = step_dir(self.directory, s)
            tree, source, error = None, "disk", None
            try:
                tree, source = self._read(s, path, model, optimizer, replica)
            except CorruptDataError as exc:
                error = str(exc)
            error = self._group.unusable(error)  # every rank falls back together
            if error is not None:
                problems.append(f"{path}: {error}")
                warnings.warn(
                    f"checkpoint {path} is unusable ({error}); falling back to an older one",
                    stacklevel=2,
                )
                continue
            if model is not None:  # DDP(model) saved, bare model restored (or back)
                tree = align_model_keys(tree, model.state_dict())
            self._group.fits(tree, path, model, optimizer, scheduler, strict)  # before any load
            keys = self._apply(tree, model, optimizer, scheduler, rng, strict)
            self._last_saved = s
            log.info("rank %d restored %s from %s", self._group.rank, path, source)
            return CheckpointState(
                step=s + 1,
                saved_step=s,
                path=path,
                extra=tree.get("extra"),
                source=source,
                fallback=self._count_replica_restore(source, replica),
                missing_keys=tuple(keys.missing_keys) if keys else (),
                unexpected_keys=tuple(keys.unexpected_keys) if keys else (),
            )
        if problems:
            raise CorruptDataError(
                f"no usable checkpoint in {self.directory!r}: {'; '.join(problems)}. Move them "
                "away to start fresh, or restore a specific step=",
                path=self.directory,
            )
        return None

    def _candidates(self, step: int | None) -> list[int]:
        """The complete checkpoints restore tries, newest first (rank 0 lists them)."""
        steps = self._group.decide(lambda: _complete_steps(self.directory))
        if step is not None:
            if step not in steps:
                raise ConfigError(
                    f"no complete checkpoint of step {step} in {self.directory!r}; found {steps}"
                )
            steps = [step]
        return steps

    def _read(self, s: int, path: str, model, optimizer, replica: _ReplicaTry) -> tuple[dict, str]:
        """(the verified state tree this rank restores from step ``s``, where it was read).

        Many ranks, or a checkpoint of many ranks: every saved rank's tree, tensors read as the
        targets need them (``load_tree``). One process and format v1: the files, or (replicas=)
        a verified in-memory replica of the newest readable step.
        """
        body = read_manifest(path)
        if body["step"] != s:
            raise CorruptDataError(f"manifest says step {body['step']!r}", path=path)
        if self._group.many or body.get("version") == _ranks.VERSION:
            group = self._group
            return load_tree(body, path, model, optimizer, group.rank, group.share), "disk"
        tensors, source = None, "disk"
        if self.config.replicas and replica.fallback is None:  # the newest readable step
            tensors, replica.fallback = self._from_replica(body, path)
            source = "disk" if tensors is None else "replica"
        if tensors is None:
            tensors = read_tensors(path, body)
        return _decode_state(body, tensors, path), source

    def _count_replica_restore(self, source: str, replica: _ReplicaTry) -> str | None:
        """replicas=: count a restore from a replica or a fallback; returns why it fell back."""
        if not self.config.replicas:
            return replica.fallback
        if source == "replica":
            self._stats.replica_restores += 1
            return None
        fallback = replica.fallback or "the newest checkpoint on disk was unusable"
        self._stats.replica_fallbacks += 1
        self._stats.last_fallback_reason = fallback
        return fallback

    def _from_replica(self, body: dict, path: str) -> tuple[dict | None, str | None]:
        """(verified tensors of ``body`` from an in-memory replica, None) or (None, the reason
        restore falls back to the disk files)."""
        try:
            found = _replica.load(self.directory, body, self.config.replica_timeout)
        except _replica.Fallback as exc:
            log.warning("restoring %s from disk, not from a replica: %s", path, exc)
            return None, str(exc)
        log.info(
            "checkpoint %s read from the replica on node %s (%s)",
            path,
            found.node,
            ", ".join(f"{k} {v:.3f}s" for k, v in found.phases.items()),
        )
        self._stats.last_replica_restore_phases = dict(found.phases)
        return found.tensors, None

    def drop_replicas(self) -> int:
        """Free the in-memory replicas of this directory's checkpoints (they outlive this object
        on purpose, for a restart); returns how many holders were ended."""
        return _replica.drop_replicas(self.directory, self.config.replica_timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the last persist, release buffers and the directory lock; re-raise its error.

        ``timeout``: as in :meth:`wait`; on :class:`TimeoutError` the Checkpointer stays open.
        """
        if not self._finalizer.alive:
            return
        try:
            self.wait(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._shut()
            raise
        self._shut()

    def _shut(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._release_images()
        self._finalizer()  # threads are idle: the joins return at once; then the lock goes

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # keep the original exception; still finish and release what we can
            with contextlib.suppress(BaseException):
                self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.directory!r}, keep={self.config.keep}, every={self.config.every!r}, "
            f"interval={self._stats.interval}, committed={self._stats.committed})"
        )

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"Checkpointer {self.directory!r} is closed")

    def _check_writer(self, verb: str) -> None:
        self._check_open()
        if self.config.read_only:
            raise ConfigError(
                f"{verb}: Checkpointer({self.directory!r}, read_only=True) only restores; save "
                f"into a Checkpointer of a writable directory (without read_only=True)"
            )

    def _raise_pending(self) -> None:
        """Raise (once) the error of a background persist that failed."""
        if self._persist is not None and self._persist.done():
            error = self._persist.exception()
            if error is not None:
                self._persist = None
                if self._auto is not None:
                    self._auto.open_cost = None  # a failed checkpoint is not a cost sample
                raise error

    def _start(
        self, step, model, optimizer, scheduler, extra, *, entered: float, rng: bool = True
    ) -> None:
        """Snapshot ``step`` and queue its persist: the phases of PROTOCOL.md, in order."""
        self._stall = 0.0
        self._stats.last_stall_seconds = 0.0
        if self._persist is not None and not self._persist.done():
            self._stats.waited_for_persist += 1
            log.info("checkpoint of step %d waits for the previous persist", step)
        self.wait()
        given = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        parts = [k for k, v in given.items() if v is not None]
        # the same step and parts on every rank, or nothing is written
        self._group.agree_save(step, parts, self.config.commit_timeout)
        abandoned = self._group.decide(lambda: self._abandoned(step))  # rank 0 owns the dir
        captured, state, tensors, replicated = self._capture(
            model, optimizer, scheduler, extra, rng
        )
        t_copy = time.monotonic()
        snapshot, cuda_done, clock = self._copy(step, tensors)
        body = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "torch": torch.__version__,
            "files": [s.file for s in self._shards],
            "tensors": {},
            "state": state,
        }
        save = _Save(
            step=step,
            abandoned=abandoned,
            shards=self._shards,
            images=list(self._images),
            body=body,
            chunks=captured.chunks,
            replicated=replicated,
            snapshot=snapshot,
            cuda_done=cuda_done,
            clock=clock,
            copy_started=t_copy,
        )
        self._persist = self._worker.submit(self._persist_job, save)
        self._persist_step = step
        self._last_saved = step
        self._stats.saves += 1
        blocked = time.monotonic() - entered
        self._stall += blocked
        self._stats.stall_seconds += blocked
        self._stats.last_stall_seconds += blocked
        nbytes = sum(s.file_bytes for s in save.shards)
        log.debug(
            "checkpoint of step %d started (%s, blocked %.3fs)", step, format_size(nbytes), blocked
        )

    def _capture(self, model, optimizer, scheduler, extra, rng: bool):
        """(captured, state tree, the tensors this rank writes, the writer of each replicated
        one), laid out in the images. Many ranks: a rank that fails here (a value that cannot be
        saved, a host_budget too small) tells the others before anything is written, so every
        rank raises at once instead of waiting in the next collective until commit_timeout
        with its group out of step."""
        captured = _Captured(self._group, model)
        error: Exception | None = None
        state: dict = {}
        try:
            state = captured.tree(model, optimizer, scheduler, extra, rng)
        except Exception as exc:
            error = exc
        held = [
            (n, n in captured.chunks, t.numel() * t.element_size()) for n, t, _ in captured.tensors
        ]
        mine, replicated = self._group.plan_writes([] if error else held)  # many: this rank's share
        tensors = [i for i in captured.tensors if i[0] in mine and i[0] not in captured.elsewhere]
        if error is None:
            try:
                self._layout(tensors)
            except Exception as exc:
                error = exc
        self._group.all_ok(error, "capture its state")
        return captured, state, tensors, replicated

    def _copy(self, step: int, tensors: list[tuple[str, torch.Tensor, bool]]):
        """Start the snapshot copies into the images: host tensors copied now (early) or on the
        copy thread (late), device tensors on each device's side stream. Returns (the copy
        thread's future, per device the event after its copies, the copy thread's CPU clock)."""
        late_cpu = []
        on_device: dict[torch.device, tuple[list, list]] = {}  # device -> (early, late) copies
        for name, t, late in tensors:
            dst = self._slots[name]
            if t.device.type == "cuda":
                on_device.setdefault(normalize_device(t.device), ([], []))[late].append((dst, t))
            elif late:
                late_cpu.append((dst, t))
            else:
                dst.copy_(as_bytes(t))  # host memory: a memcpy now (forward may change it next)
        cuda_done = {
            device: _copy_from_device(device, early, late, self._streams)
            for device, (early, late) in on_device.items()
        }
        self._cuda_done = dict(cuda_done)
        clock = CpuClock()
        late_cpu_versions = [(t, t._version) for _, t in late_cpu]
        self._late = [(t, t._version) for _, t, late in tensors if late and t.device.type == "cuda"]
        self._torn = None

        def copy_late() -> float:
            for dst, t in late_cpu:
                dst.copy_(as_bytes(t))
            torn = _changed(late_cpu_versions)  # changed while (or before) we copied it
            if torn:
                raise ConfigError(_torn_message(step, torn))
            return time.monotonic()

        self._snapshot = self._copier.submit(clock.wrap(copy_late))
        return self._snapshot, cuda_done, clock

    def _persist_job(self, save: _Save) -> None:
        """Persist thread: wait for the snapshot, write, commit (alone or with every rank)."""
        t0 = time.thread_time()
        _faults.begin_save()
        if self._group.many:
            copied, path, written, done = self._persist_ranks(save)
        else:
            copied, path, written, done = self._persist_one(save)
        cpu = save.clock.seconds + time.thread_time() - t0
        self._background_cpu = cpu if not save.cuda_done else 0.0
        self._stats.committed += 1
        self._stats.last_committed_step = save.step
        self._stats.last_snapshot_seconds = copied - save.copy_started
        self._stats.last_persist_seconds = done - copied
        self._stats.last_persist_bytes = written
        self._stats.history.append(
            {
                "step": save.step,
                "bytes": written,
                "snapshot_s": copied - save.copy_started,
                "persist_s": done - copied,
                "stall_s": self._stats.last_stall_seconds,
                "background_cpu_s": cpu,
            }
        )
        log.info(
            "checkpoint %s: %s, snapshot %.3fs, persist %.3fs (%.2f GB/s)",
            path,
            format_size(written),
            copied - save.copy_started,
            done - copied,
            written / max(done - copied, 1e-9) / 1e9,
        )

    def _persist_one(self, save: _Save) -> tuple[float, str, int, float]:
        """One process (format v1): retire an abandoned run's checkpoints (a rollback), write
        and commit, then retention and replicas. Returns (snapshot end, path, bytes, commit end)."""
        if save.abandoned:
            retire(self.directory, save.abandoned)
        copied = self._wait_snapshot(save.snapshot, save.cuda_done, save.step)
        path, written = persist(
            self.directory,
            save.step,
            save.shards,
            save.images,
            save.body,
            self._io,
            self.direct,
            save.clock,
        )
        done = time.monotonic()
        self._retain(save.step)
        if self._replicas is not None:
            self._push_replicas(save.step, save.shards, save.images, save.body)
        return copied, path, written, done

    def _push_replicas(self, step, shards, images, body) -> None:
        """Persist thread, after the commit: hold the checkpoint in other nodes' RAM too. A
        failure is counted and logged, never raised: the disk checkpoint is durable already."""
        t0 = time.monotonic()
        try:
            nodes = self._replicas.push(step, manifest_bytes(body), shards, images)
        except Exception as exc:
            self._stats.last_replica_phases = dict(self._replicas.last_phases)  # as far as it got
            self._stats.replica_push_failures += 1
            self._stats.last_replica_error = f"step {step}: {exc!r}"
            self._stats.replica_nodes = []
            log.warning("in-memory replica of checkpoint step %d failed: %r", step, exc)
            return
        self._stats.replica_pushes += 1
        self._stats.replica_nodes = nodes
        self._stats.last_replica_seconds = time.monotonic() - t0
        self._stats.last_replica_phases = dict(self._replicas.last_phases)

    def _wait_snapshot(self, snapshot: Future, cuda_done: dict, step: int) -> float:
        """Persist thread: wait for the snapshot copies; refuse a torn one. Returns their end."""
        copied = snapshot.result()  # a bounded memcpy: no timeout needed
        if cuda_done:
            for event in cuda_done.values():  # blocking events: the thread sleeps
                event.synchronize()
            copied = time.monotonic()
            # no barrier yet: every change so far may have been queued before the copies
            torn = self._torn or (_changed(self._late) if self._late else None)
            if torn:
                raise ConfigError(_torn_message(step, torn))
        return copied

    def _persist_ranks(self, save: _Save) -> tuple[float, str, int, float]:
        """Many ranks (format v2): write this rank's files durably, then the collective commit
        (``_ranks.commit_ranks``: rank 0 retires, writes the manifest, renames, retains); raises
        on every rank if any rank failed. A failure before the commit (a torn snapshot, a full
        disk) is reported in it, never skipping it. Returns as ``_persist_one``."""
        ranks, step = self._group.ranks, save.step
        error, table, written = None, {}, 0
        try:
            copied = self._wait_snapshot(save.snapshot, save.cuda_done, step)
        except BaseException as exc:
            copied, error = time.monotonic(), exc
        failed = error
        try:
            if error is not None:
                raise error
            folder = _ranks.write_rank_dir(self.directory, step, ranks.rank)
            table, written = write_shards(
                folder,
                save.shards,
                save.images,
                self._io,
                self.direct,
                save.clock,
                prefix=_ranks.rank_dir(ranks.rank) + "/",
            )
            fsync_dir(folder)
        except BaseException as exc:  # reported to rank 0, raised here after the collective
            error = exc if exc is failed else disk_full(exc, step, self.directory, written)
        report = {
            "error": None if error is None else repr(error),
            "tensors": table,
            "state": save.body["state"],
            "chunks": {n: c for n, c in save.chunks.items() if n in table},
            "replicated": save.replicated,
        }
        base = {k: save.body[k] for k in ("format", "step", "torch")}
        try:
            _ranks.commit_ranks(
                self.directory, step, report, ranks, save.abandoned, base, self._retain
            )
        except RuntimeError as exc:
            if error is not None:
                raise error from exc
            raise
        return copied, step_dir(self.directory, step), written, time.monotonic()

    def _abandoned(self, step: int) -> list[int]:
        """Complete checkpoints that saving ``step`` retires: those of an abandoned future.

        This run continues from the last step it saved or restored (``restore(step=k)``, or a
        fallback past damaged checkpoints): every checkpoint newer than that belongs to the run
        it rolled back from (step N itself included, if it exists). Checkpoints newer than
        ``step`` that this run did not supersede that way belong to another run: refused.
        """
        steps = _complete_steps(self.directory)
        base = self._last_saved
        if any(s > step for s in steps) and (base is None or step < base):
            raise ConfigError(
                f"{self.directory!r} holds checkpoints of later steps "
                f"({_steps([s for s in steps if s > step])}) than step {step}, which this "
                f"Checkpointer neither saved nor restored: saving would mix two runs, and a crash "
                f"would resume the other one. Call restore() first (to roll back, "
                f"restore(step=k): the next save retires the later checkpoints), or pass an "
                f"empty directory"
            )
        return sorted(s for s in steps if base is not None and s > base)

    def _layout(self, tensors: list[tuple[str, torch.Tensor, bool]]) -> None:
        """(Re)build the shard images when the set of tensors changed; otherwise reuse them."""
        signature = tuple((n, t.dtype, tuple(t.shape)) for n, t, _ in tensors)
        if signature == self._signature:
            return
        entries = [
            Entry(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t, _ in tensors
        ]
        shards = plan(entries, self.config.shard_bytes)
        need = sum(s.image_bytes for s in shards)
        budget = self.config.host_bytes
        if budget is not None and need > budget:
            raise BudgetError(
                f"a checkpoint of this state needs {format_size(need)} of host memory for its "
                f"snapshot but host_budget is {format_size(budget)}; raise host_budget to at "
                f"least {format_size(need)}",
                budget=budget,
                minimum=need,
            )
        self._release_images()
        pin = torch.cuda.is_available()  # pinned: device->host copies are DMA and asynchronous
        self._images = [aligned_empty(s.image_bytes, pin=pin) for s in shards]
        self._slots = {}
        for shard, block in zip(shards, self._images):
            write_header(shard, block)
            for e in shard.entries:
                start = shard.data_start + e.offset
                self._slots[e.name] = block[start : start + e.nbytes]
        self._shards, self._signature = shards, signature
        self._stats.host_bytes = need

    def _release_images(self) -> None:
        self._images, self._slots, self._signature = [], {}, None

    def _retain(self, newest: int) -> None:
        """Delete all but the ``keep`` newest complete checkpoints, never ``newest`` itself."""
        steps = _complete_steps(self.directory)
        keep = set(steps[: self.config.keep]) | {newest}
        for s in steps:
            if s in keep:
                continue
            path = step_dir(self.directory, s)
            doomed = f"{path}.deleting-{os.getpid()}"
            try:
                os.rename(path, doomed)  # atomic: restore never sees a half-deleted checkpoint
            except OSError as exc:  # the new checkpoint is committed; do not fail it for this
                log.warning("could not remove old checkpoint %s: %s", path, exc)
                continue
            _faults.point("retention-renamed")
            shutil.rmtree(doomed, ignore_errors=True)
            _faults.point("retention-deleted")

    def _apply(self, tree, model, optimizer, scheduler, rng, strict: bool):
        """Load a checkpoint that passed check_tree and check_fits (nothing left to fail on);
        the model's missing and unexpected keys (None without a model)."""
        keys = None
        if model is not None:
            keys = model.load_state_dict(tree["model"], strict=strict)
        if optimizer is not None:
            optimizer.load_state_dict(tree["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(tree["scheduler"])
        if rng and tree.get("rng") is not None:
            set_rng_state(tree["rng"])
        return keys


def load_tree(body, path, model, optimizer, rank: int, share) -> dict:
    """The state this rank restores from a manifest of any world size (``_ranks.Index``).

    ``share(saved_world)``: the saved ranks whose files this rank checksums in full. The
    reference tree (scheduler, extra, RNG) is the saved rank of the same number (rank 0's
    when there were fewer; then RNG is not restored, with a warning); the optimizer state is
    the union of every saved rank's; tensors are read as the target needs them (DTensor
    targets: their local region).
    """
    index = _ranks.Index(body, path)
    index.verify(list(share(index.world)))
    refs = _ranks.Refs(index.chunks)
    try:
        trees = [decode(r.get("state"), refs) for r in index.ranks]
        if not all(isinstance(t, dict) for t in trees):
            raise CorruptDataError("manifest state is not a mapping", path=path)
        tree = dict(trees[rank if rank < index.world else 0])
        if rank >= index.world and tree.get("rng") is not None:
            warnings.warn(
                f"checkpoint {path} was saved by {index.world} ranks; rank {rank} has no "
                f"saved random state, so its generators are left as they are",
                stacklevel=4,
            )
            tree["rng"] = None
        like: dict = {}
        if model is not None:
            like["model"] = model.state_dict()
            tree = align_model_keys(tree, like["model"])  # before DTensor targets are looked up
        opt = tree.get("optimizer")
        if isinstance(opt, dict):
            merged: dict = {}
            for t in trees:
                st = (t.get("optimizer") or {}).get("state")
                for k, v in (st if isinstance(st, dict) else {}).items():
                    merged.setdefault(k, v)
            if optimizer is not None and getattr(optimizer, "_local_form", False):
                held = optimizer.state_dict()["state"]  # what this rank holds, by position
                place = _positions(opt)  # saved ids (ints, or DCP's FQNs) -> positions
                merged = {k: v for k, v in merged.items() if place.get(k, k) in held}
                like["optimizer"] = {"state": {k: held[place.get(k, k)] for k in merged}}
            elif optimizer is not None:
                like["optimizer"] = {"state": _state_like_params(opt, merged, optimizer)}
            tree["optimizer"] = {**opt, "state": merged}
        tree = _ranks.materialize(tree, index, like)
        return check_tree(tree)
    except CorruptDataError as exc:
        exc.path = exc.path or path
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise CorruptDataError(f"malformed manifest state: {exc!r}", path=path) from exc


def _positions(saved: dict) -> dict:
    """Saved parameter id -> its position in the saved param groups: the id the optimizer's
    own ``state_dict()`` gives it. A DCP checkpoint (``get_optimizer_state_dict``) keys the
    state by parameter FQN; ``load_state_dict`` maps either kind by position."""
    groups = saved.get("param_groups")
    ids = [
        i
        for g in (groups if isinstance(groups, list) else ())
        if isinstance(g, dict) and isinstance(g.get("params"), list)
        for i in g["params"]
    ]
    return {i: k for k, i in enumerate(ids) if isinstance(i, (int, str))}


def _state_like_params(saved: dict, state: dict, optimizer) -> dict:
    """Targets for a torch optimizer's state: each entry of a DTensor parameter (FSDP2) is read
    as that parameter's local shard, a DTensor like it, since torch.optim creates its state with
    ``zeros_like(param)`` and ``load_state_dict`` keeps the type it is given (a full plain
    tensor would fail the next step on mixed Tensor and DTensor). Saved ids map to parameters
    by position in the param groups, as ``load_state_dict`` maps them; entries of another
    shape (``step``) are read whole."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list):
        return {}
    like = {}
    for saved_group, group in zip(groups, optimizer.param_groups):
        ids = saved_group.get("params") if isinstance(saved_group, dict) else None
        for i, p in zip(ids if isinstance(ids, list) else (), group["params"]):
            entry = state.get(i) if isinstance(i, (int, str)) else None
            if isinstance(entry, dict) and _ranks.dtensor_local(p)[1] is not None:
                like[i] = dict.fromkeys(entry, p)
    return like


def read_checkpoint(directory: str, step: int | None = None) -> tuple[dict, int]:
    """(state tree with full tensors, step) of the newest checkpoint in ``directory`` that
    verifies (or of ``step``), saved by any number of ranks; read-only (no lock is taken)."""
    root = os.path.abspath(os.fspath(directory))
    step = None if step is None else _check_step(step, "export_dcp")
    steps = _complete_steps(root) if os.path.isdir(root) else []
    if not steps:
        raise ConfigError(
            f"{root!r} holds no checkpoint (no complete step-N directory); pass the directory a "
            f"Checkpointer saved into"
        )
    if step is not None:
        if step not in steps:
            raise ConfigError(f"no complete checkpoint of step {step} in {root!r}; found {steps}")
        steps = [step]
    problems = []
    for s in steps:
        path = step_dir(root, s)
        try:
            body = read_manifest(path)
            if body.get("version") == _ranks.VERSION:
                return load_tree(body, path, None, None, 0, range), s
            return _decode_state(body, read_tensors(path, body), path), s
        except CorruptDataError as exc:
            problems.append(f"{path}: {exc}")
            warnings.warn(
                f"checkpoint {path} is unusable ({exc}); trying an older one", stacklevel=2
            )
    raise CorruptDataError(
        f"no usable checkpoint in {root!r}" + (": " + "; ".join(problems) if problems else ""),
        path=root,
    )


def _decode_state(body: dict, tensors: dict[str, torch.Tensor], path: str) -> dict:
    """The manifest's state tree, fully checked; anything malformed is CorruptDataError."""
    try:
        return check_tree(decode(body.get("state"), tensors))
    except CorruptDataError as exc:
        exc.path = exc.path or path
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        # a net under the explicit checks: a crafted manifest never escapes as a raw error
        raise CorruptDataError(f"malformed manifest state: {exc!r}", path=path) from exc


def _prepare_directory(directory: str, config: CheckpointConfig) -> None:
    """A writer's directory exists (made private if new) and is writable; a reader's is readable."""
    if config.read_only:
        if not os.path.isdir(directory) or not os.access(directory, os.R_OK | os.X_OK):
            raise SpillDirError(
                f"checkpoint directory {directory!r} is not a readable directory; pass the "
                f"directory a Checkpointer saved into",
                path=directory,
            )
        return
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise SpillDirError(
            f"cannot create checkpoint directory {directory!r} ({exc.strerror}); pass a writable "
            f"directory, or read_only=True to only restore from it",
            path=directory,
        ) from exc
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise SpillDirError(
            f"checkpoint directory {directory!r} is not a writable directory; fix its "
            f"permissions, pass another one, or pass read_only=True to only restore from it",
            path=directory,
        )


def _check_directory(directory: object) -> str:
    """The absolute path of ``directory``: a ``str`` or path-like naming a directory. An empty
    string (an unset environment variable) would otherwise mean the current directory, whose
    ``step-N`` folders a rollback or retention then removes."""
    path = os.fspath(directory) if isinstance(directory, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"Checkpointer(directory={directory!r}): pass the checkpoint directory as a "
            f"non-empty str or pathlib.Path, e.g. Checkpointer('ckpts/')"
        )
    return os.path.abspath(path)


def _check_step(step: object, verb: str) -> int:
    """``step`` as an int >= 0: a checkpoint is the directory ``step-<int>``, so a float, bool,
    str or negative step would be written where restore never looks (a silent fresh start)."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = step.item()  # a step counter kept as a tensor (0-dim, integer)
    fix = "count steps from 0" if isinstance(step, int) and step < 0 else "pass int(step)"
    return check_int(
        step,
        f"{verb}: step={step!r} is not an int >= 0; {fix} (a checkpoint is the directory "
        f"step-<int>)",
        minimum=0,
        numpy=True,
    )


def _before_any_step(ref: weakref.ref, *_args, **_kwargs) -> None:
    """Global optimizer step pre-hook: any optimizer's step waits for the snapshot's copies."""
    ck = ref()
    if ck is not None and not ck.closed:
        ck.before_optimizer_step()


def _changed(versions: list[tuple[torch.Tensor, int]]) -> str | None:
    """The shape of the first tensor whose version moved, if any (an in-place change)."""
    for t, v in versions:
        if t._version != v:
            return f"a tensor of shape {tuple(t.shape)} (version {v} -> {t._version})"
    return None


def _torn_message(step: int, what: str) -> str:
    return (
        f"checkpoint of step {step} was not written: {what} was changed in place while the "
        f"snapshot was still copying it, so the checkpoint would mix two steps. Call "
        f"ck.before_optimizer_step() before changing parameters or optimizer state outside "
        f"optimizer.step() (an EMA update, a manual edit); optimizer steps wait by themselves"
    )


def _copy_from_device(device, early, late, side: SideStreams) -> torch.cuda.Event:
    """Queue one device's snapshot copies to pinned host memory on its side stream.

    ``side`` first waits for the device's *current* stream (not the current device's), so the
    copies see the state after the optimizer step queued there. That stream then waits for the
    early copies (buffers, scheduler, extra: the next forward may change them); the late ones
    (parameters, optimizer state) need only finish before the next optimizer step, which waits for
    the returned event (``before_optimizer_step``); the persist thread synchronizes on it.
    ``record_stream`` keeps the allocator from reusing a source before its copy ran.
    """
    after = COMPUTE
    if early:
        done = side.copy(early, device, direction="d2h", read=as_bytes, record_sources=True)
        consume(done, torch.cuda.current_stream(device))
        after = None  # the late copies follow the early ones on the side stream
    return side.copy(  # the persist thread sleeps on this event, never spins
        late,
        device,
        direction="d2h",
        after=after,
        read=as_bytes,
        record_sources=True,
        blocking=True,
    )


def _await(future: Future, timeout: float | None, what: str, root: str) -> None:
    """Wait for ``future``; log every PROGRESS_SECONDS; TimeoutError after ``timeout`` seconds."""
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise TimeoutError(
                f"{what} is still being written to {root!r} after {timeout:g}s; it stays in "
                f"flight: call wait() or close() again, or check that filesystem"
            )
        chunk = PROGRESS_SECONDS if timeout is None else min(PROGRESS_SECONDS, timeout - waited)
        done, _ = wait_futures([future], timeout=chunk)
        if done:
            return
        log.warning("still waiting for %s after %.0fs (%s)", what, time.monotonic() - start, root)


def _shutdown(io, worker, copier, dirlock: DirLock) -> None:
    """Cleanup of a Checkpointer: join its threads, then release the directory lock.

    Runs on the caller's thread at ``close()`` (the threads are idle by then) or on the reaper
    thread after GC (``tensortier._lifetime``), never inside GC, so joining cannot deadlock or
    hit "cannot join current thread". The lock goes last: no thread of this writer is left when
    the next writer starts.
    """
    try:
        for ex in (copier, worker, io):
            ex.shutdown(wait=True)
    finally:
        if dirlock is not None:  # many ranks: only rank 0 holds it
            dirlock.release()


def _steps(steps: list[int]) -> str:
    text = ", ".join(map(str, sorted(steps)[:5]))
    return text + (", ..." if len(steps) > 5 else "")
