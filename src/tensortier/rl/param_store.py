"""ParamStore: versioned weights from one trainer to many readers, zero-copy on one machine.

Protocol (see also ``param_store.md``). The publisher owns a private 0700 directory in shared
memory (``/dev/shm`` when present). Each version is one file ``v-<version>.ttp``: a JSON header
(name, dtype, shape, offset of every tensor) and the tensors' bytes, 64-byte aligned. A version is
written to a temporary name and renamed into place when complete, so no reader can open a
half-written version; it is never modified afterwards. The newest version number is published in
a small ``latest`` control file through a seqlock (odd sequence = write in progress; a reader
retries until it sees the same even sequence before and after reading).

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
import fcntl
import json
import mmap
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Mapping

import torch

from tensortier._lifetime import private_dir, remove_private_dir
from tensortier._units import align_up
from tensortier.errors import ClosedError, ConfigError, CorruptDataError
from tensortier.rl._codec import _TORCH_DTYPES
from tensortier.tiers.disk import as_bytes

_MAGIC = b"TTPARAM1"
_HEAD = struct.Struct("<8sQ")  # magic, header length
_CTRL = struct.Struct("<QQ")  # seqlock sequence, latest version
_ALIGN = 64
_NAME = re.compile(r"^v-(\d{12})\.ttp$")


def _shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class Params(Mapping):
    """A read-only mapping name -> tensor of one version; ``.version`` says which."""

    def __init__(self, version: int, tensors: dict[str, torch.Tensor]):
        self.version = version
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
    """Reads versions published by a :class:`ParamStore` at ``path`` (any process on this machine)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        ctrl = os.path.join(self.path, "latest")
        try:
            fd = os.open(ctrl, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ConfigError(
                f"no ParamStore at {self.path!r}; pass the publisher's ParamStore.path"
            ) from exc
        try:
            self._ctrl = mmap.mmap(fd, _CTRL.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    @property
    def version(self) -> int:
        """Newest published version (0: nothing published yet)."""
        while True:
            s1, v = _CTRL.unpack_from(self._ctrl, 0)
            s2, _ = _CTRL.unpack_from(self._ctrl, 0)
            if s1 == s2 and s1 % 2 == 0:
                return v
            time.sleep(0)

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until a version >= ``version`` is published; returns it. TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0002
        while True:
            v = self.version
            if v >= version:
                return v
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"ParamStore version {version} not published within {timeout}s (newest is {v})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def get(self, min_version: int = 1, timeout: float | None = None) -> Params:
        """The newest version (waiting until one >= ``min_version`` exists), mapped without copying."""
        self.wait_for(min_version, timeout)
        while True:
            v = self.version
            try:
                return self._map(v)
            except FileNotFoundError:  # replaced and freed between reading `latest` and opening
                continue

    def _map(self, version: int) -> Params:
        path = os.path.join(self.path, f"v-{version:012d}.ttp")
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while any tensor of this version lives
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(fd)
            raise
        weakref.finalize(mm, os.close, fd)  # closing the fd drops the shared lock
        magic, hlen = _HEAD.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise CorruptDataError(f"{path!r} is not a ParamStore version file", path=path)
        header = json.loads(bytes(mm[_HEAD.size : _HEAD.size + hlen]))
        start = align_up(_HEAD.size + hlen, _ALIGN)
        tensors = {}
        for name, dtype, shape, rel, nbytes in header["tensors"]:
            off = start + rel
            if dtype not in _TORCH_DTYPES or off + nbytes > size:
                raise CorruptDataError(f"{path!r}: bad entry for {name!r}", path=path)
            if nbytes == 0:
                tensors[name] = torch.empty(shape, dtype=_TORCH_DTYPES[dtype])
                continue
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
            tensors[name] = raw.view(_TORCH_DTYPES[dtype]).reshape(shape)
        return Params(header["version"], tensors)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ctrl.close()


class ParamStore:
    """Versioned state dicts: ``publish`` by one trainer, ``get``/``wait_for`` by any reader.

    >>> params = tt.rl.ParamStore()
    >>> v = params.publish(model.state_dict())          # trainer
    >>> latest = params.get(min_version=v)              # same process
    >>> reader = tt.rl.ParamStore.attach(params.path)   # another process on this machine
    """

    def __init__(self, *, keep: int = 2, shm_dir: str | os.PathLike | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (versions kept for readers), got {keep!r}")
        self.keep = keep
        base = shm_dir if shm_dir is not None else _shm_base()
        self.path = private_dir(base, "tt-params")
        ctrl = os.path.join(self.path, "latest")
        with open(ctrl, "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open(ctrl, os.O_RDWR)
        try:
            self._ctrl = mmap.mmap(fd, _CTRL.size)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._version = 0
        self._seq = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, remove_private_dir, self.path)
        self._reader = ParamReader(self.path)
        self.stats = {"published": 0, "bytes_published": 0, "freed": 0, "publish_seconds": 0.0}

    @staticmethod
    def attach(path: str | os.PathLike) -> ParamReader:
        """A reader for the store at ``path`` (``ParamStore.path``), from any process on this machine."""
        return ParamReader(path)

    @property
    def version(self) -> int:
        return self._version

    def publish(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Copy ``state_dict`` (tensors on any device) into a new version; returns its number."""
        t0 = time.perf_counter()
        entries, datas, off = [], [], 0
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"publish: {name!r} is a {type(t).__name__}, expected a tensor")
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _TORCH_DTYPES:
                raise TypeError(f"publish: {name!r} has unsupported dtype {t.dtype}")
            data = as_bytes(t.detach().cpu())
            entries.append([name, dtype, list(t.shape), off, data.numel()])
            datas.append(data)
            off = align_up(off + data.numel(), _ALIGN)
        with self._lock:
            if self._closed:
                raise ClosedError("this ParamStore is closed")
            version = self._version + 1
            # offsets are relative to the data start: the first 64-byte boundary after the header
            header = json.dumps({"version": version, "tensors": entries}).encode()
            start = align_up(_HEAD.size + len(header), _ALIGN)
            total = start + off
            final = os.path.join(self.path, f"v-{version:012d}.ttp")
            tmp = final + ".tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, max(total, 1))
                with mmap.mmap(fd, max(total, 1)) as mm:
                    _HEAD.pack_into(mm, 0, _MAGIC, len(header))
                    mm[_HEAD.size : _HEAD.size + len(header)] = header
                    for e, data in zip(entries, datas):
                        if e[4]:
                            dst = torch.frombuffer(
                                mm, dtype=torch.uint8, count=e[4], offset=start + e[3]
                            )
                            dst.copy_(data)
                            del dst
            finally:
                os.close(fd)
            os.rename(tmp, final)  # complete before anyone can open it
            self._seq += 1
            _CTRL.pack_into(self._ctrl, 0, self._seq, self._version)  # odd: writing
            self._version = version
            self._seq += 1
            _CTRL.pack_into(self._ctrl, 0, self._seq, version)
            self._free_old()
            self.stats["published"] += 1
            self.stats["bytes_published"] += total
            self.stats["publish_seconds"] += time.perf_counter() - t0
        return version

    def _free_old(self) -> None:
        """Delete versions older than the newest ``keep`` that no reader holds."""
        for f in os.listdir(self.path):
            m = _NAME.match(f)
            if not m or int(m.group(1)) > self._version - self.keep:
                continue
            path = os.path.join(self.path, f)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a reader holds it; try again at the next publish
            os.unlink(path)
            os.close(fd)
            self.stats["freed"] += 1

    def versions(self) -> list[int]:
        """Versions whose files still exist (newest ``keep`` plus any a reader holds)."""
        return sorted(int(m.group(1)) for f in os.listdir(self.path) if (m := _NAME.match(f)))

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        return self._reader.wait_for(version, timeout)

    def get(self, min_version: int = 1, timeout: float | None = None) -> Params:
        return self._reader.get(min_version, timeout)

    def close(self) -> None:
        """Remove every version file; readers that still map one keep their pages until they drop it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            with contextlib.suppress(Exception):
                self._ctrl.close()
            self._finalizer()

    def __enter__(self) -> ParamStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
