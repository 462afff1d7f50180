"""The `tensortier` command: `demo`, `plan` and `catalog`.

Each subcommand's module is imported only when that subcommand runs, so ``tensortier --help``
and a typo cost no more than the package import. Benchmarks are not a subcommand: they live
outside the library, run from a checkout as ``python -m benchmarks <area>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # subcommand -> (module with add_args(parser) and run(args) -> int, help)
    "demo": ("tensortier.demo", "train a small model with and without tensortier"),
    "plan": ("tensortier.planner.cli", "choose what to keep, swap, compress, recompute"),
    "catalog": ("tensortier.data.cli", "build, inspect or verify a dataset catalog"),
}


DESCRIPTION = (
    "Move PyTorch tensors across device, host RAM and NVMe. `tensortier COMMAND --help` shows a "
    "command's options (also `python -m tensortier`). Benchmarks run from a checkout: "
    "`python -m benchmarks <area>`."
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tensortier", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = None
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        if argv[:1] == [name]:  # the subcommand asked for: its own arguments
            chosen = importlib.import_module(module)
            chosen.add_args(p)
    args = parser.parse_args(argv)
    return chosen.run(args)


if __name__ == "__main__":
    sys.exit(main())
