"""``fnaccel checkpoint inspect|verify|diff``: a checkpoint at a glance, its integrity, two compared.

- ``inspect DIR [--json]``: step, epoch, data position, world size and
  layout, pipeline, precision, model size by dtype and top-level module,
  files, versions; from the manifest and safetensors headers only.
- ``verify DIR``: every file's size, checksum and format; exit 0, or 2 with one
  line naming the bad file.
- ``diff A B [--atol X] [--rtol Y] [--json]``: `fa.diff` of two checkpoints;
  exit 0 when equal, 1 when they differ, 2 when one cannot be read.
"""

from __future__ import annotations

import argparse
import json
import time

from fnaccel.commands.main import CommandError, Subcommands

__all__ = ["register", "run_diff", "run_inspect", "run_verify"]


def register(subparsers: Subcommands) -> None:
    """Add ``fnaccel checkpoint`` and its three subcommands to the command line."""
    parser = subparsers.add_parser(
        "checkpoint",
        help="Inspect, verify or compare fnaccel checkpoints.",
        description="Inspect, verify or compare fnaccel checkpoints (see docs/debugging.md).",
    )
    parser.set_defaults(command_name="checkpoint")
    commands = parser.add_subparsers(title="subcommands", metavar="<subcommand>", prog="fnaccel checkpoint")
    inspect = commands.add_parser(
        "inspect",
        help="One screen on a checkpoint; reads no tensor.",
        description="Show what a checkpoint holds, from its manifest and headers.",
    )
    inspect.add_argument("directory", help="The checkpoint directory.")
    inspect.add_argument("--json", action="store_true", help="Print JSON for scripts.")
    inspect.set_defaults(handler=run_inspect, command_name="checkpoint inspect")
    verify = commands.add_parser(
        "verify",
        help="Check every file's size and checksum; exit 2 naming a bad one.",
        description="Check a checkpoint's schema and every file's size and checksum.",
    )
    verify.add_argument("directory", help="The checkpoint directory.")
    verify.set_defaults(handler=run_verify, command_name="checkpoint verify")
    diff = commands.add_parser(
        "diff",
        help="Every difference between two checkpoints (fa.diff).",
        description="Compare two checkpoints item by item; exit 1 when they differ.",
    )
    diff.add_argument("a", help="The first checkpoint directory.")
    diff.add_argument("b", help="The second checkpoint directory.")
    diff.add_argument("--atol", type=float, default=0.0, help="Absolute tolerance (default 0: bit-exact).")
    diff.add_argument("--rtol", type=float, default=0.0, help="Relative tolerance (default 0).")
    diff.add_argument("--json", action="store_true", help="Print JSON for scripts.")
    diff.set_defaults(handler=run_diff, command_name="checkpoint diff")


def run_inspect(args: argparse.Namespace) -> int:
    from fnaccel.checkpoint.summary import summarize

    summary = summarize(args.directory)
    print(json.dumps(summary.to_dict(), indent=1) if args.json else summary)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from fnaccel.checkpoint.summary import verify

    start = time.perf_counter()
    total = verify(args.directory)
    seconds = time.perf_counter() - start
    print(f"{args.directory}: intact ({total / 2**20:.1f} MiB checked in {seconds:.2f} s)")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    from fnaccel.debug.diff import diff

    if args.atol < 0 or args.rtol < 0:
        raise CommandError(f"--atol and --rtol must be >= 0, got {args.atol} and {args.rtol}")
    found = diff(args.a, args.b, atol=args.atol, rtol=args.rtol)
    if args.json:
        print(
            json.dumps(
                {
                    "equal": not found,
                    "differences": [
                        {
                            "item": d.item,
                            "a": d.a,
                            "b": d.b,
                            "max_abs": d.max_abs,
                            "max_rel": d.max_rel,
                            "index": None if d.index is None else list(d.index),
                            "count": d.count,
                        }
                        for d in found.differences
                    ],
                },
                indent=1,
            )
        )
    else:
        print(found)
    return 1 if found else 0
