"""On-disk format: safetensors shards plus a JSON manifest, and the verified reader.

A checkpoint is a directory ``step-N/`` holding ``shard-XXXXX.safetensors`` files and
``manifest.json``. Each shard is a plain safetensors file (readable by ``safetensors.safe_open``);
its header is padded with spaces (allowed by the spec) so tensor data starts on a 4 KiB boundary,
which lets the writer use O_DIRECT straight from the snapshot buffer. The manifest records, per
tensor, its file, dtype, shape and CRC32C, plus the JSON state tree (see ``_tree``) and a CRC32C
of its own canonical body. Reading never unpickles: JSON is parsed strictly and tensors come from
safetensors' own parser, then every checksum is verified before anything is returned.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field

import crc32c
import torch
from safetensors import SafetensorError, safe_open

from tensortier._units import align_up
from tensortier.checkpoint._tree import dtype_from_name, dtype_name
from tensortier.errors import CorruptDataError
from tensortier.tiers.host import PAGE

FORMAT = "tensortier.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
# exactly the names step_dir() writes: "step-007" or "step-٣" would be listed as step 7 or 3,
# then read, retired or rolled back under the name "step-7" that is not there
STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]*)$", re.ASCII)
SHARD_NAME = re.compile(r"^shard-\d{5}\.safetensors$")
RANK_SHARD_NAME = re.compile(r"^rank-\d{5}/shard-\d{5}\.safetensors$")  # many ranks (v2)
VERSIONS = (VERSION, 2)  # 2: many ranks, see _ranks.py
_MAX_MANIFEST = 256 << 20

# dtypes safetensors names natively; others are stored as raw bytes (U8) and typed by the manifest
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def crc(data: torch.Tensor) -> int:
    """CRC32C of a CPU uint8 tensor's bytes (hardware-accelerated, releases the GIL)."""
    return crc32c.crc32c(memoryview(data.numpy())) if data.numel() else 0


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # within the shard's data section


@dataclass
class Shard:
    file: str
    entries: list[Entry] = field(default_factory=list)
    data_start: int = 0  # bytes before the data section (8 + padded header)
    header: bytes = b""

    @property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def file_bytes(self) -> int:
        return self.data_start + self.data_bytes

    @property
    def image_bytes(self) -> int:
        """The file padded to a whole page, as written with O_DIRECT."""
        return align_up(self.file_bytes, PAGE)


