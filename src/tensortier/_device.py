"""Where "device" memory is: a CUDA GPU when present, otherwise this process's RAM."""

from __future__ import annotations

import os

import psutil
import torch

from tensortier.errors import ConfigError

_DEVICES = "'cpu', 'cuda' or 'cuda:<index>' (e.g. 'cuda:0')"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if cuda_available()
        else torch.device("cpu")
    )


def normalize_device(device: torch.device | str | int | None) -> torch.device:
    """One spelling per device, so ``t.device == normalize_device(d)`` compares what it means.

    ``"cuda"`` becomes ``cuda:<current device>`` and ``cpu:0`` becomes ``cpu``; a tensor's
    ``.device`` is always spelled this way, so compare against the result, never the argument.
    ``None`` is :func:`default_device`.
    """
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(device: object, *, name: str = "device") -> torch.device:
    """A device a user named, normalised (:func:`normalize_device`), or :class:`ConfigError`.

    tensortier moves tensors between the CPU and CUDA devices only, so a device it cannot reach
    (a typo such as ``"gpu0"``, ``"cuda:9"`` on a machine with fewer GPUs, ``"cuda"`` on a
    CPU-only machine, ``"mps"``) is refused here with the fix, instead of a raw torch error at
    the first copy, or a CPU tensor where another device was asked for.
    """
    if device is None:
        return default_device()
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise ConfigError(
            f"{name}={device!r} is a {type(device).__name__}, not a device; pass {_DEVICES}"
        )
    try:
        # an int is a CUDA index, as in torch.device(0) (which asks the accelerator first)
        parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except Exception:  # torch's RuntimeError lists every backend it was built with
        raise ConfigError(f"{name}={device!r} is not a device name; pass {_DEVICES}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{name}={device!r}: tensortier moves tensors between the CPU and CUDA devices "
            f"only; pass {_DEVICES}"
        )
    if parsed.type == "cuda":
        if not cuda_available():
            raise ConfigError(
                f"{name}={device!r} but CUDA is not available on this machine; pass "
                f"{name}='cpu' or leave it None (the default device)"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(
                f"{name}={device!r} but this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}; pass one of them"
            )
    return normalize_device(parsed)


def device_name(device: torch.device | None = None) -> str:
    device = device or default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def rss_bytes() -> int:
    """Resident set size of this process."""
    return psutil.Process().memory_info().rss


def open_fds() -> int:
    return psutil.Process().num_fds()
