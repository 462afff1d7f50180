"""Runs a plan: the offloader's ``decide`` callable plus ``torch.utils.checkpoint`` on chosen units.

``tt.offload(budget="6GiB", spill_dir=...)`` returns a :class:`PlannedOffload`. Used like the
plain offloader (``with off: loss = model(x)`` then ``loss.backward()``), it

1. warms up (``warmup`` iterations with every saved tensor on the profiled tier, see
   :func:`profiled_tier`: first-touch page faults, lazy initialisation and thread start-up are
   not the model's cost),
2. profiles the next iteration (:class:`Profiler`: every saved tensor, its sparsity and codec
   ratios), then times ``timing_iters`` clean iterations (one with nothing offloaded when it fits
   in free memory, one with everything on the profiled tier: they calibrate the simulator),
   measures the tier bandwidths under a forked RNG (training draws the same dropout masks as
   without the planner), and
3. from the following iteration on runs the plan the policy chose: the saved tensors of each
   unit go where the plan says (with the codec it chose per tensor), and units chosen for
   recompute have their ``forward`` wrapped in non-reentrant ``torch.utils.checkpoint``
   (restored by :meth:`PlannedOffload.close`).

It raises :class:`BudgetError` (with ``.minimum``) at step 3 when no plan fits the budget. On a
CPU-only machine it sets glibc's mmap threshold (``release_freed_memory``) so that activations
freed by the plan leave the process's RSS, which is what a CPU budget measures.
This module never moves bytes itself: the activation offloader does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensortier import _dist
from tensortier._units import SizeLike, format_size, parse_size
from tensortier.planner.policies import Choice, Options, choose, plan_all
from tensortier.planner.profile import Bandwidth, Profile
from tensortier.planner.profiler import Profiler, calibrate, plan_units, unit_of
from tensortier.planner.simulator import Mode, Plan
from tensortier.tiers.codecs import get_codec

log = logging.getLogger(__name__)


def default_prefetch(budget: int) -> int:
    """Read-ahead window for a budget: an eighth of it, between 8 MiB and 256 MiB."""
    return int(min(256 << 20, max(8 << 20, budget // 8)))


def make_decide(profile: Profile, plan: Plan) -> Callable:
    """The offloader's ``decide``: per saved tensor, the action of its unit and its planned codec.

    Codecs were chosen per profiled tensor; at run time a tensor is matched by its unit and its
    ordinal within the unit (recomputed units' tensors are never seen, so ordinals elsewhere do
    not shift) and, as a guard, its byte size.
    """
    from tensortier.activations import Action

    units = [u.name for u in profile.units]
    by_ordinal: dict[tuple[str, int], tuple[int, str | None]] = {}
    counts: dict[str, int] = {}
    for t in profile.tensors:
        k = counts.get(t.unit, 0)
        counts[t.unit] = k + 1
        by_ordinal[(t.unit, k)] = (t.nbytes, plan.codecs.get(t.index))
    codecs = {name: get_codec(name) for name in set(plan.codecs.values()) if name}
    seen: dict[str, int] = {}

    def decide(info) -> Action:
        if info.index == 0:
            seen.clear()  # a new forward
        unit = unit_of(info.module, units)
        k = seen.get(unit, 0)
        seen[unit] = k + 1
        action = plan.action(unit)
        if action.mode not in (Mode.HOST, Mode.DISK):
            return Action("keep")
        nbytes, codec = by_ordinal.get((unit, k), (None, None))
        use = codecs.get(codec) if codec and nbytes == info.nbytes else None
        return Action(action.mode.value, use)

    return decide


class Recompute:
    """Wraps the forward of the plan's recompute units in non-reentrant checkpoint; undoable."""

    def __init__(self, root: nn.Module, names: list[str]):
        units = plan_units(root)
        self._wrapped: list[nn.Module] = []
        for name in names:
            module = units.get(name)
            if module is None:
                continue
            original = module.forward

            def forward(*args, _f=original, **kwargs):
                if torch.is_grad_enabled():
                    return checkpoint(_f, *args, use_reentrant=False, **kwargs)
                return _f(*args, **kwargs)

            module.forward = forward
            self._wrapped.append(module)

    def remove(self) -> None:
        for module in self._wrapped:
            if "forward" in module.__dict__:
                del module.forward
        self._wrapped = []


def profiled_tier(to: str, device: torch.device) -> str:
    """The tier the warm-up and profiling iterations offload to: the one the user asked for;
    for ``"auto"``, host on CUDA (the fast tier a plan fills first) and disk on a CPU-only
    machine (where host RAM *is* the device memory, so only disk keeps profiling in budget)."""
    if to in ("host", "disk"):
        return to
    return "host" if device.type == "cuda" else "disk"


