import errno
import gc
import os
import threading
import time

import pytest
import torch

from tensortier import ClosedError, DiskStore, HostPool, TierFullError, TransferEngine
from tensortier.transfer import HostTensor
from tests.conftest import ALL_DTYPES, bit_equal, make_tensor


@pytest.fixture
def engine(spill_dir):
    with (
        DiskStore(spill_dir, slab_size="4MiB") as disk,
        TransferEngine(host=HostPool("64MiB", pin=None), disk=disk, max_inflight="8MiB") as e,
    ):
        yield e


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
    handle = engine.to_disk(x).result()
    y = engine.from_disk(handle, to="device", free=True).result()
    assert torch.equal(y.cpu(), x.cpu()) and y.dtype == x.dtype
    del y  # on CPU the result lives in memory lent by the host pool until it is dropped
    gc.collect()
    assert len(engine.disk) == 0 and engine.host.stats.in_use == 0


def test_host_tensor_to_disk_and_back_to_host(engine):
    x = torch.randn(5000)
    host = engine.to_host(x).result()
    handle = engine.to_disk(host, free=True).result()
    assert host.block.freed
    back = engine.from_disk(handle, to="host").result()
    assert isinstance(back, HostTensor) and torch.equal(back.tensor, x)
    back.free()


def test_stats_count_bytes_per_direction(engine):
    x = torch.randn(1024)  # 4 KiB
    h = engine.to_disk(engine.to_host(x).result(), free=True).result()
    engine.to_device(engine.from_disk(h, to="host").result(), free=True).result()
    s = engine.stats
    assert s.bytes == {"d2h": 4096, "h2d": 4096, "h2disk": 4096, "disk2h": 4096}
    assert all(v == 1 for v in s.count.values())
    assert s.wait_seconds >= 0


def test_many_concurrent_transfers_stay_under_inflight_bound(engine):
    xs = [
        torch.full((1 << 18,), float(i)) for i in range(40)
    ]  # 1 MiB each, 40 MiB total > 8 MiB bound
    futs = [engine.to_disk(x) for x in xs]
    handles = [f.result() for f in futs]
    assert engine.stats.peak_inflight_bytes <= 8 << 20
    outs = [engine.from_disk(h, free=True) for h in handles]
    for i, f in enumerate(outs):
        assert bool((f.result() == i).all())
    assert engine.stats.peak_inflight_bytes <= 8 << 20


def test_disk_error_reaches_the_future_and_releases_everything(engine, monkeypatch):
    def enospc(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    with pytest.raises(TierFullError):
        engine.to_disk(engine.to_host(torch.randn(2000)).result(), free=True).result()
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
        e.to_disk(torch.zeros(4))


def test_closed_engine_refuses(spill_dir):
    e = TransferEngine(host=HostPool("1MiB", pin=False))
    e.close()
    with pytest.raises(ClosedError):
        e.to_host(torch.zeros(4))


def test_wait_time_is_accounted(engine):
    gate = threading.Event()
    real = engine.disk._read_chunk

    def slow_read(*a):
        gate.wait(5)
        return real(*a)

    h = engine.to_disk(torch.randn(1000)).result()
    engine.disk._read_chunk = slow_read
    fut = engine.from_disk(h)
    threading.Timer(0.2, gate.set).start()
    fut.result()
    assert engine.stats.wait_seconds >= 0.15


@pytest.mark.gpu
def test_d2h_does_not_block_the_compute_stream():
    """Pack-side copies must never synchronise the compute stream (vDNN's whole point)."""
    with TransferEngine(host=HostPool("1GiB")) as engine:
        a = torch.randn(4096, 4096, device="cuda")
        x = torch.randn(64 << 20, device="cuda")  # 256 MiB
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):  # a long kernel queue on the compute stream
            a = a @ a
            a = a / a.norm()
        start.record()
        t0 = time.perf_counter()
        fut = engine.to_host(x)  # must return while the matmuls are still queued
        submit_s = time.perf_counter() - t0
        end.record()
        assert not end.query() or submit_s < 0.01, "to_host waited for the compute stream"
        host = fut.result()
        assert torch.equal(host.tensor, x.cpu())
        host.free()


@pytest.mark.gpu
def test_cuda_round_trip_under_concurrent_compute():
    with TransferEngine(host=HostPool("1GiB")) as engine:
        xs = [torch.randn(1 << 20, device="cuda") * i for i in range(8)]
        hosts = [engine.to_host(x) for x in xs]
        ys = [engine.to_device(h.result(), free=True).result() for h in hosts]
        torch.cuda.synchronize()
        for x, y in zip(xs, ys):
            assert torch.equal(x, y)
