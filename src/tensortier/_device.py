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
