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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from tensortier._units import SizeLike, parse_size
from tensortier.tiers.codecs import CodecSpeed, measure_codecs

CHANNELS = ("d2h", "h2d", "h2disk", "disk2h", "h2remote", "remote2h")


def fold_sum(seconds: Iterable[float]) -> float:
    """Left-to-right float addition: the same bits on every Python. ``sum()`` of floats
    compensates its rounding from Python 3.12 on (Neumaier), so a plan simulated on 3.12 (the
    GPU machine) differed in the last bit from the same plan on 3.11."""
    total = 0.0
    for x in seconds:
        total += x
    return total


# A probe transfer (16 MiB) not done after this long is a stuck disk or device: raise
# (concurrent.futures.TimeoutError) instead of hanging the first planned step.
PROBE_TIMEOUT_S = 300.0
FORMAT = 2  # 2: per-unit operators, timing passes under the budget


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
    op_index: int = -1  # the operator of its unit that produced its storage (-1: unknown)


@dataclass
class OpProfile:
    """One operator of a unit's forward, in dispatch order: what selective recompute works on.

    ``index`` counts the operators the way ``torch.utils.checkpoint``'s selective policy sees
    them (``SAC_IGNORED_OPS`` skipped), so a plan can name an operator by it.
    """

    index: int
    name: str  # "aten.addmm.default"
    out_bytes: int  # new storage its outputs allocate (0 for views and in-place ops)
    seconds: float  # scaled so that a unit's operators add up to its forward time
    saved_bytes: int = 0  # of that storage, what autograd saves for backward
    view: bool = False  # its output aliases an input (view, in-place): never cached alone
    random: bool = False  # draws from the RNG (dropout)
    pinned: bool = False  # never cached: random, or written in place later in the unit


@dataclass
class UnitProfile:
    """One planning unit (a module whose saved tensors share one action), in forward order."""

    name: str
    fwd_s: float
    bwd_s: float
    input_bytes: int = 0  # what stays resident when the unit is checkpointed
    grad_bytes: int = 0  # parameter gradients its backward allocates
    recomputable: bool = True
    ops: list[OpProfile] = field(default_factory=list)  # empty: no selective recompute
    selective: bool = True  # selective recompute allowed (no in-place op on a cached output)


@dataclass
class Bandwidth:
    """Bytes per second of each copy channel, measured on this machine."""

    d2h: float
    h2d: float
    h2disk: float
    disk2h: float
    issue_s: float = 0.0  # compute-thread seconds to start one asynchronous move
    # host <-> remote memory pool (other Ray nodes' RAM); 0.0: no pool was given, no remote tier
    h2remote: float = 0.0
    remote2h: float = 0.0

    @property
    def remote(self) -> bool:
        """Whether the remote channels were measured (a plan may use the remote tier)."""
        return self.h2remote > 0 and self.remote2h > 0

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
    inflight_bytes: int | None = None  # the offloader's bound on bytes in flight (None: none)
    host_budget: int | None = None  # host bytes the host tier may use (None: no limit)
    measured_peak_bytes: int | None = None  # of the profiled iteration itself
    measured_step_s: float | None = None
    # the measured iterations the simulator is calibrated on (see planner.profiler.calibrate):
    # {"kind", "kept": [unit names kept, the rest on "tier"], "parts": {unit: [ordinals of the
    #  tensors it kept]} (of other units), "tier", "peak_bytes", "step_s", "timed_step": whether
    #  step_s may calibrate move costs}
    passes: list[dict] = field(default_factory=list)
    sac_op_s: float = 0.0  # compute seconds selective checkpointing adds per operator and pass
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
        return fold_sum(u.fwd_s + u.bwd_s for u in self.units) + self.other_fwd_s + self.other_bwd_s

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
        d["units"] = [
            UnitProfile(**{**u, "ops": [OpProfile(**o) for o in u.get("ops", [])]})
            for u in d["units"]
        ]
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
        """The profile :meth:`save` wrote at ``path``; a file that cannot be read or is not a
        profile (truncated, foreign JSON) is a typed error naming it, not a bare KeyError."""
        from tensortier.errors import ConfigError, CorruptDataError, TensortierError

        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(
                f"profile {path!r} cannot be read ({exc.strerror or exc}); pass the JSON file "
                "that Profile.save or `tensortier plan --save-profile` wrote"
            ) from exc
        except ValueError as exc:  # not UTF-8
            raise CorruptDataError(f"profile {path!r} is not text ({exc})", path=path) from exc
        try:
            return cls.from_json(text)
        except TensortierError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptDataError(
                f"profile {path!r} is not a tensortier profile or is damaged "
                f"({type(exc).__name__}: {exc}); profile again and save it with --save-profile",
                path=path,
            ) from exc


