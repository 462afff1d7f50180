"""RL data service: replay buffer, memory bank and parameter store that spill to disk and serve on Ray.

``import tensortier.rl`` never imports Ray; only :func:`serve` and the Ray-backed handles do.
"""

from tensortier.rl.memory_bank import MemoryBank
from tensortier.rl.param_store import ParamStore
from tensortier.rl.rate_limiter import RateLimit
from tensortier.rl.replay import Batch, ReplayBuffer
from tensortier.rl.sampler import Prioritized, Uniform
from tensortier.rl.serve import serve

__all__ = [
    "Batch",
    "MemoryBank",
    "ParamStore",
    "Prioritized",
    "RateLimit",
    "ReplayBuffer",
    "Uniform",
    "serve",
]
