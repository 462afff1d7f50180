import errno
import gc
import os
import threading
import time
import warnings
import weakref

import pytest
import torch

from tensortier import ClosedError, ConfigError, DiskStore, HostPool, TierFullError, TransferEngine
from tensortier._lifetime import quiesce
from tensortier.tiers.codecs import LOSSLESS_CODECS, get_codec
from tensortier.transfer import Encoded, HostTensor
from tests.conftest import ALL_DTYPES, bit_equal, make_tensor


@pytest.fixture
def engine(spill_dir):
    with (
        DiskStore(spill_dir, slab_size="4MiB") as disk,
        TransferEngine(host=HostPool("64MiB", pin=None), disk=disk, inflight_budget="8MiB") as e,
    ):
        yield e


def _until(condition, seconds=5.0):
    """The I/O thread that resolved a future may hold a view of its buffer for a moment longer."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_device_host_device_round_trip(engine, dtype):
    x = make_tensor((37, 11), dtype).to(_device())
    host = engine.to_host(x).result()
    assert isinstance(host, HostTensor) and bit_equal(host.tensor, x)
    y = engine.to_device(host, free=True).result()
    assert y.device.type == x.device.type and bit_equal(y, x)
    assert engine.host.stats.in_use == 0


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_device_disk_device_round_trip(engine, dtype):
    x = make_tensor((3, 1000), dtype).to(_device())[:, ::2]  # non-contiguous
    handle = engine.to_store(x, "disk").result()
    y = engine.from_store(handle, "disk", to="device", free=True).result()
    assert torch.equal(y.cpu(), x.cpu()) and y.dtype == x.dtype
    del y  # on CPU the result lives in memory lent by the host pool until it is dropped
    _until(lambda: gc.collect() is not None and engine.host.stats.in_use == 0)
    assert len(engine.disk) == 0 and engine.host.stats.in_use == 0


def test_host_tensor_to_disk_and_back_to_host(engine):
    x = torch.randn(5000)
    host = engine.to_host(x).result()
    handle = engine.to_store(host, "disk", free=True).result()
    assert host.block.freed
    back = engine.from_store(handle, "disk", to="host").result()
    assert isinstance(back, HostTensor) and torch.equal(back.tensor, x)
    back.free()


def test_stats_count_bytes_per_direction(engine):
    x = torch.randn(1024)  # 4 KiB
    h = engine.to_store(engine.to_host(x).result(), "disk", free=True).result()
    engine.to_device(engine.from_store(h, "disk", to="host").result(), free=True).result()
    s = engine.stats
    assert s.bytes == {
        "d2h": 4096,
        "h2d": 4096,
        "h2disk": 4096,
        "disk2h": 4096,
        "h2remote": 0,
        "remote2h": 0,
    }
    assert all(s.count[d] == 1 for d in ("d2h", "h2d", "h2disk", "disk2h"))
    assert s.wait_seconds >= 0


def test_many_concurrent_transfers_stay_under_inflight_bound(engine):
    xs = [
        torch.full((1 << 18,), float(i)) for i in range(40)
    ]  # 1 MiB each, 40 MiB total > 8 MiB bound
    futs = [engine.to_store(x, "disk") for x in xs]
    handles = [f.result() for f in futs]
    assert engine.stats.peak_inflight_bytes <= 8 << 20
    outs = [engine.from_store(h, "disk", free=True) for h in handles]
    for i, f in enumerate(outs):
        assert bool((f.result() == i).all())
    assert engine.stats.peak_inflight_bytes <= 8 << 20


def test_disk_error_reaches_the_future_and_releases_everything(engine, monkeypatch):
    def enospc(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    with pytest.raises(TierFullError):
        engine.to_store(engine.to_host(torch.randn(2000)).result(), "disk", free=True).result()
    monkeypatch.undo()
    engine.synchronize()  # nothing left in flight
    assert engine.host.stats.in_use == 0 and len(engine.disk) == 0


def test_host_budget_error_is_raised_at_submit(spill_dir):
    with TransferEngine(host=HostPool("1MiB", pin=False)) as e:
        keep = e.to_host(torch.zeros(200_000)).result()
        with pytest.raises(TierFullError, match="host"):
            e.to_host(torch.zeros(200_000))
        keep.free()


def test_engine_without_disk_explains(spill_dir):
    with (
        TransferEngine(host=HostPool("1MiB", pin=False)) as e,
        pytest.raises(ValueError, match="DiskStore"),
    ):
        e.to_store(torch.zeros(4), "disk")


def test_to_store_takes_any_store_and_refuses_what_is_not_one(spill_dir):
    """Issue 26: ``to_store``/``from_store`` move to the store they are given (a Store object,
    or the engine's own by tier name); anything else is a TypeError naming the fix."""
    x = torch.randn(3000)
    with (
        DiskStore(spill_dir) as disk,
        TransferEngine(host=HostPool("1MiB", pin=False)) as e,
    ):
        h = e.to_store(x, disk).result()
        assert h in disk and e.stats.bytes["h2disk"] == x.nbytes
        assert torch.equal(e.from_store(h, disk, free=True).result(), x) and h not in disk
        enc = e.to_store(x, disk, codec=get_codec("zstd")).result()
        assert isinstance(enc, Encoded) and all(p in disk for p in enc.parts)
        assert torch.equal(e.from_store(enc, disk, to="device", free=True).result(), x)
        assert len(disk) == 0 and e.stats.count["disk2h"] == 2
        for bad in (None, 42, "nvme"):
            with pytest.raises(TypeError, match="not a Store"):
                e.to_store(x, bad)
            with pytest.raises(TypeError, match="not a Store"):
                e.from_store(h, bad)
        e.synchronize(timeout=30)


@pytest.mark.parametrize("bad", [None, 42, "handle"], ids=repr)
def test_from_store_names_a_handle_that_is_not_one(engine, bad):
    """from_store(None, "disk") said "'NoneType' object has no attribute 'nbytes'"."""
    with pytest.raises(TypeError, match=r"from_store\(handle\): expected the handle"):
        engine.from_store(bad, "disk")
    assert _idle(engine)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"host": "8GiB"}, r"host='8GiB'\): pass a HostPool, e.g. host=tt.HostPool"),
        ({"disk": "/tmp"}, r"disk='/tmp'\): pass a Store, e.g. disk=tt.DiskStore"),
        ({"remote": {"budget": "1GiB"}}, r"remote=\{'budget': '1GiB'\}\): pass a Store"),
    ],
    ids=["host-size", "disk-path", "remote-args"],
)
def test_constructor_refuses_tiers_that_are_not_tiers(kwargs, says):
    """TransferEngine(host="8GiB") was made, then its first to_host said "'str' object has no
    attribute 'alloc'" (disk="/tmp": "... no attribute 'put'")."""
    with pytest.raises(ConfigError, match=says):
        TransferEngine(**kwargs)


