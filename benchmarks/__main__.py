"""`python -m benchmarks <area> [args]`, from the repository root: one benchmark area per run.

Each area is a module here with ``add_args(parser)`` and ``run(args)``; only the chosen area's
module is imported (an area pulls in its peers: DeepSpeed, Ray, datasets, ...).
"""

from __future__ import annotations

import argparse
import importlib
import sys

AREAS = {  # area -> what it measures (its module's first docstring line says more)
    "tiers": "disk tier bandwidth against dd direct I/O (--remote: the remote tier against Ray)",
    "activations": "a GPT trained with each activation-memory strategy side by side",
    "planner": "a budget sweep: every policy's measured peak and step time",
    "budget": "tt.offload(budget=) from its first step: each step's peak over the budget",
    "optimizer": "OffloadedAdamW against torch AdamW and DeepSpeed's CPU Adam",
    "replay": "prioritized replay against TorchRL and a deque, spill, Ray, params",
    "checkpoint": "training stall and persist speed of torch.save, DCP async_save, tensortier",
    "catalog": "the dataset catalog against dd, Hugging Face datasets and LMDB",
    "distributed": "data-parallel training with OffloadedAdamW and the Checkpointer",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    areas = parser.add_subparsers(dest="area", required=True, metavar="AREA")
    modules = {}
    for name, text in AREAS.items():
        sub = areas.add_parser(name, help=text, description=text)
        if argv[:1] == [name]:  # the area asked for: its own arguments
            modules[name] = importlib.import_module(f"benchmarks.{name}")
            modules[name].add_args(sub)
    args = parser.parse_args(argv)
    modules[args.area].run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
