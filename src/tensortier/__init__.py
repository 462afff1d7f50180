"""tensortier: move PyTorch tensors across device, host RAM and NVMe so training breaks the memory wall."""

from tensortier._units import format_size, parse_size
from tensortier._verbs import offload
from tensortier.activations import (
    Action,
    Offloader,
    OffloadStats,
    SavedTensorInfo,
    offload_module,
    offload_stats,
)
from tensortier.checkpoint import Checkpointer
from tensortier.errors import (
    BudgetError,
    ClosedError,
    ConfigError,
    CorruptDataError,
    NodeLostError,
    PermissionDeniedError,
    SpillDirError,
    TensortierError,
    TierFullError,
)
from tensortier.optim import OffloadedAdamW, stream_parameters
from tensortier.tiers import DiskHandle, DiskStore, HostPool
from tensortier.tiers.codecs import get_codec
from tensortier.transfer import HostTensor, Transfer, TransferEngine

__version__ = "0.1.0"


def __getattr__(name: str):
    # RL data service (never imports Ray itself) and dataset catalog: imported on first use
    if name in ("rl", "data"):
        import importlib

        return importlib.import_module(f"tensortier.{name}")
    raise AttributeError(f"module 'tensortier' has no attribute {name!r}")


__all__ = [
    "offload_stats",
    "offload_module",
    "offload",
    "SavedTensorInfo",
    "OffloadStats",
    "Offloader",
    "Action",
    "BudgetError",
    "Checkpointer",
    "ClosedError",
    "ConfigError",
    "CorruptDataError",
    "DiskHandle",
    "DiskStore",
    "HostPool",
    "HostTensor",
    "NodeLostError",
    "OffloadedAdamW",
    "PermissionDeniedError",
    "SpillDirError",
    "TensortierError",
    "TierFullError",
    "Transfer",
    "TransferEngine",
    "format_size",
    "get_codec",
    "parse_size",
    "stream_parameters",
    "rl",
    "data",
]
