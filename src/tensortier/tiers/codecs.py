"""Codecs that shrink a tensor before it moves to a slower tier, and their measured cost.

A codec turns one tensor into a few payload tensors (what actually crosses the tier) plus a small
metadata dict, and back. Lossless codecs are bit-exact for every dtype they accept (``-0.0`` and
NaN payloads included, because they compare and copy bit patterns, never float values); the lossy
down-cast codecs are opt-in and say so in ``lossless = False``. A lossless codec stores data it
cannot shrink (random bytes, a tensor without zeros for sparse) as a copy of its bits: a payload
is never larger than the tensor.

This module owns the encodings and the helpers that *measure* their speed and ratio for the
planner's profile. It never decides when to use a codec: the planner's simulator does that
("encode + move + decode beats move").
"""

from __future__ import annotations

import abc
import threading
import time
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tensortier.errors import ConfigError, CorruptDataError

# Integer dtype with the same width: codecs compare and move bit patterns, never values.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS: dict[torch.device, torch.Tensor] = {}  # 0..7 per device, made there (no H2D copy)


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host. A device tensor is copied once (the caller needs its values now, so this
    waits for it); :meth:`TransferEngine.to_host` with ``codec=`` avoids the wait altogether."""
    return t if t.device.type == "cpu" else t.to("cpu")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: staged through pinned memory, which
    PyTorch keeps until the copy has run."""
    if device.type == "cpu":
        return t
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


#: Every dtype the lossless codecs accept (complex is moved as pairs of its real dtype).
LOSSLESS_DTYPES: tuple[torch.dtype, ...] = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@runtime_checkable
class Codec(Protocol):
    """What the activation offloader calls; ``decode`` returns on the payloads' device.

    Optional class attributes (False when absent): ``encodes_on_device`` (encode runs on a device
    tensor's own device without a host sync, so its payloads can be moved raw) and
    ``decodes_on_device`` (decode of device payloads needs no host sync); the others are encoded
    and decoded on the host, on the transfer engine's threads."""

    name: str
    lossless: bool

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]: ...

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor: ...


def _check_dtype(codec: str, t: torch.Tensor, accepted: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in accepted:
        names = ", ".join(str(d).removeprefix("torch.") for d in accepted)
        raise ConfigError(
            f"codec {codec!r} cannot encode a {t.dtype} tensor; it accepts {names}. "
            "Use codec=None (raw bytes) for this tensor."
        )


def flat_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a flat tensor with stride 1, which ``.view(dtype)`` accepts: a copy if
    not contiguous, or a conjugate or negative view (their bits are not the values until
    resolved)."""
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # contiguous() keeps an empty or one-element tensor's stride (x[::2] of two: stride 2),
        # which .view(dtype) refuses; with at most one element the stride addresses nothing
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of ``t``'s values with the same bit patterns (see :func:`flat_values`)."""
    flat = flat_values(t)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_BITS[flat.element_size()])


