"""``transfer/streams.py``, the one copy sequence of every tier move, on a machine without a GPU:
the CUDA calls are replaced by objects that log them, so a reordering (a copy before the side
stream waits, a ``record_stream`` on the wrong stream, a missing event) fails here. The same
sequences run on a GPU in the clients' ``@pytest.mark.gpu`` tests."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from tensortier import HostPool, TransferEngine
from tensortier.checkpoint import checkpointer
from tensortier.optim._staging import Staging
from tensortier.transfer import streams
from tensortier.transfer.streams import SideStreams, consume

CUDA = torch.device("cuda", 0)


class FakeCuda:
    """Streams, events and tensors that append what is done to them to ``log``."""

    def __init__(self):
        self.log: list[tuple] = []
        self.ids = itertools.count()
        self.compute = FakeStream(self, "compute")
        self.current = [self.compute]  # what torch.cuda.stream() pushes

    def install(self, monkeypatch) -> FakeCuda:
        @contextlib.contextmanager
        def stream(s):
            self.current.append(s)
            try:
                yield
            finally:
                self.current.pop()

        made = {
            "Stream": lambda device=None: FakeStream(self, f"side{next(self.ids)}", device),
            "Event": lambda blocking=False, enable_timing=False: FakeEvent(self, blocking),
            "current_stream": lambda device=None: self.current[-1],
            "stream": stream,
            "device": lambda device: contextlib.nullcontext(),
        }
        for name, fn in made.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        return self

    def tensor(self, name: str, device=CUDA, dtype=torch.float32) -> FakeTensor:
        return FakeTensor(self, name, device, dtype)


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str, device=None):
        self.cuda, self.name, self.device = cuda, name, device

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, cuda: FakeCuda, blocking: bool):
        self.cuda, self.blocking, self.name = cuda, blocking, f"event{next(cuda.ids)}"

    def record(self, stream: FakeStream) -> None:
        self.cuda.log.append(("record", self.name, stream.name))


class FakeTensor:
    def __init__(self, cuda: FakeCuda, name: str, device, dtype):
        self.cuda, self.name, self.device, self.dtype = cuda, name, torch.device(device), dtype
        self.shape = (2,)

    def copy_(self, src: FakeTensor, non_blocking: bool = False) -> FakeTensor:
        on = self.cuda.current[-1].name
        self.cuda.log.append(("copy", self.name, src.name, non_blocking, on))
        return self

    def record_stream(self, stream: FakeStream) -> None:
        self.cuda.log.append(("record_stream", self.name, stream.name))

    def view(self, *shape) -> FakeTensor:
        return self

    def to(self, device, non_blocking: bool = False) -> FakeTensor:
        on = self.cuda.current[-1].name
        self.cuda.log.append(("to", self.name, non_blocking, on))
        return self.cuda.tensor(self.name + "@dev", device, self.dtype)


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def test_copy_waits_for_compute_then_copies_records_sources_and_the_event(cuda):
    copies = SideStreams()
    a, b = cuda.tensor("host_a", "cpu"), cuda.tensor("host_b", "cpu")
    done = copies.copy(
        [(a, cuda.tensor("grad_a")), (b, cuda.tensor("grad_b"))],
        CUDA,
        direction="d2h",
        record_sources=True,
    )
    side = copies.stream(CUDA, "d2h").name
    assert cuda.log == [
        ("wait_stream", side, "compute"),
        ("copy", "host_a", "grad_a", True, side),
        ("record_stream", "grad_a", side),
        ("copy", "host_b", "grad_b", True, side),
        ("record_stream", "grad_b", side),
        ("record", done.name, side),
    ]
    assert not done.blocking


def test_copy_after_a_given_stream_or_none_and_a_blocking_event(cuda):
    copies = SideStreams()
    consumer = FakeStream(cuda, "consumer")
    done = copies.copy(
        [(cuda.tensor("dst"), cuda.tensor("src", "cpu"))],
        CUDA,
        direction="h2d",
        after=consumer,
        blocking=True,
    )
    side = copies.stream(CUDA, "h2d").name
    assert cuda.log == [
        ("wait_stream", side, "consumer"),
        ("copy", "dst", "src", True, side),
        ("record", done.name, side),
    ]  # no record_stream unless asked: the engine keeps its sources alive instead
    assert done.blocking
    cuda.log.clear()
    again = copies.copy(
        [(cuda.tensor("d"), cuda.tensor("s", "cpu"))], CUDA, direction="h2d", after=None
    )
    assert cuda.log == [("copy", "d", "s", True, side), ("record", again.name, side)]


def test_read_is_copied_on_the_side_stream_and_the_source_is_recorded(cuda):
    copies = SideStreams()
    read_on = []

    def read(t):
        read_on.append(cuda.current[-1].name)
        return cuda.tensor(t.name + ".bytes")

    copies.copy(
        [(cuda.tensor("slot", "cpu"), cuda.tensor("param"))],
        CUDA,
        direction="d2h",
        read=read,
        record_sources=True,
    )
    side = copies.stream(CUDA, "d2h").name
    assert read_on == [side]
    assert cuda.log[1:3] == [
        ("copy", "slot", "param.bytes", True, side),
        ("record_stream", "param", side),
    ]


def test_h2d_into_another_dtype_converts_on_the_device(cuda, monkeypatch):
    made = []

    def empty(shape, dtype, device):
        made.append((dtype, torch.device(device), cuda.current[-1].name))
        return cuda.tensor("tmp", device, dtype)

    monkeypatch.setattr(torch, "empty", empty)
    copies = SideStreams()
    master = cuda.tensor("master", "cpu", torch.float32)
    copies.copy([(cuda.tensor("param", dtype=torch.bfloat16), master)], CUDA, direction="h2d")
    side = copies.stream(CUDA, "h2d").name
    assert made == [(torch.float32, CUDA, side)]  # a temporary in the master's dtype
    assert cuda.log[1:3] == [
        ("copy", "tmp", "master", True, side),  # PCIe in the master dtype
        ("copy", "param", "tmp", False, side),  # converted on the device
    ]


def test_streams_are_made_once_per_device_and_direction_and_owner(cuda):
    split, shared = SideStreams(), SideStreams(split=False)
    assert split.stream(CUDA, "d2h") is split.stream(CUDA, "d2h")
    assert split.stream(CUDA, "d2h") is not split.stream(CUDA, "h2d")
    assert split.stream(CUDA, "d2h") is not split.stream(torch.device("cuda", 1), "d2h")
    assert shared.stream(CUDA, "d2h") is shared.stream(CUDA, "h2d")
    assert shared.stream(CUDA, "d2h") is not split.stream(CUDA, "d2h")  # owners never share
    assert split.stream(CUDA, "d2h").device == CUDA
    assert set(split.made()) == {(CUDA, "d2h"), (CUDA, "h2d"), (torch.device("cuda", 1), "d2h")}
    assert set(shared.made()) == {(CUDA, "both")}
    for _ in range(3):
        split.copy([], CUDA, direction="d2h")
    assert len({e[1] for e in cuda.log if e[0] == "wait_stream"}) == 1  # never one per copy


def test_consume_waits_then_records_the_tensors_on_the_consumer(cuda):
    done = streams.event()
    consume(done, cuda.compute, [cuda.tensor("a"), cuda.tensor("b")])
    assert cuda.log == [
        ("wait_event", "compute", done.name),
        ("record_stream", "a", "compute"),
        ("record_stream", "b", "compute"),
    ]


def test_copy_new_allocates_on_the_side_stream_without_waiting(cuda):
    copies = SideStreams()
    out, done = copies.copy_new([cuda.tensor("home")], CUDA)
    side = copies.stream(CUDA, "h2d").name
    assert cuda.log == [("to", "home", True, side), ("record", done.name, side)]
    assert [t.name for t in out] == ["home@dev"]


def test_copy_new_after_a_producer_and_a_blocking_event(cuda):
    copies = SideStreams()
    out, done = copies.copy_new(
        [cuda.tensor("pinned", "cpu")], CUDA, after=streams.COMPUTE, blocking=True
    )
    side = copies.stream(CUDA, "h2d").name
    assert cuda.log == [
        ("wait_stream", side, "compute"),
        ("to", "pinned", True, side),
        ("record", done.name, side),
    ]
    assert done.blocking


def test_cpu_device_does_plain_copies_and_no_event():
    copies = SideStreams()
    dst, src = torch.zeros(4, dtype=torch.float64), torch.arange(4, dtype=torch.float32)
    assert copies.copy([(dst, src)], torch.device("cpu"), direction="h2d") is None
    assert torch.equal(dst, src.double())
    raw = torch.zeros(16, dtype=torch.uint8)
    copies.copy(
        [(raw, src)], torch.device("cpu"), direction="d2h", read=lambda t: t.view(torch.uint8)
    )
    assert torch.equal(raw, src.view(torch.uint8))


# ------------------------------------------------------------------ the clients' sequences
@pytest.mark.parametrize("own", [False, True], ids=["pool-block", "callers-tensor"])
def test_engine_h2d_allocates_on_its_side_stream_and_every_reader_records(cuda, own):
    """stop-37 lead: the destination came from the consumer's pool, so the copy first waited for
    every kernel queued there (a backward prefetch could not overlap the compute before it).
    Now torchtune's unpack: allocated and copied on the h2d side stream, no wait (a caller's own
    tensor: after its producer's stream); each reader waits for the event and ``record_stream``s
    the destination, and the engine keeps source and destination until the copy ran."""
    pending, issued = [], []
    with TransferEngine(host=HostPool("1MiB", pin=False)) as engine:
        engine._completer.put = pending.append
        producer = FakeStream(cuda, "producer") if own else None
        src = cuda.tensor("pinned", "cpu")
        engine._h2d(src, CUDA, producer, lambda d, on: issued.append((d, on)), None, None)
    side = engine._streams.stream(CUDA, "h2d").name
    (item,) = pending
    wait = [("wait_stream", side, "producer")] if own else []
    assert cuda.log == wait + [("to", "pinned", True, side), ("record", item.event.name, side)]
    assert item.event.blocking  # the completion thread sleeps on it
    ((dst, on_result),) = issued
    assert item.keep == (src, dst)
    cuda.log.clear()
    assert on_result(dst) is dst  # Transfer.result() on the reader's (here: compute) stream
    assert cuda.log == [
        ("wait_event", "compute", item.event.name),
        ("record_stream", dst.name, "compute"),
    ]


def test_engine_h2d_waits_for_the_callers_stream_only_for_a_callers_own_tensor(cuda, monkeypatch):
    """A pool block is complete on the host (its D2H event was waited on); a caller's pinned tensor
    may still be the target of a ``non_blocking`` copy queued on the caller's stream."""

    class Issued(Exception):
        pass

    seen = []

    def copy_new(host, device, *, after=None, blocking=False):
        seen.append(after)
        raise Issued

    with TransferEngine(host=HostPool("1MiB", pin=False)) as engine:
        block = engine.to_host(torch.ones(4)).result()
        monkeypatch.setattr(engine._streams, "copy_new", copy_new)
        monkeypatch.setattr(engine, "_target", lambda device: CUDA)
        for host in (block, torch.ones(4)):
            with pytest.raises(Issued):
                engine.to_device(host)
        block.free()
    assert seen == [None, cuda.compute]


