"""The `tensortier` command: `demo`, `plan`, `catalog` and `bench <area>`."""

from __future__ import annotations

import argparse
import sys

from tensortier.bench import activations as bench_activations
from tensortier.bench import catalog as bench_catalog
from tensortier.bench import checkpoint as bench_checkpoint
from tensortier.bench import distributed as bench_distributed
from tensortier.bench import optimizer as bench_optimizer
from tensortier.bench import planner as bench_planner
from tensortier.bench import replay as bench_replay
from tensortier.bench import tiers as bench_tiers

BENCHES = {
    "tiers": bench_tiers,
    "activations": bench_activations,
    "planner": bench_planner,
    "optimizer": bench_optimizer,
    "replay": bench_replay,
    "checkpoint": bench_checkpoint,
    "catalog": bench_catalog,
    "distributed": bench_distributed,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensortier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model with and without tensortier")
    from tensortier import demo as demo_mod

    demo_mod.add_args(demo)
    from tensortier.planner import cli as plan_mod

    plan_mod.add_args(sub.add_parser("plan", help="choose what to keep, swap, compress, recompute"))
    from tensortier.data import cli as catalog_mod

    catalog_mod.add_args(
        sub.add_parser("catalog", help="build, inspect or verify a dataset catalog")
    )
    bench = sub.add_parser("bench", help="benchmarks against the peers a user would pick instead")
    areas = bench.add_subparsers(dest="area", required=True)
    for name, module in BENCHES.items():
        module.add_args(areas.add_parser(name, help=(module.__doc__ or "").splitlines()[0]))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo_mod.run(args)
    if args.command == "plan":
        return plan_mod.run(args)
    if args.command == "catalog":
        return catalog_mod.run(args)
    BENCHES[args.area].run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
