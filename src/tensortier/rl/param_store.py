"""ParamStore: versioned weights from one trainer to many readers, zero-copy on one machine.

Protocol (see also ``param_store.md``). The publisher owns a private 0700 directory in shared
memory (``/dev/shm`` when present). Each version is one file ``v-<version>.ttp``: a JSON header
(name, dtype, shape, offset of every tensor) and the tensors' bytes, 64-byte aligned. A version is
written to a temporary name and renamed into place when complete, so no reader can open a
half-written version; it is never modified afterwards. Its whole size is reserved
(``posix_fallocate``) before a byte is written through the mapping, so a full tmpfs raises
:class:`TierFullError` instead of killing the process with SIGBUS. The newest version number and a
"closed" flag are published in a small ``latest`` control file through a seqlock (odd sequence =
write in progress; a reader retries until it sees the same even sequence before and after reading).

Readers wait by polling ``latest`` with exponential back-off (0.2 ms to 10 ms: no futex, no busy
spin). A wait ends when the version appears, at ``timeout``, or with :class:`ClosedError` when the
publisher closed the store or its process died (its owner lock in the directory is free).

Readers ``mmap`` a version copy-on-write (``MAP_PRIVATE``): tensors are views of the shared pages,
no copy is made, and a reader that writes into its tensors changes only its own pages. While a
reader holds a version it holds a shared ``flock`` on the file; the publisher deletes an old
version only when it can take the exclusive lock, i.e. when no reader holds it (a reader that
crashes drops its lock with its process). The lock is released when the returned tensors are
garbage collected.

This module never pickles; dtypes are looked up in a fixed table.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import numbers
import os
import re
import struct
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping

import torch

from tensortier._lifetime import (
    OWNER_FILE,
    Finalizer,
    lock_if_free,
    private_dir,
    remove_private_dir,
)
from tensortier._renamed import renamed, renamed_attribute
from tensortier._stats import register as register_stats
from tensortier._units import align_up, format_size
from tensortier.errors import ClosedError, ConfigError, CorruptDataError, TierFullError
from tensortier.tiers.disk import as_bytes
from tensortier.tiers.itemcodec import TORCH_DTYPES

_MAGIC = b"TTPARAM1"
_HEAD = struct.Struct("<8sQ")  # magic, header length
_SEQ = struct.Struct("<Q")  # seqlock sequence (odd: a write is in progress)
_BODY = struct.Struct("<QQ")  # latest version, closed flag (after the sequence)
_CTRL = struct.Struct("<QQQ")  # sequence, latest version, closed flag
_POLL_MIN, _POLL_MAX = 0.0002, 0.01  # reader back-off (seconds)
_LIVENESS_EVERY = 0.5  # seconds between checks that the publisher process still exists
_ALIGN = 64
_NAME = re.compile(r"^v-(\d{12})\.ttp$")


def _shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def check_version(value: object, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(
            f"{arg} must be an int >= 0 (a version number; 0 or 1: any published version), "
            f"got {value!r}"
        )
    return max(int(value), 1)  # version 0 means "nothing published": there is nothing to get


def deadline_of(timeout: object) -> float | None:
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise ConfigError(
            f"timeout must be None (wait as long as it takes) or seconds >= 0, got {timeout!r}"
        )
    return time.monotonic() + float(timeout)


def checked_tensors(state_dict: object) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, dtype name, tensor)`` of each entry of a state dict to publish (here or through
    ``serve``); TypeError naming the first entry that is not a str name and a supported tensor."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"publish: state_dict must be a mapping name -> tensor (e.g. "
            f"model.state_dict()), got {type(state_dict).__name__}"
        )
    out = []
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"publish: state_dict keys must be str names, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"publish: {name!r} is a {type(t).__name__}, expected a tensor")
        if _is_dtensor(t):
            raise TypeError(
                f"publish: {name!r} is a DTensor sharded as {t.placements} (FSDP2 or tensor "
                f"parallel): this rank holds only its shard. Gather a full state dict on every "
                f"rank first, get_model_state_dict(model, options=StateDictOptions("
                f"full_state_dict=True, cpu_offload=True)) from "
                f"torch.distributed.checkpoint.state_dict, and publish it from rank 0"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in TORCH_DTYPES:
            raise TypeError(f"publish: {name!r} has unsupported dtype {t.dtype}")
        out.append((name, dtype, t))
    return out


def tied_key(t: torch.Tensor) -> tuple | None:
    """What ``t``'s values are: the same key for two entries means one tensor under two names.

    ``model.state_dict()`` of tied weights (an embedding shared with the output layer) holds two
    detached views of one storage; they are published once, and readers get two names for the
    same bytes, as ``torch.load`` gives them. None when there is nothing to share."""
    if t.numel() == 0:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own
        return None
    return (
        t.device,
        t.dtype,
        ptr,
        t.storage_offset(),
        t.shape,
        t.stride(),
        t.is_conj(),
        t.is_neg(),
    )


def _layout(
    checked: list[tuple[str, str, torch.Tensor]],
) -> tuple[list[list], list[tuple[int, torch.Tensor]], int]:
    """(header entries, (offset, bytes) of each distinct tensor, data size) of one version;
    tied entries share their offset."""
    entries, writes, off = [], [], 0
    placed: dict[tuple, list] = {}
    for name, dtype, t in checked:
        key = tied_key(t)
        same = placed.get(key) if key is not None else None
        if same is not None:
            entries.append([name, dtype, list(t.shape), same[3], same[4]])
            continue
        data = as_bytes(t.detach().cpu())
        entry = [name, dtype, list(t.shape), off, data.numel()]
        entries.append(entry)
        writes.append((off, data))
        if key is not None:
            placed[key] = entry
        off = align_up(off + data.numel(), _ALIGN)
    return entries, writes, off


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (only possible once ``torch.distributed.tensor`` is imported,
    so publishing never imports it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _publisher_alive(path: str) -> bool:
    """Whether a process still holds the owner lock of the store's directory (see ``_lifetime``).

    The lock is taken shared and non-blocking and dropped at once, so this never waits.
    """
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # removed: closed, or reclaimed after the publisher died
    except OSError:
        return True  # cannot tell; the caller's timeout still bounds the wait
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # the publisher holds it
    finally:
        os.close(fd)
    return False


def _ctrl_write(ctrl: mmap.mmap, version: int, closed: bool) -> None:
    """The single writer's seqlock update of ``latest``: odd sequence, body, even sequence."""
    (seq,) = _SEQ.unpack_from(ctrl, 0)
    odd = seq + 1 if seq % 2 == 0 else seq + 2
    _SEQ.pack_into(ctrl, 0, odd)
    _BODY.pack_into(ctrl, _SEQ.size, version, int(closed))
    _SEQ.pack_into(ctrl, 0, odd + 1)


