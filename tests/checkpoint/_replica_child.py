"""Writer process of the replica tests: joins the Ray cluster, trains a tiny model, checkpoints
with ``replicas=1``, prints one JSON line with its stats, then waits to be killed (SIGKILL)."""

from __future__ import annotations

import json
import sys
import time

import ray
import torch

from tensortier.checkpoint import Checkpointer


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main(address: str, directory: str, steps: int) -> None:
    torch.set_num_threads(1)
    ray.init(address=address, log_to_driver=False)
    model, opt = make()
    ck = Checkpointer(directory, keep=2, every=2, replicas=1, replica_timeout=30)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ck.maybe_save(i, model=model, optimizer=opt, extra={"step": i})
    ck.wait()
    stats = ck.stats()
    print(
        json.dumps(
            {
                "committed": stats.last_committed_step,
                "replica_nodes": stats.replica_nodes,
                "replica_pushes": stats.replica_pushes,
                "replica_error": stats.last_replica_error,
            }
        ),
        flush=True,
    )
    while True:  # the test kills this process; nothing here closes anything
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