def _meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r} in codec metadata")
    return dtype


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.bool:
        return torch.uint8
    width = torch.empty(0, dtype=dtype).element_size()
    return _BITS[width // 2 if dtype.is_complex else width]


def _from_bits(bits: torch.Tensor, meta: dict) -> torch.Tensor:
    dtype, shape = _dtype(meta["dtype"]), tuple(meta["shape"])
    if dtype.is_complex:
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.view_as_complex(bits.view(real).reshape(-1, 2)).reshape(shape)
    if dtype == torch.bool:
        return bits.view(torch.bool).reshape(shape)
    return bits.view(dtype).reshape(shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _stored_raw(bits: torch.Tensor, meta: dict) -> tuple[list[torch.Tensor], dict]:
    """Compress only where it pays: data the codec would not shrink (random bytes, a dense
    tensor for sparse) is stored as a copy of its bits, never larger than the tensor. A copy,
    because the caller frees or reuses the source once encoded."""
    return [bits.clone()], {**meta, "raw": True}


def _from_raw(codec: str, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor:
    """Decodes what :func:`_stored_raw` made, on the payload's device (a copy: the payload's
    memory goes back to its pool once decoded)."""
    (bits,) = payloads
    dtype, shape = _dtype(meta["dtype"]), tuple(meta["shape"])
    expected = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if _nbytes(bits) != expected or int(meta.get("nbytes", expected)) != expected:
        raise CorruptDataError(
            f"{codec} payload stored raw has {_nbytes(bits)} bytes, expected {expected}"
        )
    flat = bits.reshape(-1).view(torch.uint8).clone()
    return _from_bits(flat.view(_bits_dtype(dtype)), meta)


class SparseCodec:
    """Bitmask of the nonzero elements plus the packed nonzeros (FlashNeuron/Gist/cDMA style).

    Pays for ReLU outputs and dropout masks: a tensor with a fraction ``z`` of zeros shrinks to
    ``1/(8*itemsize) + (1 - z)`` of its bytes. Encoding runs on the host (the payload's size
    depends on the data, so a device would have to synchronise to know it); decoding runs on the
    payloads' device, without synchronising (a prefix-sum gather instead of boolean indexing).
    """

    name = "sparse"
    lossless = True
    decodes_on_device = True  # a prefix-sum gather: no host sync, far faster than on a CPU

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        _check_dtype(self.name, t, LOSSLESS_DTYPES)
        bits = _host_copy(_as_bits(t))
        n, meta = bits.numel(), {**_meta(t), "n": bits.numel()}
        nonzeros = int(torch.count_nonzero(bits))  # in place: no mask, no int64 copy of one
        if (n + 7) // 8 + nonzeros * bits.element_size() >= _nbytes(bits):
            return _stored_raw(bits, meta)
        packed, values = _pack_on_host(bits.numpy(), nonzeros)
        return [torch.from_numpy(packed), torch.from_numpy(values)], meta

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor:
        if meta.get("raw"):
            return _from_raw(self.name, payloads, meta)
        packed, values = payloads
        n = int(meta["n"])
        _check_sparse_sizes(packed, values, n, _dtype(meta["dtype"]))
        if values.device.type != "cpu":
            return _from_bits(_scatter_by_mask(_unpack_mask(packed, n), values), meta)
        bits = np.zeros(n, dtype=values.numpy().dtype)
        done = _unpack_on_host(packed.numpy(), values.numpy(), bits)
        if done != values.numel():
            raise CorruptDataError(
                f"sparse payload has {values.numel()} values for a mask of {done} nonzeros (n={n})"
            )
        return _from_bits(torch.from_numpy(bits), meta)


# Elements per step of sparse encode/decode on the host (a multiple of 8): temporaries of at most
# 9 bytes per element of a chunk (mask, selected values) whatever the tensor's size. A mask of the
# whole tensor and its uint8, padded and shifted copies took 4 bytes per element; numpy's
# packbits/unpackbits and boolean indexing make no copies and no int64 indices.
_CHUNK = 1 << 21


def _pack_on_host(bits: np.ndarray, nonzeros: int) -> tuple[np.ndarray, np.ndarray]:
    """The little-endian bitmask of ``bits``' nonzero elements, and those elements."""
    packed = np.empty((bits.size + 7) // 8, np.uint8)
    values = np.empty(nonzeros, bits.dtype)
    done = 0
    for i in range(0, bits.size, _CHUNK):
        part = bits[i : i + _CHUNK]
        mask = part != 0
        picked = part[mask]
        values[done : done + picked.size] = picked
        done += picked.size
        packed[i // 8 : i // 8 + (part.size + 7) // 8] = np.packbits(mask, bitorder="little")
    return packed, values


def _unpack_on_host(packed: np.ndarray, values: np.ndarray, out: np.ndarray) -> int:
    """Scatters ``values`` into the zeros ``out`` where ``packed``'s bits are set; returns the
    count of set bits (values are written only while that count fits them)."""
    done = 0
    for i in range(0, out.size, _CHUNK):
        part = out[i : i + _CHUNK]
        mask = np.unpackbits(
            packed[i // 8 : i // 8 + (part.size + 7) // 8], count=part.size, bitorder="little"
        )
        mask = mask.view(bool)
        k = int(np.count_nonzero(mask))
        if done + k <= values.size:
            part[mask] = values[done : done + k]
        done += k
    return done


def _unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of the little-endian bitmask ``packed``, as bools on its device."""
    shifted = packed.unsqueeze(1) >> _shifts(packed.device)
    return shifted.bitwise_and_(1).view(-1)[:n].view(torch.bool)


def _check_sparse_sizes(
    packed: torch.Tensor, values: torch.Tensor, n: int, dtype: torch.dtype
) -> None:
    """What a sparse payload's sizes must be, checked from shapes alone (no host sync, so on
    every device; a device tensor's mask was not checked and failed in a reshape). Whether the
    count of values matches the mask's set bits needs the data: checked on the host only."""
    if packed.dtype != torch.uint8 or packed.numel() != (n + 7) // 8:
        raise CorruptDataError(
            f"sparse payload's mask has {packed.numel()} {packed.dtype} bytes, expected "
            f"{(n + 7) // 8} uint8 for n={n}"
        )
    if values.dtype != _bits_dtype(dtype) or values.numel() > n:
        raise CorruptDataError(
            f"sparse payload has {values.numel()} {values.dtype} values, expected at most {n} "
            f"{_bits_dtype(dtype)} for n={n}"
        )


def _scatter_by_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``zeros; out[mask] = values`` with no host sync: the k-th set bit takes ``values[k]``, found
    by a prefix sum (boolean indexing would need the count of set bits on the host first)."""
    zeros = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return zeros
    index = torch.cumsum(mask, 0, dtype=torch.int32 if mask.numel() < 2**31 else torch.int64)
    # a corrupt mask reads wrong values, never out of bounds
    index.sub_(1).clamp_(0, values.numel() - 1)
    return torch.where(mask, values.index_select(0, index), zeros)


class _HostBytesCodec(abc.ABC):
    """Compresses the tensor's bytes on the host; payload is one uint8 CPU tensor."""

    name = "bytes"
    lossless = True

    @abc.abstractmethod
    def _compress(self, data: memoryview) -> bytes | bytearray:
        """The compressed bytes (a bytearray is wrapped without a copy)."""

    @abc.abstractmethod
    def _decompress(self, data: memoryview, size: int) -> bytearray:
        """``size`` bytes back from ``data``, in a bytearray: the result is a tensor over its
        memory (decoding to ``bytes`` and copying them peaked at twice the tensor)."""

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        _check_dtype(self.name, t, LOSSLESS_DTYPES)
        bits = _host_copy(_as_bits(t)).view(torch.uint8)
        raw = bits.numpy()
        out = self._compress(memoryview(raw))
        if len(out) >= raw.nbytes:  # incompressible: stored raw, never larger than the tensor
            del out
            return _stored_raw(bits, {**_meta(t), "nbytes": raw.nbytes})
        payload = torch.frombuffer(
            out if isinstance(out, bytearray) else bytearray(out), dtype=torch.uint8
        )
        return [payload], {**_meta(t), "nbytes": raw.nbytes}

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor:
        size = int(meta["nbytes"])
        if meta.get("raw"):
            return _from_raw(self.name, payloads, meta)
        (payload,) = payloads
        data = _host_copy(payload).numpy()  # decompression runs on the host, where bytes are
        try:
            raw = self._decompress(memoryview(data), size) if size else bytearray()
        except Exception as exc:  # zstandard.ZstdError, lz4's RuntimeError: the bytes are damaged
            raise CorruptDataError(
                f"{self.name} payload of {data.nbytes} bytes cannot be decoded ({exc}); it was "
                f"damaged after encoding"
            ) from exc
        if len(raw) != size:
            raise CorruptDataError(
                f"{self.name} payload decoded to {len(raw)} bytes, expected {size}"
            )
        bits = (
            torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        )
        bits = bits.view(_bits_dtype(_dtype(meta["dtype"])))
        return _to_device(_from_bits(bits, meta), payload.device)


class ZstdCodec(_HostBytesCodec):
    """zstandard at a low level: the best ratio per CPU second for dense activations on host.

    One codec serves every copy worker of an engine at once, and zstandard's compressor and
    decompressor objects must not be used by two threads at a time (corrupt output, crashes):
    each thread gets its own pair."""

    lossless = True

    def __init__(self, level: int = 1, threads: int = 0):
        import zstandard

        try:  # checked here: a bad level otherwise failed on a copy worker, in the backward
            zstandard.ZstdCompressor(level=level, threads=threads)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"ZstdCodec(level={level!r}, threads={threads!r}): {exc}; pass an int level up "
                f"to {zstandard.MAX_COMPRESSION_LEVEL} (1, the default, is fast; negative is "
                f"faster still) and an int threads (0: none, -1: one per core)"
            ) from None
        self.name = f"zstd{level}" if level != 1 else "zstd"
        self._level, self._threads = level, threads
        self._zstd = zstandard
        self._local = threading.local()

    def _contexts(self):
        local = self._local
        if not hasattr(local, "c"):
            local.c = self._zstd.ZstdCompressor(level=self._level, threads=self._threads)
            local.d = self._zstd.ZstdDecompressor()
        return local.c, local.d

    def _compress(self, data: memoryview) -> bytes:
        return self._contexts()[0].compress(data)

    def _decompress(self, data: memoryview, size: int) -> bytearray:
        reader = self._contexts()[1].stream_reader(data)
        out = bytearray(size)
        view, n = memoryview(out), 0
        while n < size and (k := reader.readinto(view[n:])):
            n += k
        if n != size or reader.read(1):
            raise ValueError(f"the frame holds {'more' if n == size else n} bytes, not {size}")
        return out


class Lz4Codec(_HostBytesCodec):
    """lz4 frame: lower ratio than zstd, several times faster to decode."""

    name = "lz4"
    lossless = True

    def _compress(self, data: memoryview) -> bytes:
        import lz4.frame

        return lz4.frame.compress(data, compression_level=0, return_bytearray=True)

    def _decompress(self, data: memoryview, size: int) -> bytearray:
        """Streams the frame into one buffer, 1 MiB at a time: ``lz4.frame.decompress`` decodes
        into its own buffer and copies that into the bytearray (twice the tensor at the peak)."""
        import lz4.frame

        out, n, pos, step = bytearray(size), 0, 0, 1 << 16
        view, frame = memoryview(out), lz4.frame.LZ4FrameDecompressor()
        while not frame.eof:
            if frame.needs_input and pos >= len(data):
                raise ValueError(f"the frame is cut short after {n} of {size} bytes")
            # bytes: the decompressor joins a chunk to what it kept of the last (a memoryview
            # cannot be joined); at most 64 KiB copied at a time
            chunk = bytes(data[pos : pos + step]) if frame.needs_input else b""
            pos += len(chunk)
            piece = frame.decompress(chunk, max_length=1 << 20)
            if n + len(piece) > size:
                raise ValueError(f"the frame holds more than {size} bytes")
            view[n : n + len(piece)] = piece
            n += len(piece)
        if n != size:
            raise ValueError(f"the frame holds {n} bytes, not {size}")
        if pos < len(data) or frame.unused_data:
            raise ValueError(
                f"{len(data) - pos + len(frame.unused_data or b'')} bytes follow the frame"
            )
        return out


class CastCodec:
    """Opt-in lossy down-cast of float32 activations to fp16 or bf16 (half the bytes).

    Not bit-exact: values round to the target's precision (relative error up to 2**-11 for fp16,
    2**-8 for bf16) and gradients change slightly. fp16 also has a narrow range: values below
    about 6e-8 come back as 0, and a tensor with finite values beyond +-65504 (which would come
    back as inf) is a ``ConfigError`` naming the fix, raised by encode on the host and by decode
    on a device. bf16 keeps float32's exponent range but not its very top: finite values of
    about 3.3961e38 and above round to inf, unchecked. Use it only where the user accepts that
    (``allow_lossy=True`` in the planner, which never picks a cast for a tensor whose probed
    values it would turn into inf: :func:`cast_overflows`).
    """

    lossless = False
    encodes_on_device = True  # a cast: stream-ordered on the device, no host sync
    decodes_on_device = True

    def __init__(self, to: torch.dtype = torch.bfloat16):
        if to not in (torch.float16, torch.bfloat16):
            raise ConfigError(
                f"CastCodec: to={to} is not supported; use torch.float16 or torch.bfloat16"
            )
        self.to = to
        self.name = "fp16" if to == torch.float16 else "bf16"

    def encode(self, t: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        """The cast; fp16 also checks every tensor for values it turns into inf (the planner's
        probe saw one step only). On the host that raises now; on a device the flag goes in the
        metadata and decode raises (the offloader copies it to the host in stream order:
        :class:`~tensortier.transfer.streams.HostScalar`): no host sync here."""
        _check_dtype(self.name, t, (torch.float32,))
        t = t.detach()  # a payload, not a node of the user's graph
        cast, meta = t.to(self.to), _meta(t)
        if self.to == torch.float16 and t.numel():
            flag = _cast_overflow(t, self.to, cast)
            if t.device.type == "cpu":
                _raise_if_overflowed(self.name, bool(flag))
            else:  # a 0-dim device tensor: the activation offloader reads it without a sync
                meta["overflow"] = flag
        return [cast], meta

    def decode(self, payloads: list[torch.Tensor], meta: dict) -> torch.Tensor:
        if "overflow" in meta:  # bool() of a device tensor syncs; the offloader's copy does not
            _raise_if_overflowed(self.name, bool(meta["overflow"]))
        return payloads[0].to(_dtype(meta["dtype"])).reshape(tuple(meta["shape"]))


def _raise_if_overflowed(name: str, overflowed: bool) -> None:
    if overflowed:
        raise ConfigError(
            f"codec {name!r}: a tensor has finite values beyond fp16's range (+-65504) that it "
            f"would store as inf, corrupting the gradients; use codec='bf16' (float32's exponent range) "
            f"or keep this tensor out of the codec (a decide= hook giving it codec=None; the "
            f"planner, which chose fp16 from a step whose values fit: Options(allow_lossy=False))"
        )


def _cast_overflow(t: torch.Tensor, to: torch.dtype, cast: torch.Tensor | None = None):
    """0-dim bool on ``t``'s device, no host sync: whether casting ``t`` to ``to`` (``cast``, if
    already made) turned a finite value into inf, i.e. it holds more infs than ``t``. In chunks
    of 4M elements, so the temporaries stay small (the planner's probe runs within the budget)."""
    flat, n = flat_values(t.detach()), 1 << 22
    made = cast.reshape(-1) if cast is not None else None
    grew = [
        torch.count_nonzero(
            torch.isinf(flat[i : i + n].to(to) if made is None else made[i : i + n])
        )
        - torch.count_nonzero(torch.isinf(flat[i : i + n]))
        for i in range(0, flat.numel(), n)
    ]
    if not grew:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return torch.stack(grew).sum() > 0


def get_codec(name: str) -> Codec:
    """The codec called ``name``: sparse, zstd, lz4, fp16 or bf16."""
    factories = {
        "sparse": SparseCodec,
        "zstd": ZstdCodec,
        "lz4": Lz4Codec,
        "fp16": lambda: CastCodec(torch.float16),
        "bf16": lambda: CastCodec(torch.bfloat16),
    }
    if name not in factories:
        raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(factories)}")
    return factories[name]()


def as_codec(value: Codec | str | None, *, name: str = "codec") -> Codec | None:
    """``codec=`` as users pass it: a codec, its name (``"zstd"``, as :func:`get_codec` takes) or
    None; anything else is a ``ConfigError`` at the call, not a failure inside a copy thread."""
    if value is None or isinstance(value, Codec):
        return value
    if isinstance(value, str):
        return get_codec(value)
    raise ConfigError(
        f"{name}={value!r}: pass a codec name ('sparse', 'zstd', 'lz4', 'fp16', 'bf16'), "
        f"tt.get_codec(name) or None"
    )


def codec_key(codec: Codec) -> object:
    """What makes two codecs the same setting: a built-in codec by its class and configuration
    (``get_codec("zstd")`` twice is one setting), any other by identity."""
    if type(codec) in (SparseCodec, ZstdCodec, Lz4Codec, CastCodec):
        return (type(codec).__name__, codec.name, getattr(codec, "_threads", None))
    return codec


LOSSLESS_CODECS = ("sparse", "zstd", "lz4")
LOSSY_CODECS = ("fp16", "bf16")


def accepts(name: str, dtype: torch.dtype) -> bool:
    """Whether codec ``name`` can encode tensors of ``dtype``."""
    return dtype == torch.float32 if name in LOSSY_CODECS else dtype in LOSSLESS_DTYPES


def cast_overflows(name: str, t: torch.Tensor) -> bool:
    """Whether lossy cast ``name`` turns a finite value of ``t`` into inf (fp16 above 65504).
    The planner's probe; :class:`CastCodec` itself checks every fp16 encode."""
    if name not in LOSSY_CODECS or not t.dtype.is_floating_point or t.numel() == 0:
        return False
    to = torch.float16 if name == "fp16" else torch.bfloat16
    return bool(_cast_overflow(t, to))  # one host sync


def payload_bytes(payloads: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in payloads)


def zero_fraction(t: torch.Tensor) -> float:
    """Fraction of elements whose bit pattern is all zeros (what the sparse codec drops)."""
    if t.numel() == 0:
        return 0.0
    bits = _as_bits(t)
    # count_nonzero reduces in place; (bits == 0).sum() made a bool mask and an int64 copy of it
    # (2.25x the tensor's bytes: the profiler's probe ran over the budget on the largest tensor)
    return 1.0 - float(torch.count_nonzero(bits).item()) / bits.numel()


def sparse_ratio(zero_frac: float, itemsize: int) -> float:
    """Predicted payload/raw bytes of :class:`SparseCodec` for a given zero fraction (of elements
    of ``itemsize`` bytes: a complex tensor's real components); at most 1, as what would not
    shrink is stored raw."""
    return min(1.0, 1.0 / (8 * itemsize) + (1.0 - zero_frac))


@dataclass
class CodecSpeed:
    """Measured throughput of one codec on this machine, in raw bytes per second."""

    name: str
    encode_bps: float
    decode_bps: float
    ratio: float  # payload / raw bytes on the calibration sample
    lossless: bool

    def as_dict(self) -> dict:
        return asdict(self)


def measure_codec(
    codec: Codec, sample: torch.Tensor, *, repeat: int = 3
) -> tuple[CodecSpeed, bool]:
    """Times encode and decode of ``sample`` (best of ``repeat``); also reports bit-exactness."""
    raw = sample.numel() * sample.element_size()
    enc_best = dec_best = float("inf")
    payloads, meta, out = [], {}, sample
    for _ in range(repeat):
        t0 = time.perf_counter()
        payloads, meta = codec.encode(sample)
        t1 = time.perf_counter()
        out = codec.decode(payloads, meta)
        t2 = time.perf_counter()
        enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
    exact = bool(torch.equal(_as_bits(out), _as_bits(sample))) if codec.lossless else False
    speed = CodecSpeed(
        name=codec.name,
        encode_bps=raw / max(enc_best, 1e-9),
        decode_bps=raw / max(dec_best, 1e-9),
        ratio=payload_bytes(payloads) / max(raw, 1),
        lossless=codec.lossless,
    )
    return speed, exact


def calibration_sample(
    nbytes: int = 4 << 20, *, zero_frac: float = 0.5, seed: int = 0
) -> torch.Tensor:
    """An fp32 activation-like sample: post-ReLU Gaussian values with ``zero_frac`` zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(1, nbytes // 4), generator=g)
    keep = torch.rand(x.shape, generator=g) >= zero_frac
    return (x.abs() * keep).float()


def measure_codecs(
    names: tuple[str, ...] = LOSSLESS_CODECS + LOSSY_CODECS, *, nbytes: int = 4 << 20
) -> dict[str, CodecSpeed]:
    """Calibrates every codec in ``names`` on one sample; the planner's profile stores the result."""
    sample = calibration_sample(nbytes)
    return {n: measure_codec(get_codec(n), sample)[0] for n in names}


def estimate_ratio(
    name: str, t: torch.Tensor, *, zero_frac: float | None = None, sample_bytes: int = 1 << 20
) -> float:
    """Payload/raw bytes of codec ``name`` on ``t``: exact for sparse and casts, sampled for zstd/lz4."""
    if name in LOSSY_CODECS:
        return 0.5
    if name == "sparse":
        z = zero_fraction(t) if zero_frac is None else zero_frac
        return sparse_ratio(z, _bits_dtype(t.dtype).itemsize)  # complex: per real component
    bits = _as_bits(t.detach())
    n = max(1, sample_bytes // bits.element_size())
    head = bits[:n]
    payloads, _ = get_codec(name).encode(head)
    return payload_bytes(payloads) / max(1, head.numel() * head.element_size())


__all__ = [
    "Codec",
    "CastCodec",
    "CodecSpeed",
    "Lz4Codec",
    "SparseCodec",
    "ZstdCodec",
    "accepts",
    "cast_overflows",
    "estimate_ratio",
    "get_codec",
    "measure_codec",
    "measure_codecs",
    "sparse_ratio",
    "zero_fraction",
]
