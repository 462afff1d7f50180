"""tensortier: move PyTorch tensors across device, host RAM and NVMe so training breaks the memory wall."""

from tensortier._units import format_size, parse_size
from tensortier.activations import (
    Action,
    Offloader,
    OffloadStats,
    SavedTensorInfo,
    offload,
    offload_module,
    offload_stats,
)
from tensortier.checkpoint import Checkpointer
from tensortier.errors import (
    BudgetError,
    ClosedError,
    ConfigError,
    CorruptDataError,
    SpillDirError,
    TensortierError,
    TierFullError,
)
from tensortier.optim import OffloadedAdamW, stream_parameters
from tensortier.tiers import DiskHandle, DiskStore, HostPool
from tensortier.transfer import HostTensor, Transfer, TransferEngine

__version__ = "0.1.0"

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
    "OffloadedAdamW",
    "SpillDirError",
    "TensortierError",
    "TierFullError",
    "Transfer",
    "TransferEngine",
    "format_size",
    "parse_size",
    "stream_parameters",
]
