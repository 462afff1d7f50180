"""Offloaders that are dropped, replaced or detached release their engine, pool and files."""

import gc
import os
import threading

import pytest
import torch
from torch import nn

import tensortier as tt
from tensortier._device import open_fds
from tensortier._lifetime import quiesce
from tensortier.activations import offloader as O


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))


def _settle():
    gc.collect()
    assert quiesce()


def _step(model, ctx):
    with ctx:
        loss = model(torch.randn(16, 64)).square().mean()
    loss.backward()


def test_switching_offload_settings_every_step_releases_everything(spill_dir):
    model = mlp()
    O._thread_cache().clear()
    _step(model, tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0))  # warm: reaper, pools
    _settle()
    threads, fds = threading.active_count(), open_fds()
    engines, pools = [], []
    for i in range(20):  # the settings change at every step
        off = tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=i % 2)
        engines.append(off._engine)
        pools.append(off._host)
        _step(model, off)
        del off
    _settle()
    # every replaced offloader was closed (before: dropped unclosed; on CUDA its engine, pinned
    # pool, spill files and completion thread then leaked for the life of the process)
    assert all(e._closed for e in engines[:-1])
    assert all(p.stats.reserved == 0 for p in pools[:-1])
    assert len(os.listdir(spill_dir)) == 1  # the current offloader's directory only
    cache = O._thread_cache()
    (current,) = cache.pop(next(iter(cache)))
    current.close()
    _settle()
    assert engines[-1]._closed and os.listdir(spill_dir) == []
    assert threading.active_count() <= threads and open_fds() <= fds


def test_switching_settings_inside_one_step_keeps_the_first_alive_until_backward(spill_dir):
    """Two settings in one forward: the first offloader's graph is still alive when the second
    replaces it, so it is closed later (by its finalizer), not under the backward's feet."""
    model = mlp()
    x = torch.randn(16, 64)
    model(x).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    O._thread_cache().clear()
    with tt.offload(tier="host", min_bytes=0) as first:
        h = model[:2](x)
    with tt.offload(tier="disk", spill_dir=spill_dir, min_bytes=0) as second:
        loss = model[2:](h).square().mean()
    assert not first._engine._closed and first is not second
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
    engine = first._engine
    del first, h, loss
    _settle()
    assert engine._closed  # closed by its finalizer on the reaper, once nothing needed it
    second.close()
    O._thread_cache().clear()


def test_dropped_offloader_is_closed_by_the_reaper(spill_dir):
    off = tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0)
    _step(mlp(), off)
    engine, host = off._engine, off._host
    del off
    _settle()
    assert engine._closed and host.stats.reserved == 0 and os.listdir(spill_dir) == []


def test_offload_handle_remove_closes_its_offloader(spill_dir):
    model = mlp()
    x = torch.randn(16, 64)
    handle = tt.offload_module(model[0], tier="disk", spill_dir=spill_dir, min_bytes=0)
    model(x).sum().backward()
    engine = handle.offloader._engine
    handle.remove()  # idle: closed at once
    assert engine._closed and os.listdir(spill_dir) == []

    # removed between forward and backward: backward still works, the offloader closes after
    handle = tt.offload_module(model[0], tier="disk", spill_dir=spill_dir, min_bytes=0)
    loss = model(x).sum()
    engine = handle.offloader._engine
    handle.remove()
    assert not engine._closed
    loss.backward()
    del loss
    _settle()
    assert engine._closed and handle.offloader is None

    # an offloader passed in by the caller stays the caller's to close
    mine = tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0)
    handle = tt.offload_module(model[0], offloader=mine)
    model(x).sum().backward()
    handle.remove()
    assert not mine.closed and mine.stats.tensors_offloaded > 0
    mine.close()


def test_a_closed_offloader_refuses_to_start(spill_dir):
    off = tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0)
    off.close()
    with pytest.raises(tt.ClosedError, match="closed"), off:
        pass
    lin = nn.Linear(4, 4)
    handle = tt.offload_module(lin, offloader=off)
    with pytest.raises(tt.ClosedError, match="closed"):
        lin(torch.randn(2, 4))
    handle.remove()
