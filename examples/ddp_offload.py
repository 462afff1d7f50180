"""Data-parallel training with tensortier: DDP + sharded OffloadedAdamW + Checkpointer + offload.

Run it the way you launch training:

    torchrun --nproc-per-node 2 examples/ddp_offload.py --steps 20 --ckpt /tmp/tt-ckpt
    python examples/ddp_offload.py --nproc 2 --steps 20          # torch.multiprocessing.spawn

CPU: gloo; GPU: NCCL, one device per rank. Every rank:
- keeps 1/N of the AdamW state (fp32 masters and moments) in host RAM or on NVMe
  (``--tier disk``); the updated parameters are all-gathered before the next forward;
- checkpoints its own shards (``Checkpointer``: one global manifest, restore on any world size);
- offloads saved activations to its own private spill directory (``tt.offload``).
Stop it and run it again: it resumes from the newest checkpoint, on any number of ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tensortier as tt
from tensortier.models.gpt import GPT, GPTConfig, random_batch


def train(args) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=2048)
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts it)
    model = GPT(cfg).to(device)
    ddp = DDP(model)
    opt = tt.OffloadedAdamW(model.parameters(), lr=3e-4, tier=args.tier, spill_dir=args.spill_dir)
    ck = tt.Checkpointer(args.ckpt, keep=3, every=args.every)
    state = ck.restore(model=model, optimizer=opt)  # None on a fresh start
    start = state.step if state else 0
    if rank == 0:
        print(f"{world} ranks, starting at step {start}; {opt!r}")
    for step in range(start, args.steps):
        x, y = random_batch(cfg, 4, seed=1000 * step + rank, device=device)
        with tt.offload("disk", spill_dir=args.spill_dir):  # each rank: its own private subdir
            loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DDP-reduced: global already
        opt.step()
        opt.zero_grad(set_to_none=True)
        ck.maybe_save(step, model=model, optimizer=opt)
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    ck.close()
    opt.close()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    train(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--tier", choices=["host", "disk"], default="host")
    p.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "tt-example-ckpt"))
    p.add_argument("--spill-dir", default=tempfile.gettempdir())
    p.add_argument("--nproc", type=int, default=0, help="spawn this many ranks (no torchrun)")
    args = p.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        train(args)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.nproc or 2
    torch.multiprocessing.spawn(_spawned, args=(world, port, args), nprocs=world)


if __name__ == "__main__":
    main()
