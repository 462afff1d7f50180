"""Host copies of a bucket's gradients, and the parameter write-back, for ``OffloadedAdamW``.

CPU gradients. A speculative update needs a *snapshot*: the gradient may change before
``step()`` (clipping, unscaling, edits), and ``step()`` compares the snapshot with the gradient
then, bit for bit. The copy runs on the optimizer's worker thread (``Staged.wait``) into a
buffer allocated once per bucket. A non-speculative update reads the gradient tensors directly.

CUDA gradients (written to be correct by construction, compared line by line with torchao's
``CPUOffloadOptimizer`` and DeepSpeed's ZeRO offload; there is no GPU on the CI machine):
- one side stream per device for both directions (``transfer.streams.SideStreams``, whose
  ``copy`` is the sequence below), created when the optimizer is built (never one per launch:
  the stream pool is round-robin and would alias other components' streams);
- one pinned buffer per bucket, allocated on first use and reused every step; the copy is
  ``non_blocking`` on the side stream after it waited for the compute stream, the source gets
  ``record_stream`` so the allocator cannot hand it out before the copy ran, and one event per
  batch is what the worker waits on;
- with digests (``_speculation.py``), the end of backward makes the compute stream wait for the
  snapshot copies (``fence``, as FSDP's post-backward callback waits for its reduce-scatter
  stream), so no edit after backward can reach a copy in flight;
- the check in ``step()`` copies the current gradients into one pinned buffer per device and
  compares them with the snapshot on ATen's thread count (``_compare.py``); on a mismatch that
  copy becomes the bucket's staged gradients;
- parameter write-back: ``non_blocking`` H2D from the pinned master on the side stream (after it
  waited for the compute stream), dtype conversion on the device, one event that the compute
  stream waits on; the event is recorded on the host buffer, which is not written again before it
  completed (``_states._HostBuf.ready_to_write``); ``defer_write_back=True``: no such wait,
  each module's forward waits for its own parameters' copies (``_readers.DeferredWriteBack``).

Waits: CUDA events complete once the copies queued before them ran; they cannot hang unless the
device does. Every event a host thread synchronizes on is blocking (``cudaEventBlockingSync``: the
thread sleeps). torchao synchronizes default events (spinning or yielding, by the device's
schedule flags) because its waits are serial inside ``step()``; here they overlap CPU work: the
worker waits for a snapshot through the GPU's lag behind backward, and ``step()``'s check and
write-back waits run beside the worker's CPU AdamW, whose intra-op threads a spinning core would
slow. The transfer engine's completion thread and the checkpointer's persist thread sleep the same
way, as does transformers' generation (``torch.Event(blocking=True)`` on its pinned D2H). This
module never runs an update and never touches optimizer state.
"""

from __future__ import annotations

import time

import torch

from tensortier._units import align_up
from tensortier.optim._compare import Comparer
from tensortier.optim._readers import DeferredWriteBack
from tensortier.optim._states import ALIGN
from tensortier.optim._stats import OptimizerStats
from tensortier.tiers.host import aligned_empty
from tensortier.transfer.streams import COMPUTE, SideStreams, consume


class Staged:
    """A bucket's gradients on the host: ``wait()`` returns them once the copy has completed."""

    __slots__ = ("views", "_event", "_fill")

    def __init__(self, views: list[torch.Tensor], event=None, fill=()):
        self.views, self._event, self._fill = views, event, list(fill)

    def wait(self) -> list[torch.Tensor]:
        ev, self._event = self._event, None
        if ev is not None:
            ev.synchronize()  # copies queued before it: completes unless the device hangs
        fill, self._fill = self._fill, []
        for dst, src in fill:  # CPU snapshot, taken on the worker thread
            dst.copy_(src)
        return self.views


