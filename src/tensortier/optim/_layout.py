"""How parameters map onto optimizer state: param groups -> buckets -> slots.

A bucket is a run of parameters of one param group, device and master dtype, up to
``bucket_size`` bytes of master state, taken in reverse registration order (roughly the order
backward produces their gradients). Its state is three flat vectors (``_states.py``); a *slot* is
one parameter's range in them, starting on a 64-byte boundary (``_states.slot_layout``), plus the
parameter's step counter and the bookkeeping the step needs. Sharded across ranks (``_zero.py``)
a bucket holds only this rank's pieces of its parameters (``_shard.partition``); under FSDP2
slots cover the parameters' local shards (``_dtensor.py``).

Also here: the param-group checks (what the fused CPU kernel can do, ``TORCH_KEYS``) and the
hyper-parameters a bucket update reads. This module never runs an update, never reads a gradient
on its own and never writes a parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from tensortier.errors import ConfigError
from tensortier.optim._dtensor import local
from tensortier.optim._shard import ALIGN, GatherPlan, partition
from tensortier.optim._states import slot_layout

# Param-group keys of torch 2.13's AdamW, with the values that describe this optimizer (the fused
# kernel). Emitted by ``state_dict()`` so ``torch.optim.AdamW(fused=True).load_state_dict`` keeps
# ``fused`` on (it replaces its groups with the loaded ones).
TORCH_KEYS = {
    "amsgrad": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


def check_hyper(group: dict, where: str = "param group") -> None:
    """Refuse what ``torch.optim.AdamW`` refuses (lr, betas, eps, weight_decay), in every group:
    torch checks only its defaults, and a group's negative lr would quietly climb the loss."""
    for key in ("lr", "eps", "weight_decay"):
        value = group.get(key, 0.0)
        if not _real(value) or not float(value) >= 0.0:
            what = "learning rate lr" if key == "lr" else key
            raise ConfigError(f"{where}: invalid {what}={value!r}: pass a number >= 0")
    betas = group.get("betas", (0.0, 0.0))
    if (
        isinstance(betas, (str, bytes))
        or len(betas) != 2
        or not all(_real(b) and 0.0 <= float(b) < 1.0 for b in betas)
    ):
        raise ConfigError(f"{where}: invalid betas={betas!r}: pass two numbers, each in [0, 1)")