def test_gradient_staging_sequence(cuda):
    staging = Staging({CUDA})
    views = [cuda.tensor("v0", "cpu"), cuda.tensor("v1", "cpu")]
    staged = staging._d2h(CUDA, views, [cuda.tensor("g0"), cuda.tensor("g1")])
    side = staging._streams.stream(CUDA, "d2h").name
    assert cuda.log == [
        ("wait_stream", side, "compute"),
        ("copy", "v0", "g0", True, side),
        ("record_stream", "g0", side),
        ("copy", "v1", "g1", True, side),
        ("record_stream", "g1", side),
        ("record", staged._event.name, side),
    ]
    # the tt-adamw worker (and step()'s check) sleeps on it: these waits overlap CPU work, unlike
    # torchao's serial step() (stop-37 lead; see optim/_staging.py "Waits")
    assert staged._event.blocking


def test_write_back_waits_for_compute_once_per_step_and_compute_waits_at_the_end(cuda):
    staging = Staging({CUDA})
    side = staging._streams.stream(CUDA, "h2d").name
    assert side == staging._streams.stream(CUDA, "d2h").name  # one stream for both directions

    class Holder:
        event = None

    first, second = Holder(), Holder()
    staging.write_back([(cuda.tensor("p0"), cuda.tensor("m0", "cpu"))], first)
    staging.write_back([(cuda.tensor("p1"), cuda.tensor("m1", "cpu"))], second)
    staging.finish_write_back()
    end = [e for e in cuda.log if e[0] == "record"][-1][1]
    assert cuda.log == [
        ("wait_stream", side, "compute"),
        ("copy", "p0", "m0", True, side),
        ("record", first.event.name, side),
        ("copy", "p1", "m1", True, side),  # the same step: no second wait
        ("record", second.event.name, side),
        ("record", end, side),
        ("wait_event", "compute", end),
    ]
    assert first.event.blocking and second.event.blocking  # the worker sleeps on them
    cuda.log.clear()
    staging.write_back([(cuda.tensor("p2"), cuda.tensor("m2", "cpu"))], Holder())
    assert cuda.log[0] == ("wait_stream", side, "compute")  # the next step waits again


