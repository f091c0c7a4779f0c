"""``fnaccel test``: run the installation check (`fnaccel.commands.test_script`) under
``fnaccel launch``, with the given config file and launch flags.

As ``accelerate test`` runs ``accelerate-launch --config_file ... test_script.py``.
Any flag other than ``--config_file`` goes to ``fnaccel launch`` unchanged, so
``fnaccel test --cpu --num_processes 2`` checks a two-process CPU run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fnaccel.commands import launch
from fnaccel.commands.main import USAGE_ERROR, Subcommands

__all__ = ["SCRIPT", "launch_argv", "register", "run"]

SCRIPT = Path(__file__).with_name("test_script.py")


class _LaunchFlagsParser(argparse.ArgumentParser):
    """Keeps the flags it does not know, in order, as ``launch_args`` for ``fnaccel launch``.

    ``parse_args`` rejects unknown flags and ``nargs=REMAINDER`` cannot start
    with one, so the pass-through has to happen at ``parse_known_args``.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, unknown = super().parse_known_args(args, namespace)
        parsed.launch_args = [*getattr(parsed, "launch_args", []), *unknown]
        return parsed, []


def register(subparsers: Subcommands) -> None:
    """Add ``fnaccel test`` to the command line."""
    # argparse has no public way to choose one subparser's class: swap it for this one call
    default_class = subparsers._parser_class
    subparsers._parser_class = _LaunchFlagsParser
    try:
        parser = subparsers.add_parser(
            "test",
            help="Check that fnaccel works on this system, end to end.",
            description="Launch fnaccel's installation check with `fnaccel launch`: the process "
            "group, every collective, training steps against plain PyTorch, "
            "three resumes within an epoch and one on one process, and mixed precision. "
            "Prints one line per check.",
            epilog="Any other flag goes to `fnaccel launch`, e.g. `fnaccel test --cpu "
            "--num_processes 2` or `fnaccel test --mixed_precision bf16`.",
            allow_abbrev=False,  # a prefix of a launch flag must not turn into --config_file
        )
    finally:
        subparsers._parser_class = default_class
    parser.add_argument(
        "--config_file",
        default=None,
        help="The launch config file to use; default: the one `fnaccel launch` reads.",
    )
    parser.set_defaults(handler=run, command_name="test", launch_args=[])


def launch_argv(config_file: str | None, launch_args: Sequence[str]) -> list[str]:
    """What ``fnaccel test`` passes to ``fnaccel launch``: the config file, the launch
    flags, then the check script.

    >>> launch_argv("c.yaml", ["--cpu"])[:3]
    ['--config_file', 'c.yaml', '--cpu']
    """
    config = ["--config_file", config_file] if config_file is not None else []
    return [*config, *launch_args, str(SCRIPT)]


def run(args: argparse.Namespace) -> int:
    """Launch the check script; 0 when every check passed, else launch's status."""
    status = launch.run_launch(launch_argv(args.config_file, args.launch_args))
    if status == 0:
        print("Test is a success! You are ready for your distributed training!")
    elif status != USAGE_ERROR:  # a usage error: launch has said why in its one line
        print(
            f"fnaccel test: the installation check failed (exit status {status}); "
            "see the report and messages above",
            file=sys.stderr,
        )
    return status
