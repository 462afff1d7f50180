"""Parameter streaming: parameters live on host RAM or disk and visit the device per module.

A *unit* is a module that owns parameters directly. Between uses, each of its parameters holds a
NaN placeholder of the right shape (one element, expanded), so autograd, ``.grad`` and optimizers
still see the parameter's shape, and any use outside the owning module's forward fails loudly
instead of silently computing with stale values. A forward pre-hook installs the unit's real
values (prefetched while the previous unit ran), a forward hook puts the placeholders back.
Autograd would keep the installed tensors alive until backward; a saved-tensors hook replaces
them by a token, and backward loads the parameter again (prefetching the unit before it) when the
token is unpacked. Values are copied, never recomputed, so outputs and gradients are bit-identical
to the resident model.

This module owns the parameter tensors' storage only; it never changes gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from tensortier._units import SizeLike, format_size, parse_size
from tensortier.errors import BudgetError, ClosedError, ConfigError
from tensortier.tiers.disk import DiskHandle, DiskStore


class ParamTier(str, Enum):
    """Where streamed parameters live between uses."""

    HOST = "host"
    DISK = "disk"


@dataclass
class StreamStats:
    loads: int = 0  # unit loads (forward and backward)
    prefetch_hits: int = 0  # loads served by a prefetch already in flight
    bytes_loaded: int = 0
    peak_resident_bytes: int = 0  # most parameter bytes installed or prefetched at once


@dataclass(eq=False)
class _Unit:
    index: int
    module: nn.Module
    names: list[str]
    params: list[nn.Parameter]
    nbytes: int
    homes: list = field(default_factory=list)  # host tensors or DiskHandles
    placeholders: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class _Token:
    unit: int
    slot: int
    shape: tuple
    stride: tuple
    offset: int  # relative to the parameter's own storage offset


class ParameterStreamer:
    """Handle returned by :func:`stream_parameters`; ``close()`` makes the model resident again."""

    def __init__(
        self,
        model: nn.Module,
        *,
        budget: SizeLike | None,
        tier: ParamTier | str,
        device: torch.device | str | None,
        spill_dir: str | None,
    ):
        try:
            self.tier = ParamTier(tier)
        except ValueError:
            raise ConfigError(
                f"tier={tier!r} is not a parameter tier; pass one of {[t.value for t in ParamTier]}"
            ) from None
        self.model = model
        self.units: list[_Unit] = []
        for m in model.modules():
            named = [(n, p) for n, p in m._parameters.items() if p is not None]
            if named:
                nbytes = sum(p.numel() * p.element_size() for _, p in named)
                self.units.append(
                    _Unit(len(self.units), m, [n for n, _ in named], [p for _, p in named], nbytes)
                )
        if not self.units:
            raise ConfigError("the model has no parameters to stream")
        first = self.units[0].params[0]
        self.device = torch.device(device) if device is not None else first.device
        largest = max(u.nbytes for u in self.units)
        self.budget = (
            2 * largest if budget is None else parse_size(budget, name="budget", allow_zero=False)
        )
        if self.budget < largest:
            raise BudgetError(
                f"parameter budget {format_size(self.budget)} cannot hold the largest module's "
                f"parameters ({format_size(largest)}); raise budget to at least that, or split "
                f"the module",
                budget=self.budget,
                minimum=largest,
            )
        self.stats = StreamStats()
        self._store = (
            DiskStore(spill_dir, owner="tensortier-params") if self.tier is ParamTier.DISK else None
        )
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tt-params")
        self._pending: dict[int, Future] = {}
        self._installed: dict[int, tuple[int, list[torch.Tensor]]] = {}  # storage ptr -> unit
        self._live_bytes = 0
        self._hooks = []
        self._saved_ctx = None
        self._depth = 0
        self._last: tuple[int, list[torch.Tensor]] | None = None
        with torch.no_grad():
            for u in self.units:
                for p in u.params:
                    if self._store is not None:
                        u.homes.append(self._store.write(p.detach().cpu()))
                    else:
                        home = p.detach().to("cpu", copy=True)
                        if self.device.type == "cuda":
                            home = home.pin_memory()
                        u.homes.append(home)
                    ph = torch.full((1,), float("nan"), dtype=p.dtype, device=self.device)
                    u.placeholders.append(ph.expand(p.shape))
                    p.data = u.placeholders[-1]
                self._hooks.append(u.module.register_forward_pre_hook(self._make_pre(u)))
                self._hooks.append(u.module.register_forward_hook(self._make_post(u)))
        self._hooks.append(model.register_forward_pre_hook(self._enter))
        self._hooks.append(model.register_forward_hook(self._exit))

    # ------------------------------------------------------------ loading
    def _fetch(self, u: _Unit) -> list[torch.Tensor]:
        out = []
        for home in u.homes:
            if isinstance(home, DiskHandle):
                t = self._store.read(home)
                out.append(t.to(self.device) if self.device.type != "cpu" else t)
            else:
                out.append(home.to(self.device, non_blocking=True, copy=True))
        return out

    def _prefetch(self, index: int) -> None:
        if not 0 <= index < len(self.units) or index in self._pending:
            return
        u = self.units[index]
        if self._live_bytes + u.nbytes > self.budget:
            return
        self._live_bytes += u.nbytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self._live_bytes)
        self._pending[index] = self._loader.submit(self._fetch, u)

    def _load(self, u: _Unit) -> list[torch.Tensor]:
        fut = self._pending.pop(u.index, None)
        if fut is not None:
            self.stats.prefetch_hits += 1
            self._live_bytes -= u.nbytes
            tensors = fut.result()
        else:
            tensors = self._fetch(u)
        self.stats.loads += 1
        self.stats.bytes_loaded += u.nbytes
        return tensors

    # ------------------------------------------------------------ hooks
    def _make_pre(self, u: _Unit):
        def pre(module, args):
            tensors = self._load(u)
            for p, t in zip(u.params, tensors):
                p.data = t
                self._installed[t.untyped_storage().data_ptr()] = (u.index, p)
            self._live_bytes += u.nbytes
            self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self._live_bytes)
            self._prefetch(u.index + 1)

        return pre

    def _make_post(self, u: _Unit):
        def post(module, args, output):
            for p, ph in zip(u.params, u.placeholders):
                self._installed.pop(p.data.untyped_storage().data_ptr(), None)
                p.data = ph
            self._live_bytes -= u.nbytes

        return post

    def _enter(self, module, args) -> None:
        self._depth += 1
        if self._depth == 1:
            self._last = None
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_ctx.__enter__()

    def _exit(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0 and self._saved_ctx is not None:
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = None

    def _pack(self, t: torch.Tensor):
        if t.device != self.device or not self._installed:
            return t
        hit = self._installed.get(t.untyped_storage().data_ptr())
        if hit is None:
            return t
        unit, p = hit
        slot = next(i for i, q in enumerate(self.units[unit].params) if q is p)
        rel = t.storage_offset() - p.data.storage_offset()
        return _Token(unit, slot, tuple(t.shape), tuple(t.stride()), rel)

    def _unpack(self, x):
        if not isinstance(x, _Token):
            return x
        u = self.units[x.unit]
        if self._last is not None and self._last[0] == x.unit:
            tensors = self._last[1]  # another saved view of the unit just loaded
        else:
            tensors = self._load(u)
            self._last = (x.unit, tensors)
            self._prefetch(x.unit - 1)  # backward runs the units in reverse
        base = tensors[x.slot]
        return base.as_strided(x.shape, x.stride, base.storage_offset() + x.offset)

    # ------------------------------------------------------------ resident views
    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Install every parameter for the block (e.g. around ``optimizer.step()``), then store
        the possibly updated values back to their tier."""
        self._check_open()
        self._drop_prefetch()  # they hold values from before the update
        with torch.no_grad():
            for u in self.units:
                for p, t in zip(u.params, self._fetch(u)):
                    p.data = t
            try:
                yield
            finally:
                for u in self.units:
                    for i, p in enumerate(u.params):
                        if self._store is not None:
                            new = self._store.write(p.detach().cpu())
                            self._store.free(u.homes[i])
                            u.homes[i] = new
                        else:
                            u.homes[i].copy_(p.detach())
                        p.data = u.placeholders[i]

    def _drop_prefetch(self) -> None:
        for index, fut in list(self._pending.items()):
            fut.exception()
            self._live_bytes -= self.units[index].nbytes
        self._pending.clear()
        self._last = None

    def _check_open(self) -> None:
        if self._loader is None:
            raise ClosedError("this ParameterStreamer is closed")

    def close(self) -> None:
        """Make the model resident on ``device`` again and remove every hook and file."""
        if self._loader is None:
            return
        self._drop_prefetch()
        with torch.no_grad():
            for u in self.units:
                for p, t in zip(u.params, self._fetch(u)):
                    p.data = t
        for h in self._hooks:
            h.remove()
        self._loader.shutdown(wait=True)
        self._loader = None
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> ParameterStreamer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_parameters(
    model: nn.Module,
    budget: SizeLike | None = None,
    *,
    tier: ParamTier | str = ParamTier.HOST,
    device: torch.device | str | None = None,
    spill_dir: str | None = None,
) -> ParameterStreamer:
    """Keep ``model``'s parameters on host RAM (or disk) and bring each module's parameters to
    ``device`` only for its forward and backward, prefetching the next module within ``budget``
    bytes of installed parameters (default: twice the largest module). Outputs and gradients are
    identical to the resident model. Wrap optimizer steps in ``with streamer.resident():``.
    """
    return ParameterStreamer(model, budget=budget, tier=tier, device=device, spill_dir=spill_dir)
