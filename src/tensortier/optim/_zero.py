"""ZeRO over ``torch.distributed``: whether the optimizer shards, every rank agreeing on what it
builds, and the sharded step (PROTOCOL.md, "Sharded across ranks").

``Sharding`` decides, at construction, between one full state per rank, ZeRO-1 sharding over
``process_group`` (each rank keeps masters and moments for its pieces of every bucket), and
FSDP2 (DTensor parameters: FSDP already shards, each rank updates its local shards); it checks
that every rank builds the same optimizer, and gives the CPU ``DeviceMesh`` of the state's
DTensors. ``ShardedStep`` updates this rank's pieces from the gradients DDP reduced and
all-gathers the updated pieces into every replica: host states bucket by bucket while the next
bucket updates (the last gather carries every rank's failure byte); disk states after the ranks
agreed that every write succeeded and committed (all or nothing). ``defer_gather=True`` (host
states): the gathers run after ``step()`` returns on ``_shard.GatherThread``, and
``DeferredWrites`` makes every reader that can be intercepted wait for them. The partition and
the all-gather's byte layout are ``_shard.py``'s.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tensortier import _dist
from tensortier.errors import ConfigError
from tensortier.optim._dtensor import is_dtensor
from tensortier.optim._layout import Bucket, Slot
from tensortier.optim._readers import ParamReaders, params_read
from tensortier.optim._shard import Gatherer, Gathering, GatherPlan, GatherThread
from tensortier.optim._step import Done, Step
from tensortier.optim._update import Job


class Sharding:
    """How this rank's optimizer state relates to the other ranks' (decided at construction)."""

    def __init__(self, params: list[torch.Tensor], process_group, shard: bool | None):
        group_active = _dist.active(process_group)
        # FSDP2 (fully_shard): parameters are DTensors; FSDP already shards them, so each rank
        # updates its local shards and the state is DTensor-aware (PROTOCOL.md, "FSDP2")
        self.fsdp = any(is_dtensor(p) for p in params)
        if shard is None:
            shard = group_active and not self.fsdp
        if shard and self.fsdp:
            raise ConfigError(
                "shard=True with DTensor parameters: FSDP2 (fully_shard) already shards them; "
                "leave shard=None and each rank updates its local shards"
            )
        if shard and not group_active:
            import torch.distributed as dist

            why = (
                "the process group has one rank: there is nothing to shard across"
                if dist.is_available() and dist.is_initialized()
                else "call torch.distributed.init_process_group() first"
            )
            raise ConfigError(
                f"shard={shard!r} needs torch.distributed initialised with more than one rank in "
                f"process_group; {why}, or pass shard=False"
            )
        self.sharded = bool(shard)
        self.pg = process_group
        self.world = _dist.world(process_group) if self.sharded else 1
        self.rank = _dist.rank(process_group) if self.sharded else 0
        self.gatherer = Gatherer(process_group, self.world, self.rank) if shard else None
        self.agreeing = group_active  # every rank must build the same optimizer
        self._mesh = None

    @property
    def local_form(self) -> bool:
        """Sharded or FSDP2: ``state_dict()`` holds this rank's part, one entry per parameter it
        holds (``step`` 0 when never stepped, so DCP and restores find every key); ``step()``
        agrees with the other ranks before it branches."""
        return self.sharded or self.fsdp

    def agree(self, settings: dict, groups: list[dict], what: str) -> None:
        """Every rank must build the same buckets: same parameters, groups and settings."""
        _dist.agree(
            {
                **settings,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                "parameters": [
                    [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in g["params"]]
                    for g in groups
                ],
            },
            what,
            self.pg,
            fix="build the model and the optimizer the same way on every rank",
        )

    def device_mesh(self):
        """The CPU mesh of the group: the sharded state's DTensors live in host memory."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = self.pg if self.pg is not None else torch.distributed.group.WORLD
            self._mesh = DeviceMesh.from_group(group, "cpu")  # the states live in host memory
        return self._mesh


def peer_failed(rank: int, applied: bool) -> RuntimeError:
    what = (
        "the parts that succeeded were applied on every rank"
        if applied
        else "no rank applied it, so parameters and state are as before the step"
    )
    return RuntimeError(
        f"OffloadedAdamW: rank {rank} failed its part of this step (its log has the error); {what}"
    )