@dataclass
class PlanConfig:
    budget: int
    policy: str = "auto"
    to: str = "auto"  # the tiers the plan may use: "host", "disk" or "auto" (both)
    spill_dir: str | None = None
    warmup: int = 1
    timing_iters: int = 2  # clean timing passes after the probe (see Profiler)
    prefetch: int | None = None  # None: default_prefetch(budget)
    host_budget: int = 8 << 30
    options: Options | None = None
    bandwidth: Bandwidth | None = None
    report: str | None = None  # write an HTML report of the chosen plan here


class PlannedOffload:
    """A budget-driven offloader; see the module docstring."""

    def __init__(self, config: PlanConfig):
        if config.prefetch is None:
            config.prefetch = default_prefetch(config.budget)
        self.config = config
        self._rss0: int | None = None
        self._overhead = 0
        self.iteration = 0
        self.profile: Profile | None = None
        self.choice: Choice | None = None
        self.offloader = None
        self._profiler: Profiler | None = None
        self._warm = None
        self._recompute: Recompute | None = None
        self._root: nn.Module | None = None
        self._active = None
        self._root_hook = None
        self._profiled = 0  # profiler passes run: the probe, then the timing passes
        self._closed = False

    # the outermost module run in the forward is the model the plan's unit names refer to
    def _catch_root(self, module: nn.Module, args) -> None:
        if self._root is None:
            self._root = module

    def __enter__(self) -> PlannedOffload:
        from tensortier.activations import Offloader

        cfg = self.config
        if self._closed:
            from tensortier.errors import ClosedError

            raise ClosedError(
                "this planned offload is closed (close() was called, or tt.offload() was called "
                "with other settings, which releases the previous one); call "
                "tt.offload(budget=...) again"
            )
        if self.profile is None and self._profiled > cfg.timing_iters:
            self._finish_profile()
        if self.iteration < cfg.warmup:
            if self._rss0 is None and not torch.cuda.is_available():
                from tensortier._device import rss_bytes
                from tensortier.planner.profiler import release_freed_memory

                release_freed_memory()  # else RSS never drops below the plain peak

                self._rss0 = rss_bytes()
            if self._warm is None:
                tier = self._tier()
                self._warm = Offloader(
                    # "auto": a host tier that is full spills to disk instead of failing
                    "disk" if tier == "disk" else ("host" if cfg.to == "host" else "auto"),
                    spill_dir=cfg.spill_dir,
                    decide=lambda info: tier,
                    prefetch=cfg.prefetch,
                    host_budget=cfg.host_budget,
                )
            self._root_hook = nn.modules.module.register_module_forward_pre_hook(self._catch_root)
            self._active = self._warm
            self._warm.__enter__()
        elif self.profile is None and self._profiler is not None:  # a timing pass
            self._active = self._profiler.timing()
            self._active.__enter__()
        elif self.profile is None:
            if self._rss0 is not None:  # what the warm-up left behind: the offloader's buffers
                from tensortier._device import rss_bytes

                grads = sum(
                    p.grad.untyped_storage().nbytes()
                    for p in (self._root.parameters() if self._root is not None else [])
                    if p.grad is not None
                )
                self._overhead = max(0, rss_bytes() - self._rss0 - grads)
            self._profiler = Profiler(
                offloader=self._warm,
                tier=self._tier(),
                spill_dir=cfg.spill_dir,
                bandwidth=cfg.bandwidth,
                allow_lossy=bool(cfg.options and cfg.options.allow_lossy),
                prefetch=cfg.prefetch,
                host_budget=cfg.host_budget,
            )
            self._active = self._profiler.forward()
            self._active.__enter__()
        else:
            self._active = self.offloader
            self.offloader.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        active, self._active = self._active, None
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None
        if active is not None:
            active.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.iteration += 1
            if self.profile is None and active is not self._warm:
                self._profiled += 1

    def _tier(self) -> str:
        from tensortier._device import default_device

        return profiled_tier(self.config.to, default_device())

    def _finish_profile(self) -> None:
        from tensortier.planner.profiler import own_rng

        with own_rng(self._profiler.device):  # nothing here may move the training's RNG
            self._plan()

    def _plan(self) -> None:
        cfg = self.config
        prof = self._profiler
        self.profile = calibrate(prof.finish(offload_overhead=self._overhead))
        root = prof.root

        self.choice = agreed_choice(self.profile, cfg)
        plan = self.choice.plan
        log.info(
            "tensortier plan %s: predicted peak %s, step %.3fs",
            plan.policy,
            format_size(self.choice.result.peak_bytes),
            self.choice.result.step_s,
        )
        if cfg.report and _dist.rank() == 0:
            from tensortier.planner.report import write_report

            write_report(
                cfg.report,
                self.profile,
                self.choice,
                plan_all(self.profile, cfg.budget, cfg.options),
                budget=cfg.budget,
            )
        from tensortier.activations import Offloader

        if prof.offloader is not None and prof.offloader is not self._warm:
            prof.offloader.close()
        self._recompute = Recompute(root, plan.recomputed()) if root is not None else None
        if self._warm is not None:  # same spill files and buffers; plan decides from now on
            self.offloader, self._warm = self._warm, None
            self.offloader.decide = make_decide(self.profile, plan)
            self.offloader.record, self.offloader.records = False, []
            if cfg.to != "host":  # host-only plans never go to disk
                self.offloader.to = "auto"  # host tier full: spill to disk
                self.offloader._attach_disk()
        else:
            self.offloader = Offloader(
                "host" if cfg.to == "host" else "auto",
                spill_dir=cfg.spill_dir,
                decide=make_decide(self.profile, plan),
                prefetch=cfg.prefetch,
                host_budget=cfg.host_budget,
            )

    @property
    def stats(self):
        return self.offloader.stats if self.offloader is not None else None

    def close(self) -> None:
        """Undo the checkpoint wrappers and release the offloaders' memory and files."""
        self._closed = True
        if self._recompute is not None:
            self._recompute.remove()
            self._recompute = None
        closed: list = []
        for off in (self.offloader, self._warm, self._profiler and self._profiler.offloader):
            if off is not None and all(off is not c for c in closed):
                off.close()
                closed.append(off)


