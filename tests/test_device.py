"""Devices named by users: refused at once with the fix, never a raw torch error at the first copy
or a CPU tensor where another device was asked for."""

import pytest
import torch

import tensortier as tt
from tensortier import ConfigError, HostPool, TransferEngine

_CUDA = torch.cuda.is_available()
# a CUDA device this machine does not have: every CUDA device on a CPU-only machine
_MISSING = f"cuda:{torch.cuda.device_count()}" if _CUDA else "cuda:9"


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


BAD = [
    ("gpu0", "not a device name"),
    ("CPU", "not a device name"),
    ("cuda:-1", "not a device name"),
    ("mps", "the CPU and CUDA devices only"),
    ("meta", "the CPU and CUDA devices only"),
    (1.5, "is a float, not a device"),
    (_MISSING, "CUDA device(s)" if _CUDA else "CUDA is not available"),
]


@pytest.mark.parametrize(("device", "says"), BAD, ids=repr)
def test_engine_refuses_a_device_it_cannot_reach(device, says):
    with pytest.raises(ConfigError, match="device=") as info:
        TransferEngine(host=HostPool("1MiB"), device=device)
    assert says in str(info.value) and repr(device) in str(info.value)
    assert "'cpu'" in str(info.value)  # the fix


@pytest.mark.parametrize(("device", "says"), BAD, ids=repr)
def test_to_device_refuses_a_device_it_cannot_reach(device, says):
    """``device="mps"`` used to give back a CPU tensor, "gpu0" a raw RuntimeError."""
    with TransferEngine(host=HostPool("1MiB")) as engine:
        host = engine.to_host(torch.arange(6.0)).result()
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            engine.to_device(host, device=device)
        back = engine.to_device(host, free=True, device="cpu").result()  # still usable
    assert torch.equal(back, torch.arange(6.0))


@pytest.mark.parametrize(("device", "says"), BAD, ids=repr)
def test_stream_parameters_refuses_a_device_it_cannot_reach(device, says):
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ConfigError, match="device=") as info:
        tt.stream_parameters(m, device=device)
    assert says in str(info.value)
    after = m.state_dict()  # refused before anything moved
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_stream_parameters_names_the_model_argument():
    """``stream_parameters("gpu0")`` (the device passed first) said "'str' object has no
    attribute 'named_modules'"."""
    with pytest.raises(ConfigError, match=r"model must be a torch.nn.Module, got str 'gpu0'"):
        tt.stream_parameters("gpu0")


@pytest.mark.skipif(_CUDA, reason="checks the CPU-only message")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 1)], ids=repr)
def test_cuda_on_a_cpu_only_machine_says_so(device):
    with pytest.raises(ConfigError, match="CUDA is not available on this machine; pass"):
        TransferEngine(host=HostPool("1MiB"), device=device)


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), None], ids=repr)
def test_cpu_spellings_are_accepted(device):
    from tensortier._device import check_device

    got = check_device(device)
    if device is not None:
        assert got == torch.ones(1).device
