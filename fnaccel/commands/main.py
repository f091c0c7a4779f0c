"""``fnaccel`` / ``python -m fnaccel``: parse, dispatch, report errors in one line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fnaccel._errors import FnaccelError

__all__ = ["CommandError", "build_parser", "main"]

# The subcommand modules, in the order `fnaccel --help` lists them.
_COMMANDS = ("config", "env", "launch", "test", "estimate", "merge", "tpu")

USAGE_ERROR = 2  # argparse's exit status for bad usage; a bad config file is bad usage too


class CommandError(FnaccelError):
    """A command cannot do what was asked; the message says why and what to do."""


def build_parser() -> argparse.ArgumentParser:
    """The ``fnaccel`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fnaccel",
        usage="fnaccel <command> [<args>]",
        description="Launch and manage fnaccel training runs (the `accelerate` commands, same flags).",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="<command>", prog="fnaccel")
    for name in _COMMANDS:
        importlib.import_module(f"fnaccel.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``fnaccel`` command and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 1
    try:
        return int(handler(args))
    except (CommandError, FnaccelError) as exc:
        command = getattr(args, "command_name", "")
        print(f"fnaccel {command}: error: {exc}".replace("  ", " "), file=sys.stderr)
        return USAGE_ERROR


def console_main() -> None:
    """The console script's entry point."""
    sys.exit(main())
