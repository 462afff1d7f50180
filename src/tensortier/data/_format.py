"""A catalog directory on disk: the manifest, the index, and whether a build is done.

Layout of ``<path>/`` (``PROTOCOL.md``)::

    catalog.json        the manifest, written last: its presence means "complete"
    index.bin           N fixed-width rows (segment u32, length u32, offset u64, crc u32)
    seg-00000000.ttr    append-only segment files (``tiers/segments.py`` record format 3)
    .tt-build.lock      only while a build runs (flock held by the builder)

Reading a manifest validates every field before anything uses it, so a damaged one is one
:class:`CorruptDataError` naming the file; it never parses the index (opening is O(1) in records).
This module never writes a complete catalog itself; ``_build.py`` does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from tensortier import _modes
from tensortier._units import check_int, is_int
from tensortier.errors import ConfigError, CorruptDataError

FORMAT = "tensortier-catalog"
# 2: a numpy scalar is stored as itself (item kind "ns", tiers/itemcodec.py), read back as a numpy
# scalar; 1 stored it as a 0-d array (kind "np"), which is how a version-1 catalog still reads
VERSION = 2
READABLE = (1, 2)  # the versions this code opens
MANIFEST = "catalog.json"
INDEX = "index.bin"
LOCK = ".tt-build.lock"
RECORD_FORMAT = 3  # tiers/segments.py format 3: format 2's coverage with CRC-32C
ALIGN = 8  # records (header + blob) are padded to 8 bytes, so every field can be viewed in place
INDEX_DTYPE = np.dtype([("seg", "<u4"), ("len", "<u4"), ("off", "<u8"), ("crc", "<u4")])
_DTYPE_DESC = [list(f) for f in INDEX_DTYPE.descr]
SEGMENT = re.compile(r"^seg-(\d{8})\.ttr$")
# names a build leaves behind; anything else in a directory means "not ours: do not touch"
BUILD_FILES = re.compile(r"^(seg-\d{8}\.ttr|index\.bin|catalog\.json\.tmp|\.tt-build\.lock)$")


def segment_path(root: str, seg: int) -> str:
    return os.path.join(root, f"seg-{seg:08d}.ttr")


@dataclass(frozen=True)
class Manifest:
    records: int
    payload_bytes: int  # sum of encoded record sizes (what a reader gets)
    segments: dict[int, int]  # segment number -> bytes
    index_crc: int
    writers: int
    created: str
    version: int = VERSION  # the format version it was written with (READABLE)

    @property
    def file_bytes(self) -> int:
        return sum(self.segments.values())

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": self.version,
            "records": self.records,
            "payload_bytes": self.payload_bytes,
            "record_format": RECORD_FORMAT,
            "align": ALIGN,
            "index": {"file": INDEX, "dtype": _DTYPE_DESC, "crc32c": self.index_crc},
            "segments": [[s, n] for s, n in sorted(self.segments.items())],
            "writers": self.writers,
            "created": self.created,
        }


def _int(d: dict, name: str, low: int = 0, high: int = 2**63) -> int:
    v = d.get(name)
    msg = f"{name} must be an int in [{low}, {high}), got {v!r}"
    return check_int(v, msg, minimum=low, maximum=high - 1, error=ValueError)


def read_manifest(root: str) -> Manifest:
    """The validated manifest of the complete catalog in ``root`` (see :func:`refuse_incomplete`)."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError):
        raise
    except PermissionError as exc:
        raise _modes.denied(path, exc, "Catalog.open") from exc
    except (OSError, ValueError) as exc:
        raise CorruptDataError(
            f"the catalog manifest {path} cannot be read ({exc}); rebuild the catalog",
            path=path,
        ) from exc
    try:
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"it is not a {FORMAT} manifest")
        version = meta.get("version")
        if isinstance(version, int) and version > VERSION:
            raise ConfigError(
                f"the catalog in {root!r} has format version {version}, newer than this "
                f"tensortier reads ({VERSION}); upgrade tensortier"
            )
        if (
            version not in READABLE
            or isinstance(version, bool)
            or meta.get("record_format") != RECORD_FORMAT
            or meta.get("align") != ALIGN
        ):
            raise ValueError("unknown version, record format or alignment")
        index = meta.get("index")
        if not isinstance(index, dict) or index.get("file") != INDEX:
            raise ValueError("index must name index.bin")
        if index.get("dtype") != _DTYPE_DESC:
            raise ValueError(f"index dtype {index.get('dtype')!r} is not {_DTYPE_DESC!r}")
        segs = meta.get("segments")
        if not isinstance(segs, list):
            raise ValueError("segments must be a list")
        table: dict[int, int] = {}
        for entry in segs:
            if (
                not isinstance(entry, list)
                or len(entry) != 2
                or not all(is_int(x) for x in entry)
                or not 0 <= entry[0] < 2**32
                or entry[1] < 0
                or entry[0] in table
            ):
                raise ValueError(f"bad segment entry {entry!r}")
            table[entry[0]] = entry[1]
        created = meta.get("created")
        if not isinstance(created, str):
            raise ValueError("created must be a string")
        return Manifest(
            records=_int(meta, "records"),
            payload_bytes=_int(meta, "payload_bytes"),
            segments=table,
            index_crc=_int(index, "crc32c", 0, 2**32),
            writers=_int(meta, "writers", 1, 1 << 16),
            created=created,
            version=version,
        )
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise CorruptDataError(
            f"the catalog manifest {path} is not valid ({exc}); rebuild the catalog", path=path
        ) from exc


