"""The one place that constructs CUDA streams and events (issue 26), owned by the transfer layer.

Every side stream and every event tensortier uses is made here: the transfer engine's copy
streams and completion events, the optimizer's gradient staging and parameter write-back, the
parameter streamer's copies, the checkpointer's snapshot copies and the planner's timing events.
One module to read when asking "which streams exist, and which events does a thread sleep on".

This module only *makes* them. Ordering (``wait_stream``, ``wait_event``, ``record_stream``,
which stream an event is recorded on, who synchronizes) stays at each call site, next to the
copies it orders, where ``TRANSFER.md`` and each client's protocol note describe it.
"""

from __future__ import annotations

import torch


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream on ``device``, for copies that must overlap the compute stream.

    Made once per owner and device and kept (never one per copy: PyTorch's stream pool is
    round-robin, so pool streams alias other components' streams)."""
    return torch.cuda.Stream(device=device)


def event(*, blocking: bool = False) -> torch.cuda.Event:
    """A completion event. ``blocking=True``: a host thread that synchronizes on it sleeps
    instead of spinning (``cudaEventBlockingSync``); for threads that wait on copies."""
    return torch.cuda.Event(blocking=blocking)


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A non-blocking event recorded on ``stream`` now (what ``stream.record_event()`` makes)."""
    done = torch.cuda.Event()
    done.record(stream)
    return done


def timing_event() -> torch.cuda.Event:
    """An event that records a timestamp, for ``elapsed_time`` (the planner's profiler)."""
    return torch.cuda.Event(enable_timing=True)
