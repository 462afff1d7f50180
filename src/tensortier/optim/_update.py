"""The bucket update, run on the optimizer's one worker thread (an in-place update in ``step()``
runs on the caller's thread when the worker is idle: nothing to overlap, no write-back to wait for).

Owns the worker (``tt-adamw``: one thread, strictly FIFO, which is what lets ``step()`` wait on
bucket i while i+1 still runs) and its scratch buffer for unscaled gradient copies. An update
loads a bucket's state (committed, or a shadow copy when speculating), seeds masters from
parameters that changed, runs the fused kernel (``_kernel.py``) and saves the result as pending
(``_states.py``). It never commits, never writes a parameter, and reads gradients only as staged
host copies (``_staging.py``); what to update is decided on the caller's thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tensortier._units import align_up
from tensortier.optim._kernel import adamw_
from tensortier.optim._layout import Bucket, Hyper, Layout, Slot
from tensortier.optim._staging import Staged, Staging
from tensortier.optim._stats import OptimizerStats

# (bucket, slots updated, the update's future, per slot: the kernel unscaled .grad in place)
Job = tuple[Bucket, list[Slot], Future, list[bool]]


class Updater:
    """Queues bucket updates on the worker and runs them there.

    ``groups``: the optimizer's ``param_groups`` (hyper-parameters are read from it on the
    caller's thread). ``sharded``: other ranks own the rest of each gradient, so the kernel never
    unscales one in place.
    """

    def __init__(
        self,
        layout: Layout,
        states,
        staging: Staging,
        stats: OptimizerStats,
        groups: list[dict],
        *,
        sharded: bool,
    ):
        self.layout, self.states, self.staging = layout, states, staging
        self.stats = stats
        self.groups = groups
        self.sharded = sharded
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="tt-adamw")
        self._last: Future | None = None  # the latest job given to the worker (FIFO)
        # unscaled gradient copies; one update at a time uses it (the worker, or inline when idle)
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def submit_shadow(
        self, b: Bucket, slots: list[Slot], staged: Staged, scale: float | None, hyper: Hyper
    ) -> Future:
        """A speculative update of ``b`` into a copy of its committed state."""
        return self.submit(self._update, b, slots, staged, scale, hyper, True, None, None)

    def submit(self, fn, *args) -> Future:
        """Queue ``fn(*args)`` on the worker, after every job queued before."""
        self._last = self.worker.submit(fn, *args)
        return self._last

    def _inline(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the caller's thread; its outcome as a completed future."""
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # reported through the future, as the worker's would be
            fut.set_exception(exc)
        return fut

    def submit_now(
        self, b: Bucket, scale: float | None, staged: Staged | None, *, inline: bool = False
    ) -> Job | None:
        """Queue a non-speculative update of ``b`` with the gradients as they are now; ``inline``
        (the caller only waits for it): run it on the caller's thread if the worker is idle."""
        slots = [s for s in b.slots if s.param.grad is not None]
        if not slots:
            return None
        grads = [s.grad() for s in slots]
        if staged is None:  # the parameters shape the staging buffers of CUDA gradients only
            params = [s.tensor() for s in b.slots] if b.device.type == "cuda" else []
            staged = self.staging.stage(b.id, params, [s.index for s in slots], grads)
        direct = [  # sharded: never unscale a gradient in place (other ranks own the rest of it)
            not self.sharded and g.device.type == "cpu" and g.dtype == b.dtype and g.is_contiguous()
            for g in grads
        ]
        seeds = (
            None
            if b.in_place
            else [  # in place: the parameter is the master
                s.tensor().reshape(-1).to("cpu")
                if s.version == -1 or s.data_version != s.version
                else None
                for s in slots
            ]
        )
        hyper = Hyper.of(self.groups[b.group])
        args = (b, slots, staged, scale, hyper, False, seeds, direct)
        if (inline or b.in_place) and (self._last is None or self._last.done()):
            # the worker is idle and the caller waits: handing off would only add a thread
            # switch per bucket (~25 us of CPU measured, more on a loaded core): it runs here
            fut = self._inline(self._update, *args)
        else:
            fut = self.submit(self._update, *args)
        self.stats.launched_in_step += 1
        return b, slots, fut, direct

    def submit_prepare(self, bucket_id: int) -> Future:
        """Queue the copy of a bucket's committed state into its spare (host states)."""
        return self.submit(self._prepare, bucket_id)

    def _prepare(self, bucket_id: int) -> None:
        t0 = time.perf_counter()
        try:
            self.states.prepare(bucket_id)
        finally:
            self.stats.prepare_seconds += time.perf_counter() - t0

    def prefetch_depth(self) -> int:
        return getattr(self.states, "depth", 2)

    def _update(
        self,
        bucket: Bucket,
        slots: list[Slot],
        staged: Staged,
        scale: float | None,
        hyper: Hyper,
        shadow: bool,
        seeds: list | None,
        direct: list[bool] | None,
    ) -> list[torch.Tensor]:
        """Run one bucket's AdamW update (worker, or inline); returns the new step counters.

        ``shadow``: update a copy of the committed state (speculation). ``seeds``: per slot, the
        parameter's current value (CPU) when the master must be checked against it.
        ``direct``: per slot, the kernel may unscale the gradient tensor itself (CPU, in step()).
        """
        t0 = time.perf_counter()
        grads = staged.wait()
        self.stats.grad_wait_seconds += time.perf_counter() - t0
        flat = self._kernel_grads(bucket, grads, scale, keep=shadow or self.sharded, direct=direct)
        token, (master, m, v), _ = self.states.load(bucket.id, shadow=shadow)
        saved = False
        try:
            order = self.layout.order
            pos = order.index(bucket.id) if bucket.id in order else -1
            if pos >= 0:
                self.states.prefetch(order[pos + 1 : pos + self.prefetch_depth()])
            ps, back = self._masters(bucket, slots, master, seeds, shadow)
            if hasattr(token, "moments"):  # host buffers keep their slots' views
                ms, vs = token.moments(slots)
            else:
                ms = [m[s.offset : s.offset + s.numel] for s in slots]
                vs = [v[s.offset : s.offset + s.numel] for s in slots]
            # in place, the committed state is written as it goes: so are the step counters
            own = bucket.in_place and not shadow
            steps = [s.step if own else s.step.clone() for s in slots]
            tk = time.perf_counter()
            adamw_(
                ps,
                flat,
                ms,
                vs,
                steps,
                lr=hyper.lr,
                beta1=hyper.beta1,
                beta2=hyper.beta2,
                eps=hyper.eps,
                weight_decay=hyper.weight_decay,
                maximize=hyper.maximize,
                grad_scale=None if scale is None else torch.tensor(scale, dtype=torch.float32),
            )
            self.stats.kernel_seconds += time.perf_counter() - tk
            self.stats.kernel_threads = torch.get_num_threads()  # this thread's: ATen's setting
            for t, mp in back:  # a parameter that stopped being contiguous (``p.data = ...``)
                t.copy_(mp.view(t.shape))
            saved = True  # save() owns the token from here on, also when it raises
            self.states.save(bucket.id, token, (master, m, v))
        finally:
            if not saved:
                self.states.discard(token)
            self.stats.update_seconds += time.perf_counter() - t0
        return steps

    @staticmethod
    def _masters(bucket: Bucket, slots: list[Slot], master, seeds, shadow: bool):
        """The kernel's parameter tensors, and (parameter, copy) pairs to write back after it.

        In place (``Bucket.in_place``): the parameters themselves, no copy (a shadow update copies
        them into the spare's master vector: the committed state, the parameters, stays as is).
        Else the master slices, seeded from ``seeds`` where the parameter changed.
        """
        ps, back = [], []
        for i, s in enumerate(slots):
            if bucket.in_place and not shadow:
                t = s.tensor()
                if t.is_contiguous():  # the kernel reads numel and data only: shapes may differ
                    ps.append(t)
                else:
                    ps.append(t.reshape(-1).clone())
                    back.append((t, ps[-1]))
                continue
            mp = master[s.offset : s.offset + s.numel]
            if bucket.in_place:
                mp.copy_(s.tensor().reshape(-1))
            seed = seeds[i] if seeds is not None else None
            if seed is not None and (
                s.version == -1 or not torch.equal(seed, mp.to(seed.dtype))
            ):  # first step, or the user changed the parameter: the parameter wins
                mp.copy_(seed)
            ps.append(mp)
        return ps, back

    def _kernel_grads(self, bucket, grads, scale, *, keep: bool, direct) -> list[torch.Tensor]:
        """Flat gradients in the master dtype for the kernel (worker thread).

        With ``scale`` the kernel writes the unscaled gradient back into its input: a snapshot that
        ``step()`` still compares (``keep``) is copied to a scratch buffer first.
        """
        flat = []
        need = 0
        for i, g in enumerate(grads):
            if g.dtype != bucket.dtype:
                flat.append(g.reshape(-1).to(bucket.dtype))
            elif direct is not None and direct[i]:
                flat.append(g)  # contiguous: as good as flat for the kernel
            elif scale is not None and keep:
                flat.append(None)
                need = align_up(need + g.numel() * g.element_size(), 64)
            else:
                flat.append(g.reshape(-1))
        if need:
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.uint8)
            off = 0
            for i, g in enumerate(grads):
                if flat[i] is None:
                    nb = g.numel() * g.element_size()
                    flat[i] = self._scratch[off : off + nb].view(g.dtype)
                    flat[i].copy_(g.reshape(-1))
                    off = align_up(off + nb, 64)
        return flat