def _shutdown(ctrl: mmap.mmap, path: str) -> None:
    """Mark the store closed for readers, then delete its directory (``close()`` or the reaper)."""
    with contextlib.suppress(ValueError, OSError):
        _, version, _ = _CTRL.unpack_from(ctrl, 0)
        _ctrl_write(ctrl, version, closed=True)
        ctrl.close()
    remove_private_dir(path)


class Params(Mapping):
    """A read-only mapping name -> tensor of one version; ``.version`` says which.

    ``shared``: the tensors are copy-on-write views of memory other readers map too (no copy was
    made); False where they are a private copy.
    """

    def __init__(self, version: int, tensors: dict[str, torch.Tensor], *, shared: bool = True):
        self.version = version
        self.shared = shared
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"Params(version={self.version}, tensors={len(self)})"


class ParamReader:
    """Reads versions published by a :class:`ParamStore` in ``directory`` (any process on this
    machine)."""

    path = renamed_attribute("path", "directory")  # the vocabulary's name; goes in 0.2

    def __init__(self, directory: str | os.PathLike):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"attach: directory must be a ParamStore's .directory (a str), got {directory!r}"
            )
        self.directory = os.fspath(directory)
        ctrl = os.path.join(self.directory, "latest")
        try:
            fd = os.open(ctrl, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ConfigError(
                f"no ParamStore at {self.directory!r}; pass the publisher's ParamStore.directory"
            ) from exc
        try:
            self._ctrl = mmap.mmap(fd, _CTRL.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def _read(self) -> tuple[int, bool]:
        """(newest version, closed) read through the seqlock.

        Cannot hang: the sequence is odd only between two 8-byte stores of a live publisher; one
        that died in between is detected by its free owner lock.
        """
        tries = 0
        while True:
            try:
                s1, version, closed = _CTRL.unpack_from(self._ctrl, 0)
                (s2,) = _SEQ.unpack_from(self._ctrl, 0)
            except ValueError as exc:  # our mapping of `latest` was closed
                raise ClosedError(
                    f"this reader of the ParamStore {self.directory!r} is closed"
                ) from exc
            if s1 == s2 and s1 % 2 == 0:
                return version, bool(closed)
            tries += 1
            if tries % 1000 == 0 and not _publisher_alive(self.directory):
                raise ClosedError(
                    f"the process publishing {self.directory!r} died while updating it; "
                    f"publish from a new ParamStore"
                )
            time.sleep(0 if tries < 100 else 0.001)

    def _closed_error(self, version: int) -> ClosedError:
        return ClosedError(
            f"the ParamStore at {self.directory!r} was closed by its publisher (last version "
            f"{version}); attach to the path of the publisher's new ParamStore"
        )

    @property
    def version(self) -> int:
        """Newest published version (0: nothing published yet)."""
        return self._read()[0]

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until a version >= ``version`` is published; returns it.

        Raises TimeoutError after ``timeout`` seconds, and ClosedError once the publisher closed
        the store or its process exited (no newer version can come).
        """
        want = check_version(version, "version")
        deadline = deadline_of(timeout)
        delay = _POLL_MIN
        next_check = time.monotonic() + _LIVENESS_EVERY
        while True:
            v, closed = self._read()
            if closed:
                raise self._closed_error(v)
            if v >= want:
                return v
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"ParamStore version {want} not published within {timeout}s (newest is {v})"
                )
            if now >= next_check:
                if not _publisher_alive(self.directory):
                    raise ClosedError(
                        f"the process publishing {self.directory!r} exited without closing it (last "
                        f"version {v}); version {want} will never come"
                    )
                next_check = now + _LIVENESS_EVERY
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - now)))
            delay = min(delay * 2, _POLL_MAX)

    def get(self, min_version: int = 1, timeout: float | None = None) -> Params:
        """The newest version (waiting until one >= ``min_version`` exists), mapped without copying."""
        self.wait_for(min_version, timeout)
        while True:
            v, closed = self._read()
            if closed:
                raise self._closed_error(v)
            try:
                return self._map(v)
            except FileNotFoundError:
                pass
            # The file named by `latest` is gone: replaced and freed in between (then `latest`
            # moved on and we retry; each retry needs a newer publish), or the store is gone.
            newer, closed = self._read()
            if closed:
                raise self._closed_error(newer) from None
            if not os.path.exists(os.path.join(self.directory, "latest")):
                raise ClosedError(
                    f"the ParamStore at {self.directory!r} was removed (its publisher exited)"
                ) from None
            if newer == v:
                raise CorruptDataError(
                    f"version {v} of {self.directory!r} was deleted by something other than its "
                    f"publisher",
                    path=self.directory,
                )

    def _map(self, version: int) -> Params:
        path = os.path.join(self.directory, f"v-{version:012d}.ttp")
        fd = os.open(path, os.O_RDONLY)
        try:
            try:  # held while any tensor of this version lives
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # the publisher is freeing it (exclusive lock, then unlink)
                raise FileNotFoundError(path) from None
            st = os.fstat(fd)
            if st.st_nlink == 0:  # freed between open and lock
                raise FileNotFoundError(path)
            size = st.st_size
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(fd)
            raise
        weakref.finalize(mm, os.close, fd)  # closing the fd drops the shared lock (never blocks)
        try:
            magic, hlen = _HEAD.unpack_from(mm, 0)
            if magic != _MAGIC:
                raise ValueError("bad magic")
            header = json.loads(bytes(mm[_HEAD.size : _HEAD.size + hlen]))
            entries, hversion = header["tensors"], header["version"]
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise CorruptDataError(f"{path!r} is not a ParamStore version file", path=path) from exc
        start = align_up(_HEAD.size + hlen, _ALIGN)
        tensors = {}
        for name, dtype, shape, rel, nbytes in entries:
            off = start + rel
            if dtype not in TORCH_DTYPES or off + nbytes > size:
                raise CorruptDataError(f"{path!r}: bad entry for {name!r}", path=path)
            if nbytes == 0:
                tensors[name] = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
                continue
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
            tensors[name] = raw.view(TORCH_DTYPES[dtype]).reshape(shape)
        return Params(hversion, tensors)

    def __reduce__(self):
        """A reader pickles as its directory: unpickled in a process on this machine (a Ray
        task or actor, a subprocess) it attaches there; elsewhere it raises ConfigError."""
        return (ParamReader, (self.directory,))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ctrl.close()


class ParamStore:
    """Versioned state dicts: ``publish`` by one trainer, ``get``/``wait_for`` by any reader.

    >>> params = tt.rl.ParamStore()
    >>> v = params.publish(model.state_dict())          # trainer
    >>> latest = params.get(min_version=v)              # same process
    >>> reader = tt.rl.ParamStore.attach(params.directory)   # another process on this machine

    Versions live in ``spill_dir`` (``/dev/shm`` by default, i.e. RAM): it needs room for ``keep + 1``
    versions while publishing. A full one raises :class:`TierFullError` and the store stays usable.
    """

    path = renamed_attribute("path", "directory")  # the vocabulary's name; goes in 0.2

    @renamed(shm_dir="spill_dir")
    def __init__(self, *, keep: int = 2, spill_dir: str | os.PathLike | None = None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (versions kept for readers), got {keep!r}")
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise TypeError(
                f"spill_dir must be a directory path (str or os.PathLike), got {spill_dir!r}; "
                f"pass None for /dev/shm"
            )
        self.keep = keep
        base = spill_dir if spill_dir is not None else _shm_base()
        self.directory = private_dir(base, "tt-params")
        try:
            ctrl = os.path.join(self.directory, "latest")
            fd = os.open(ctrl, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                self._reserve(fd, mmap.PAGESIZE, version=0)
                self._ctrl = mmap.mmap(fd, _CTRL.size)
            finally:
                os.close(fd)
        except BaseException:
            remove_private_dir(self.directory)
            raise
        self._lock = threading.Lock()
        self._version = 0
        self._closed = False
        # close() runs it now; after GC the reaper runs it (it takes a lock and deletes files)
        self._finalizer = Finalizer(self, _shutdown, self._ctrl, self.directory)
        self._reader = ParamReader(self.directory)
        self.stats = {"published": 0, "bytes_published": 0, "freed": 0, "publish_seconds": 0.0}
        register_stats("param_store", self)  # tt.stats() lists it while it is open

    @staticmethod
    @renamed(path="directory")
    def attach(directory: str | os.PathLike) -> ParamReader:
        """A reader for the store in ``directory`` (``ParamStore.directory``), from any process on
        this machine."""
        return ParamReader(directory)

    @property
    def version(self) -> int:
        return self._version

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ParamStore is closed; make a new ParamStore to publish again")

    def publish(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Copy ``state_dict`` (tensors on any device) into a new version; returns its number.

        Tied weights (two names, one tensor) are stored once and read back as one tensor."""
        checked = checked_tensors(state_dict)
        self._check_open()
        t0 = time.perf_counter()
        entries, writes, off = _layout(checked)
        with self._lock:
            self._check_open()
            version = self._version + 1
            # offsets are relative to the data start: the first 64-byte boundary after the header
            header = json.dumps({"version": version, "tensors": entries}).encode()
            start = align_up(_HEAD.size + len(header), _ALIGN)
            total = start + off
            final = os.path.join(self.directory, f"v-{version:012d}.ttp")
            tmp = final + ".tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # Reserve every page before writing through the mapping: a write to a page the
                # filesystem cannot back raises SIGBUS, which no Python code can catch.
                self._reserve(fd, total, version)
                with mmap.mmap(fd, total) as mm:
                    _HEAD.pack_into(mm, 0, _MAGIC, len(header))
                    mm[_HEAD.size : _HEAD.size + len(header)] = header
                    for rel, data in writes:
                        if data.numel():
                            dst = torch.frombuffer(
                                mm, dtype=torch.uint8, count=data.numel(), offset=start + rel
                            )
                            dst.copy_(data)
                            del dst
                os.rename(tmp, final)  # complete before anyone can open it
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # nothing half-published; the version number is not used
                raise
            finally:
                os.close(fd)
            _ctrl_write(self._ctrl, version, closed=False)
            self._version = version
            self._free_old()
            self.stats["published"] += 1
            self.stats["bytes_published"] += total
            self.stats["publish_seconds"] += time.perf_counter() - t0
        return version

    def _reserve(self, fd: int, nbytes: int, version: int) -> None:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            raise self._full_error(nbytes, version) from exc

    def _full_error(self, nbytes: int, version: int) -> TierFullError:
        st = os.statvfs(self.directory)
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        held = sum(
            os.path.getsize(os.path.join(self.directory, f))
            for f in os.listdir(self.directory)
            if _NAME.match(f)
        )
        base = os.path.dirname(self.directory)
        what = f"publish: version {version}" if version else "ParamStore(): the control file"
        return TierFullError(
            f"{what} needs {format_size(nbytes)} in {base!r} but only "
            f"{format_size(free)} of {format_size(size)} are free there (this store holds "
            f"{format_size(held)}: keep={self.keep} versions plus those readers hold, and a new "
            f"version is written before the oldest is freed). Give the machine or container more "
            f"shared memory (docker run --shm-size=..., at least "
            f"{format_size((self.keep + 1) * nbytes)} here; Kubernetes: an emptyDir with "
            f"medium: Memory) or pass ParamStore(spill_dir=...) a directory with room",
            tier="shm",
            requested=nbytes,
            in_use=size - free,
            limit=size,
        )

    def _free_old(self) -> None:
        """Delete versions older than the newest ``keep`` that no reader holds."""
        for f in os.listdir(self.directory):
            m = _NAME.match(f)
            if not m or int(m.group(1)) > self._version - self.keep:
                continue
            path = os.path.join(self.directory, f)
            try:
                fd = lock_if_free(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            if fd is None:
                continue  # a reader holds it; try again at the next publish
            os.unlink(path)
            os.close(fd)
            self.stats["freed"] += 1

    def versions(self) -> list[int]:
        """Versions whose files still exist (newest ``keep`` plus any a reader holds)."""
        self._check_open()
        return sorted(int(m.group(1)) for f in os.listdir(self.directory) if (m := _NAME.match(f)))

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        self._check_open()
        return self._reader.wait_for(version, timeout)

    def get(self, min_version: int = 1, timeout: float | None = None) -> Params:
        self._check_open()
        return self._reader.get(min_version, timeout)

    def close(self) -> None:
        """Remove every version file; readers that still map one keep their pages until they drop it.

        Readers waiting for a version get :class:`ClosedError`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            self._finalizer()

    def __reduce__(self):
        raise TypeError(
            "a ParamStore belongs to its publisher's process and cannot be pickled (for a Ray "
            "task or actor, or another process); pass ParamStore.attach(params.directory), a "
            "reader that pickles, on this machine, or publish through tt.rl.serve(ParamStore()) "
            "for readers on any node"
        )

    def __enter__(self) -> ParamStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
