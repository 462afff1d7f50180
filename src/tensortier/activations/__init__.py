"""Activation offload: saved tensors go to host or disk in forward and come back, prefetched, in backward."""

from tensortier.activations.offloader import (
    Action,
    Codec,
    Offloader,
    OffloadHandle,
    OffloadStats,
    SavedTensorInfo,
    offload,
    offload_module,
    offload_stats,
)

__all__ = [
    "Action",
    "Codec",
    "OffloadHandle",
    "OffloadStats",
    "Offloader",
    "SavedTensorInfo",
    "offload",
    "offload_module",
    "offload_stats",
]