@dataclass(frozen=True)
class Verdict:
    """What every rank did in a deferred step (``_judge``)."""

    sparse: bool  # some rank had sparse gradients (or one not shaped like its parameter)
    skip: bool  # some rank skipped (GradScaler found inf/NaN)
    split: bool  # some ranks skipped, others updated
    failed: int | None  # the lowest rank whose update failed

    def error(self, *, updated: bool) -> RuntimeError:
        """Another rank took another branch: gradients that are not the same on every rank."""
        what = (
            "sparse gradients (or one not shaped like its parameter)"
            if self.sparse
            else "GradScaler's inf/NaN check"
        )
        mine = (
            "this rank updated its part of the optimizer state, so the state no longer matches "
            "the other ranks': restore from a checkpoint"
            if updated
            else "this rank did not update"
        )
        return RuntimeError(
            f"OffloadedAdamW: the ranks disagreed on {what} (the gradients differ between ranks: "
            f"call step() with the gradients DDP reduced, the same on every rank); {mine}"
        )


def _judge(
    reduced: list[float], *, sparse: bool, skip: bool, failed: bool, world: int
) -> tuple[bool, BaseException | None]:
    """The gather thread's verdict on a deferred step from every rank's flags (MAX of [sparse,
    skipped, updated, world - failing rank]): whether to drop the step's gathers (the ranks took
    different branches: no rank issues them) and the error the next wait raises on this rank
    (none where ``step()`` raised already: its own sparse gradients or failed update)."""
    any_sparse, any_skip, any_update, first = (int(v) for v in reduced)
    verdict = Verdict(
        sparse=bool(any_sparse),
        skip=bool(any_skip),
        split=bool(any_skip and any_update),
        failed=world - first if first else None,
    )
    if verdict.sparse or verdict.split:
        return True, None if sparse else verdict.error(updated=not skip)
    if verdict.failed is not None and not failed:
        return False, peer_failed(verdict.failed, applied=True)
    return False, None


def _record_versions(slots: list[Slot]) -> None:
    """The gather wrote these slots' parameters: their versions now are ours, not the user's
    (recorded before the write, the next step saw a changed parameter and compared every
    master with it: half the update's CPU time)."""
    for s in slots:
        s.version = s.data_version


class DeferredWrites(ParamReaders):
    """``defer_gather=True``: the step's all-gathers run after ``step()`` returned
    (``GatherThread``), and each parameter is written before anything reads it.

    Who waits: a module's forward for the gathers of the parameters it holds itself, and
    ``model.state_dict()`` for all (``_readers.ParamReaders``); the optimizer waits in
    ``step()``, ``state_dict()``, ``load_state_dict()``, ``close()`` and ``synchronize()`` (the
    Checkpointer calls it). Not covered: reading a parameter directly, or through a module whose
    forward is not called (see the ``defer_gather`` docstring).
    """

    def __init__(self, sharding: Sharding):
        group = _dist.new_group_like(sharding.pg)  # destroyed by the thread's close()
        self.thread = GatherThread(group, sharding.world, sharding.rank)
        self._item: dict[int, int] = {}  # id(parameter) -> number of the gather that writes it
        super().__init__()

    def hand_over(
        self, plan: GatherPlan, values: dict[int, torch.Tensor], slots: list[Slot]
    ) -> None:
        """Queue one bucket's gather (``values`` unchanged until it is written). ``slots``: this
        rank's slots of the bucket whose ``version`` records the write, once it is done."""
        n = self.thread.submit(plan, values, functools.partial(_record_versions, slots))
        for p in plan.params:
            self._item[id(p)] = n

    def check(self, sparse: bool, skip: bool, failed: bool, count: int) -> None:
        """Queue the step's check ahead of its ``count`` gathers (``_judge``): the ranks agree
        on the thread, after ``step()`` returned, instead of in a collective inside it."""
        rank, world = self.thread.gatherer.rank, self.thread.gatherer.world
        first = float(world - rank) if failed else 0.0  # MAX of it: the lowest failing rank
        flags = [float(sparse), float(skip), float(not (sparse or skip)), first]
        judge = functools.partial(_judge, sparse=sparse, skip=skip, failed=failed, world=world)
        self.thread.check(flags, count, judge)

    def before_use(self, module: torch.nn.Module) -> None:
        """A module is about to run: the held gathers start (the forward has begun), and it waits
        for its own parameters' gathers."""
        if self.thread.held:
            self.thread.release()
        super().before_use(module)

    def wait_for(self, module: torch.nn.Module) -> None:
        if not self._item:
            return
        last = max((self._item.get(id(p), 0) for p in params_read(module)), default=0)
        if last:
            self.thread.wait(last)
            if not self.thread.pending:
                self._item.clear()

    def synchronize(self) -> None:
        """Every handed-over gather written (raises a failed gather's error)."""
        if self._item or self.thread.busy:
            self.thread.wait()
            self._item.clear()

    def close(self) -> None:
        super().close()
        self.thread.close()


