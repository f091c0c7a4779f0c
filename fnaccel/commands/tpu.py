"""``fnaccel tpu-config``: Accelerate's flags, parsed; this build cannot run them.

Configuring a TPU pod needs a torch_xla engine, and fnaccel's engines are
torch.distributed's gloo and nccl. The command exists so that scripts written
for ``accelerate tpu-config`` fail with a sentence saying so instead of
"invalid choice".
"""

from __future__ import annotations

import argparse

from fnaccel.commands.main import CommandError, Subcommands

__all__ = ["register", "run"]


def register(subparsers: Subcommands) -> None:
    """Add ``fnaccel tpu-config`` to the command line."""
    parser = subparsers.add_parser(
        "tpu-config",
        help="Run commands on a TPU pod (not supported by this build).",
        description="Accelerate's `tpu-config` (runs commands on every worker of a TPU pod). "
        "Every flag is accepted, but this build has no TPU support (no torch_xla "
        "engine), so the command always fails.",
    )
    config = parser.add_argument_group("Config Arguments", "Arguments that `fnaccel config` can set.")
    config.add_argument("--config_file", default=None, help="Path to the config file to use.")
    config.add_argument(
        "--tpu_name", default=None, help="The TPU to use; default: the one in the config file."
    )
    config.add_argument(
        "--tpu_zone", default=None, help="The zone of the TPU; default: the one in the config file."
    )
    pod = parser.add_argument_group("TPU Arguments", "Arguments for options run inside the TPU.")
    pod.add_argument("--command_file", default=None, help="A file of commands to run on the pod at startup.")
    pod.add_argument(
        "--command",
        action="append",
        nargs="+",
        help="A command to run on the pod; may be passed several times.",
    )
    pod.add_argument(
        "--install_accelerate", action="store_true", help="Install the library on the pod first."
    )
    pod.add_argument(
        "--accelerate_version",
        default="latest",
        help="The version to install on the pod ('dev' for the development one).",
    )
    pod.add_argument(
        "--debug", action="store_true", help="Print the command that would run instead of running it."
    )
    parser.set_defaults(handler=run, command_name="tpu-config")


def run(args: argparse.Namespace) -> int:
    """Always raises `CommandError`: there is no TPU engine to configure."""
    raise CommandError(
        "this build has no TPU support (no torch_xla engine), so it cannot configure or run "
        "commands on a TPU pod; use `accelerate tpu-config` for TPUs, or `fnaccel launch` "
        "on CPUs and CUDA GPUs"
    )