def test_closed_engine_refuses(spill_dir):
    e = TransferEngine(host=HostPool("1MiB", pin=False))
    e.close()
    with pytest.raises(ClosedError):
        e.to_host(torch.zeros(4))


def test_a_call_waiting_for_bytes_when_close_begins_is_refused(spill_dir):
    """A call blocked in the byte throttle when close() began went on once bytes came back,
    after close()'s wait: its copy found the workers shut down (a raw RuntimeError) or, on CUDA,
    the completion thread stopped (a future that never resolved). It is refused now, and close()
    still waits for the transfer that was in flight."""
    engine = TransferEngine(host=HostPool("8MiB", pin=False), io_threads=1, inflight_budget="1MiB")
    gate = _gate(engine)
    x = torch.randn(1 << 18)  # the whole inflight budget
    first = engine.to_host(x)  # queued behind the gate
    outcome = []

    def second():
        try:
            outcome.append(engine.to_host(torch.ones(1 << 10)))  # waits for first's bytes
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.3)  # in the throttle by now (and refused all the same if not yet)
    closer = threading.Thread(target=engine.close)
    closer.start()
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], ClosedError), outcome
    assert closer.is_alive()  # still waiting for the transfer in flight
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert bit_equal(first.result(timeout=10).tensor, x)
    assert engine._throttle.inflight == 0
    with pytest.raises(ClosedError):
        engine.to_host(x)


def test_a_device_copy_queued_after_close_fails_instead_of_waiting_forever():
    """The completion thread is gone after close(): an item queued then used to wait forever
    (on CPU it even started a new completion thread that nothing stopped)."""
    engine = TransferEngine(host=HostPool("1MiB", pin=False))
    engine.close()
    failed = []
    engine._enqueue(_Event(), _Source(), lambda: failed.append("done"), failed.append)
    assert len(failed) == 1 and isinstance(failed[0], ClosedError), failed
    assert not any(t.name == "tt-cuda-events" for t in threading.enumerate())


def test_wait_time_is_accounted(engine):
    gate = threading.Event()
    real = engine.disk._read_chunk

    def slow_read(*a):
        gate.wait(5)
        return real(*a)

    h = engine.to_store(torch.randn(1000), "disk").result()
    engine.disk._read_chunk = slow_read
    fut = engine.from_store(h, "disk")
    threading.Timer(0.2, gate.set).start()
    fut.result()
    assert engine.stats.wait_seconds >= 0.15


# ----------------------------------------------------------------------------- failures give bytes back
def _finishes(fn, seconds: float = 10.0) -> bool:
    """Whether ``fn`` returns within ``seconds`` (on a thread: a hang fails the test, not the run)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _idle(engine) -> bool:
    return engine._throttle.inflight == 0 and _finishes(engine.synchronize)


class _Abort(BaseException):
    """What pytest.fail(), sys.exit() or a framework's cancellation raise: not an Exception."""


@pytest.mark.parametrize("path", ["to_host", "to_store", "from_store", "to_device"])
def test_a_callback_that_raises_a_base_exception_gives_the_bytes_back(spill_dir, path):
    """Future runs callbacks inside set_result and catches only Exception: a callback raising
    pytest.fail()'s or sys.exit()'s exception skipped the ticket's release, so synchronize() and
    close() waited forever for bytes nobody held (to_store, from_store)."""
    disk = DiskStore(spill_dir, slab_size="4MiB")
    engine = TransferEngine(host=HostPool("64MiB", pin=None), disk=disk)
    try:
        _raise_in_callback(engine, path)
    finally:
        if _idle(engine):  # a leak must fail the test, not hang it in close()
            engine.close()
            disk.close()


