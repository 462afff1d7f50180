from tensortier.rl.memory_bank import MemoryBank
from tensortier.rl.replay import Batch, ReplayBuffer
from tensortier.rl.sampler import Prioritized, Uniform
