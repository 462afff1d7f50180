"""Asynchronous moves between device, host and disk, returned as futures.

* device -> host: a dedicated CUDA stream waits for the producer (``wait_stream``, no host sync),
  copies into a pinned pool block and records an event. A completion thread waits on the events in
  order, then resolves the futures and drops the source tensor, so the source stays alive exactly
  until its copy has finished (no ``record_stream`` games, no device-wide sync).
* host -> device: the destination is allocated on the caller's stream, the copy runs on a second
  side stream, and ``result()`` makes the caller's stream wait on the copy's event (device-side).
* host <-> disk: the disk tier's I/O threads.

On a CPU-only machine "device" is this process's memory: the same calls copy with ``torch`` on a
worker thread (``copy_`` releases the GIL), and disk reads land directly in the returned tensor.

A byte throttle bounds the data in flight so a burst of requests cannot pin unbounded memory.
This module schedules copies; it never decides *what* to move (that is the clients' and planner's job).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

import torch

from tensortier._units import SizeLike, parse_size
from tensortier.errors import ClosedError, TierFullError
from tensortier.tiers.disk import DiskHandle, DiskStore, as_bytes
from tensortier.tiers.host import HostBlock, HostPool, aligned_empty

T = TypeVar("T")
DIRECTIONS = ("d2h", "h2d", "h2disk", "disk2h")


@dataclass
class TransferStats:
    bytes: dict[str, int]
    count: dict[str, int]
    wait_seconds: float = 0.0  # callers blocked in result() on unfinished transfers
    throttle_seconds: float = 0.0  # submitters blocked because too many bytes were in flight
    peak_inflight_bytes: int = 0

    @classmethod
    def empty(cls) -> TransferStats:
        return cls(bytes=dict.fromkeys(DIRECTIONS, 0), count=dict.fromkeys(DIRECTIONS, 0))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class HostTensor:
    """A tensor held in a :class:`HostBlock`; ``free()`` hands the block back to its pool."""

    block: HostBlock
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def tensor(self) -> torch.Tensor:
        return self.block.view.view(self.dtype).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return self.block.nbytes

    def free(self) -> None:
        self.block.free()


class Transfer(Future, Generic[T]):
    """A future that accounts the time its caller waited, and can finish on the caller's thread."""

    def __init__(self, stats: TransferStats, lock: threading.Lock):
        super().__init__()
        self._stats, self._stats_lock = stats, lock
        self._on_result = None

    def result(self, timeout: float | None = None) -> T:
        if not self.done():
            t0 = time.perf_counter()
            value = super().result(timeout)
            with self._stats_lock:
                self._stats.wait_seconds += time.perf_counter() - t0
        else:
            value = super().result(timeout)
        return self._on_result(value) if self._on_result is not None else value


class _Throttle:
    """Blocks submitters while more than ``limit`` bytes are in flight (one oversize request passes)."""

    def __init__(self, limit: int, stats: TransferStats):
        self.limit, self.inflight, self.stats = limit, 0, stats
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            if self.inflight and self.inflight + nbytes > self.limit:
                t0 = time.perf_counter()
                while self.inflight and self.inflight + nbytes > self.limit:
                    self._cond.wait()
                self.stats.throttle_seconds += time.perf_counter() - t0
            self.inflight += nbytes
            self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.inflight)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.inflight -= nbytes
            self._cond.notify_all()


