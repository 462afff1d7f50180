"""A checkpoint never mixes two steps (review finding 5): every optimizer's step waits for the
snapshot, also one not passed to ``save``; an in-place change that overtakes the copy fails that
checkpoint with ConfigError instead of committing a torn one with a valid checksum."""

import threading

import pytest
import torch

from tensortier.checkpoint import Checkpointer, checkpointer
from tensortier.errors import ConfigError


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)


@pytest.fixture
def gated(monkeypatch):
    """Late (background) copies wait until the test opens the gate."""
    gate = threading.Event()
    real = checkpointer.as_bytes

    def as_bytes(t):
        if threading.current_thread().name.startswith("tt-ckpt-snapshot"):
            assert gate.wait(30)
        return real(t)

    monkeypatch.setattr(checkpointer, "as_bytes", as_bytes)
    return gate


def test_optimizer_not_passed_to_save_still_waits_for_the_snapshot(tmp_path, gated):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    m(torch.randn(4, 256)).square().sum().backward()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, model=m)  # no optimizer=: the copy of the parameters runs late
        threading.Timer(0.2, gated.set).start()
        opt.step()  # must wait for the copy (global step pre-hook)
        ck.wait()
    restored = _model()
    with Checkpointer(tmp_path, every=1) as ck:
        assert ck.restore(model=restored).saved_step == 0
    for k, v in restored.state_dict().items():
        assert torch.equal(v, before[k])


def test_in_place_change_that_overtakes_the_copy_fails_the_checkpoint(tmp_path, gated):
    m = _model()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, model=m)
        with torch.no_grad():
            m.weight.mul_(0.5)  # an EMA-style update without before_optimizer_step()
        gated.set()
        with pytest.raises(ConfigError, match="before_optimizer_step"):
            ck.wait()
        assert ck.stats().committed == 0
        ck.save(1, model=m)  # the Checkpointer stays usable
        ck.wait()
        assert ck.stats().committed == 1


def test_before_optimizer_step_orders_an_in_place_change(tmp_path, gated):
    m = _model()
    before = m.weight.detach().clone()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, model=m)
        gated.set()
        ck.before_optimizer_step()
        with torch.no_grad():
            m.weight.mul_(0.5)
        ck.wait()
    restored = _model()
    with Checkpointer(tmp_path, every=1) as ck:
        ck.restore(model=restored)
    assert torch.equal(restored.weight, before)