def _real(value: object) -> bool:
    """A real number or a one-element tensor (torch allows a tensor lr), not a str or a bool."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_group(group: dict, where: str = "param group", *, loaded: bool = False) -> None:
    """Refuse what the fused CPU AdamW cannot do; then state what it is (``TORCH_KEYS``).

    A group the user passes may not ask for another implementation (``foreach=True``,
    ``fused=False``): its results would not be what was asked for. A loaded state dict's groups
    may (any ``torch.optim.AdamW`` variant's state loads)."""
    check_hyper(group, where)
    for key in ("amsgrad", "capturable", "differentiable"):
        if group.get(key):
            raise ConfigError(
                f"{where} has {key}=True; OffloadedAdamW does not offer {key} (it runs the "
                f"fused AdamW kernel on CPU state): use torch.optim.AdamW for that run"
            )
    if not loaded and (group.get("foreach") or group.get("fused", True) is False):
        raise ConfigError(
            f"{where} has foreach={group.get('foreach')!r}, fused={group.get('fused')!r}; "
            "OffloadedAdamW always runs the fused AdamW kernel (the results of "
            "torch.optim.AdamW(fused=True)): pass foreach=None and fused=None or True, or use "
            "torch.optim.AdamW for another implementation"
        )
    if group.get("decoupled_weight_decay") is False and group.get("weight_decay", 0) != 0:
        raise ConfigError(
            f"{where} has decoupled_weight_decay=False (torch.optim.Adam's L2 penalty); "
            "OffloadedAdamW is AdamW: use torch.optim.Adam, or weight_decay=0"
        )
    group.update(TORCH_KEYS)


def check_params(gi: int, params: list[torch.Tensor]) -> None:
    """Refuse parameters the kernel cannot update, and one listed twice (torch only warns, then
    steps it twice per ``step()``; it would get two states here)."""
    if len({id(p) for p in params}) != len(params):
        raise ConfigError(
            f"param group {gi} lists a parameter more than once: pass each parameter once "
            "(e.g. list(dict.fromkeys(params)))"
        )
    for p in params:
        if not p.is_floating_point():
            raise ConfigError(f"OffloadedAdamW optimizes floating-point tensors, got {p.dtype}")
        if p.is_sparse:
            raise ConfigError("OffloadedAdamW does not support sparse parameters")


@dataclass(frozen=True)
class Hyper:
    """A param group's AdamW hyper-parameters, read on the caller's thread (never the worker's:
    loops set ``lr`` between backward and step, and the worker must not race that)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool

    @staticmethod
    def of(group: dict) -> Hyper:
        beta1, beta2 = group["betas"]
        return Hyper(
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group.get("maximize", False)),
        )


@dataclass(eq=False)
class Slot:
    """One parameter inside a bucket's flat state."""

    param: torch.Tensor
    index: int  # position in the bucket
    offset: int
    numel: int
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    version: int = -1  # param._version after our last write; -1: master never seeded
    count: int = 0  # gradients accumulated since the last step()
    has_state: bool = False  # like torch: state exists once a step() saw a gradient for it
    start: int = 0  # sharded: first flat element of the parameter this rank owns
    local: torch.Tensor | None = None  # what the update writes: the parameter, or its DTensor shard

    def __post_init__(self) -> None:
        if self.local is None:
            self.local = local(self.param)

    @functools.cached_property
    def whole(self) -> bool:
        """The slot covers its parameter's local tensor (fixed at construction)."""
        return self.start == 0 and self.numel == self.local.numel()

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This slot's elements of ``t`` (a local tensor: the parameter's data, or its gradient)."""
        return t if self.whole else t.reshape(-1)[self.start : self.start + self.numel]

    def tensor(self) -> torch.Tensor:
        """The parameter data this slot updates (detached; a DTensor's local shard)."""
        return self.view(self.local.detach())

    @property
    def data_version(self) -> int:
        """Moves with every in-place change of the parameter's data. A DTensor (FSDP2) has two
        counters: an in-place op on the DTensor (``p.mul_()``, ``load_state_dict``,
        ``nn.init``) bumps only its own, a write to its local shard (ours) only the shard's."""
        v = self.local._version
        return v if self.local is self.param else v + self.param._version

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else self.view(local(g))


@dataclass(eq=False)
class Bucket:
    id: int
    group: int
    dtype: torch.dtype  # of the master state
    device: torch.device
    slots: list[Slot]
    numel: int
    trainable: int
    plan: GatherPlan | None = None  # sharded: every rank's pieces of this bucket's parameters
    in_place: bool = False  # the parameters are the masters: updated in place, never copied back


def _own_master(s: Slot, b: Bucket) -> bool:
    """Whether the slot's parameter can be its own master: a whole, dense CPU tensor of the master
    dtype (not a piece of a sharded parameter, not an FSDP2 shard), updated in place by the kernel
    exactly as ``torch.optim.AdamW(fused=True)`` updates it."""
    p = s.param
    return (
        s.local is p
        and s.whole
        and p.device.type == "cpu"
        and p.dtype == b.dtype
        and p.layout == torch.strided
        and p.is_contiguous()
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Layout:
    """Every bucket of the optimizer, where each parameter's slot is, and the bucket order.

    ``world`` > 1: sharded (ZeRO), this is rank ``rank``'s part. ``order`` is the order step()
    visits buckets: registration order until the speculator learns the order backward makes
    them ready (``_speculation.py``).
    """

    def __init__(self, bucket_bytes: int, master_weights: bool, *, world: int = 1, rank: int = 0):
        self.bucket_bytes = bucket_bytes
        self.master_weights = master_weights
        self.world, self.rank = world, rank
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[Slot, Bucket]] = {}  # id(param) -> its slot and bucket
        self.order: list[int] = []
        self._load = [0] * world  # bytes of state per rank, to balance whole parameters

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def master_dtype(self, p: torch.Tensor) -> torch.dtype:
        if p.dtype in (torch.float32, torch.float64) or not self.master_weights:
            return p.dtype
        return torch.float32

    def slots(self) -> Iterable[Slot]:
        return (s for b in self.buckets for s in b.slots)

    def ordered(self) -> list[Bucket]:
        return [self.buckets[i] for i in self.order]

    def add_group(self, gi: int, group: dict, states) -> None:
        """Check param group ``gi`` and lay its parameters out in new buckets of ``states``."""
        check_group(group)
        params = group["params"]
        check_params(gi, params)
        for chunk in self._chunks(params):
            b = self._bucket(gi, chunk)
            b.in_place = (
                not self.sharded  # sharded: the all-gather reads this rank's masters
                and states.params_as_masters
                and all(_own_master(s, b) for s in b.slots)
            )
            self.buckets.append(b)
            if b.numel:
                states.add(b.id, b.numel, b.dtype, master=not b.in_place)
            for s in b.slots:
                self.where[id(s.param)] = (s, b)
        self.order = [b.id for b in self.buckets]

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Runs of parameters (reversed) of one device and master dtype, up to bucket_bytes."""
        current: list[torch.Tensor] = []
        used = 0
        for p in reversed(params):  # backward produces gradients roughly in reverse order
            dtype = self.master_dtype(p)
            nbytes = local(p).numel() * _itemsize(dtype)
            if current and (
                used + nbytes > self.bucket_bytes
                or dtype != self.master_dtype(current[0])
                or p.device != current[0].device
            ):
                yield current
                current, used = [], 0
            current.append(p)
            used += nbytes
        if current:
            yield current

    def _bucket(self, gi: int, params: list[torch.Tensor]) -> Bucket:
        dtype = self.master_dtype(params[0])
        es = _itemsize(dtype)
        plan = None
        if self.sharded:  # this rank's pieces of the bucket (PROTOCOL.md, "Sharded")
            pieces = partition(params, self.world, ALIGN // es, self._load, es)
            plan = GatherPlan(list(params), pieces)
            mine = pieces[self.rank]
            offsets, total = slot_layout([pc.numel for pc in mine], es)
            slots = [
                Slot(params[pc.index], k, off, pc.numel, start=pc.start)
                for k, (pc, off) in enumerate(zip(mine, offsets))
            ]
        else:
            locals_ = [local(q) for q in params]  # FSDP2: the local shards
            offsets, total = slot_layout([q.numel() for q in locals_], es)
            slots = [
                Slot(q, i, off, lq.numel(), local=lq)
                for i, (q, lq, off) in enumerate(zip(params, locals_, offsets))
            ]
        return Bucket(
            id=len(self.buckets),
            group=gi,
            dtype=dtype,
            device=params[0].device,
            slots=slots,
            numel=total,
            trainable=sum(s.param.requires_grad for s in slots),
            plan=plan,
        )
