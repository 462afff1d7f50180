"""Speculate-then-validate: bucket updates started by the gradient hooks during backward, kept by
``step()`` only when nothing they assumed has changed (adamw.py's docstring, PROTOCOL.md).

Owns the per-step cycle the hooks drive: gradient counts, the learned number of backward passes
per step and the order in which buckets become ready (written to ``Layout.order``), each
bucket's pending speculation and its backoff, the GradScaler scale of the last step, and the
spare-state copies made after a step. It never writes committed state nor a parameter: a kept
speculation's result is applied by the step (``_step.py``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tensortier.optim._digest import Digests
from tensortier.optim._layout import Bucket, Hyper, Layout, Slot
from tensortier.optim._staging import Staged, Staging
from tensortier.optim._states import HostStates
from tensortier.optim._stats import OptimizerStats
from tensortier.optim._update import Updater

log = logging.getLogger("tensortier.optim.adamw")

MAX_PAUSE = 64  # steps a bucket stops speculating after repeated failures, at most
VALIDATE = ("auto", "digest", "bits")  # OffloadedAdamW(validate=...): see Speculator


@dataclass(eq=False)
class Spec:
    """A speculative update of one bucket: what it assumed, and its pending result."""

    slots: list[Slot]
    grads: list[weakref.ref]  # identity, data_ptr and _version of each gradient at launch
    ptrs: list[int]
    versions: list[int]
    param_versions: list[int]
    layouts: list[tuple]  # dtype, shape, device of each gradient: a digest sees bytes only
    scale: float | None
    hyper: Hyper  # the group's hyper-parameters at launch: a change before step() means redo
    staged: Staged
    future: Future
    digest: torch.Tensor | None  # on the gradients' device, taken at launch (``_digest.py``)
    stale: bool = False  # a further backward pass reached the bucket


@dataclass(eq=False)
class _Track:
    """One bucket's speculation state."""

    ready: int = 0  # trainable parameters whose gradients are complete this cycle
    spec: Spec | None = None
    pause: int = 0  # steps left without speculation
    backoff: int = 1  # the next pause after a failed speculation


def _layouts(grads: list[torch.Tensor]) -> list[tuple]:
    """What a gradient's bytes mean: equal bytes under another dtype or shape (``.data = ...``)
    digest the same, so the layout is compared separately (``Staging.matches`` does too)."""
    return [(g.dtype, g.shape, g.device) for g in grads]


def distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Speculator:
    """The hooks' side of the optimizer, and the validation of what they launched.

    ``overlap``: speculate at all. ``collective``: sharded or FSDP2, never speculate (gradients
    are final only after communication that follows the hooks). ``validate``: how ``step()``
    checks that the gradients still hold the snapshot's bits: ``"bits"`` compares them on the
    host (CUDA: copied there first), ``"digest"`` compares device-side digests taken at launch
    and in ``step()`` (``_digest.py``: a change is missed with probability 2^-64), ``"auto"``:
    digests for CUDA gradients, bits for CPU ones (already on the host: nothing to save).
    """

    def __init__(
        self,
        layout: Layout,
        states,
        staging: Staging,
        updater: Updater,
        stats: OptimizerStats,
        groups: list[dict],
        *,
        overlap: bool,
        collective: bool,
        validate: str = "auto",
    ):
        self.layout, self.states, self.staging, self.updater = layout, states, staging, updater
        self.stats = stats
        self.groups = groups
        self.overlap = overlap
        self._collective = collective
        self._tracks: defaultdict[int, _Track] = defaultdict(_Track)  # bucket id -> its state
        self._calibrated = False
        self._accum = 1
        self.last_scale: float | None = None  # GradScaler's scale at the last step
        self._dist = collective or distributed()
        self._seen_order: list[int] = []
        self._prepared: list[Future] = []  # spare copies made on the worker after a step
        self.validate = validate
        self._digests: Digests | None = None  # made on first use: a random matrix per process
        # digested snapshots not fenced yet (their devices, in order) and the backward passes
        # with a fence queued at their end (a reentrant one ends inside another: either fences all)
        self._unfenced: dict[torch.device, None] = {}
        self._fence_tasks: set[int] = set()

    # ------------------------------------------------------------------ backward side
    def _speculating(self, bucket: Bucket) -> bool:
        paused = self._tracks[bucket.id].pause
        return self.overlap and self._calibrated and not self._dist and paused == 0

    def on_grad(self, p: torch.Tensor) -> None:
        """A gradient was accumulated into ``p`` (post-accumulate-grad hook)."""
        entry = self.layout.where.get(id(p))
        if entry is None:
            return
        slot, bucket = entry
        track = self._tracks[bucket.id]
        slot.count += 1
        if not self._calibrated:
            if slot.count == 1:
                track.ready += 1
                if track.ready == bucket.trainable:
                    self._seen_order.append(bucket.id)
            return
        if slot.count > self._accum:  # a further backward pass: the snapshot is out of date
            if track.spec is not None:
                track.spec.stale = True
            return
        if slot.count == self._accum:
            track.ready += 1
            ready = track.ready == bucket.trainable and track.spec is None
            if ready and self._speculating(bucket):
                self._speculate(bucket)

    def _speculate(self, bucket: Bucket) -> None:
        slots = [s for s in bucket.slots if s.param.grad is not None]
        if not slots or any(
            s.param.grad.is_sparse or s.version == -1 or s.data_version != s.version for s in slots
        ):
            return  # sparse, or the master needs seeding from the parameter: step() does it
        grads = [s.grad() for s in slots]
        params = [s.tensor() for s in bucket.slots]
        staged = self.staging.snapshot(bucket.id, params, [s.index for s in slots], grads)
        # on the stream the gradients were made on (backward's), after they were final
        digests = self._digester(grads[0].device)
        digest = None if digests is None else digests.take(grads)
        if digest is not None:
            self._fence(staged, grads[0].device)
        scale = self.last_scale
        hyper = Hyper.of(self.groups[bucket.group])
        future = self.updater.submit_shadow(bucket, slots, staged, scale, hyper)
        self._tracks[bucket.id].spec = Spec(
            slots=slots,
            grads=[weakref.ref(g) for g in grads],
            ptrs=[g.data_ptr() for g in grads],
            versions=[g._version for g in grads],
            param_versions=[s.data_version for s in slots],
            layouts=_layouts(grads),
            scale=scale,
            hyper=hyper,
            staged=staged,
            future=future,
            digest=digest,
        )
        self.stats.speculated += 1
        self.stats.launched_in_backward += 1

    def _fence(self, staged: Staged, device: torch.device) -> None:
        """A digest describes the gradients when the bucket was ready, so the snapshot must hold
        those bits: no edit may reach it while it is being copied (else an edit undone before
        ``step()`` would leave a torn snapshot that the digests call unchanged; PROTOCOL.md).

        CPU: the copy is made now, on this thread (not on the worker). CUDA: at the end of this
        backward (autograd's final callback, run on the streams current around the user's
        ``backward()`` call), each device's current stream waits for the snapshot copies.
        """
        if device.type != "cuda":
            staged.wait()
            return
        task = torch._C._current_graph_task_id()
        if task == -1:  # a hook run outside a backward: nothing can run before the fence
            self.staging.fence(device)
            return
        self._unfenced[device] = None
        if task not in self._fence_tasks:  # the first snapshot of this backward pass
            self._fence_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Autograd's final callback of a backward that took digested snapshots: every device
        with a snapshot not fenced yet is fenced (also those an enclosing backward took before a
        reentrant one, ``checkpoint(use_reentrant=True)``, whose callback runs first)."""
        devices, self._unfenced = self._unfenced, {}
        self._fence_tasks.clear()  # a later snapshot queues a fence again (also for a failed one)
        for device in devices:
            self.staging.fence(device)

    # ------------------------------------------------------------------ step side
    def resolve(self, b: Bucket, scale: float | None) -> tuple[Spec | None, Staged | None]:
        """step(), per bucket in order: (the speculation, if it is kept; else the current
        gradients' host copy when validation already made one, for the redo)."""
        track = self._tracks[b.id]
        spec, track.spec = track.spec, None
        if spec is None:
            if track.pause > 0:
                track.pause -= 1
                self.stats.paused_bucket_steps += 1
            return None, None
        keep, changed, staged = self._validate(b, spec, scale)
        if changed:  # back off exponentially: 1, 2, 4, ... steps without speculation
            track.pause = track.backoff
            track.backoff = min(2 * track.backoff, MAX_PAUSE)
        else:
            track.backoff = 1
        if keep:
            return spec, None
        self.states.drop(b.id)
        self.stats.redone += 1
        return None, staged

    def _validate(
        self, b: Bucket, spec: Spec, scale: float | None
    ) -> tuple[bool, bool, Staged | None]:
        """(keep, the gradients or parameters changed, host copy of the current gradients)."""
        t0 = time.perf_counter()
        exc = spec.future.exception()  # finite work (see PROTOCOL.md)
        self.stats.spec_wait_seconds += time.perf_counter() - t0
        if exc is not None:  # a failed speculation is redone; the redo raises if it fails too
            log.debug("tensortier: speculative update of bucket %d failed: %r", b.id, exc)
            return False, False, None
        if spec.stale:
            return False, True, None
        current = [s for s in b.slots if s.param.grad is not None]
        if current != spec.slots or any(
            s.data_version != v for s, v in zip(spec.slots, spec.param_versions)
        ):
            return False, True, None
        if _layouts([s.grad() for s in spec.slots]) != spec.layouts:  # e.g. .data of another dtype
            return False, True, None
        if spec.scale != scale:  # GradScaler changed its scale (or unscale_ was called)
            return False, False, None
        if spec.hyper != Hyper.of(self.groups[b.group]):  # e.g. lr set after backward
            self.stats.hyper_changed += 1
            return False, False, None
        grads = [s.param.grad for s in spec.slots]
        same = all(
            r() is g and g.data_ptr() == p and g._version == v
            for r, g, p, v in zip(spec.grads, grads, spec.ptrs, spec.versions)
        )
        # a snapshot is described by its digest once its backward's end fenced it; a backward
        # that raised never got there: compare the snapshot's bits instead
        digest = None if b.device in self._unfenced else spec.digest
        digest_same = self._same_digest(digest, grads)  # None: no digest, compare bits
        if digest_same is False:
            self.stats.unversioned_edits += same
            return False, True, None  # the redo copies the current gradients
        if digest_same is None and not self.staging.matches(spec.staged, grads, self.stats):
            self.stats.unversioned_edits += same
            # CUDA: matches() left the current gradients in the snapshot buffer; reuse that copy
            return False, True, spec.staged if b.device.type == "cuda" else None
        self.stats.validated += 1
        self.stats.compared_equal += not same
        return True, False, None

    def _digester(self, device: torch.device) -> Digests | None:
        """The digests validating speculations on ``device``, or None: compare bits instead."""
        if self.validate == "bits" or (self.validate == "auto" and device.type != "cuda"):
            return None
        if self._digests is None:
            self._digests = Digests()
        return self._digests if self._digests.usable(device) else None

    def _same_digest(self, digest: torch.Tensor | None, grads: list[torch.Tensor]) -> bool | None:
        """Whether ``grads`` digest to ``digest`` (one device sync: the comparison's result);
        None when there is no digest to compare with."""
        if digest is None:
            return None
        t0 = time.perf_counter()
        now = self._digests.take(grads)
        if now is None:
            return None
        same = now.shape == digest.shape and bool(torch.equal(now, digest))
        self.stats.digest_seconds += time.perf_counter() - t0
        self.stats.digest_checks += 1
        return same

    # ------------------------------------------------------------------ the cycle
    @property
    def pending(self) -> bool:
        """A speculation or a gradient count that no step() consumed yet."""
        return any(t.spec is not None for t in self._tracks.values()) or any(
            s.count for s in self.layout.slots()
        )

    def wait(self) -> None:
        """Let every speculation finish (it never writes the committed state being read)."""
        for b in self.layout.buckets:
            spec = self._tracks[b.id].spec
            if spec is not None:
                spec.future.exception()  # finite work; the committed state is what we read

    def discard(self) -> None:
        """Drop every pending speculation (zero_grad without step, a skipped step, a reload)."""
        for b in self.layout.buckets:
            track = self._tracks[b.id]
            spec, track.spec = track.spec, None
            if spec is None:
                continue
            spec.future.exception()  # finite CPU work (and a CUDA event): see PROTOCOL.md
            self.states.drop(b.id)
            self.stats.discarded += 1

    def drop_prepared(self) -> None:
        """Wait for the spare copies in flight (they read committed state about to be replaced)."""
        for f in self._prepared:
            f.exception()
        self._prepared = []

    def reset_cycle(self) -> None:
        for b in self.layout.buckets:
            track = self._tracks[b.id]
            track.ready = 0
            track.spec = None
            for s in b.slots:
                s.count = 0

    def end_cycle(self) -> None:
        """After a step (or a skipped one): learn the bucket order once, relearn accumulation."""
        self._unfenced = {}  # the snapshots a failed backward left unfenced are consumed
        self._fence_tasks.clear()  # backward passes whose callback never ran (compiled autograd)
        counts = [s.count for s in self.layout.slots()]
        if not self._calibrated:
            seen = list(dict.fromkeys(self._seen_order))
            buckets = self.layout.buckets
            self.layout.order = seen + [b.id for b in buckets if b.id not in seen]
            self._calibrated = True
        if max(counts, default=0) > 0:  # relearn: accumulation may change during training
            self._accum = max(counts)
        self._dist = self._collective or distributed()
        self.reset_cycle()

    def prepare_spares(self) -> None:
        """Host: copy each bucket's committed state into its spare on the worker now, while the
        next forward runs, so the speculative updates in backward only run the kernel."""
        self._prepared = [f for f in self._prepared if not f.done()]
        if not isinstance(self.states, HostStates) or not self.overlap or self._dist:
            return
        for i in self.layout.order:
            if self._tracks[i].pause == 0 and self.layout.buckets[i].trainable:
                self._prepared.append(self.updater.submit_prepare(i))