class Staging:
    """Reusable host gradient buffers per bucket, side streams per device, write-back."""

    def __init__(self, devices: set[torch.device], deferred: DeferredWriteBack | None = None):
        # one side stream per device for both directions: write-backs stay ordered after the
        # gradient copies queued before them, as with torchao's single stream
        self._streams = SideStreams(split=False)
        self._bufs: dict[int, tuple[tuple, torch.Tensor, list[int]]] = {}
        self._check: dict[torch.device, torch.Tensor] = {}
        self._wb_devices: dict[torch.device, bool] = {}
        self.comparer = Comparer()  # validation's comparisons, on the host's cores
        self.deferred = deferred  # defer_write_back=True: forward waits per module, not all
        self.add_devices(devices)

    def close(self) -> None:
        """Join the comparison threads (the optimizer's shutdown); deferred write-backs: the
        current streams wait for them, then the module hooks go."""
        self.comparer.close()
        if self.deferred is not None:
            self.deferred.synchronize()
            self.deferred.close()

    def add_devices(self, devices: set[torch.device]) -> None:
        for d in devices:
            if d.type == "cuda":  # made with the optimizer (once per device), not at a step
                self._streams.stream(d, "d2h")

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for _, b, _ in self._bufs.values()) + sum(
            b.numel() for b in self._check.values()
        )

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _layout(params: list[torch.Tensor]) -> tuple[list[int], int]:
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off = align_up(off + p.numel() * p.element_size(), ALIGN)
        return offsets, off

    def _views(self, key: int, all_params: list[torch.Tensor], which: list[int], pin: bool):
        """Views shaped like ``all_params[i]`` for i in ``which``, into the bucket's buffer."""
        sig = tuple((p.dtype, p.shape) for p in all_params)
        entry = self._bufs.get(key)
        if entry is None or entry[0] != sig:  # allocated once per bucket, then reused
            offsets, total = self._layout(all_params)
            entry = self._bufs[key] = (sig, aligned_empty(total, pin=pin, alignment=ALIGN), offsets)
        _, buf, offsets = entry
        out = []
        for i in which:
            p = all_params[i]
            nb = p.numel() * p.element_size()
            out.append(buf[offsets[i] : offsets[i] + nb].view(p.dtype).view(p.shape))
        return out

    def _check_views(self, device: torch.device, params: list[torch.Tensor]):
        offsets, total = self._layout(params)
        buf = self._check.get(device)
        if buf is None or buf.numel() < total:
            buf = self._check[device] = aligned_empty(total, pin=True, alignment=ALIGN)
        return [
            buf[o : o + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            for o, p in zip(offsets, params)
        ]

    # ------------------------------------------------------------------ gradients
    def snapshot(
        self, key: int, all_params: list[torch.Tensor], which: list[int], grads: list[torch.Tensor]
    ) -> Staged:
        """A copy of ``grads`` that later edits of the gradients cannot reach."""
        device = grads[0].device
        views = self._views(key, all_params, which, pin=device.type == "cuda")
        if device.type != "cuda":
            return Staged(views, fill=zip(views, grads))
        return self._d2h(device, views, grads)

    def stage(
        self, key: int, all_params: list[torch.Tensor], which: list[int], grads: list[torch.Tensor]
    ) -> Staged:
        """Host gradients for an update that runs now: CPU tensors as they are, CUDA copied."""
        if grads[0].device.type != "cuda":
            return Staged(list(grads))
        return self.snapshot(key, all_params, which, grads)

    def _d2h(self, device, views, grads) -> Staged:
        # after the compute stream (the gradients are final there); each g is record_stream-ed:
        # the allocator must not reuse it before its copy ran
        event = self._streams.copy(
            zip(views, grads), device, direction="d2h", record_sources=True, blocking=True
        )
        return Staged(views, event)

    def fence(self, device: torch.device) -> None:
        """The device's current stream waits for every snapshot copy queued so far, so work queued
        there afterwards (a user's edit of a gradient) cannot reach a copy still reading it."""
        consume(self._streams.record(device, "d2h"), torch.cuda.current_stream(device))

    def matches(
        self, staged: Staged, grads: list[torch.Tensor], stats: OptimizerStats | None = None
    ) -> bool:
        """Whether ``grads`` still hold exactly the snapshot's bits (call after ``staged.wait()``).

        CUDA: the current gradients are copied to the host first; on a mismatch that copy replaces
        the snapshot, so ``staged.views`` then hold the gradients a redo must use. The comparison
        runs on ATen's thread count (``_compare.Comparer``). ``stats``: where the copy's and the
        comparison's seconds are counted.
        """
        views = staged.views
        if len(views) != len(grads) or any(
            v.shape != g.shape or v.dtype != g.dtype for v, g in zip(views, grads)
        ):
            return False
        t0 = time.perf_counter()
        cuda = grads[0].device.type == "cuda"
        if cuda:
            check = self._check_views(grads[0].device, grads)
            self._d2h(grads[0].device, check, grads).wait()
        t1 = time.perf_counter()
        same = self.comparer.equal(list(zip(views, check if cuda else grads)))
        if stats is not None:
            stats.check_copy_seconds += t1 - t0
            stats.compare_seconds += time.perf_counter() - t1
            stats.compare_threads = self.comparer.last_threads
        if cuda and not same:
            for v, c in zip(views, check):
                v.copy_(c)
        return same

    # ------------------------------------------------------------------ write-back
    def write_back(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], holder=None):
        """Copy masters (host) into parameters; ``holder.event`` guards the host buffer on CUDA.

        ``holder=None`` on CUDA waits for the copies before returning (the buffer is reused).
        Returns the event after the copies when they may still run (CUDA, a ``holder``).
        """
        cuda = [(p, m) for p, m in pairs if p.device.type == "cuda"]
        cpu = [(p, m.view(p.shape)) for p, m in pairs if p.device.type != "cuda"]
        self._streams.copy(cpu, torch.device("cpu"), direction="h2d")  # plain copies, now
        if not cuda:
            return None
        device = cuda[0][0].device  # a bucket holds parameters of one device
        # the first write-back of this step on the device waits for compute: kernels may still
        # read p; H2D in the master dtype, converted on the device
        first = not self._wb_devices.get(device)
        self._wb_devices[device] = True
        pairs = [(p, m.view(p.shape)) for p, m in cuda]
        after = COMPUTE if first else None
        event = self._streams.copy(pairs, device, direction="h2d", after=after, blocking=True)
        if holder is None:
            event.synchronize()
            return None
        holder.event = event
        return event

    def finish_write_back(self) -> None:
        """Make each compute stream wait for this step's write-back (one event per device);
        ``defer_write_back``: each module's forward waits for its own parameters instead."""
        for device in [d for d, used in self._wb_devices.items() if used]:
            if self.deferred is None:
                consume(self._streams.record(device, "h2d"), torch.cuda.current_stream(device))
            self._wb_devices[device] = False