def _raise_in_callback(engine, path):
    x = torch.randn(5000)
    stored = engine.to_store(x, "disk").result() if path == "from_store" else None
    calls = []

    def callback(fut):
        calls.append(fut)
        raise _Abort

    fut = {
        "to_host": lambda: engine.to_host(x),
        "to_store": lambda: engine.to_store(x, "disk"),
        "from_store": lambda: engine.from_store(stored, "disk", free=True),
        "to_device": lambda: engine.to_device(x, device="cpu"),
    }[path]()
    try:
        fut.add_done_callback(callback)  # runs here if already done
    except _Abort:
        pass
    engine.synchronize(timeout=10)
    assert calls == [fut] and engine._throttle.inflight == 0
    out = fut.result()
    if path == "to_host":
        assert bit_equal(out.tensor, x)
        out.free()
    elif path != "to_store":
        assert bit_equal(out, x)


@pytest.mark.parametrize("to", ["device", "host"])
def test_a_callback_that_raises_on_a_failed_read_gives_the_bytes_back(spill_dir, to):
    """The failure path too: a read that fails on the disk's thread (a flipped bit) fails the
    future; a callback raising a BaseException there kept the bytes."""
    from tensortier.errors import CorruptDataError

    disk = DiskStore(spill_dir, slab_size="4MiB")
    engine = TransferEngine(host=HostPool("64MiB", pin=None), disk=disk)
    try:
        h = engine.to_store(torch.randn(300_000), "disk").result()
        (slab,) = [
            os.path.join(disk.directory, n) for n in os.listdir(disk.directory) if "slab" in n
        ]
        fd = os.open(slab, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, h.offset + 5000)[0] ^ 0x04]), h.offset + 5000)
        finally:
            os.close(fd)
        fut = engine.from_store(h, "disk", to=to)
        try:
            fut.add_done_callback(lambda f: (_ for _ in ()).throw(_Abort()))
        except _Abort:
            pass  # it had already failed: the callback ran here
        engine.synchronize(timeout=10)
        with pytest.raises(CorruptDataError):
            fut.result()
        del fut  # its error's traceback holds the memory the read went into
        gc.collect()
        _until(lambda: engine.host.stats.in_use == 0)
        assert engine.host.stats.in_use == 0
    finally:
        if _idle(engine):  # a leak must fail the test, not hang it in close()
            engine.close()
            disk.close()


def test_stale_handle_raises_and_gives_its_bytes_back(engine):
    """Issue 18 #7: a synchronous KeyError used to keep its bytes in the throttle forever, so
    synchronize() and close() hung."""
    h = engine.to_store(torch.ones(100), "disk").result()
    engine.from_store(h, "disk", free=True).result()
    for to in ("device", "host"):
        with pytest.raises(KeyError):
            engine.from_store(h, "disk", to=to).result()
    assert _idle(engine) and engine.host.stats.in_use == 0


def test_full_disk_at_submit_raises_and_gives_its_bytes_back(spill_dir):
    with (
        DiskStore(spill_dir, slab_size="1MiB", budget="1MiB") as disk,
        TransferEngine(host=HostPool("16MiB", pin=False), disk=disk, inflight_budget="4MiB") as e,
    ):
        keep = e.to_store(torch.zeros(200_000), "disk").result()  # 800 KB of the 1 MiB
        for _ in range(8):  # more than inflight_budget in total: a leak would block the next call
            with pytest.raises(TierFullError):
                e.to_store(torch.zeros(200_000), "disk").result()
            host = e.to_host(torch.zeros(200_000)).result()
            with pytest.raises(TierFullError):
                e.to_store(host, "disk", free=True).result()
            assert host.block.freed
        assert _idle(e) and e.host.stats.in_use == 0
        disk.free(keep)
        assert _finishes(e.close)


def test_full_host_pool_raises_and_gives_its_bytes_back(spill_dir):
    with (
        DiskStore(spill_dir, slab_size="4MiB") as disk,
        TransferEngine(host=HostPool("1MiB", pin=False), disk=disk, inflight_budget="1MiB") as e,
    ):
        held = e.to_host(torch.zeros(200_000)).result()
        h = e.to_store(torch.zeros(200_000), "disk").result()
        for _ in range(4):
            with pytest.raises(TierFullError):
                e.to_host(torch.zeros(200_000))
            with pytest.raises(TierFullError):
                e.from_store(h, "disk", to="host")
        held.free()
        assert _idle(e)
        e.from_store(h, "disk", to="host", free=True).result().free()


def test_failed_read_gives_its_bytes_and_block_back(engine, monkeypatch):
    h = engine.to_store(torch.randn(5000), "disk").result()

    def eio(*a):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(engine.disk, "_read_chunk", eio)
    for to in ("host", "device"):
        with pytest.raises(OSError):
            engine.from_store(h, "disk", to=to).result()
    monkeypatch.undo()
    # the I/O error's traceback (a reference cycle) holds the lent buffer until a GC pass
    _until(lambda: gc.collect() is not None and engine.host.stats.in_use == 0)
    assert _idle(engine) and engine.host.stats.in_use == 0
    engine.disk.free(h)


def test_callbacks_on_transfer_threads_never_wait_for_bytes():
    """REVIEW #13: a thread that gives bytes back (copy workers, completion thread, disk I/O
    callbacks) must never block in the throttle, or it can wait for bytes only it would release."""
    with TransferEngine(host=HostPool("16MiB", pin=False), inflight_budget="1MiB") as e:
        held = e._throttle.acquire(1 << 20)  # the bound is full
        try:
            chained = e._cpu.submit(lambda: e.to_host(torch.zeros(1 << 18)))
            assert _finishes(lambda: chained.result(timeout=10)), "a transfer thread waited"
            chained.result().result(timeout=10).free()  # waited for here, not on the worker
        finally:
            held.release()


