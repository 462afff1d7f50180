"""CUDA side streams, events and the one device-copy sequence of every tier move (issue 26).

This module is the only place in the package that makes a CUDA stream or event, calls
``wait_stream`` or ``record_stream`` (``tests/test_layering.py`` greps ``src`` for them). Its
clients: the transfer engine (``engine.py``), ``OffloadedAdamW``'s gradient staging and parameter
write-back (``optim/_staging.py``), the parameter streamer (``optim/streaming.py``), the
checkpointer's snapshot (``checkpoint/checkpointer.py``), the planner's timing events and the
activation offloader's :class:`HostScalar` (a codec's overflow flag).

The sequence, :meth:`SideStreams.copy` (compared line by line with the peers, ``TRANSFER.md``):
1. the side stream waits for ``after`` (device-side, no host sync), by default the device's
   *current* stream, where the producer of the sources is queued (torchao's
   ``CPUOffloadOptimizer`` and torchtune's ``OffloadActivations``: ``s1.wait_stream(s0)``);
2. on the side stream, ``dst.copy_(src, non_blocking=True)`` per pair (an H2D into another dtype
   copies in the source's dtype and converts on the device, never on the host);
3. ``src.record_stream(side)`` if asked, so the caching allocator does not hand a device source
   to another stream before its copy ran (torchao's ``p_device.grad.record_stream``); the engine
   keeps its sources alive until the event completed instead (torchtune's ``fwd_stash``);
4. an event recorded on the side stream after the copies, ``blocking=True`` where a host thread
   sleeps on it (``cudaEventBlockingSync``) instead of spinning.
The consumer side is :func:`consume`: a stream waits for the event (device-side) and the tensors
it will read are ``record_stream``-ed on it. Copies into new device memory (the engine's H2D, the
parameter streamer) are :meth:`SideStreams.copy_new`, torchtune's unpack: allocated from the side
stream's pool, so they wait for no other stream.

Side streams belong to an owner (:class:`SideStreams`), one per device and direction, made once
and kept, never one per copy: ``torch.cuda.Stream()`` takes the next of PyTorch's pooled streams
round-robin, so a stream per copy would alias other components' streams. Owners do not share
streams either: a shared stream would serialise one client's copies behind another's waits
(gradient D2H behind activation H2D, a parameter prefetch behind the engine's ``wait_stream``),
which ``gpu-paths/REVIEW.md`` #11 names as lost overlap.

This module orders copies; it never decides what to copy and never waits on the host, except
where :class:`HostScalar` is read (after the work queued before it has run, as a rule).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Literal

import torch

Direction = Literal["d2h", "h2d"]
COMPUTE = "compute"  # ``after=COMPUTE``: the device's current stream when the copy is issued


def event(*, blocking: bool = False) -> torch.cuda.Event:
    """A completion event. ``blocking=True``: a host thread that synchronizes on it sleeps
    instead of spinning (``cudaEventBlockingSync``); for threads that wait on copies."""
    return torch.cuda.Event(blocking=blocking)


def timing_event() -> torch.cuda.Event:
    """An event that records a timestamp, for ``elapsed_time`` (the planner's profiler)."""
    return torch.cuda.Event(enable_timing=True)


class HostScalar:
    """A 0-dim device tensor read on the host later without a host sync now: copied to pinned
    memory in stream order, with an event behind the copy. ``bool()`` waits for that event, done
    by the time anything queued after it has run (the activation offloader reads a codec's
    overflow flag once the payload encoded with it has been copied off the device)."""

    def __init__(self, value: torch.Tensor):
        self._host = torch.empty((), dtype=value.dtype, pin_memory=True)
        self._host.copy_(value, non_blocking=True)
        self._done = event()
        self._done.record(torch.cuda.current_stream(value.device))  # the copy's stream

    def __bool__(self) -> bool:
        self._done.synchronize()
        return bool(self._host)


def _wait_for(side: torch.cuda.Stream, device: torch.device, after) -> None:
    """``side`` waits (device-side) for the work queued on ``after``: ``COMPUTE`` (the device's
    current stream), a stream, or ``None`` (nothing: only the side stream's own earlier work)."""
    if isinstance(after, str):  # COMPUTE
        after = torch.cuda.current_stream(device)
    if after is not None:
        side.wait_stream(after)


def consume(done: torch.cuda.Event, stream, tensors: Iterable[torch.Tensor] = ()) -> None:
    """``stream`` waits for ``done`` (device-side: the host never blocks); ``tensors``, read on
    ``stream`` but allocated on another one, are ``record_stream``-ed on it so their memory is
    reused only after the work queued on ``stream`` so far."""
    stream.wait_event(done)
    for t in tensors:
        t.record_stream(stream)


def current(t: torch.Tensor):
    """The current stream of ``t``'s device, or None for a CPU tensor (nothing to order)."""
    return torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None


def share(t: torch.Tensor, made_on, stream) -> None:
    """``t`` was made (or waited for) on ``made_on`` and is read on ``stream`` too: ``stream``
    waits for the work queued on ``made_on`` so far (device-side), and ``t``'s memory is reused
    only after ``stream``'s work queued so far. Nothing to do on the same stream, or on a CPU."""
    if stream is None or made_on is None or stream == made_on:
        return
    stream.wait_stream(made_on)
    t.record_stream(stream)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` queued on the current (side) stream; an H2D into another dtype crosses
    PCIe in the source's dtype and converts on the device (a temporary of the side stream)."""
    if dst.dtype != src.dtype and dst.device.type == "cuda" and src.device.type != "cuda":
        tmp = torch.empty(dst.shape, dtype=src.dtype, device=dst.device)
        tmp.copy_(src, non_blocking=True)
        dst.copy_(tmp)
    else:
        dst.copy_(src, non_blocking=True)


class SideStreams:
    """One owner's copy streams: per device, one per direction (``split=True``) or one for both
    (``split=False``: copies in both directions stay ordered with each other), made on first use
    (or ahead with :meth:`stream`) and kept for the owner's life."""

    def __init__(self, *, split: bool = True):
        self._split = split
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._lock = threading.Lock()  # the engine makes streams from several threads

    def stream(self, device: torch.device, direction: Direction) -> torch.cuda.Stream:
        """The side stream of ``device`` for ``direction``, made now if it does not exist."""
        key = (device, direction if self._split else "both")
        side = self._streams.get(key)
        if side is None:
            with self._lock:
                side = self._streams.get(key)
                if side is None:
                    side = self._streams[key] = torch.cuda.Stream(device=device)
        return side

    def made(self) -> dict[tuple[torch.device, str], torch.cuda.Stream]:
        """The streams made so far, by (device, direction; ``"both"`` when not split)."""
        with self._lock:
            return dict(self._streams)

    def copy(
        self,
        pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        *,
        direction: Direction,
        after=COMPUTE,
        record_sources: bool = False,
        blocking: bool = False,
        read: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.cuda.Event | None:
        """Queue ``dst.copy_(src, non_blocking=True)`` for each ``(dst, src)`` on ``device``'s side
        stream, after the work queued on ``after`` (``COMPUTE``: the device's current stream; a
        stream; ``None``: only after the side stream's own earlier work). ``record_sources``:
        ``src.record_stream(side)`` after each copy. ``read(src)``, if given, is what is copied,
        computed on the side stream (the checkpointer's ``as_bytes``: a contiguous copy of a
        strided source is made there, while ``src`` itself is the one recorded). Returns the
        event recorded after the copies; on a CPU ``device`` (process memory) the copies are
        plain ``copy_`` calls, done when this returns, and there is no event (``None``)."""
        if device.type != "cuda":
            for dst, src in pairs:
                dst.copy_(src if read is None else read(src))
            return None
        side = self.stream(device, direction)
        done = event(blocking=blocking)
        with torch.cuda.device(device):
            _wait_for(side, device, after)
            with torch.cuda.stream(side):
                for dst, src in pairs:
                    _copy(dst, src if read is None else read(src))
                    if record_sources:
                        src.record_stream(side)
            done.record(side)
        return done

    def copy_new(
        self,
        host: list[torch.Tensor],
        device: torch.device,
        *,
        after=None,
        blocking: bool = False,
    ) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """New ``device`` copies of host tensors, allocated from the h2d side stream's pool, and
        the event after them: torchtune's unpack (``.to("cuda", non_blocking=True)`` under
        ``torch.cuda.stream(s1)``). The memory is the side stream's, so the copies wait for no
        other stream (a prefetch overlaps the compute queued before it); ``after`` (a stream,
        ``COMPUTE``; default ``None``) is only for a source whose producer may still be queued
        there. Every reader must :func:`consume` the event *and* the tensors: ``record_stream`` is
        what keeps the memory from being reused under the reader's kernels once it is freed."""
        side = self.stream(device, "h2d")
        done = event(blocking=blocking)
        with torch.cuda.device(device):
            _wait_for(side, device, after)
            with torch.cuda.stream(side):
                out = [h.to(device, non_blocking=True) for h in host]
            done.record(side)
        return out, done

    def record(self, device: torch.device, direction: Direction) -> torch.cuda.Event:
        """An event after everything queued so far on the side stream (for :func:`consume`)."""
        done = event()
        done.record(self.stream(device, direction))
        return done