class ShardedStep(Step):
    """``step()`` when the state is sharded: never speculated, every rank in lockstep."""

    def __init__(self, *args, sharding: Sharding, deferred: DeferredWrites | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharding = sharding
        self.deferred = deferred  # defer_gather=True: the gathers run after step() returns

    def run(self, scale_t: torch.Tensor | None, scale: float | None) -> None:
        """Update this rank's pieces and all-gather them into every replica.

        Host states: each bucket is all-gathered as soon as it is updated, while the next one
        updates; what succeeded is applied, as without sharding (a host update fails only on a
        bug or out of memory), and the last bucket's gather carries every rank's failure byte, so
        every rank raises naming the first failing one. Disk states: all or nothing on every rank
        (a failed write on any rank aborts the step everywhere, parameters untouched): every rank
        waits for its writes, the ranks agree (one all-reduce), commit, then all-gather.
        """
        t0 = time.perf_counter()
        if self.host:
            done, error, failed = self._update_and_gather(*self._submit(scale))
            self.stats.step_wait_seconds += time.perf_counter() - t0  # updates and gathers
        else:
            done, failed = [], None
            jobs, error = self._submit(scale)
            error = self._collect(jobs, lambda *d: done.append(d), error)
            if error is None:
                error = self.states.write_error()  # waits for this step's state writes
            self.stats.step_wait_seconds += time.perf_counter() - t0
            failed = _dist.first_true(error is not None, self.sharding.pg)
            if failed is not None:
                self.states.abort()
                self.speculator.reset_cycle()
                raise error or peer_failed(failed, applied=False)
        self._conclude(done, scale_t)
        if failed is not None:
            raise error or peer_failed(failed, applied=True)

    def run_deferred(
        self,
        scale_t: torch.Tensor | None,
        scale: float | None,
        *,
        sparse: bool,
        skip: bool,
        refused: BaseException | None = None,
    ) -> None:
        """``defer_gather``: update this rank's pieces on this thread (unless its gradients are
        sparse or GradScaler found inf/NaN) and hand the step's check and gathers over as the
        last thing ``step()`` does: no collective inside ``step()``.

        The ranks agree on the gather thread (``_judge``), after ``step()`` returned: with DDP
        every rank holds the same reduced gradients, so each takes the branch the others take,
        and a peer's failed update (a bug or out of memory) is raised by this rank's next wait
        (the next forward, ``synchronize()``, ``state_dict()``, ``step()``) once what succeeded
        is written. This rank's own failure is raised here, after its gathers are written.
        Measured (2 gloo ranks on 2 loaded cores): an agreement all-reduce inside ``step()``
        cost more wall time than the updates, waiting for both ranks' threads to be scheduled.
        """
        t0 = time.perf_counter()
        own = sparse or skip  # this rank does not update
        done, values, error = ([], {}, None) if own else self._update_inline(scale)
        self.stats.step_wait_seconds += time.perf_counter() - t0
        count = 0 if own else len(self.layout.buckets)
        self.deferred.check(sparse, skip, error is not None, count)
        if sparse:
            self.speculator.discard()
            self.speculator.reset_cycle()
            raise refused or RuntimeError("OffloadedAdamW does not support sparse gradients")
        if skip:  # GradScaler found inf/NaN: nothing advances (every rank, under DDP)
            self.skip()
            return
        try:
            self._conclude(done, scale_t)
        finally:  # the last thing step() does (every rank hands every bucket over)
            self._hand_over(values)
        if error is not None:  # raised with what succeeded written
            self.deferred.synchronize()
            raise error

    def _conclude(self, done: list[Done], scale_t: torch.Tensor | None) -> None:
        """Commit, advance the step counters, gather disk states, record versions, unscale."""
        tw = time.perf_counter()
        try:
            self.states.commit()
            updated = self._advance(done)
            if not self.host:
                self._gather_committed(done)
            if self.deferred is None:  # deferred: recorded once each gather wrote its bucket
                for s in self.layout.slots():
                    if s.version != -1 or id(s) in updated:
                        s.version = s.data_version
            if scale_t is not None:  # fused AdamW leaves the unscaled gradients in .grad
                for p in (p for g in self.groups for p in g["params"]):
                    if p.grad is not None:
                        p.grad.div_(scale_t.to(p.grad.device))
        finally:
            self.stats.writeback_seconds += time.perf_counter() - tw
        self._finish(scale_t)

    def _submit(self, scale: float | None) -> tuple[list[Job], BaseException | None]:
        """Queue every bucket's update on the worker (FIFO), in the learned order."""
        jobs = []
        for b in self.layout.ordered():
            try:
                job = self.updater.submit_now(b, scale, None)
            except BaseException as exc:  # e.g. out of memory: nothing more is launched
                return jobs, exc
            if job is not None:
                jobs.append(job)
        return jobs, None

    def _recorder(
        self, done: list[Done], values: dict[int, dict[int, torch.Tensor]]
    ) -> Callable[..., None]:
        """``finished`` for :meth:`_collect`: adds each update to ``done`` and its bucket's new
        masters (by slot index) to ``values``, for the bucket's gather."""

        def finished(
            b: Bucket, slots: list[Slot], counters: list[torch.Tensor], direct: list[bool]
        ) -> None:
            done.append((b, slots, counters, direct))
            master = self.states.latest(b.id).master
            values[b.id] = {s.index: master[s.offset : s.offset + s.numel] for s in slots}

        return finished

    def _update_and_gather(
        self, jobs: list[Job], error: BaseException | None
    ) -> tuple[list[Done], BaseException | None, int | None]:
        """Host states: wait for the updates in turn; all-gather each bucket once it and every
        bucket before it (id order: the same on every rank) is updated, while later ones update.

        Returns the updates done, this rank's first error and the lowest failing rank (or None),
        which every rank learns from the failure bytes of the last bucket's gather.
        """
        gatherer, buckets = self.sharding.gatherer, self.layout.buckets
        pending = {b.id for b, _, _, _ in jobs}
        values: dict[int, dict[int, torch.Tensor]] = {}
        done: list[Done] = []
        finished = self._recorder(done, values)
        issued: list[Gathering] = []
        nxt = 0
        for job in [*jobs, None]:  # None: after the last update, issue what is left
            if job is not None:
                pending.discard(job[0].id)
                error = self._collect([job], finished, error)
            while nxt < len(buckets) and nxt not in pending:
                last = nxt == len(buckets) - 1  # issued after every update: the verdict
                vals = values.pop(nxt, {})
                issued.append(
                    gatherer.start(buckets[nxt].plan, vals, failed=last and error is not None)
                )
                nxt += 1
            while len(issued) > 1:  # unpack the older ones while the worker updates
                gatherer.finish(issued.pop(0))
        if not issued:  # no bucket at all: nothing carried the verdict
            return done, error, _dist.first_true(error is not None, self.sharding.pg)
        gatherer.finish(issued[-1])
        return done, error, issued[-1].failed

    def _update_inline(
        self, scale: float | None
    ) -> tuple[list[Done], dict[int, dict[int, torch.Tensor]], BaseException | None]:
        """``defer_gather``: update the buckets on this thread (it would only wait for the worker,
        and a hand-off per bucket costs two thread switches on a loaded core). Returns the updates
        done, each bucket's new masters by slot index (for its gather) and this rank's first
        error (after a failed launch, e.g. out of memory, nothing more is launched)."""
        values: dict[int, dict[int, torch.Tensor]] = {}
        done: list[Done] = []
        finished = self._recorder(done, values)
        error: BaseException | None = None
        for b in self.layout.buckets[::-1]:
            try:
                job = self.updater.submit_now(b, scale, None, inline=True)
            except BaseException as exc:
                error = error or exc
                break
            if job is not None:
                error = self._collect([job], finished, error)
        return done, values, error

    def _hand_over(self, values: dict[int, dict[int, torch.Tensor]]) -> None:
        """``defer_gather``: hand every bucket to the gather thread (each gather is a collective,
        so every bucket, updated or not), highest id first: buckets are built in reverse, so this
        is the order forward reads them, the same on every rank.

        Why at the end of ``step()``, not as each bucket is done: the point of
        deferring is that the gathers overlap the next forward; handed over during the step they
        took the core from the updates (2 gloo ranks on 2 cores: ~9 of the step's ~18 ms of
        process CPU time were the gather thread's and gloo's) and moved nothing out of ``step()``.
        """
        for b in self.layout.buckets[::-1]:
            vals = values.pop(b.id, {})
            mark = [s for s in b.slots if s.version != -1 or s.index in vals]
            self.deferred.hand_over(b.plan, vals, mark)

    def _gather_committed(self, done: list[Done]) -> None:
        """Disk states, after the commit: all-gather every bucket's committed pieces (bucket-id
        order), each bucket's gather in flight while the next bucket's masters are read."""
        gatherer = self.sharding.gatherer
        by_id = {b.id: slots for b, slots, _, _ in done}
        masters = self.states.masters(sorted(by_id))  # streamed with read-ahead
        previous: Gathering | None = None
        try:
            for b in self.layout.buckets:
                values = {}
                if b.id in by_id:
                    i, master = next(masters)
                    assert i == b.id
                    values = {s.index: master[s.offset : s.offset + s.numel] for s in by_id[i]}
                g = gatherer.start(b.plan, values)  # copies the values out of the read buffer
                if previous is not None:
                    gatherer.finish(previous)
                previous = g
            if previous is not None:
                gatherer.finish(previous)
        finally:
            masters.close()