def _in_callback(fut, fn) -> dict:
    """Run ``fn`` in a done-callback of ``fut``; what it returned or raised, once it ran."""
    out: dict = {}

    def callback(_):
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    fut.add_done_callback(callback)
    return out


@pytest.mark.parametrize("call", ["result", "exception", "synchronize", "close"])
def test_a_callback_that_waits_on_the_engine_raises_naming_the_fix(call):
    """stop 36 "engine callback self-deadlock": a done-callback runs on the engine's thread that
    finished the transfer; waiting there for a transfer queued behind it (here: on the only copy
    worker) never ended (`.result()` without a timeout hung the engine and its close())."""
    with TransferEngine(host=HostPool("16MiB", pin=False), io_threads=1) as e:
        gate = threading.Event()
        e._cpu.submit(gate.wait)  # the callback below runs on the one copy worker
        fut = e.to_host(torch.ones(1024))

        def wait():
            if call in ("result", "exception"):
                inner = e.to_host(torch.zeros(1024))  # queued behind this callback
                return getattr(inner, call)(timeout=5)  # old code: TimeoutError after 5 s
            return getattr(e, call)()

        out = _in_callback(fut, wait)
        gate.set()
        fut.result(timeout=10).free()
        _until(lambda: bool(out))
        assert isinstance(out.get("error"), RuntimeError), out
        assert "add_done_callback" in str(out["error"]) and "own thread" in str(out["error"])
        assert _finishes(e.synchronize)


def test_a_callback_on_the_completion_thread_cannot_wait_for_a_later_copy():
    """The CUDA form: callbacks of device copies run on the one completion thread, which must
    finish the later copy itself."""
    with TransferEngine(host=HostPool("1MiB", pin=False)) as e:
        first, later = _Event(), _Event()
        fut = _pending(e, first, _Source())
        queued = _pending(e, later, _Source())
        out = _in_callback(fut, lambda: queued.result(timeout=5))
        first.done.set()
        later.done.set()
        _until(lambda: bool(out))
        assert isinstance(out.get("error"), RuntimeError), out
        assert queued.result(timeout=10) == "copied"
        assert _in_callback(queued, lambda: fut.result()) == {"value": "copied"}  # done: fine


# ----------------------------------------------------------------------------- completion thread
class _Event:
    """Stands in for a CUDA event: ``synchronize()`` waits for ``done`` (or raises ``error``)."""

    def __init__(self, error: BaseException | None = None):
        self.done, self.error = threading.Event(), error

    def synchronize(self):
        assert self.done.wait(10)
        if self.error is not None:
            raise self.error


class _Source:
    """A stand-in for a device tensor whose copy is in flight (weak-referenceable)."""


def _pending(engine, event, keep, nbytes=4096):
    fut = engine._new()
    ticket = engine._throttle.acquire(nbytes)
    engine._enqueue(
        event, keep, lambda: engine._resolve(fut, ticket, "copied"), engine._failer(fut, ticket)
    )
    return fut


def test_completion_thread_drops_the_source_as_soon_as_its_copy_is_done():
    """REVIEW #13: the completer kept the last source alive through its loop variable until the
    next transfer arrived (for a whole optimizer step, say)."""
    with TransferEngine(host=HostPool("1MiB", pin=False)) as e:
        event, src = _Event(), _Source()
        ref = weakref.ref(src)
        fut = _pending(e, event, src)
        del src
        assert ref() is not None  # in flight: the engine keeps it
        event.done.set()
        assert fut.result(timeout=10) == "copied"
        _until(lambda: ref() is None)
        assert ref() is None, "the completion thread still holds the finished copy's source"


def test_device_error_fails_every_pending_transfer_and_the_next_call():
    """REVIEW #13: an exception on the completion thread used to kill it silently; every future
    then hung, and so did the throttle, synchronize() and close()."""
    e = TransferEngine(host=HostPool("1MiB", pin=False))
    bad = _Event(RuntimeError("CUDA error: an illegal memory access was encountered"))
    futs = [_pending(e, bad, _Source())] + [_pending(e, _Event(), _Source()) for _ in range(3)]
    bad.done.set()
    for f in futs:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            f.result(timeout=10)
    assert _idle(e)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        e.to_host(torch.zeros(4))
    assert _finishes(e.close)


def test_dropped_engines_leave_no_threads_and_are_collected(spill_dir):
    """REVIEW #8: the completion thread's target was a bound method, so an engine (its pinned
    pool, its disk store, its threads) was never collected. 20 engines used and dropped."""
    TransferEngine(host=HostPool("1MiB", pin=False)).close()  # the reaper thread exists from here
    gc.collect()
    quiesce()
    baseline = {t.ident for t in threading.enumerate()}
    refs = []
    for _ in range(20):
        disk = DiskStore(spill_dir, slab_size="1MiB")
        e = TransferEngine(host=HostPool("4MiB", pin=False), disk=disk)
        x = torch.randn(1000)
        assert torch.equal(e.to_device(e.to_host(x).result(), free=True).result(), x)
        assert torch.equal(
            e.from_store(e.to_store(x, "disk").result(), "disk", free=True).result(), x
        )
        event = _Event()
        fut = _pending(e, event, _Source())  # starts the completion thread
        event.done.set()
        fut.result(timeout=10)
        refs.append(weakref.ref(e))
        del e, disk, fut, event
    gc.collect()
    assert quiesce()
    _until(lambda: {t.ident for t in threading.enumerate()} <= baseline)
    extra = [t.name for t in threading.enumerate() if t.ident not in baseline]
    assert extra == [], f"threads left behind: {extra}"
    assert all(r() is None for r in refs), "an engine was never collected"


