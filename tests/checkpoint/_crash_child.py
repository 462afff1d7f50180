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


def rollback_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 64)


def rollback(directory: str, fault: str) -> None:
    """Run A saves steps 0..5 (keep=4: 2..5 stay), run B rolls back to 2 and saves 3 and 4."""
    os.environ.pop(ENV, None)
    torch.set_num_threads(1)
    model = rollback_model()
    with Checkpointer(directory, keep=4, every=1, shard_size="4KiB") as ck:
        for i in range(6):
            ck.maybe_save(i, model=model, extra={"run": "A", "step": i})
    os.environ[ENV] = fault  # counted from here: save 1 is run B's first
    with Checkpointer(directory, keep=4, every=1, shard_size="4KiB") as ck:
        state = ck.restore(model=model, step=2)
        for i in range(state.step, 5):
            ck.maybe_save(i, model=model, extra={"run": "B", "step": i})