def measure_bandwidth(
    spill_dir: str | None = None,
    *,
    nbytes: SizeLike = "64MiB",
    chunk: SizeLike = "16MiB",
    resident: SizeLike | None = None,
    device: torch.device | str | None = None,
    io_threads: int = 4,
) -> Bandwidth:
    """Measures every copy channel with real transfers of ``nbytes`` in ``chunk``-sized tensors.

    Device<->host through :class:`TransferEngine` (a memcpy on CPU), host<->disk through
    :class:`DiskStore` in a private directory under ``spill_dir`` that is removed afterwards.
    At most ``resident`` bytes of chunks (default ``nbytes``) exist at once: the same chunks
    travel in rounds, so the probe fits a small memory budget and still moves ``nbytes``.
    One untimed round first: first-touch page faults, the disk slab's allocation and CUDA's
    ``cudaMalloc`` are not bandwidth. The disk store gets ``io_threads``, the I/O threads of the
    offloader whose moves the bandwidth prices: four threads measured 4 MiB chunks faster than
    the one thread a small CPU budget runs with (issue 27).
    """
    from tensortier._device import check_device
    from tensortier.tiers.disk import DiskStore
    from tensortier.tiers.host import HostPool
    from tensortier.transfer import TransferEngine

    total = parse_size(nbytes, name="nbytes", allow_zero=False)
    size = min(total, parse_size(chunk, name="chunk", allow_zero=False))
    n = max(1, total // size)
    keep = n if resident is None else parse_size(resident, name="resident", allow_zero=False)
    k = max(1, min(n, keep // size))  # chunks alive at once
    rounds = max(1, n // k)
    dev = check_device(device)
    gen = torch.Generator(device=dev).manual_seed(0)  # never the training's RNG (dropout masks)
    src = [
        torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev, generator=gen)
        for _ in range(k)
    ]
    moved = rounds * k * size
    with (
        HostPool(2 * k * size + (16 << 20)) as pool,
        DiskStore(spill_dir, owner="tt-plan", io_threads=io_threads) as disk,
    ):
        eng = TransferEngine(host=pool, disk=disk, device=dev)
        try:
            for h in _wait([eng.to_host(t) for t in src]):  # maps the pool's pages
                h.free()
            issue_s, d2h_s, hosts = _time_d2h(eng, src, rounds)
            h2d_s = _time_h2d(eng, hosts, rounds, dev)
            h2disk_s, disk2h_s = _time_disk(disk, hosts, rounds)
            for h in hosts:
                h.free()
        finally:
            eng.close()
    return Bandwidth(
        d2h=moved / d2h_s,
        h2d=moved / h2d_s,
        h2disk=moved / h2disk_s,
        disk2h=moved / disk2h_s,
        issue_s=issue_s / (rounds * k),
    )


def _wait(futures) -> list:
    """The results of a probe's transfers; a stuck disk or device raises instead of hanging."""
    return [f.result(timeout=PROBE_TIMEOUT_S) for f in futures]


def _time_d2h(eng, src: list[torch.Tensor], rounds: int) -> tuple[float, float, list]:
    """Seconds issuing and completing ``rounds`` of device-to-host copies of ``src``, and the
    host copies of the last round (kept: the other channels move them)."""
    issue_s = d2h_s = 0.0
    hosts: list = []
    for r in range(rounds):
        t0 = time.perf_counter()
        futs = [eng.to_host(t) for t in src]
        issue_s += time.perf_counter() - t0
        hosts = _wait(futs)
        d2h_s += time.perf_counter() - t0
        if r + 1 < rounds:
            for h in hosts:
                h.free()
    return issue_s, d2h_s, hosts


def _time_h2d(eng, hosts: list, rounds: int, dev: torch.device) -> float:
    """Seconds of ``rounds`` of host-to-device copies of ``hosts``, after one untimed round (the
    destinations' ``cudaMalloc``). On CUDA ``result()`` of a device-bound move only makes the
    current stream wait on the copy's event: synchronize before reading the clock, or the issue
    time is measured instead of the copy."""

    def sync() -> None:
        if dev.type == "cuda":  # bounded: the copies this probe issued
            torch.cuda.synchronize(dev)

    h2d_s = 0.0
    for r in range(rounds + 1):
        sync()
        t0 = time.perf_counter()
        backs = _wait([eng.to_device(h, free=False) for h in hosts])
        sync()
        if r:
            h2d_s += time.perf_counter() - t0
        del backs
    return h2d_s


def _time_disk(disk, hosts: list, rounds: int) -> tuple[float, float]:
    """Seconds of ``rounds`` of writes of ``hosts`` to ``disk`` (after one untimed round: the
    slab file is allocated) and of ``rounds`` of reads back into them."""
    h2disk_s = disk2h_s = 0.0
    handles: list = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        new = _wait([disk.put(h.tensor) for h in hosts])
        if r:
            h2disk_s += time.perf_counter() - t0
        for hd in handles:
            disk.free(hd)
        handles = new
    for _ in range(rounds):
        t0 = time.perf_counter()
        _wait([disk.get(hd, into=h.tensor) for hd, h in zip(handles, hosts)])
        disk2h_s += time.perf_counter() - t0
    for hd in handles:
        disk.free(hd)
    return h2disk_s, disk2h_s


def measure_remote_bandwidth(
    store,
    *,
    nbytes: SizeLike = "64MiB",
    chunk: SizeLike = "16MiB",
    resident: SizeLike | None = None,
) -> tuple[float, float]:
    """``(h2remote, remote2h)`` bytes per second of a :class:`RemoteStore`, measured as
    :func:`measure_bandwidth` measures the disk: ``nbytes`` in ``chunk``-sized tensors, at most
    ``resident`` bytes of them alive at once (the same chunks travel in rounds), one untimed
    round first (the memory nodes' first objects, Ray's connections). At most half the store's
    free budget is used, so the probe never fills a pool the training needs."""
    total = parse_size(nbytes, name="nbytes", allow_zero=False)
    free = max(1 << 20, (store.stats.budget_bytes - store.stats.used_bytes) // 2)
    size = min(total, free, parse_size(chunk, name="chunk", allow_zero=False))
    n = max(1, total // size)
    keep = n * size if resident is None else parse_size(resident, name="resident")
    k = max(1, min(n, keep // size, free // size))  # chunks alive at once
    rounds = max(1, n // k)
    gen = torch.Generator().manual_seed(0)  # never the training's RNG (dropout masks)
    src = [torch.randint(0, 255, (size,), dtype=torch.uint8, generator=gen) for _ in range(k)]
    moved = rounds * k * size
    put_s = get_s = 0.0
    for r in range(rounds + 1):  # round 0 untimed
        t0 = time.perf_counter()
        handles = _wait([store.put(t) for t in src])
        if r:
            put_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        _wait([store.get(h, into=t) for h, t in zip(handles, src)])
        if r:
            get_s += time.perf_counter() - t0
        for h in handles:
            store.free(h)
    return moved / put_s, moved / get_s


def measure_codec_speeds(
    names: tuple[str, ...] | None = None, nbytes: int = 4 << 20
) -> dict[str, CodecSpeed]:
    """Codec throughput on this machine (a post-ReLU-like fp32 sample of ``nbytes``; every
    codec unless ``names``)."""
    return measure_codecs(nbytes=nbytes) if names is None else measure_codecs(names, nbytes=nbytes)
