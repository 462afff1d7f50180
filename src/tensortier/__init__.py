"""tensortier: move PyTorch tensors across device, host RAM and NVMe so training breaks the memory wall."""

from tensortier._stats import stats
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
    RateLimitTimeout,
    RecordTypeError,
    ShardLostError,
    SpillDirError,
    TensortierError,
    TierFullError,
)
from tensortier.optim import OffloadedAdamW, OptimizerStats, stream_parameters
from tensortier.tiers import DiskStore, HostPool, RemoteStore  # RemoteStore imports Ray on use
from tensortier.tiers.codecs import get_codec
from tensortier.transfer import TransferEngine

__version__ = "0.1.0"


def __getattr__(name: str):
    # RL data service (never imports Ray itself) and dataset catalog: imported on first use
    if name in ("rl", "data"):
        import importlib

        return importlib.import_module(f"tensortier.{name}")
    raise AttributeError(f"module 'tensortier' has no attribute {name!r}")


# The public surface, listed in the README ("Public API"); everything else is internal. Handles
# and futures (``tensortier.transfer.HostTensor``/``Transfer``, ``tensortier.tiers.DiskHandle``)
# are importable from their modules.
__all__ = [
    # activations: the verbs, the mechanism and what it reports
    "Action",
    "OffloadStats",
    "Offloader",
    "SavedTensorInfo",
    "offload",
    "offload_module",
    "offload_stats",
    # every live client's counters
    "stats",
    # optimizer state and parameters off the device
    "OffloadedAdamW",
    "OptimizerStats",
    "stream_parameters",
    # checkpoints
    "Checkpointer",
    # tiers and the mover between them
    "DiskStore",
    "HostPool",
    "RemoteStore",
    "TransferEngine",
    "get_codec",
    # sizes
    "format_size",
    "parse_size",
    # errors
    "BudgetError",
    "ClosedError",
    "ConfigError",
    "CorruptDataError",
    "NodeLostError",
    "PermissionDeniedError",
    "RateLimitTimeout",
    "RecordTypeError",
    "ShardLostError",
    "SpillDirError",
    "TensortierError",
    "TierFullError",
    # subpackages, imported on first use
    "data",
    "rl",
]
