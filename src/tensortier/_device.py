"""Where "device" memory is: a CUDA GPU when present, otherwise this process's RAM."""

from __future__ import annotations

import os

import psutil
import torch


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