def plan(entries: list[Entry], shard_bytes: int) -> list[Shard]:
    """Group tensors into shards of about ``shard_bytes`` and build each safetensors header.

    Larger element sizes come first inside a shard, so every tensor's offset is a multiple of its
    element size (the data section starts page-aligned).
    """
    shards: list[Shard] = []
    current = Shard(file="")
    for e in entries:
        if current.entries and current.data_bytes + e.nbytes > shard_bytes:
            shards.append(current)
            current = Shard(file="")
        current.entries.append(e)
    if current.entries or not shards:
        shards.append(current)
    for i, shard in enumerate(shards):
        shard.file = f"shard-{i:05d}.safetensors"
        shard.entries.sort(key=lambda e: -e.dtype.itemsize)
        header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "tensortier"}}
        offset = 0
        for e in shard.entries:
            e.offset = offset
            st = _ST_DTYPES.get(e.dtype)
            shape = list(e.shape) if st else [e.nbytes]
            header[e.name] = {
                "dtype": st or "U8",
                "shape": shape,
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        shard.data_start = align_up(8 + len(text), PAGE)
        shard.header = text + b" " * (shard.data_start - 8 - len(text))
    return shards


def write_header(shard: Shard, image: torch.Tensor) -> None:
    """Put the 8-byte length and the padded JSON header at the start of ``image`` (uint8)."""
    n = len(shard.header)
    prefix = n.to_bytes(8, "little") + shard.header
    image[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    tail = shard.image_bytes - shard.file_bytes
    if tail:
        image[shard.file_bytes : shard.image_bytes].zero_()


def canonical(body: dict) -> bytes:
    """The checksummed bytes of a body. Keys keep their order (a user's ``extra`` and any
    state dict come back in the order saved, as from ``torch.save``); a body parsed from a
    manifest has the file's order, so this re-encodes it exactly (manifests written with sorted
    keys by earlier versions included)."""
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def manifest_bytes(body: dict) -> bytes:
    data = canonical(body)
    return json.dumps({"crc32c": crc32c.crc32c(data), "body": body}, allow_nan=False).encode()


def _reject_constant(name: str) -> None:
    raise CorruptDataError(f"non-standard JSON constant {name} in manifest")


def read_manifest(path: str) -> dict:
    """Parse and check ``path/manifest.json``; raises :class:`CorruptDataError` on any defect."""
    file = os.path.join(path, MANIFEST)
    try:
        # O_NONBLOCK: a FIFO in its place must not block the open; only a regular file is read,
        # and never past the limit (a link to /dev/zero reports size 0 and never ends)
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CorruptDataError("manifest is not a regular file", path=file)
            raw = f.read(_MAX_MANIFEST + 1)
    except OSError as exc:
        raise CorruptDataError(f"cannot read manifest: {exc}", path=file) from exc
    if len(raw) > _MAX_MANIFEST:
        raise CorruptDataError(
            f"manifest is over {_MAX_MANIFEST} bytes, larger than any we write", path=file
        )
    return parse_manifest(raw, file)


def parse_manifest(raw: bytes, file: str) -> dict:
    """The checked body of a manifest's bytes (``file`` names where they came from)."""
    try:
        doc = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptDataError(f"cannot read manifest: {exc}", path=file) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict):
        raise CorruptDataError("manifest is not a tensortier manifest", path=file)
    body = doc["body"]
    try:
        data = canonical(body)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CorruptDataError(f"manifest body cannot be re-encoded: {exc}", path=file) from exc
    if crc32c.crc32c(data) != doc.get("crc32c"):
        raise CorruptDataError("manifest checksum mismatch", path=file)
    if body.get("format") != FORMAT or body.get("version") not in VERSIONS:
        raise CorruptDataError(
            f"unsupported checkpoint format {body.get('format')!r} v{body.get('version')!r}",
            path=file,
        )
    if not isinstance(body.get("step"), int) or not isinstance(body.get("tensors"), dict):
        raise CorruptDataError("manifest lacks a step or a tensor table", path=file)
    return body


def read_tensors(path: str, body: dict, allow_ranks: bool = False) -> dict[str, torch.Tensor]:
    """Load every tensor the manifest lists through safetensors and verify its CRC32C.

    ``allow_ranks``: file names may be ``rank-RRRRR/shard-XXXXX.safetensors`` (v2, many ranks).
    """
    by_file: dict[str, list[tuple[str, dict]]] = {}
    for name, info in body["tensors"].items():
        file = str(info.get("file", "")) if isinstance(info, dict) else ""
        if not (SHARD_NAME.match(file) or (allow_ranks and RANK_SHARD_NAME.match(file))):
            raise CorruptDataError(f"tensor {name!r}: bad file entry in manifest", path=path)
        by_file.setdefault(info["file"], []).append((name, info))
    out: dict[str, torch.Tensor] = {}
    for file, items in sorted(by_file.items()):
        full = os.path.join(path, file)
        try:
            if not stat.S_ISREG(os.stat(full).st_mode):  # a FIFO would block safe_open forever
                raise CorruptDataError(f"{file} is not a regular file", path=full)
            with safe_open(full, framework="pt") as f:
                keys = set(f.keys())
                for name, info in items:
                    if name not in keys:
                        raise CorruptDataError(f"tensor {name!r} missing from {file}", path=full)
                    raw = f.get_tensor(name).reshape(-1).view(torch.uint8)
                    dtype = dtype_from_name(info.get("dtype"))
                    shape = info.get("shape")
                    if not isinstance(shape, list) or not all(
                        isinstance(s, int) and s >= 0 for s in shape
                    ):
                        raise CorruptDataError(f"tensor {name!r}: bad shape", path=full)
                    if raw.numel() != info.get("nbytes"):
                        raise CorruptDataError(
                            f"tensor {name!r}: {raw.numel()} bytes, manifest says "
                            f"{info.get('nbytes')}",
                            path=full,
                        )
                    if crc(raw) != info.get("crc32c"):
                        raise CorruptDataError(f"tensor {name!r}: checksum mismatch", path=full)
                    out[name] = (
                        raw.view(dtype).reshape(shape)
                        if raw.numel()
                        else torch.empty(shape, dtype=dtype)
                    )
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, CorruptDataError):
                raise
            raise CorruptDataError(f"cannot read {file}: {exc}", path=full) from exc
    return out


def entry_info(entry: Entry, shard: Shard, checksum: int) -> dict:
    return {
        "file": shard.file,
        "dtype": dtype_name(entry.dtype),
        "shape": list(entry.shape),
        "nbytes": entry.nbytes,
        "crc32c": checksum,
    }
