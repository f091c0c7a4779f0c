"""``fnaccel`` / ``python -m fnaccel``: parse, dispatch, report errors in one line."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import signal
import sys
from collections.abc import Iterable, Sequence
from types import FrameType, MappingProxyType
from typing import Any, NoReturn, TypeAlias

from fnaccel._errors import FnaccelError

__all__ = ["CommandError", "build_parser", "main"]

# Each command's name -> the module registering it, in the order `fnaccel --help` lists them.
_COMMANDS = MappingProxyType(
    {
        "config": "config",
        "env": "env",
        "launch": "launch",
        "test": "test",
        "estimate-memory": "estimate",
        "merge-weights": "merge",
        "checkpoint": "checkpoint",
        "tpu-config": "tpu",
    }
)

USAGE_ERROR = 2  # argparse's exit status for bad usage; a bad config file is bad usage too
# The signals a scheduler or a terminal sends to stop a command; each ends it with one line and
# 128 + the signal's number from the console entry's first line on, until a command installs
# its own handlers (fnaccel launch forwards them to its workers).
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_BROKEN_PIPE = 128 + 13  # a shell's status for a process ended by SIGPIPE


# What each command module's `register(subparsers)` is given: argparse's action of sub-parsers
# (typeshed's name for what `add_subparsers` returns; argparse documents no public one).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandError(FnaccelError):
    """A command cannot do what was asked; the message says why and what to do."""


def closest(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the candidate closest to a mistyped ``word``, else "".

    >>> closest("--num_procesess", ["--num_processes", "--num_machines"])
    ' (did you mean --num_processes?)'
    """
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {found[0]}?)" if found else ""


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (with a suggestion for a
    mistyped command), exit status 2, and no usage dump; ``--help`` is unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(parser=self)  # the innermost parser that parsed wins

    def error(self, message: str) -> NoReturn:
        if choice := re.match(r"argument .*: invalid choice: '([^']*)' \(choose from (.*)\)", message):
            options = re.findall(r"'([^']*)'", choice.group(2)) or choice.group(2).split(", ")
            message += closest(choice.group(1), options)
        elif "required: training_script" in message:
            message = f"no training script given: {self.prog} [flags] SCRIPT.py [script arguments]"
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")

    def option_strings(self) -> list[str]:
        """Every flag this parser takes, for suggestions."""
        return [flag for action in self._actions for flag in action.option_strings]


def build_parser(commands: Iterable[str] = _COMMANDS) -> OneLineParser:
    """The ``fnaccel`` parser with ``commands`` (every subcommand, unless told) registered.

    >>> build_parser(["checkpoint"]).parse_args(["checkpoint", "inspect", "ckpt"]).directory
    'ckpt'
    """
    parser = OneLineParser(
        prog="fnaccel",
        usage="fnaccel <command> [<args>]",
        description="Launch and manage fnaccel training runs (the `accelerate` commands, same flags).",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="<command>", prog="fnaccel")
    for name in commands:
        importlib.import_module(f"fnaccel.commands.{_COMMANDS[name]}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``fnaccel`` command and return its exit status.

    Only the named command's module is imported (each imports what its work needs, e.g.
    torch, which alone takes seconds to import): ``fnaccel checkpoint inspect`` imports no
    torch. An unknown or missing command gets the whole parser (its help and suggestions).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[:1] if argv[:1] and argv[0] in _COMMANDS else _COMMANDS)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "command_name", None)
        sub = getattr(args, "parser", parser)
        flag = unknown[0].split("=", 1)[0]
        print(
            f"{sub.prog}: error: unrecognized argument {unknown[0]}"
            f"{closest(flag, sub.option_strings()) if flag.startswith('-') else ''}"
            + (f"; {command} takes no such argument" if command and not flag.startswith("-") else ""),
            file=sys.stderr,
        )
        return USAGE_ERROR
    handler = getattr(args, "handler", None)
    if handler is None:
        build_parser().print_help()
        return 1
    try:
        return int(handler(args))
    except FnaccelError as exc:
        command = getattr(args, "command_name", "")
        print(f"fnaccel {command}: error: {exc}".replace("  ", " "), file=sys.stderr)
        return USAGE_ERROR


def _stopped(signum: int, _frame: FrameType | None) -> None:
    """End the command at once, with one line: while it is still importing (torch alone takes
    seconds), no state is worth a traceback, and a scheduler reads the status."""
    command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in _COMMANDS else ""
    os.write(
        2,
        f"fnaccel{' ' + command if command else ''}: stopped by {signal.Signals(signum).name} "
        f"(exit {128 + signum})\n".encode(),
    )
    os._exit(128 + signum)


def console_main() -> None:
    """The entry point of the ``fnaccel`` script and of ``python -m fnaccel``.

    SIGTERM, SIGINT, SIGHUP and SIGUSR1 end a command with one line and 128 + the
    signal's number from here on (before, SIGTERM during the seconds ``fnaccel launch``
    spends importing ended it with -15 and no word; Ctrl-C with a traceback), until the
    command installs handlers of its own. A reader that closes the pipe early
    (``fnaccel env | head -1``) ends the command as SIGPIPE ends other programs: status
    141 (128 + SIGPIPE), no traceback."""
    for sig in _STOPPING:
        signal.signal(sig, _stopped)
    try:
        try:
            status: int = main()
        finally:
            sys.stdout.flush()  # what is still buffered meets the closed pipe here, not at exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush stays quiet
        status = _BROKEN_PIPE
    sys.exit(status)
