"""OffloadedAdamW: AdamW whose state and master weights live in host RAM or on NVMe.

Flow of one step. Parameters are grouped into buckets (reverse registration order, which is
roughly the order backward produces gradients). A ``register_post_accumulate_grad_hook`` on each
parameter counts its gradients. ``step()`` runs every bucket's CPU update (``torch._fused_adamw_``,
the kernel of ``torch.optim.AdamW(fused=True)``) on one worker thread, commits, and writes the
parameters back in their dtype. Parameters are never modified before ``step()``.

Speculation (``overlap=True``). The first step learns how many backward passes feed a step and
the order in which buckets become ready. From then on, when every trainable parameter of a bucket
has its final gradient, the hook *snapshots* the gradients (CUDA: D2H on a side stream into a
reusable pinned buffer; CPU: copied on the worker) and the worker runs the update on the snapshot
into a *shadow* state while backward continues: the committed state is never written. ``step()``
then validates each speculation against what the user did between ``backward()`` and ``step()``:
it is kept only if the gradient every parameter has *now* is bit-identical to the snapshot, the
parameter was not changed, and the GradScaler scale is the one speculated with (CUDA gradients:
checked by device-side digests taken with the snapshot and in ``step()``, ``_digest.py``, which
miss a change with probability 2^-64 and copy nothing to the host; the end of backward makes
the compute stream wait for the snapshot copies, so both describe the same bits;
``validate="bits"`` copies the gradients to the host and compares every bit, as CPU gradients
always are). Otherwise the
shadow is dropped (free and exact) and the bucket is updated again from the committed state with
the current gradients. The results are therefore those of the non-overlapped path whatever
happens to ``.grad`` (``clip_grad_norm_``, ``GradScaler.unscale_``, manual edits or replacement,
more backward passes). The comparison is by content, not by version counters, because measured on
torch 2.13 ``GradScaler.unscale_``, ``p.grad.data.mul_`` and writes through ``p.grad.numpy()``
change gradients without bumping ``_version``; version counters are recorded only to count edits
(``OptimizerStats.compared_equal``: edited but bit-identical, e.g. a clip factor of 1.0).
Under ``torch.distributed`` with more than one rank nothing is speculated (the hooks fire before
DDP's all-reduce); the update runs in ``step()``. A bucket whose speculation keeps failing (e.g.
clipping that clips every step) stops speculating for 1, 2, 4, ... up to 64 steps.

GradScaler. ``_step_supports_amp_scaling`` is set: ``GradScaler.step`` hands ``grad_scale`` and
``found_inf`` to the optimizer as it does for ``torch.optim.AdamW(fused=True)``; the kernel
unscales, and a step with ``found_inf`` advances nothing (steps, states, parameters).

Memory. Host states: 12 B/param with fp32 masters, plus while speculating a spare copy of each
bucket's state (another 12 B/param) and a snapshot of its gradients (grad dtype size per param);
``overlap=False`` keeps 12 B/param. CPU parameters already of the master dtype (fp32 on a CPU-only
run) are their own masters: 8 B/param of moments, updated in place with no copy, as
``torch.optim.AdamW(fused=True)`` does. ``stats.host_state_bytes`` reports what is allocated.

This module must never unpickle anything nor write a parameter outside ``step()``/``load_state_dict``.
Threads and ordering are described in ``PROTOCOL.md``.

Parts. This class is the coordinator; each concern is a module it composes:
``_layout.py`` (param groups -> buckets -> slots), ``_tiers.py`` (where the state lives) over
``_states.py`` (the state protocol per tier), ``_update.py`` (the worker thread and the bucket
update, ``_kernel.py``), ``_speculation.py`` (hooks, speculate-then-validate, backoff, the learned
order), ``_step.py`` (the step on one rank's whole state, GradScaler's skipped step), ``_zero.py``
(sharding over ``torch.distributed``: agreement and the sharded step; ``_shard.py`` the partition
and all-gather), ``_dtensor.py`` (FSDP2's DTensor parameters), ``_state_dict.py`` (the state-dict
forms) and ``_staging.py`` (gradient snapshots and parameter write-back, CUDA streams).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from tensortier import _dist
from tensortier._lifetime import Finalizer
from tensortier._renamed import renamed
from tensortier._stats import register as register_stats
from tensortier._units import SizeLike, format_size, parse_size
from tensortier.errors import ClosedError, ConfigError
from tensortier.optim._layout import TORCH_KEYS, Bucket, Layout, check_group, check_params
from tensortier.optim._readers import DeferredWriteBack
from tensortier.optim._speculation import VALIDATE, Speculator
from tensortier.optim._staging import Staging
from tensortier.optim._state_dict import StateDicts
from tensortier.optim._state_view import StateView
from tensortier.optim._states import DiskStates
from tensortier.optim._stats import OptimizerStats, record_memory
from tensortier.optim._step import Step
from tensortier.optim._tiers import StateTier, open_states, parse_tier, states_placement
from tensortier.optim._update import Updater
from tensortier.optim._zero import DeferredWrites, ShardedStep, Sharding
from tensortier.optim.streaming import is_streamed

if TYPE_CHECKING:  # Ray is imported only when a RemoteStore is made
    from tensortier.tiers.remote import RemoteStore


def _grad_hook(ref: weakref.ref, param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad(param)


def _shutdown(worker, states, hooks: list, deferred, staging) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()
    if deferred is not None:  # writes what is pending, removes its module hooks
        deferred.close()
    worker.shutdown(wait=True, cancel_futures=True)  # jobs are finite CPU work (see PROTOCOL.md)
    staging.close()  # joins the comparison threads
    states.close()


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with fp32 master weights and moments off the device.

    >>> opt = OffloadedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, tier="disk",
    ...                      spill_dir="/mnt/nvme/tt")
    >>> loss.backward(); opt.step(); opt.zero_grad()

    Bit-identical to ``torch.optim.AdamW(fused=True)`` (same kernel, per parameter), including
    under ``GradScaler`` and whatever the loop does to ``.grad`` between backward and step (on
    CUDA by default up to a 2^-64 chance that a change goes unseen: ``validate``).
    ``tier``: ``"host"`` keeps state in RAM (12 bytes per parameter, 8 for fp32 CPU parameters,
    which are their own masters; while ``overlap``
    speculates, a second copy of the state and a gradient snapshot are added, see the module
    docstring); ``"disk"`` keeps it in a :class:`DiskStore` under ``spill_dir`` and streams it
    through ``pipeline_depth`` host buffers of one bucket each, so host memory stays
    ``pipeline_depth * 3 * bucket_size``; ``"remote"`` streams it the same way from other Ray
    nodes' memory: ``remote`` is a :class:`~tensortier.tiers.remote.RemoteStore` (the caller's,
    left open by :meth:`close`) or a dict of its arguments (``{"budget": "8GiB"}``; the
    optimizer makes the store and closes it). A lost memory node makes ``step()`` raise
    ``NodeLostError`` naming it (nothing applied; the state on that node is gone: restore from a
    checkpoint).
    ``master_weights``: keep fp32 masters for bf16/fp16 parameters (else state is in their dtype).
    ``overlap``: speculate bucket updates during backward (see module docstring); ``False``
    updates in ``step()`` only; ``"auto"`` (default) speculates when parameters live on a GPU,
    whose backward the CPU update then hides behind. On a CPU-only run backward already uses
    every core, so speculating measured slower (41.9 vs 33.9 ms per iteration, 5.2M parameters,
    ``notes/issue-12-optim.md``) and costs the spare state. ``validate``: how ``step()`` checks
    a speculation's gradients: ``"auto"`` (default) by device-side digests for CUDA gradients
    (a change goes unseen with probability 2^-64; nothing is copied back to the host) and bit
    for bit for CPU ones; ``"bits"``: always bit for bit (CUDA: the gradients are copied to the
    host again in ``step()``); ``"digest"``: digests on every device. ``amsgrad``,
    ``capturable``, ``differentiable``, ``foreach=True`` and ``fused=False`` are refused with a
    ``ConfigError`` (their defaults are accepted, as in ``torch.optim.AdamW``), as are bad
    hyper-parameters in any param group and a parameter listed twice.

    Data parallel (DDP): with ``torch.distributed`` initialised and more than one rank in
    ``process_group`` (default: the world), the state is *sharded* (``shard=None`` -> on; pass
    ``shard=False`` to keep a full copy per rank): each rank keeps masters and moments for its
    part of every bucket (1/N of the host bytes), updates it from the gradients DDP has reduced,
    and the updated parameters are all-gathered into every replica before ``step()`` returns.
    ``defer_gather=True`` (host states, gloo): ``step()`` returns once this rank's updates are
    done and their all-gathers are handed to a thread (own process group), in the order forward
    reads the buckets, so the gathers overlap the next forward instead of ending the step, and
    ``step()`` issues no collective (the ranks agree on the thread: a rank whose update failed
    raises in ``step()``, the others at their next wait, naming it). A parameter is written
    before a module holding it runs forward (global forward pre-hook), before
    ``model.state_dict()`` and ``model.load_state_dict()`` (whose load a later write would
    undo), and at the next ``step()``, ``state_dict()``, ``load_state_dict()``,
    ``close()``, a Checkpointer save and :meth:`synchronize`. Under ``torch.compile`` the
    pre-hook runs eagerly (a graph break at each module call; code compiled before the optimizer
    is made is dropped with ``torch.compiler.reset()``, since dynamo does not guard on module
    hooks and that code would never wait; ``fullgraph=True`` cannot compile a module meanwhile).
    Off by default because some reads cannot be intercepted: reading parameters directly after
    ``step()`` (``p.norm()`` logging,
    ``torch.optim.swa_utils.AveragedModel.update_parameters``, ``p.data``), and parameters a
    parent's forward uses without calling the module that holds them (functional calls; PyTorch's
    ``nn.MultiheadAttention`` and transformer layers, which do, wait for all the parameters
    under them): call :meth:`synchronize` first.
    ``defer_write_back=True`` (host states, not sharded; CUDA parameters): ``step()`` returns
    with the parameters' host-to-device copies still queued on the optimizer's side stream, in
    the order forward reads them, and a module's forward makes the device wait (``wait_event``,
    the host never blocks) for the copies of the parameters it holds, so the copies overlap the
    next forward instead of ending the step (fp32 GPT-2 of 472M parameters: 1.9 GB, ~35 ms at
    an H100's PCIe speed). The same readers are covered and the same are not as with
    ``defer_gather``: call :meth:`synchronize` before reading parameters directly. CPU
    parameters are written in ``step()`` as always. Not yet measured on a GPU.
    See ``PROTOCOL.md`` ("Sharded across ranks") for why DDP's all-reduce and not a
    reduce-scatter, and :meth:`state_dict` / :meth:`full_state_dict` for checkpoints.
    """

    @renamed(states="tier", disk_capacity="disk_budget")
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        amsgrad: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        tier: StateTier | str = StateTier.HOST,
        spill_dir: str | None = None,
        disk_budget: SizeLike | None = None,
        remote: RemoteStore | dict | None = None,
        master_weights: bool = True,
        bucket_size: SizeLike = "16MiB",
        overlap: bool | str = "auto",
        validate: str = "auto",
        pipeline_depth: int = 4,
        io_threads: int = 4,
        process_group=None,
        shard: bool | None = None,
        defer_gather: bool = False,
        defer_write_back: bool = False,
    ):
        torch_keys = dict(
            amsgrad=amsgrad,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_group({**hyper, **torch_keys}, "OffloadedAdamW's arguments")  # refused, not ignored
        self.tier = parse_tier(tier)
        placement = states_placement(self.tier, spill_dir, disk_budget, remote)
        self._bucket_bytes = parse_size(bucket_size, name="bucket_size", allow_zero=False)
        self.master_weights = master_weights
        if overlap not in (True, False, "auto"):
            raise ConfigError(f"overlap={overlap!r}: pass True, False or 'auto'")
        if validate not in VALIDATE:
            raise ConfigError(
                f"validate={validate!r}: pass one of {', '.join(map(repr, VALIDATE))}"
            )
        self._validate = validate
        self._ready = False
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize
        )
        super().__init__(params, {**defaults, **TORCH_KEYS})
        self._step_supports_amp_scaling = True  # GradScaler: grad_scale / found_inf, as fused AdamW
        self._sharding = Sharding(list(self._all_params()), process_group, shard)
        self._defer_gather = bool(defer_gather)
        if self._sharding.agreeing:  # every rank must build the same optimizer
            self._agree(self.param_groups, "OffloadedAdamW")
        self._deferred = self._defer(self._defer_gather)  # before anything is opened
        devices = {p.device for g in self.param_groups for p in g["params"]}
        pin = any(d.type == "cuda" for d in devices)
        self._states = open_states(
            placement,
            bucket_bytes=self._bucket_bytes,
            depth=pipeline_depth,
            io_threads=io_threads,
            pin=pin,
        )
        self._staging = Staging(devices, self._defer_write_back(defer_write_back))
        self._compose(pin if overlap == "auto" else overlap)
        self._ready = True
        for gi in range(len(self.param_groups)):
            self._add_group(gi)
        register_stats("optimizer", self)  # tt.stats() lists it while it is open

    # ------------------------------------------------------------------ construction
    def _compose(self, overlap: bool) -> None:
        """Make the parts (they share the layout, the states, the staging and the stats)."""
        sh, groups = self._sharding, self.param_groups
        self._stats = OptimizerStats()
        self._layout = Layout(self._bucket_bytes, self.master_weights, world=sh.world, rank=sh.rank)
        self._updater = Updater(
            self._layout, self._states, self._staging, self._stats, groups, sharded=sh.sharded
        )
        self._spec = Speculator(
            self._layout,
            self._states,
            self._staging,
            self._updater,
            self._stats,
            groups,
            overlap=overlap,
            collective=sh.local_form,
            validate=self._validate,
        )
        parts = (self._layout, self._states, self._staging, self._updater, self._spec)
        host = self.tier is StateTier.HOST
        if sh.sharded:
            self._stepper: Step = ShardedStep(
                *parts, self._stats, groups, host=host, sharding=sh, deferred=self._deferred
            )
        else:
            self._stepper = Step(*parts, self._stats, groups, host=host)
        self._dicts = StateDicts(self._layout, self._states, sh, groups)
        self._hooks: list = []
        self._finalizer = Finalizer(
            self,
            _shutdown,
            self._updater.worker,
            self._states,
            self._hooks,
            self._deferred,
            self._staging,
        )

    def _defer(self, defer_gather: bool) -> DeferredWrites | None:
        """``defer_gather=True``: sharded host states over a CPU (gloo) group only."""
        if not defer_gather:
            return None
        self._refuse_streamed_deferral("defer_gather")
        sh = self._sharding
        if not sh.sharded or self.tier is not StateTier.HOST:
            raise ConfigError(
                f"defer_gather=True needs sharded host states (states='host', torch.distributed "
                f"with more than one rank); got states={self.tier.value!r}, sharded={sh.sharded}: "
                f"pass defer_gather=False"
            )
        if _dist.comm_device(sh.pg).type != "cpu":
            raise ConfigError(
                "defer_gather=True needs a process group whose collectives take CPU tensors "
                "(gloo); this one is NCCL: pass defer_gather=False"
            )
        return DeferredWrites(sh)

    def _defer_write_back(self, defer: bool) -> DeferredWriteBack | None:
        """``defer_write_back=True``: host states of one process (or unsharded DDP) only."""
        if not defer:
            return None
        self._refuse_streamed_deferral("defer_write_back")
        sh = self._sharding
        if self.tier is not StateTier.HOST or sh.sharded or sh.local_form:
            raise ConfigError(
                f"defer_write_back=True needs host states without sharding (tier='host', one "
                f"process or shard=False); got tier={self.tier.value!r}, sharded={sh.sharded}, "
                f"FSDP2={sh.local_form}: pass defer_write_back=False"
                + (" (sharded host states: defer_gather=True)" if sh.sharded else "")
            )
        return DeferredWriteBack()  # parameters added with their group (_add_group)

    def _refuse_streamed_deferral(self, setting: str) -> None:
        """``streamer.resident()`` reads the parameters back to its tier when its block ends,
        right after ``step()``: a deferred write would land after that read (a gather into the
        placeholders failed, "restore from a checkpoint"), so deferring buys nothing there."""
        if any(is_streamed(p) for p in self._all_params()):
            raise ConfigError(
                f"{setting}=True with parameters held by stream_parameters(): resident() stores "
                f"them when its block ends, before a deferred write lands; pass {setting}=False"
            )

    def _agree(self, groups: list[dict], what: str) -> None:
        """Every rank must build the same buckets: same parameters, groups and settings."""
        settings = {
            "tier": self.tier.value,
            "bucket_size": self._bucket_bytes,
            "master_weights": self.master_weights,
            "defer_gather": self._defer_gather,
        }
        self._sharding.agree(settings, groups, what)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``; a group refused leaves the optimizer as it was."""
        if getattr(self, "_ready", False):
            self._check_open()
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            try:  # before the ranks agree or a bucket is made
                check_group(self.param_groups[-1])
                check_params(len(self.param_groups) - 1, self.param_groups[-1]["params"])
            except ConfigError:
                self.param_groups.pop()
                raise
            if self._sharding.agreeing:
                self._agree(self.param_groups[-1:], "OffloadedAdamW.add_param_group")
            self._spec.discard()
            group = self.param_groups[-1]
            self._staging.add_devices({p.device for p in group["params"]})
            self._add_group(len(self.param_groups) - 1)

    def _add_group(self, gi: int) -> None:
        """Lay out param group ``gi``; hook its parameters (sharded: nothing to speculate)."""
        group = self.param_groups[gi]
        self._layout.add_group(gi, group, self._states)
        if self._deferred is not None:
            self._deferred.add_params(group["params"])
        if self._staging.deferred is not None:
            self._staging.deferred.add_params(group["params"])
        trainable = [p for p in group["params"] if p.requires_grad]
        if trainable and not self._sharding.sharded:
            # eager under compiled autograd: traced by dynamo, the hook's bookkeeping failed its
            # guards ("Guard failed on the same frame it was created")
            hook = torch.compiler.disable(functools.partial(_grad_hook, weakref.ref(self)))
            for p in trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._stats.buckets = len(self._buckets)
        record_memory(self._stats, self._states, self._staging)

    # ------------------------------------------------------------------ the parts, by name
    def stats(self) -> OptimizerStats:
        """Counters of this optimizer, live: they keep counting (:meth:`reset_stats` restarts)."""
        return self._stats

    def reset_stats(self) -> None:
        """Start the counters afresh (the memory counters are refreshed, not zeroed)."""
        self._stats = OptimizerStats(buckets=len(self._buckets))
        for part in (self._updater, self._spec, self._stepper):
            part.stats = self._stats
        record_memory(self._stats, self._states, self._staging)

    @property
    def state(self) -> StateView:  # type: ignore[override]
        """``opt.state[p]``: copies of ``p``'s state whose edits are loaded (``_state_view.py``)."""
        return self.__dict__["_view"]

    @state.setter
    def state(self, value: Mapping) -> None:
        """``opt.state = defaultdict(dict)`` (a reset, as in torch: every parameter fresh at its
        next step) or a mapping of entries: replaces every entry of the view."""
        view = self.__dict__.get("_view")
        if view is None:  # torch.optim.Optimizer.__init__'s own defaultdict
            self.__dict__["_view"] = StateView(weakref.ref(self))
            return
        if value is view:  # opt.state = opt.state
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                f"opt.state = {type(value).__name__}: assign a mapping of parameters to their "
                f"state, e.g. collections.defaultdict(dict) for fresh state"
            )
        entries = dict(value)  # before clear(): value may be this view itself
        view.clear()
        view.update(entries)

    @property
    def overlap(self) -> bool:
        """Whether bucket updates are speculated during backward."""
        return self._spec.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self._spec.overlap = value

    @property
    def _buckets(self) -> list[Bucket]:
        return self._layout.buckets

    @property
    def _worker(self):
        return self._updater.worker

    @property
    def _sharded(self) -> bool:
        return self._sharding.sharded

    @property
    def _gatherer(self):
        return self._sharding.gatherer

    @property
    def _local_form(self) -> bool:
        """Sharded or FSDP2: ``state_dict()`` holds this rank's part (read by the Checkpointer)."""
        return self._sharding.local_form

    def _all_params(self) -> Iterable[torch.Tensor]:
        return (p for g in self.param_groups for p in g["params"])

    # ------------------------------------------------------------------ backward side
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._finalizer.alive:
            self._spec.on_grad(p)

    # ------------------------------------------------------------------ step
    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError("OffloadedAdamW is closed; create a new optimizer")

    def _scaler_inputs(self) -> tuple[torch.Tensor | None, float | None, bool]:
        """``grad_scale`` / ``found_inf`` as ``torch.optim.AdamW(fused=True)`` reads them."""
        scale_t = getattr(self, "grad_scale", None)
        found_t = getattr(self, "found_inf", None)
        scale = None if scale_t is None else float(scale_t)  # float32 -> float: exact
        skip = found_t is not None and float(found_t) != 0.0
        return scale_t, scale, skip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Validate speculations, run the remaining bucket updates, commit, write parameters back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        self._apply_state_edits()  # edits of opt.state[p] copies, before the update reads it
        self.synchronize()  # the last step's gathers read the masters this one updates
        refused = self._refused_gradient()
        sparse = refused is not None  # sparse, or not shaped like its parameter: nothing runs
        scale_t, scale, skip = self._scaler_inputs()
        if self._deferred is not None:  # the branch is agreed in the step's one all-reduce
            self._stepper.run_deferred(scale_t, scale, sparse=sparse, skip=skip, refused=refused)
            return loss
        if self._sharding.local_form:  # every rank takes the same branch (collectives follow;
            # under FSDP2 GradScaler checked only the local shards: ShardedGradScaler's reason)
            sparse, skip = _dist.any_true([sparse, skip], self._sharding.pg)
        if sparse:
            self._spec.discard()
            self._spec.reset_cycle()
            raise refused or RuntimeError(
                "another rank's gradients are sparse or not shaped like their parameters: "
                "OffloadedAdamW did not update on any rank"
            )
        if skip:  # GradScaler found inf/NaN: like fused AdamW, nothing advances
            self._stepper.skip()
            return loss
        try:
            self._stepper.run(scale_t, scale)
        finally:  # the compute streams wait for whatever write-back was issued
            self._staging.finish_write_back()
        return loss

    def _refused_gradient(self) -> Exception | None:
        """The error for a gradient ``step()`` cannot use, if one is: sparse, or not of its
        parameter's shape (put in through ``.grad.data``: the fused kernel would read past its
        end, as ``torch.optim.AdamW(fused=True)`` does, and write NaN or crash)."""
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    return RuntimeError("OffloadedAdamW does not support sparse gradients")
                if g.shape != p.shape:
                    return ConfigError(
                        f"param group {gi}, parameter {i}: gradient of shape {tuple(g.shape)} "
                        f"for a parameter of shape {tuple(p.shape)}; a gradient must have its "
                        f"parameter's shape (check what assigns .grad or .grad.data): nothing "
                        f"was updated"
                    )
        return None

    def synchronize(self) -> None:
        """Wait until every parameter holds the last ``step()``'s values (``defer_gather=True``:
        the all-gathers run after ``step()`` returns; ``defer_write_back=True``: work queued from
        now on the current CUDA streams runs after the copies; otherwise they are already
        written). Call it before reading parameters directly rather than through a module's
        forward or ``state_dict()``. Raises if a deferred gather failed (parameters may be partly
        written)."""
        if self._finalizer.alive:
            for readers in (self._deferred, self._staging.deferred):
                if readers is not None:
                    readers.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop speculation that no step() consumed, then clear gradients as torch does."""
        if self._spec.pending:
            self._spec.discard()
            self._spec.reset_cycle()
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip all gradients by their global norm (``torch.nn.utils.clip_grad_norm_``); call before step."""
        self._check_open()
        grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(
            grads, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """Same layout and param-group keys as ``torch.optim.AdamW(fused=True)``: tensors and plain
        values only (no pickle needed). Between backward and step it is the state before the step.
        Hooks registered with ``register_state_dict_pre_hook``/``_post_hook`` run as in torch.

        Per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, plus ``master_param`` when the master
        weights differ in dtype from the parameter.

        Sharded (``torch.distributed``): the *sharded* form, for ``torch.distributed.checkpoint``
        (DCP): each rank returns the parameters it owns a part of; a parameter cut across ranks
        has its tensors as ``DTensor`` (``Shard(0)`` over the group), one owned whole is a plain
        tensor on its owner; ``step`` is a plain tensor, the same on every owner. Parameters owned
        but not stepped yet have ``step`` 0 and zero moments (equivalent to no state, so
        ``dcp.load`` into a fresh optimizer's ``state_dict()`` works). For the full layout of
        ``torch.optim.AdamW`` on every rank use :meth:`full_state_dict` (a collective). DCP's
        ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) calls the parameters a
        rank does not own missing: load with ``set_optimizer_state_dict(...,
        options=StateDictOptions(strict=False))`` (and the model strictly, on its own), or use
        ``flatten_optimizer_state_dict=True`` in both calls.
        """
        self._check_open()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # as torch.optim runs them
            pre_hook(self)
        self._apply_state_edits()
        self.synchronize()  # the step is over when its state is read
        self._spec.wait()
        state_dict = self._dicts.local()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def full_state_dict(self) -> dict:
        """The state in ``torch.optim.AdamW``'s full layout (parameter-shaped plain tensors).

        Without sharding this is :meth:`state_dict`. Sharded, it is a collective (call it on every
        rank): each bucket's pieces are all-gathered, so every rank returns the whole state (host
        memory for one full copy of the state). ``torch.optim.AdamW(fused=True).load_state_dict``
        and :meth:`load_state_dict` on any world size accept it.
        """
        if not self._sharding.local_form:
            return self.state_dict()
        self._check_open()
        self._apply_state_edits()
        self.synchronize()
        self._spec.wait()
        if self._sharding.fsdp:
            return self._dicts.full_fsdp()
        return self._dicts.full_sharded()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.optim.AdamW.state_dict()`` (any of
        its variants: fused, foreach, for-loop). Pending speculation is dropped.

        Sharded: the full layout (from ``torch.optim.AdamW``, :meth:`full_state_dict`, or an
        unsharded OffloadedAdamW, saved on any world size) or this optimizer's sharded form
        (e.g. filled by ``torch.distributed.checkpoint.load``); each rank takes its pieces, with
        no communication. Entries with ``step`` 0 are fresh state.
        """
        self._check_open()
        state_dict = state_dict.copy()  # shallow, as torch.optim: a hook may edit its keys
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load(state_dict)
        self.state.forget()  # copies handed out are of the state just replaced
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load(self, state_dict: dict) -> None:
        """Replace the state (every check first: on an error nothing has changed)."""
        self.synchronize()  # pending gathers read the masters that are about to be replaced
        loaded = self._dicts.parse(state_dict)  # every check, before anything changes
        self._spec.discard()
        self._spec.drop_prepared()  # they read the committed state that is about to be replaced
        if isinstance(self._states, DiskStates):
            self._states.drop_prefetch()
        self._dicts.write(loaded)
        self._dicts.adopt(loaded, state_dict["param_groups"])

    def _apply_state_edits(self) -> None:
        """Load the ``opt.state[p]`` copies changed since they were read (``_state_view.py``)."""
        edits = self.state.take_edits()
        if not edits:
            return
        self.synchronize()
        self._spec.wait()
        state_dict = self._dicts.local()
        pos = {id(p): i for i, p in enumerate(self._all_params())}
        for p, entry in edits:
            if entry:
                state_dict["state"][pos[id(p)]] = entry
            else:  # emptied, deleted or assigned {}: fresh state, as torch's next step makes it
                state_dict["state"].pop(pos[id(p)], None)
        try:
            self._load(state_dict)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(
                f"an edited opt.state[p] cannot be loaded ({exc}); nothing was changed. Keep "
                f"its keys (step, exp_avg, exp_avg_sq) and each tensor's shape"
            ) from exc

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for updates, remove the gradient hooks, and delete any spill files."""
        self._finalizer()

    def __getstate__(self) -> dict:
        """Refused: torch.optim's pickles only ``state``, empty here (the moments live in this
        process's buffers or spill files), so ``torch.save(opt)`` kept nothing and the copy
        could not step."""
        raise ConfigError(
            "OffloadedAdamW cannot be pickled or copied (its state lives in this process's "
            "buffers or spill files): save opt.state_dict() instead (torch.save(opt.state_dict(), "
            "path)) and load it into a new OffloadedAdamW with load_state_dict()"
        )

    def __enter__(self) -> OffloadedAdamW:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"OffloadedAdamW(tier={self.tier.value}, buckets={len(self._buckets)}, "
            f"host_state={format_size(self._states.host_bytes)}, groups={len(self.param_groups)})"
        )