# ----------------------------------------------------------------------------- devices, defaults
def test_restores_go_to_the_device_asked_for(engine):
    """Issue 12 #6: to_device/from_store take device= (the record's device), normalised."""
    x = torch.randn(300)
    for device in ("cpu", "cpu:0", torch.device("cpu", 0)):
        y = engine.to_device(engine.to_host(x).result(), free=True, device=device).result()
        assert y.device == torch.device("cpu") and torch.equal(y, x)
        h = engine.to_store(x, "disk").result()
        y = engine.from_store(h, "disk", to="device", free=True, device=device).result()
        assert y.device == torch.device("cpu") and torch.equal(y, x)
    del y
    _until(lambda: gc.collect() is not None and engine.host.stats.in_use == 0)


def test_engine_without_a_pool_does_not_default_to_a_terabyte():
    import psutil

    with TransferEngine() as e:
        assert e.host.budget <= min(4 << 30, psutil.virtual_memory().total // 4)
        assert torch.equal(e.to_host(torch.ones(8)).result().tensor, torch.ones(8))
    assert e.host._closed  # the engine made it, so the engine closed it


# ----------------------------------------------------------------------------- codecs
@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_codec_round_trips_through_host_and_disk_are_bit_exact(engine, codec, dtype):
    """REVIEW #10: raw bytes cross to the host asynchronously and are encoded / decoded on the
    engine's threads; the results are those of the codec itself, bit for bit."""
    x = make_tensor((64, 33), dtype).to(_device())[:, ::3]  # non-contiguous
    c = get_codec(codec)
    enc = engine.to_host(x, codec=c).result()
    assert isinstance(enc, Encoded) and all(isinstance(p, HostTensor) for p in enc.parts)
    direct, _ = c.encode(x.cpu())
    assert [bit_equal(p.tensor, d) for p, d in zip(enc.parts, direct)] == [True] * len(direct)
    y = engine.to_device(enc, free=True).result()
    assert y.device.type == x.device.type and bit_equal(y, x)
    assert engine.host.stats.in_use == 0
    on_disk = engine.to_store(x, "disk", codec=c).result()
    assert all(p in engine.disk for p in on_disk.parts)
    back = engine.from_store(on_disk, "disk", to="host").result()
    assert isinstance(back, HostTensor) and bit_equal(back.tensor, x)
    back.free()
    y = engine.from_store(on_disk, "disk", to="device", free=True).result()
    assert bit_equal(y, x) and len(engine.disk) == 0
    del y
    _until(lambda: gc.collect() is not None and engine.host.stats.in_use == 0)
    assert engine.host.stats.in_use == 0 and _idle(engine)


def test_sparse_codec_through_the_engine_moves_fewer_bytes(engine):
    x = torch.relu(torch.randn(1 << 16)) * (torch.rand(1 << 16) < 0.2)
    enc = engine.to_host(x, codec=get_codec("sparse")).result()
    assert enc.payload_bytes < 0.3 * enc.nbytes
    enc.free()
    assert engine.host.stats.in_use == 0


def test_codec_failure_reaches_the_future_and_gives_bytes_back(engine):
    class Broken:
        name, lossless = "broken", True

        def encode(self, t):
            raise ValueError("cannot encode")

        def decode(self, payloads, meta):
            raise AssertionError

    with pytest.raises(ValueError, match="cannot encode"):
        engine.to_host(torch.randn(100), codec=Broken()).result()
    with pytest.raises(ValueError, match="cannot encode"):
        engine.to_store(torch.randn(100), "disk", codec=Broken()).result()
    assert _idle(engine) and engine.host.stats.in_use == 0 and len(engine.disk) == 0


# ----------------------------------------------------------------------------- blocks under copies (review-12-18 #3)
def test_host_tensor_view_stays_valid_after_the_host_tensor_is_dropped(engine):
    """``to_host(x).result().tensor``: the HostTensor is a temporary; its block must not go back
    to the pool (and be overwritten by the next transfer) while the view lives."""
    t = engine.to_host(torch.ones(1 << 16)).result().tensor
    gc.collect()
    other = engine.to_host(torch.full((1 << 16,), 7.0)).result()
    assert bool((t == 1).all()), "the view was overwritten by the next transfer"
    other.free()
    del t
    gc.collect()
    assert engine.host.stats.in_use == 0


def _gate(engine):
    """Holds the engine's (single) copy worker until the returned event is set."""
    gate = threading.Event()
    engine._cpu.submit(gate.wait, 30)
    return gate


def test_block_freed_while_its_copy_to_the_device_is_queued_is_not_rewritten(spill_dir):
    """to_device(h) then h.free(): the copy still reads the block. The pool must not lend it again
    (CachingHostAllocator's rule) until the copy has run; the copy must see the original bytes."""
    with TransferEngine(host=HostPool("64MiB", pin=False), io_threads=1) as engine:
        x = torch.randn(1 << 18)
        h = engine.to_host(x).result()
        ptr = h.block.buffer.data_ptr()
        gate = _gate(engine)
        fut = engine.to_device(h, device="cpu")  # queued behind the gate
        h.free()
        other = engine.host.alloc(h.nbytes)
        assert other.buffer.data_ptr() != ptr, "the block was lent again under a queued copy"
        other.view.fill_(0)
        gate.set()
        assert torch.equal(fut.result(), x)
        other.free()


def test_full_pool_waits_for_the_copy_that_still_reads_a_freed_block(spill_dir):
    with TransferEngine(host=HostPool("1MiB", pin=False), io_threads=1) as engine:
        x = torch.randn(1 << 18)  # exactly the budget
        h = engine.to_host(x).result()
        gate = _gate(engine)
        fut = engine.to_device(h, device="cpu")
        h.free()
        threading.Timer(0.2, gate.set).start()
        block = engine.host.alloc(h.nbytes)  # waits until the queued copy has read the block
        block.view.fill_(0)
        assert torch.equal(fut.result(), x)
        block.free()


def test_block_freed_while_it_is_written_to_disk_is_not_rewritten(engine, monkeypatch):
    disk = engine.disk
    put, gate = disk.put, threading.Event()

    def slow_put(t):
        from concurrent.futures import Future

        out = Future()

        def later():
            gate.wait(30)
            inner = put(t)
            inner.add_done_callback(
                lambda f: (
                    out.set_exception(f.exception())
                    if f.exception()
                    else out.set_result(f.result())
                )
            )

        threading.Thread(target=later).start()
        return out

    monkeypatch.setattr(disk, "put", slow_put)
    x = torch.randn(1 << 18)
    h = engine.to_host(x).result()
    ptr = h.block.buffer.data_ptr()
    fut = engine.to_store(h, "disk")
    h.free()
    other = engine.host.alloc(h.nbytes)
    assert other.buffer.data_ptr() != ptr, "the block was lent again under a queued disk write"
    other.view.fill_(0)
    gate.set()
    handle = fut.result()
    monkeypatch.undo()
    assert torch.equal(
        engine.from_store(handle, "disk", to="device", device="cpu", free=True).result(), x
    )
    other.free()


def test_transfers_of_a_freed_host_tensor_are_refused(engine):
    h = engine.to_host(torch.randn(100)).result()
    h.free()
    for call in (engine.to_device, lambda h: engine.to_store(h, "disk")):
        with pytest.raises(ValueError, match="already freed"):
            call(h)
    assert _idle(engine)


# ----------------------------------------------------------------------------- GPU (REVIEW #6, #8, #10, #12, #13)
@pytest.mark.gpu
def test_d2h_does_not_block_the_compute_stream():
    """Pack-side copies must never synchronise the compute stream (vDNN's whole point). The pool
    is warm (REVIEW #12: the old test timed a cold 256 MiB pinning), and no clock is read: the
    compute queued before the call must still be pending when it returns."""
    with TransferEngine(host=HostPool("1GiB")) as engine:
        x = torch.randn(64 << 20, device="cuda")  # 256 MiB
        engine.to_host(x).result().free()  # warm: the 256 MiB block is pinned and cached
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of queued compute on the current stream
        queued = torch.cuda.Event()
        queued.record()  # completes only once the compute queued before it has run
        fut = engine.to_host(x)
        assert not queued.query(), "to_host waited for the compute stream"
        host = fut.result()
        assert torch.equal(host.tensor, x.cpu())
        host.free()


@pytest.mark.gpu
def test_cuda_source_freed_while_its_copy_is_in_flight_is_not_reused_under_it():
    """REVIEW #12: the copy waits behind a long kernel; the caller drops the source and fills a
    same-size tensor on the compute stream; the host copy must hold the source's values."""
    with TransferEngine(host=HostPool("1GiB")) as engine:
        engine.to_host(torch.empty(16 << 20, device="cuda")).result().free()  # warm the pool
        x = torch.full((16 << 20,), 7.0, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # the D2H is queued behind this on the side stream
        fut = engine.to_host(x)
        del x  # the engine must keep the source until the copy has run
        y = torch.empty(16 << 20, device="cuda").fill_(-1.0)  # reuses freed memory if allowed
        host = fut.result()
        assert bool((host.tensor == 7.0).all()), "the source was overwritten while being copied"
        ys = [engine.to_device(engine.to_host(y * i).result(), free=True) for i in range(4)]
        for i, f in enumerate(ys):
            assert torch.equal(f.result(), y * i)
        host.free()


def _hold_h2d(engine: TransferEngine, cycles: int) -> None:
    """Queue a long kernel on the engine's h2d side stream: the next H2D copies run after it (they
    wait for no other stream, so a sleep on the caller's stream would not hold them)."""
    device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.stream(engine._streams.stream(device, "h2d")):
        torch.cuda._sleep(cycles)


@pytest.mark.gpu
def test_block_freed_under_a_queued_h2d_is_not_rewritten_on_cuda():
    """review-12-18 #3 sketch: the H2D resolves at issue and is still queued; the block is freed
    and the same buffer written from the host; the copy must read the old bytes."""
    with TransferEngine(host=HostPool("256MiB")) as e:
        x = torch.full((16 << 20,), 3.0, device="cuda")
        h = e.to_host(x).result()
        _hold_h2d(e, 2_000_000_000)  # the H2D queues behind this
        y = e.to_device(h).result()  # resolves at issue
        h.free()
        e.host.alloc(h.nbytes).view.fill_(0)  # a same-class block, written from the host
        torch.cuda.synchronize()
        assert bool((y == 3.0).all())


@pytest.mark.gpu
def test_synchronize_waits_for_host_to_device_copies():
    """REVIEW #13: H2D bytes were released at submission, so synchronize() did not wait for them."""
    with TransferEngine(host=HostPool("256MiB")) as engine:
        host = engine.to_host(torch.randn(8 << 20, device="cuda")).result()
        _hold_h2d(engine, 1_000_000_000)  # the H2D queues behind this
        y = engine.to_device(host, free=True).result()
        engine.synchronize()
        assert host.block.freed, "synchronize() returned before the copy finished"
        del y


@pytest.mark.gpu
def test_h2d_does_not_wait_for_the_compute_queued_before_it():
    """stop-37 lead: the destination came from the caller's stream's pool, so the copy waited for
    every kernel queued there first (a backward prefetch never overlapped the compute before it).
    It is the h2d side stream's memory now (torchtune's unpack): the copy runs at once."""
    with TransferEngine(host=HostPool("256MiB")) as e:
        x = torch.randn(8 << 20, device="cuda")
        h = e.to_host(x).result()
        e.to_device(h).result()  # warm: the side stream's pool caches a block (no cudaMalloc)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of compute queued on the caller's stream
        queued = torch.cuda.Event()
        queued.record()
        y = e.to_device(h, free=True).result()
        e.synchronize()  # the copy's event has completed: its bytes are back
        assert not queued.query(), "the H2D waited for the compute queued before it"
        assert torch.equal(y, x)


@pytest.mark.gpu
def test_h2d_of_a_callers_pinned_tensor_waits_for_its_producer():
    """A caller's own pinned tensor may still be the target of a non_blocking D2H queued on its
    stream: that copy, unlike the engine's blocks, runs after the caller's stream."""
    with TransferEngine(host=HostPool("64MiB")) as e:
        x = torch.randn(4 << 20, device="cuda")
        pinned = torch.empty(x.shape, pin_memory=True)
        torch.cuda._sleep(1_000_000_000)
        pinned.copy_(x, non_blocking=True)  # still queued behind the sleep
        assert torch.equal(e.to_device(pinned).result(), x)


@pytest.mark.gpu
def test_h2d_destination_read_on_another_stream_is_not_reused_under_it():
    """The destination is the side stream's memory: ``result()`` on a reader's stream records it
    there, so once dropped it is not lent to the next copy while that stream still reads it."""
    with TransferEngine(host=HostPool("256MiB")) as e:
        fives = e.to_host(torch.full((16 << 20,), 5.0, device="cuda")).result()
        minus = e.to_host(torch.full((16 << 20,), -1.0, device="cuda")).result()
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            y = e.to_device(fives, free=True).result()
            torch.cuda._sleep(1_000_000_000)
            out = y * 2  # reads y after the sleep
        del y  # the reader has not read it yet
        z = e.to_device(minus, free=True).result()  # its memory must not be y's
        reader.synchronize()
        assert bool((out == 10.0).all()), "the next copy overwrote a destination still being read"
        assert bool((z == -1.0).all())


@pytest.mark.gpu
def test_cuda_callback_waiting_for_a_later_copy_raises_instead_of_hanging():
    """stop 36's self-deadlock on a GPU: the callback runs on the completion thread, the only one
    that could finish the copy it waits for."""
    with TransferEngine(host=HostPool("64MiB")) as e:
        x = torch.randn(1 << 20, device="cuda")
        torch.cuda._sleep(200_000_000)  # the copy is still queued when the callback is added
        fut = e.to_host(x)
        out = _in_callback(fut, lambda: e.to_host(x).result(timeout=5))
        fut.result().free()
        _until(lambda: bool(out))
        assert isinstance(out.get("error"), RuntimeError), out
        assert _finishes(e.synchronize)


@pytest.mark.gpu
def test_dropped_cuda_engines_are_collected_with_their_threads():
    """REVIEW #8 GPU sketch: create, use and drop 20 engines; threads back to baseline."""
    TransferEngine(host=HostPool("16MiB")).close()
    gc.collect()
    quiesce()
    baseline = threading.active_count()
    refs = []
    for _ in range(20):
        e = TransferEngine(host=HostPool("64MiB"))
        x = torch.randn(1 << 20, device="cuda")
        assert torch.equal(e.to_device(e.to_host(x).result(), free=True).result(), x)
        refs.append(weakref.ref(e))
        del e
    gc.collect()
    assert quiesce()
    _until(lambda: threading.active_count() <= baseline)
    assert threading.active_count() == baseline
    assert all(r() is None for r in refs)


@pytest.mark.gpu
def test_cpu_tensor_restored_to_cpu_in_a_cuda_engine(spill_dir):
    """REVIEW #6: a CPU record restored with device=record.device stays on the CPU."""
    with DiskStore(spill_dir) as disk, TransferEngine(host=HostPool("64MiB"), disk=disk) as e:
        assert e.device.type == "cuda"
        x = torch.randn(1 << 19)
        y = e.to_device(e.to_host(x).result(), free=True, device=x.device).result()
        assert y.device.type == "cpu" and torch.equal(y, x)
        z = e.from_store(
            e.to_store(x, "disk").result(), "disk", free=True, device=x.device
        ).result()
        assert z.device.type == "cpu" and torch.equal(z, x)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_tensor_on_another_gpu_round_trips_on_that_gpu(spill_dir):
    """REVIEW #6: the engine's default device is cuda:0; a cuda:1 tensor is copied on cuda:1's
    side streams (after cuda:1's compute) and comes back on cuda:1."""
    torch.cuda.set_device(0)
    with DiskStore(spill_dir) as disk, TransferEngine(host=HostPool("256MiB"), disk=disk) as e:
        dev = torch.device("cuda", 1)
        x = torch.full((8 << 20,), 3.0, device=dev)
        with torch.cuda.device(dev):
            torch.cuda._sleep(1_000_000_000)  # cuda:1's compute still running
            x.mul_(2)
        host = e.to_host(x).result()
        assert bool((host.tensor == 6.0).all()), "the copy did not wait for cuda:1's stream"
        y = e.to_device(host, free=True, device=dev).result()
        z = e.from_store(
            e.to_store(x, "disk").result(), "disk", free=True, device="cuda:1"
        ).result()
        assert y.device == dev == z.device and torch.equal(y, x) and torch.equal(z, x)
        assert {d for d, _ in e._streams.made()} == {dev}


@pytest.mark.gpu
@pytest.mark.parametrize("codec", LOSSLESS_CODECS)
def test_codecs_through_the_engine_never_synchronise(codec):
    """REVIEW #10: with codec= the caller's thread issues only async copies."""
    with TransferEngine(host=HostPool("256MiB")) as engine:
        x = torch.relu(torch.randn(1 << 20, device="cuda"))
        engine.to_device(engine.to_host(x, codec=get_codec(codec)).result(), free=True).result()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fut = engine.to_host(x, codec=get_codec(codec))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        enc = fut.result()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = engine.to_device(enc, free=True).result()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(y, x)


@pytest.mark.gpu
def test_sparse_decode_on_the_device_never_synchronises():
    c = get_codec("sparse")
    x = torch.relu(torch.randn(1 << 20))
    payloads, meta = c.encode(x)
    on_device = [p.cuda() for p in payloads]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = c.decode(on_device, meta)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(y.cpu(), x)


def test_wrong_argument_types_are_typed_errors_naming_the_fix():
    with TransferEngine(host=HostPool("1MiB")) as engine:
        for call in (engine.to_host, engine.to_device):
            with pytest.raises(TypeError, match="torch.as_tensor"):
                call([1, 2, 3])
        with pytest.raises(TypeError, match=r"parse_size\('1KiB'\)"):
            engine.host.alloc("1KiB")
        with pytest.raises(ConfigError, match="negative"):
            engine.host.alloc(-1)


def _no_plain_values() -> list[tuple[torch.Tensor, type, str]]:
    with warnings.catch_warnings():  # nested (strided layout) and quantized: deprecated/prototype
        warnings.simplefilter("ignore", UserWarning)
        return [
            (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), TypeError, "unbind"),
            (torch.eye(3).to_sparse(), TypeError, "to_dense"),
            (
                torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
                TypeError,
                "dequantize",
            ),
            (torch.empty(3, device="meta"), ValueError, "materialize"),
        ]


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_tensors_without_plain_values_are_refused_naming_the_fix(engine, codec):
    # was torch's own errors from inside the copy ("NestedTensorImpl doesn't support sizes",
    # "copy_() between dense and sparse", "Cannot copy out of meta tensor")
    c = None if codec is None else get_codec(codec)
    for t, error, fix in _no_plain_values():
        with pytest.raises(error, match=fix):
            engine.to_host(t, codec=c)
        with pytest.raises(error, match=fix):
            engine.to_store(t, "disk", codec=c)
    engine.synchronize(timeout=5)  # nothing was left in flight


def test_to_disk_and_from_disk_are_the_store_path_to_the_engines_disk(spill_dir):
    """The short names kept for the engine's own disk tier (the fault reproducers use them)."""
    with DiskStore(spill_dir) as disk, TransferEngine(disk=disk) as eng:
        x = torch.randn(1000)
        h = eng.to_disk(x).result()
        assert torch.equal(eng.from_disk(h, free=True).result(), x)
        with pytest.raises(KeyError):
            eng.from_disk(h).result()


def test_codec_by_name_round_trips_and_a_bad_codec_fails_at_the_call(tmp_path):
    """``to_host/to_store(codec="zstd")`` encode with that codec (a name raised TypeError from a
    copy thread); a value that is no codec is a ConfigError before anything is queued."""
    x = torch.zeros(1000, 100)
    x[::7] = torch.randn(100)
    with TransferEngine(disk=DiskStore(tmp_path)) as engine:
        enc = engine.to_host(x, codec="zstd").result()
        assert enc.codec.name == "zstd"
        assert torch.equal(engine.to_device(enc).result(), x)
        enc = engine.to_store(x, "disk", codec="sparse").result()
        assert enc.codec.name == "sparse"
        assert torch.equal(engine.from_store(enc, "disk", to="device").result(), x)
        for call in (engine.to_host, lambda t, codec: engine.to_store(t, "disk", codec=codec)):
            with pytest.raises(ConfigError, match="codec=3"):
                call(x, codec=3)