@pytest.mark.parametrize("early", [True, False])
def test_checkpoint_snapshot_sequence(cuda, monkeypatch, early):
    monkeypatch.setattr(checkpointer, "as_bytes", lambda t: cuda.tensor(t.name + ".bytes"))
    copies = SideStreams()
    first = [(cuda.tensor("slot_buf", "cpu"), cuda.tensor("buf"))] if early else []
    done = checkpointer._copy_from_device(
        CUDA, first, [(cuda.tensor("slot_w", "cpu"), cuda.tensor("w"))], copies
    )
    side = copies.stream(CUDA, "d2h").name
    head = [("wait_stream", side, "compute")]
    if early:
        early_done = cuda.log[3][1]
        head += [
            ("copy", "slot_buf", "buf.bytes", True, side),
            ("record_stream", "buf", side),
            ("record", early_done, side),
            ("wait_event", "compute", early_done),  # the next forward waits for the early copies
        ]
    assert cuda.log == head + [
        ("copy", "slot_w", "w.bytes", True, side),
        ("record_stream", "w", side),
        ("record", done.name, side),
    ]
    assert done.blocking  # the persist thread sleeps on it


def test_planner_timing_events_come_from_the_engine(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw) or kw)
    assert streams.timing_event() == {"enable_timing": True}
    assert made == [{"enable_timing": True}]