def write_manifest(root: str, manifest: Manifest, point=lambda name: None, mode=0o600) -> None:
    """Write ``catalog.json`` atomically and durably: temp file, fsync, rename, fsync directory.

    The rename is the commit point of a build: before it the directory opens as incomplete.
    The file gets exactly ``mode``, as every file of the catalog (``_modes.py``).
    """
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(_modes.create(tmp, mode), "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    point("manifest-written")
    os.replace(tmp, os.path.join(root, MANIFEST))
    point("manifest-renamed")
    fsync_dir(root)


def fsync_dir(root: str) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def builder_pid(root: str) -> int | None:
    """The pid of a live build of ``root``, 0 if one runs but its pid is unknown, else None.

    Probes the builder's lock with a shared, non-blocking ``flock`` on a read-only descriptor:
    nothing is created or changed, so a read-only catalog can be probed.
    """
    try:
        fd = os.open(os.path.join(root, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            text = os.pread(fd, 64, 0).decode(errors="replace").split()
            return int(text[1]) if len(text) == 2 and text[1].isdigit() else 0
        return None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def refuse_incomplete(root: str) -> None:
    """Raise the error that says why ``root`` holds no complete catalog (it has no manifest)."""
    if not os.path.exists(root):
        raise FileNotFoundError(
            errno.ENOENT,
            f"no catalog at {root!r}: the directory does not exist (build one with "
            f"tt.data.Catalog.build)",
            root,
        )
    if not os.path.isdir(root):
        raise ConfigError(f"directory={root!r} is a file, not a catalog directory")
    pid = builder_pid(root)
    if os.path.exists(os.path.join(root, MANIFEST)):
        return  # the build finished between the caller's look and ours
    if pid is not None:
        who = f"process {pid}" if pid else "another process"
        raise ConfigError(
            f"the catalog at {root!r} is still being built by {who}; open it after "
            f"Catalog.build has returned"
        )
    leftovers = [n for n in os.listdir(root) if BUILD_FILES.match(n)]
    if leftovers:
        raise CorruptDataError(
            f"{root!r} holds an incomplete catalog build (its builder stopped before finishing: "
            f"it crashed, was killed or raised); build it again (Catalog.build reuses the "
            f"directory) or delete it",
            path=root,
        )
    raise FileNotFoundError(
        errno.ENOENT,
        f"no catalog at {root!r} (no {MANIFEST}); build one with tt.data.Catalog.build",
        root,
    )
