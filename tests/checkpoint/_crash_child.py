"""Child process of the crash test: trains and checkpoints until a kill point SIGKILLs it.

Started through a forkserver that has imported torch once, so each child costs a fork.
"""

from __future__ import annotations

import os

import torch

from tensortier.checkpoint import Checkpointer
from tensortier.checkpoint._faults import ENV
from tests.checkpoint import _train

# the first optimizer imports torch._dynamo (seconds): do it once, in the forkserver
_train.make(width=4)


def main(directory: str, steps: int, fault: str | None) -> None:
    if fault:
        os.environ[ENV] = fault
    else:
        os.environ.pop(ENV, None)
    torch.set_num_threads(1)
    model, opt, sched = _train.make(width=64)
    ck = Checkpointer(directory, keep=2, every=2, shard_size="16KiB", io_threads=2)
    for i in range(steps):
        _train.step(model, opt, sched, ck)
        ck.maybe_save(i, model=model, optimizer=opt, scheduler=sched, extra={"step": i})
    ck.close()