def agreed_choice(profile: Profile, cfg: PlanConfig) -> Choice:
    """The plan, the same on every rank of ``torch.distributed`` (world > 1).

    Ranks that recompute different blocks run different collectives (FSDP's all-gathers in the
    recomputed forward) and can deadlock, so, as torchtitan does, one rank plans: the ranks first
    agree on the settings and on the profiled structure (a mismatch is ``ConfigError`` on every
    rank, naming the rank), rank 0 chooses, and the choice (or its ``BudgetError``) is broadcast.
    """
    if not _dist.active():
        return choose(profile, cfg.budget, cfg.policy, cfg.options)
    from tensortier.errors import BudgetError

    _dist.agree(
        {
            "budget": cfg.budget,
            "to": cfg.to,
            "policy": cfg.policy,
            "host_budget": cfg.host_budget,
            "spill_dir": cfg.spill_dir,
            "planning units": [u.name for u in profile.units],
            "saved tensors": [(t.unit, t.nbytes) for t in profile.tensors],
        },
        "tt.offload(budget=...)",
        fix="run the same model, batch shapes and offload settings on every rank",
    )
    sent: object = None
    if _dist.rank() == 0:
        try:
            sent = choose(profile, cfg.budget, cfg.policy, cfg.options)
        except BudgetError as exc:  # sent as values: every rank raises the same error
            sent = ("BudgetError", str(exc), exc.budget, exc.minimum)
    got = _dist.broadcast_object(sent, 0)
    if isinstance(got, tuple):
        _, message, budget, minimum = got
        raise BudgetError(f"rank 0 planned: {message}", budget=budget, minimum=minimum)
    return got


_CACHE: dict = {}


def planned_offload(
    budget: SizeLike,
    *,
    to: str = "auto",
    spill_dir: str | None = None,
    policy: str = "auto",
    warmup: int = 1,
    timing_iters: int = 2,
    prefetch: SizeLike | None = None,
    host_budget: SizeLike = "8GiB",
    options: Options | None = None,
    report: str | None = None,
    min_bytes: SizeLike | None = None,
) -> PlannedOffload:
    """``tt.offload(budget=...)``: profile, plan and run under a memory budget.

    ``to="host"`` restricts the plan to the host tier; ``"disk"`` or ``"auto"`` let it use host
    and disk (on a CPU-only machine, host only pays with a codec). ``min_bytes`` is ignored: the
    planner decides per tensor. Calls with the same settings return the same object, so a
    training loop can write ``with tt.offload(budget=...):`` every step.
    """
    from tensortier.errors import ConfigError

    if to not in ("host", "disk", "auto"):
        raise ConfigError(f"to must be 'host', 'disk' or 'auto', got {to!r}")
    opts = options or Options()
    if to == "host":
        opts = Options(**{**opts.__dict__, "tiers": ("host",)})
    config = PlanConfig(
        budget=parse_size(budget, name="budget", allow_zero=False),
        policy=policy,
        to=to,
        spill_dir=spill_dir,
        warmup=warmup,
        timing_iters=timing_iters,
        prefetch=None if prefetch is None else parse_size(prefetch, name="prefetch"),
        host_budget=parse_size(host_budget, name="host_budget", allow_zero=False),
        options=opts,
        report=report,
    )
    key = repr(config)
    cached = _CACHE.get(key)
    if cached is None or cached._active is not None:
        cached = PlannedOffload(config)
        # one cached configuration: switching settings releases the old one (its pinned host
        # pool, spill files and threads), unless it is running right now (nested use)
        for old in _CACHE.values():
            if old._active is None:
                old.close()
        _CACHE.clear()
        _CACHE[key] = cached
    return cached
