"""`tensortier catalog build|info|verify`: make, describe and check a dataset catalog.

tensortier catalog build OUT --lines names.txt        # one str record per line ("-": stdin)
tensortier catalog build OUT --files 'data/**/*.json' # one {"path": str, "data": bytes} per file
tensortier catalog info OUT [--json]
tensortier catalog verify OUT                         # every checksum, with a progress bar
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Iterator

from tensortier._units import format_size
from tensortier.errors import TensortierError


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="catalog_command", required=True)
    build = sub.add_parser("build", help="build a catalog from lines of a text file or from files")
    build.add_argument("path", help="new (or empty) directory of the catalog")
    src = build.add_mutually_exclusive_group(required=True)
    src.add_argument("--lines", help="text file whose lines are the records ('-': stdin)")
    src.add_argument("--files", nargs="+", help="glob patterns ('**' recurses); one record each")
    build.add_argument("--segment-size", default="1GiB", help="bytes per segment file")
    build.add_argument("--writers", type=int, default=2, help="threads writing segments at once")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    info = sub.add_parser("info", help="records, sizes and files of a catalog")
    info.add_argument("path")
    info.add_argument("--json", action="store_true", help="print JSON")
    verify = sub.add_parser("verify", help="read every record and check every checksum")
    verify.add_argument("path")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")


def _lines(path: str) -> Iterator[str]:
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    try:
        for line in f:
            yield line.rstrip("\n")
    finally:
        if f is not sys.stdin:
            f.close()


def _files(patterns: list[str]) -> Iterator[dict]:
    for pattern in patterns:
        for name in sorted(glob.glob(pattern, recursive=True)):
            if os.path.isfile(name):
                with open(name, "rb") as f:
                    yield {"path": name, "data": f.read()}


def run(args: argparse.Namespace) -> int:
    from tensortier.data import Catalog

    try:
        if args.catalog_command == "build":
            records = _lines(args.lines) if args.lines else _files(args.files)
            cat = Catalog.build(
                args.path,
                records,
                segment_size=args.segment_size,
                writers=args.writers,
                progress=not args.quiet,
            )
            s = cat.build_stats
            print(
                f"built {args.path}: {s['records']} records, {format_size(s['file_bytes'])} in "
                f"{s['segments']} segments, {s['seconds']:.2f} s "
                f"({s['bytes_per_s'] / 1e9:.3f} GB/s)"
            )
            return 0
        cat = Catalog.open(args.path)
        if args.catalog_command == "info":
            info = cat.info()
            if args.json:
                print(json.dumps(info, indent=1))
            else:
                for key, value in info.items():
                    shown = (
                        format_size(value)
                        if key.endswith("_bytes") and key[:4] != "mean"
                        else value
                    )
                    print(f"{key:>18}: {shown}")
            return 0
        report = cat.verify(progress=not args.quiet)
        for index, path, reason in report.bad[:50]:
            print(f"record {index} in {path}: {reason}")
        if len(report.bad) > 50:
            print(f"... and {len(report.bad) - 50} more damaged records")
        for problem in report.problems:
            print(problem)
        verdict = "OK" if report.ok else f"DAMAGED ({len(report.bad)} records)"
        print(
            f"{verdict}: {report.records} records, {format_size(report.bytes_read)} read in "
            f"{report.seconds:.2f} s"
        )
        return 0 if report.ok else 1
    except (TensortierError, FileNotFoundError, TypeError) as exc:
        print(f"tensortier catalog {args.catalog_command}: {exc}", file=sys.stderr)
        return 2