class TransferEngine:
    """Moves tensors between tiers asynchronously.

    >>> engine = TransferEngine(host=HostPool("8GiB"), disk=DiskStore("/mnt/nvme/tt"))
    >>> h = engine.to_host(activation)          # Transfer[HostTensor]
    >>> d = engine.to_disk(activation)          # Transfer[DiskHandle]
    >>> x = engine.from_disk(d.result(), to="device").result()
    """

    def __init__(
        self,
        *,
        host: HostPool | None = None,
        disk: DiskStore | None = None,
        max_inflight: SizeLike = "512MiB",
        device: torch.device | str | None = None,
        threads: int = 2,
    ):
        self.host = host if host is not None else HostPool("1TiB")
        self.disk = disk
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.stats = TransferStats.empty()
        self._lock = threading.Lock()
        self._throttle = _Throttle(
            parse_size(max_inflight, name="max_inflight", allow_zero=False), self.stats
        )
        self._closed = False
        self._cpu = ThreadPoolExecutor(threads, thread_name_prefix="tt-copy")
        if self.device.type == "cuda":
            self._d2h_stream = torch.cuda.Stream(self.device)
            self._h2d_stream = torch.cuda.Stream(self.device)
            self._events: queue.Queue = queue.Queue()
            self._completer = threading.Thread(
                target=self._complete_events, name="tt-cuda-events", daemon=True
            )
            self._completer.start()

    # ---------------------------------------------------------------- public API
    def to_host(self, tensor: torch.Tensor) -> Transfer[HostTensor]:
        """Copy a device (or CPU) tensor into a host pool block."""
        self._check_open()
        src = tensor.detach()
        nbytes = src.numel() * src.element_size()
        block = self.host.alloc(nbytes)
        out = HostTensor(block, src.dtype, tuple(src.shape))
        fut = self._start("d2h", nbytes)
        if src.device.type == "cuda":
            compute = torch.cuda.current_stream(src.device)
            self._d2h_stream.wait_stream(compute)
            with torch.cuda.stream(self._d2h_stream):
                out.tensor.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h_stream)
            self._events.put((event, fut, out, src, "d2h", nbytes))
        else:
            self._on_thread(fut, "d2h", nbytes, lambda: (out.tensor.copy_(src), out)[1])
        return fut

    def to_device(
        self,
        host: HostTensor | torch.Tensor,
        *,
        free: bool = False,
        device: torch.device | None = None,
    ) -> Transfer[torch.Tensor]:
        """Copy a host tensor to the device. ``free=True`` returns the host block once copied."""
        self._check_open()
        device = torch.device(device) if device is not None else self.device
        src = host.tensor if isinstance(host, HostTensor) else host
        nbytes = src.numel() * src.element_size()
        fut = self._start("h2d", nbytes)
        release = host.free if (free and isinstance(host, HostTensor)) else None
        if device.type == "cuda":
            dst = torch.empty(src.shape, dtype=src.dtype, device=device)  # on the caller's stream
            self._h2d_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._h2d_stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._h2d_stream)

            def wait_on_copy(value: torch.Tensor) -> torch.Tensor:
                torch.cuda.current_stream(device).wait_event(event)  # device-side, no host sync
                return value

            fut._on_result = wait_on_copy
            # resolve at once: the consumer's stream waits on the event, not the host
            self._finish(fut, "h2d", nbytes, dst)
            self._events.put((event, None, None, (src, dst, release), "h2d-free", 0))
        else:

            def copy() -> torch.Tensor:
                out = torch.empty(src.shape, dtype=src.dtype)
                out.copy_(src)
                if release is not None:
                    release()
                return out

            self._on_thread(fut, "h2d", nbytes, copy)
        return fut

    def to_disk(
        self, tensor: torch.Tensor | HostTensor, *, free: bool = False
    ) -> Transfer[DiskHandle]:
        """Write a device, CPU or host-pool tensor to the disk tier.

        Device tensors are staged through a host block, which is returned to the pool once written.
        ``free=True`` frees a given :class:`HostTensor` once written.
        """
        self._check_open()
        disk = self._need_disk()
        if isinstance(tensor, HostTensor):
            return self._host_to_disk(tensor, free=free)
        if tensor.device.type == "cuda":
            staged = self.to_host(tensor)
            out = Transfer(self.stats, self._lock)
            out.set_running_or_notify_cancel()

            def staged_done(f: Future) -> None:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                    return
                inner = self._host_to_disk(Future.result(f), free=True)
                inner.add_done_callback(lambda g: _forward(g, out))

            staged.add_done_callback(staged_done)
            return out
        data = tensor.detach()
        nbytes = data.numel() * data.element_size()
        fut = self._start("h2disk", nbytes)
        self._forward_disk(disk.put(data), fut, "h2disk", nbytes)
        return fut

    def from_disk(
        self, handle: DiskHandle, *, to: str = "device", free: bool = False
    ) -> Transfer[torch.Tensor] | Transfer[HostTensor]:
        """Read a tensor back, to a host pool block (``to="host"``) or to the device.

        ``free=True`` frees the disk extent once read.
        """
        self._check_open()
        if to not in ("host", "device"):
            raise ValueError(f"to must be 'host' or 'device', got {to!r}")
        disk = self._need_disk()
        fut = self._start("disk2h", handle.nbytes)
        if to == "device" and self.device.type == "cpu":  # process memory: read straight into it
            try:
                into = self.host.lend(handle.length)  # recycled memory: no first-touch page faults
            except TierFullError:
                into = None
            self._forward_disk(
                disk.get(handle, into=into),
                fut,
                "disk2h",
                handle.nbytes,
                after=(lambda: disk.free(handle)) if free else None,
            )
            return fut
        block = self.host.alloc(handle.length)
        inner = disk.get(handle, into=block.buffer)
        host = HostTensor(block, handle.dtype, handle.shape)
        host.block.nbytes = handle.nbytes

        def read_done(f: Future) -> None:
            if f.exception() is not None:
                block.free()
                self._fail(fut, "disk2h", handle.nbytes, f.exception())
                return
            if free:
                disk.free(handle)
            self._finish(fut, "disk2h", handle.nbytes, host)

        inner.add_done_callback(read_done)
        if to == "host":
            return fut
        out = Transfer(self.stats, self._lock)
        out.set_running_or_notify_cancel()

        def to_dev(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            dev = self.to_device(Future.result(f), free=True)
            out._on_result = dev._on_result
            dev.add_done_callback(lambda g: _forward(g, out))

        fut.add_done_callback(to_dev)
        return out

    def synchronize(self) -> None:
        """Wait until every transfer submitted so far has finished."""
        with self._throttle._cond:
            while self._throttle.inflight:
                self._throttle._cond.wait()

    def close(self) -> None:
        if self._closed:
            return
        self.synchronize()
        self._closed = True
        self._cpu.shutdown(wait=True)
        if self.device.type == "cuda":
            self._events.put(None)
            self._completer.join()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("TransferEngine is closed")

    def _need_disk(self) -> DiskStore:
        if self.disk is None:
            raise ValueError("this TransferEngine has no disk tier; pass disk=DiskStore(spill_dir)")
        return self.disk

    def _start(self, direction: str, nbytes: int) -> Transfer:
        self._throttle.acquire(nbytes)
        fut: Transfer = Transfer(self.stats, self._lock)
        fut.set_running_or_notify_cancel()
        return fut

    def _finish(self, fut: Transfer, direction: str, nbytes: int, value) -> None:
        with self._lock:
            self.stats.bytes[direction] += nbytes
            self.stats.count[direction] += 1
        self._throttle.release(nbytes)
        fut.set_result(value)

    def _fail(self, fut: Transfer, direction: str, nbytes: int, error: BaseException) -> None:
        self._throttle.release(nbytes)
        fut.set_exception(error)

    def _on_thread(self, fut: Transfer, direction: str, nbytes: int, fn) -> None:
        def run() -> None:
            try:
                value = fn()
            except BaseException as exc:
                self._fail(fut, direction, nbytes, exc)
            else:
                self._finish(fut, direction, nbytes, value)

        self._cpu.submit(run)

    def _forward_disk(
        self, inner: Future, fut: Transfer, direction: str, nbytes: int, after=None
    ) -> None:
        def done(f: Future) -> None:
            if f.exception() is not None:
                self._fail(fut, direction, nbytes, f.exception())
                return
            if after is not None:
                after()
            self._finish(fut, direction, nbytes, f.result())

        inner.add_done_callback(done)

    def _host_to_disk(self, host: HostTensor, *, free: bool) -> Transfer[DiskHandle]:
        disk = self._need_disk()
        nbytes = host.nbytes
        fut = self._start("h2disk", nbytes)
        # the block is page-aligned, so O_DIRECT writes straight from it
        self._forward_disk(
            disk.put(host.tensor), fut, "h2disk", nbytes, after=host.free if free else None
        )
        if free:  # also give the block back if the write failed
            fut.add_done_callback(
                lambda f: f.exception() is not None and not host.block.freed and host.free()
            )
        return fut

    def _complete_events(self) -> None:
        """CUDA only: wait for copy events in submission order, then resolve and release."""
        while True:
            item = self._events.get()
            if item is None:
                return
            event, fut, value, keepalive, direction, nbytes = item
            event.synchronize()  # releases the GIL while the copy runs
            if direction == "h2d-free":
                _src, _dst, release = keepalive
                if release is not None:
                    release()
                continue
            del keepalive  # the source may now be freed: its copy is complete
            self._finish(fut, direction, nbytes, value)


def _forward(src: Future, dst: Future) -> None:
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(Future.result(src))


__all__ = ["HostTensor", "Transfer", "TransferEngine", "TransferStats", "aligned_empty", "as_bytes"]
