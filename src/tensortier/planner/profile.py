"""What one profiled iteration says about a model on this machine, as plain JSON-able dataclasses.

A :class:`Profile` holds, per saved tensor, its bytes, dtype, producing module and op, pack and
unpack time and zero fraction (with the payload ratio of every codec); per planning unit (the
module granularity at which recompute works) its forward and backward compute time, the bytes
its inputs hold when it is checkpointed and the gradient bytes its backward allocates; and per
tier path the bandwidth *measured at start-up* by :func:`measure_bandwidth` with small real
transfers through the foundation's TransferEngine and DiskStore. Nothing here is hard-coded.

Profiles serialize to JSON so the simulator and the policies run and are tested without a model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from tensortier._units import SizeLike, parse_size
from tensortier.tiers.codecs import CodecSpeed, measure_codecs

CHANNELS = ("d2h", "h2d", "h2disk", "disk2h")
# A probe transfer (16 MiB) not done after this long is a stuck disk or device: raise
# (concurrent.futures.TimeoutError) instead of hanging the first planned step.
PROBE_TIMEOUT_S = 300.0
FORMAT = 1


@dataclass
class TensorProfile:
    """One saved tensor, in pack order."""

    index: int
    unit: str  # planning unit it belongs to ("" = outside every unit, never recomputed)
    nbytes: int
    dtype: str = "float32"
    shape: list[int] = field(default_factory=list)
    module: str = ""  # innermost module that saved it
    op: str = ""  # autograd node, e.g. "ReluBackward0"
    zero_frac: float = 0.0
    ratios: dict[str, float] = field(default_factory=dict)  # codec -> payload/raw bytes
    pack_s: float = 0.0
    unpack_s: float = 0.0


@dataclass
class UnitProfile:
    """One planning unit (a module whose saved tensors share one action), in forward order."""

    name: str
    fwd_s: float
    bwd_s: float
    input_bytes: int = 0  # what stays resident when the unit is checkpointed
    grad_bytes: int = 0  # parameter gradients its backward allocates
    recomputable: bool = True


@dataclass
class Bandwidth:
    """Bytes per second of each copy channel, measured on this machine."""

    d2h: float
    h2d: float
    h2disk: float
    disk2h: float
    issue_s: float = 0.0  # compute-thread seconds to start one asynchronous move

    def of(self, channel: str) -> float:
        return getattr(self, channel)


@dataclass
class Profile:
    device: str  # "cpu" or "cuda"
    units: list[UnitProfile]
    tensors: list[TensorProfile]
    bandwidth: Bandwidth
    codecs: dict[str, CodecSpeed] = field(default_factory=dict)
    unified: bool = True  # host RAM is the device's memory (CPU): host-tier bytes count as device
    base_bytes: int = 0  # resident for the whole step (counted in every peak)
    workspace_bytes: int = 0  # constant memory beyond saved tensors and grads
    transient_factor: float = 1.5  # an op's temporaries / the saved tensor it makes or uses
    move_s_per_byte: float = 0.0  # compute seconds lost per byte moved (copy threads, CPU)
    offload_overhead_bytes: int = 0  # persistent buffers of the offload machinery (reported only)
    other_fwd_s: float = 0.0  # forward compute outside every unit (loss, ...)
    other_bwd_s: float = 0.0
    prefetch_bytes: int = 256 << 20  # the offloader's read-ahead window
    host_budget: int | None = None  # host bytes the host tier may use (None: no limit)
    measured_peak_bytes: int | None = None  # of the profiled iteration itself
    measured_step_s: float | None = None
    keep_peak_bytes: int | None = None  # of a timing iteration that kept everything (calibrates)
    offload_step_s: float | None = None  # of a timing iteration that offloaded all (calibrates)
    meta: dict = field(default_factory=dict)

    # --- derived -------------------------------------------------------------------------
    def unit(self, name: str) -> UnitProfile:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    def tensors_of(self, unit: str) -> list[TensorProfile]:
        return [t for t in self.tensors if t.unit == unit]

    @property
    def saved_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def compute_s(self) -> float:
        return sum(u.fwd_s + u.bwd_s for u in self.units) + self.other_fwd_s + self.other_bwd_s

    # --- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        from tensortier.errors import ConfigError

        d = dict(d)
        fmt = d.pop("format", FORMAT)
        if fmt != FORMAT:
            raise ConfigError(f"profile format {fmt} is not supported (expected {FORMAT})")
        d["units"] = [UnitProfile(**u) for u in d["units"]]
        d["tensors"] = [TensorProfile(**t) for t in d["tensors"]]
        d["bandwidth"] = Bandwidth(**d["bandwidth"])
        d["codecs"] = {k: CodecSpeed(**v) for k, v in d.get("codecs", {}).items()}
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        with open(path) as f:
            return cls.from_json(f.read())


def measure_bandwidth(
    spill_dir: str | None = None,
    *,
    nbytes: SizeLike = "64MiB",
    chunk: SizeLike = "16MiB",
    device: torch.device | str | None = None,
) -> Bandwidth:
    """Measures every copy channel with real transfers of ``nbytes`` in ``chunk``-sized tensors.

    Device<->host through :class:`TransferEngine` (a memcpy on CPU), host<->disk through
    :class:`DiskStore` in a private directory under ``spill_dir`` that is removed afterwards.
    Buffers are touched once before timing: first-touch page faults are not bandwidth.
    """
    from tensortier.tiers.disk import DiskStore
    from tensortier.tiers.host import HostPool
    from tensortier.transfer import TransferEngine

    total = parse_size(nbytes, name="nbytes", allow_zero=False)
    size = min(total, parse_size(chunk, name="chunk", allow_zero=False))
    n = max(1, total // size)
    from tensortier._device import normalize_device

    dev = normalize_device(device)
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)  # never the training's RNG (dropout masks)
    src = [
        torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev, generator=gen)
        for _ in range(n)
    ]
    with HostPool(2 * n * size + (64 << 20)) as pool, DiskStore(spill_dir, owner="tt-plan") as disk:
        eng = TransferEngine(host=pool, disk=disk, device=dev)
        try:
            warm = [
                eng.to_host(t).result(timeout=PROBE_TIMEOUT_S) for t in src
            ]  # maps the pool's pages
            for h in warm:
                h.free()
            t0 = time.perf_counter()
            futs = [eng.to_host(t) for t in src]
            issue_s = (time.perf_counter() - t0) / n
            hosts = [f.result(timeout=PROBE_TIMEOUT_S) for f in futs]
            d2h = n * size / (time.perf_counter() - t0)
            # On CUDA ``result()`` of a device-bound move only makes the current stream wait on
            # the copy's event: synchronize before reading the clock, or the issue time is
            # measured instead of the copy. One untimed round first: the destinations'
            # cudaMalloc is not bandwidth either.
            for _ in range(2 if cuda else 1):
                if cuda:
                    torch.cuda.synchronize(dev)  # bounded: the random fill and earlier copies
                t0 = time.perf_counter()
                backs = [
                    f.result(timeout=PROBE_TIMEOUT_S)
                    for f in [eng.to_device(h, free=False) for h in hosts]
                ]
                if cuda:
                    torch.cuda.synchronize(dev)  # bounded: waits for the copies just issued
                h2d = n * size / (time.perf_counter() - t0)
                del backs
            t0 = time.perf_counter()
            handles = [
                f.result(timeout=PROBE_TIMEOUT_S) for f in [disk.put(h.tensor) for h in hosts]
            ]
            h2disk = n * size / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs = [
                f.result(timeout=PROBE_TIMEOUT_S)
                for f in [disk.get(hd, into=h.tensor) for hd, h in zip(handles, hosts)]
            ]
            disk2h = n * size / (time.perf_counter() - t0)
            del outs
            for hd in handles:
                disk.free(hd)
            for h in hosts:
                h.free()
        finally:
            eng.close()
    return Bandwidth(d2h=d2h, h2d=h2d, h2disk=h2disk, disk2h=disk2h, issue_s=issue_s)


def measure_codec_speeds() -> dict[str, CodecSpeed]:
    """Codec throughput on this machine (4 MiB post-ReLU-like fp32 sample)."""
    return measure_codecs()
