"""Child process of the crash test: trains and checkpoints until a kill point SIGKILLs it."""

import sys

import torch

from tensortier.checkpoint import Checkpointer
from tests.checkpoint import _train

if __name__ == "__main__":
    torch.set_num_threads(1)
    directory, steps = sys.argv[1], int(sys.argv[2])
    model, opt, sched = _train.make(width=64)
    ck = Checkpointer(directory, keep=2, every=2, shard_size="16KiB", io_threads=2)
    for i in range(steps):
        _train.step(model, opt, sched, ck)
        ck.maybe_save(i, model=model, optimizer=opt, scheduler=sched, extra={"step": i})
    ck.close()
