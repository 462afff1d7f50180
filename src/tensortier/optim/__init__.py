"""Model-state offload: AdamW state and master weights on host RAM or NVMe, parameter streaming."""

from tensortier.optim.adamw import OffloadedAdamW, OptimizerStats, StateTier
from tensortier.optim.streaming import ParameterStreamer, ParamTier, stream_parameters

__all__ = [
    "OptimizerStats",
    "OffloadedAdamW",
    "ParamTier",
    "ParameterStreamer",
    "StateTier",
    "stream_parameters",
]
