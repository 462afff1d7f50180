"""`tensortier demo`: a quick, real look at the tiers (until activation offload lands)."""

from __future__ import annotations

import argparse

from tensortier.bench import tiers


def add_args(p: argparse.ArgumentParser) -> None:
    tiers.add_args(p)


def run(args: argparse.Namespace) -> None:
    args.quick = True
    tiers.run(args)
