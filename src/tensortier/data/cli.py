"""`tensortier catalog build|info|verify`: make, describe and check a dataset catalog.

tensortier catalog build OUT --lines names.txt        # one str record per line ("-": stdin)
tensortier catalog build OUT --jsonl rows.jsonl       # one record per JSON line (objects: dicts)
tensortier catalog build OUT --parquet 'data/*.parquet'  # one dict per row (needs pyarrow)
tensortier catalog build OUT --npy features/          # one {"path", "data": array} per .npy file
tensortier catalog build OUT --npy tokens.npy         # one array per row of one .npy file
tensortier catalog build OUT --files 'data/**/*.json' # one {"path": str, "data": bytes} per file
tensortier catalog build OUT ... --mode 644           # files readable by everyone (default 600)
tensortier catalog info OUT [--json]
tensortier catalog verify OUT                         # every checksum, with a progress bar
"""

from __future__ import annotations

import argparse
import json
import sys

from tensortier._units import format_size
from tensortier.errors import TensortierError

MODES = {"600": 0o600, "640": 0o640, "644": 0o644}


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="catalog_command", required=True)
    build = sub.add_parser("build", help="build a catalog from text, JSON lines, Parquet or files")
    build.add_argument("directory", help="new (or empty) directory of the catalog")
    src = build.add_mutually_exclusive_group(required=True)
    src.add_argument("--lines", help="UTF-8 text file whose lines are the records ('-': stdin)")
    src.add_argument("--jsonl", help="JSON-lines file, one record per line ('-': stdin)")
    src.add_argument("--parquet", nargs="+", help="Parquet files or glob patterns; a dict per row")
    src.add_argument("--npy", help="folder of .npy files (a record each) or one .npy (per row)")
    src.add_argument("--files", nargs="+", help="glob patterns ('**' recurses); one record each")
    build.add_argument(
        "--segment-size", default="1GiB", help="bytes per segment file (default: %(default)s)"
    )
    build.add_argument(
        "--io-threads",
        type=int,
        default=2,
        help="threads writing segments at once (default: %(default)s)",
    )
    build.add_argument(
        "--mode",
        choices=sorted(MODES),
        default="600",
        help="mode of every file: 600 private (default), 640 group may read, 644 all may read",
    )
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    info = sub.add_parser("info", help="records, sizes and files of a catalog")
    info.add_argument("directory")
    info.add_argument("--json", action="store_true", help="print JSON")
    verify = sub.add_parser("verify", help="read every record and check every checksum")
    verify.add_argument("directory")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")


def _records(args: argparse.Namespace) -> tuple[object, int | None]:
    """(records, count if known) of the build's input; ConfigError for input that is not there."""
    from tensortier.data import _sources

    if args.lines:
        return _sources.lines(args.lines), None
    if args.jsonl:
        return _sources.jsonl(args.jsonl), None
    if args.parquet:
        return _sources.parquet(_sources.expand(args.parquet, "--parquet"))
    if args.npy:
        return _sources.npy(args.npy)
    names = _sources.expand(args.files, "--files")
    return _sources.files(names), len(names)


def _build(args: argparse.Namespace) -> int:
    from tensortier.data import Catalog

    records, count = _records(args)
    if count is not None and not hasattr(records, "__len__"):
        records = _Sized(records, count)  # for the progress bar
    cat = Catalog.build(
        args.directory,
        records,
        segment_size=args.segment_size,
        io_threads=args.io_threads,
        progress=not args.quiet,
        mode=MODES[args.mode],
    )
    s = cat.build_stats
    print(
        f"built {args.directory}: {s['records']} records, {format_size(s['file_bytes'])} in "
        f"{s['segments']} segments, {s['seconds']:.2f} s ({s['bytes_per_s'] / 1e9:.3f} GB/s)"
    )
    return 0


class _Sized:
    """An iterator with a known length (the progress bar's total)."""

    def __init__(self, it, n: int):
        self.it, self.n = it, n

    def __iter__(self):
        return iter(self.it)

    def __len__(self) -> int:
        return self.n


def run(args: argparse.Namespace) -> int:
    from tensortier.data import Catalog

    try:
        if args.catalog_command == "build":
            return _build(args)
        cat = Catalog.open(args.directory)
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
    except (TensortierError, FileNotFoundError, TypeError, ImportError) as exc:
        print(f"tensortier catalog {args.catalog_command}: {exc}", file=sys.stderr)
        return 2
