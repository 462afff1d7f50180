"""``step()`` over this rank's whole bucket state: one process, DDP without sharding, or FSDP2's
local shards (the sharded step, ``_zero.ShardedStep``, builds on this one).

For each bucket in the learned order: keep its speculation if it validates (``_speculation.py``),
else queue an update with the gradients as they are now (``_update.py``); then commit, write the
parameters back and advance the step counters. Host states: each bucket's parameters are written
back as soon as its result is final, overlapping later updates, and what succeeded is applied even
if another bucket failed (an update fails only on a bug or out of memory). Disk and remote
states: all or nothing, the parameters are written from the committed masters after the commit,
so a full disk leaves parameters and state as they were. Also here: the step GradScaler skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tensortier.optim._layout import Bucket, Layout, Slot
from tensortier.optim._speculation import Speculator
from tensortier.optim._staging import Staging
from tensortier.optim._stats import OptimizerStats, record_memory
from tensortier.optim._update import Job, Updater

# (bucket, slots updated, their new step counters, per slot: .grad was unscaled in place)
Done = tuple[Bucket, list[Slot], list[torch.Tensor], list[bool]]


class Step:
    """Runs the optimizer's steps; ``host``: the states live in host RAM (``StateTier.HOST``)."""

    def __init__(
        self,
        layout: Layout,
        states,
        staging: Staging,
        updater: Updater,
        speculator: Speculator,
        stats: OptimizerStats,
        groups: list[dict],
        *,
        host: bool,
    ):
        self.layout, self.states, self.staging = layout, states, staging
        self.updater, self.speculator = updater, speculator
        self.stats = stats
        self.groups = groups
        self.host = host
        # defer_write_back: the copies are issued at the end, in forward order (see run)
        self.defer_write_back = staging.deferred is not None

    def skip(self) -> None:
        """GradScaler found inf/NaN: like fused AdamW, nothing advances (a state appears for
        every parameter that had a gradient, as torch's lazy state init does)."""
        self.speculator.discard()
        self.states.abort()
        for s in self.layout.slots():
            s.has_state |= s.param.grad is not None
        self.stats.skipped_steps += 1
        self.speculator.last_scale = None
        self._end_cycle()

    def run(self, scale_t: torch.Tensor | None, scale: float | None) -> None:
        t0 = time.perf_counter()
        done: list[Done] = []
        jobs: list[Job] = []
        error: BaseException | None = None
        wb_seconds = 0.0
        later: list[tuple[int, list[Slot], object]] = []  # defer_write_back: issued at the end

        def finished(b, slots, steps, direct, kept: bool = False) -> None:
            nonlocal wb_seconds
            done.append((b, slots, steps, direct))
            if b.in_place and not kept:  # the kernel updated the parameters themselves
                self._wrote(slots)
            elif self.host and self.defer_write_back:
                later.append((b.id, slots, self.states.latest(b.id)))
            elif self.host:  # host: write back now, overlapping later updates
                tw = time.perf_counter()
                self._write_back(slots, self.states.latest(b.id))
                wb_seconds += time.perf_counter() - tw

        for b in self.layout.ordered():
            kept, staged = self.speculator.resolve(b, scale)
            if kept is not None:  # a shadow result: copied to the parameters
                finished(b, kept.slots, kept.future.result(), [False] * len(kept.slots), True)
                continue
            try:
                job = self.updater.submit_now(b, scale, staged)
            except BaseException as exc:  # e.g. out of memory: nothing more is launched
                error = error or exc
                self.speculator.discard()
                break
            if job is not None:
                jobs.append(job)
        error = self._collect(jobs, finished, error)
        # forward order (buckets are built in reverse: highest id first, as defer_gather hands
        # its gathers over): the next forward's first modules wait for the first copies only
        tw = time.perf_counter()
        for _, slots, holder in sorted(later, key=lambda x: -x[0]):
            self._write_back(slots, holder)
        wb_seconds += time.perf_counter() - tw
        self.stats.step_wait_seconds += time.perf_counter() - t0 - wb_seconds
        self.stats.writeback_seconds += wb_seconds
        self._apply(done, error, scale_t)

    def _collect(self, jobs: list[Job], finished: Callable, error: BaseException | None):
        """Wait for every queued update; ``finished`` gets each success. Returns the first error."""
        for b, slots, fut, direct in jobs:
            exc = fut.exception()  # finite work (see PROTOCOL.md)
            if exc is not None:
                error = error or exc
            else:
                finished(b, slots, fut.result(), direct)
        return error

    def _apply(self, done: list[Done], error: BaseException | None, scale_t) -> None:
        """Commit, advance step counters, write parameters back; raise ``error`` if a job failed."""
        try:
            if error is not None and not self.host:
                self.states.abort()
                raise error
            self.states.commit()  # disk: raises TierFullError with nothing applied
        except BaseException:
            self.speculator.reset_cycle()
            raise
        tw = time.perf_counter()
        self._advance(done)
        if not self.host:
            by_id = {b.id: slots for b, slots, _, _ in done}
            for i, master in self.states.masters(list(by_id)):
                self._write_back(by_id[i], None, master)
        self.stats.writeback_seconds += time.perf_counter() - tw
        if scale_t is not None:  # fused AdamW leaves the unscaled gradients in .grad
            for _, slots, _, direct in done:
                for s, d in zip(slots, direct):
                    if not d:
                        s.param.grad.div_(scale_t.to(s.param.grad.device))
        self._finish(scale_t)
        self.speculator.prepare_spares()
        if error is not None:
            raise error

    def _advance(self, done: list[Done]) -> set[int]:
        """The updated slots' new step counters take effect; returns their ids."""
        updated: set[int] = set()
        for _, slots, steps, _ in done:
            for s, st in zip(slots, steps):
                s.step = st
                s.has_state = True
                updated.add(id(s))
        return updated

    def _finish(self, scale_t: torch.Tensor | None) -> None:
        """A step was applied: count it, start the next cycle, read ahead its first buckets."""
        self.stats.steps += 1
        self.speculator.last_scale = None if scale_t is None else float(scale_t)
        self._end_cycle()
        self.states.prefetch(self.layout.order[: self.updater.prefetch_depth() - 1])

    def _end_cycle(self) -> None:
        self.speculator.end_cycle()
        record_memory(self.stats, self.states, self.staging)

    def _write_back(self, slots: list[Slot], holder, master=None) -> None:
        master = holder.master if master is None else master
        event = self.staging.write_back(
            [(s.tensor(), master[s.offset : s.offset + s.numel]) for s in slots], holder
        )
        if event is not None and self.staging.deferred is not None:  # modules wait for it
            self.staging.deferred.written([s.param for s in slots], event)
        self._wrote(slots)

    @staticmethod
    def _wrote(slots: list[Slot]) -> None:
        """The parameters hold the masters' values: later changes are the user's."""
        for s in slots:
            s.version = s.data_version
