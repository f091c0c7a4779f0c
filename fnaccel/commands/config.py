"""``fnaccel config``: write the launch config file by questions, by defaults, or by update.

- ``fnaccel config``: asks Accelerate's questions and writes the answers.
  The answers may come from a pipe; when the input ends early, the remaining
  questions take their defaults, so the command never needs a terminal.
- ``fnaccel config default``: a config for this machine without questions.
- ``fnaccel config update``: rewrites an existing file (an Accelerate one
  too) with today's keys and defaults, keeping the user's values.

Every file written is validated first and replaced atomically.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO, TypeVar

from fnaccel.checks import str_to_bool
from fnaccel.commands.main import CommandError, Subcommands
from fnaccel.config.launch import (
    basic_config,
    config_from_mapping,
    default_config_file,
    load_config,
    write_basic_config,
    write_config,
)

__all__ = ["Questions", "ask_config", "register", "run"]

T = TypeVar("T")

_CONFIG_FILE_HELP = (
    "Where the config file goes. Default: $HF_HOME/fnaccel/default_config.yaml, else "
    "$XDG_CACHE_HOME/huggingface/fnaccel/, else ~/.cache/huggingface/fnaccel/."
)


def register(subparsers: Subcommands) -> None:
    parser = subparsers.add_parser(
        "config",
        help="Create the launch config file (questions, defaults, or update).",
        description="Ask questions about the training setup and write the answers as the launch "
        "config file. `config default` and `config update` need no answers.",
    )
    parser.add_argument("--config_file", default=None, help=_CONFIG_FILE_HELP)
    parser.set_defaults(handler=run, command_name="config")
    actions = parser.add_subparsers(title="subcommands", metavar="{default,update}")
    default = actions.add_parser(
        "default",
        help="Write a config for this machine without questions.",
        description="Write a config for this machine (all its GPUs, else its "
        "CPU) without questions; an existing file is kept.",
    )
    default.add_argument("--config_file", default=None, help=_CONFIG_FILE_HELP)
    default.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16"),
        default="no",
        help="Mixed precision of the run: no, fp16 or bf16.",
    )
    default.set_defaults(handler=run_default, command_name="config default")
    update = actions.add_parser(
        "update",
        help="Rewrite a config file with today's keys and defaults.",
        description="Rewrite an existing config file (an Accelerate one too) "
        "with today's keys and defaults, keeping its values.",
    )
    update.add_argument("--config_file", default=None, help=_CONFIG_FILE_HELP)
    update.set_defaults(handler=run_update, command_name="config update")


def _target(args: argparse.Namespace) -> Path:
    return Path(args.config_file) if args.config_file else default_config_file()


def run_default(args: argparse.Namespace) -> int:
    target = _target(args)
    if target.exists() and not target.is_file():  # not "a config file already exists"
        raise CommandError(f"{target}: not a file (a directory?); choose a file path for --config_file")
    written = write_basic_config(args.mixed_precision, target)
    if written is False:
        print(
            f"fnaccel: a config file already exists at {target}; it was kept. Delete it, run "
            "`fnaccel config`, or pass another --config_file.",
            file=sys.stderr,
        )
        return 0
    print(f"fnaccel configuration saved at {target}")
    return 0


def run_update(args: argparse.Namespace) -> int:
    target = _target(args)
    if not target.is_file():
        raise CommandError(
            f"no config file at {target}; run `fnaccel config` or `fnaccel config default` to create one"
        )
    write_config(load_config(target), target)
    print(f"fnaccel configuration updated at {target}")
    return 0


def run(args: argparse.Namespace) -> int:
    answers = ask_config(Questions(sys.stdin, sys.stdout))
    target = write_config(config_from_mapping(answers, "your answers"), _target(args))
    print(f"fnaccel configuration saved at {target}")
    return 0


class Questions:
    """Asks on ``output`` and reads answers line by line from ``source`` (a
    terminal or a pipe); past the end of ``source`` every question takes its default."""

    def __init__(self, source: TextIO, output: TextIO) -> None:
        self.source = source
        self.output = output
        self.exhausted = False

    def _line(self, prompt: str) -> str | None:
        self.output.write(prompt)
        self.output.flush()
        line = "" if self.exhausted else self.source.readline()
        if not line:
            if not self.exhausted:
                self.output.write("\n(no more input: the remaining questions take their defaults)\n")
            self.exhausted = True
            return None
        if not self.source.isatty():
            self.output.write(line if line.endswith("\n") else line + "\n")
        return line.strip()

    def ask(self, question: str, default: T, convert: Callable[[str], T], hint: str = "") -> T:
        """One question; an empty answer (or none) is ``default``; a bad one is asked again."""
        while True:
            answer = self._line(f"{question} [{hint or default}]: ")
            if not answer:
                return default
            try:
                return convert(answer)
            except ValueError as exc:
                self.output.write(f"  {exc}\n")

    def yes_no(self, question: str, default: bool = False) -> bool:
        return self.ask(question, default, _yes_no, "YES/no" if default else "yes/NO")

    def choose(self, question: str, options: Sequence[str], default: int = 0) -> str:
        lines = "".join(f"  {i}: {option}\n" for i, option in enumerate(options))
        self.output.write(f"{question}\n{lines}")
        index = self.ask("Please enter a number", default, _index(len(options)))
        return options[index]


def _yes_no(text: str) -> bool:
    try:
        return str_to_bool(text, to_bool=True)
    except ValueError:
        raise ValueError("please answer yes or no") from None


def _index(count: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        if not text.isdigit() or not 0 <= int(text) < count:
            raise ValueError(f"please enter a number from 0 to {count - 1}")
        return int(text)

    return convert


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError("please enter a whole number of at least 1")
    return int(text)


def _whole(text: str) -> int:
    if not text.isdigit():
        raise ValueError("please enter a whole number")
    return int(text)


_MACHINES = ("No distributed training", "multi-CPU", "multi-GPU")
_DYNAMO = ("INDUCTOR", "AOT_EAGER", "EAGER", "CUDAGRAPHS")


def ask_config(q: Questions) -> dict[str, object]:
    """Accelerate's ``accelerate config`` questions (for what this build runs); the answers
    as config keys."""
    basic = basic_config()
    config: dict[str, object] = {"compute_environment": "LOCAL_MACHINE"}
    machine = q.choose(
        "Which type of machine are you using?", _MACHINES, 2 if basic.distributed_type == "MULTI_GPU" else 0
    )
    distributed = machine != _MACHINES[0]
    config["distributed_type"] = {"multi-CPU": "MULTI_CPU", "multi-GPU": "MULTI_GPU"}.get(machine, "NO")
    if machine == "multi-CPU":
        config["use_cpu"] = True
    if distributed:
        num_machines = q.ask(
            "How many different machines will you use (more than 1 for multi-node training)?", 1, _positive
        )
        config["num_machines"] = num_machines
        if num_machines > 1:
            config["machine_rank"] = q.ask("What is the rank of this machine?", 0, _whole)
            config["main_process_ip"] = q.ask(
                "What is the IP address of the machine of rank 0?", "127.0.0.1", str
            )
            config["main_process_port"] = q.ask(
                "What is the port of the machine of rank 0?", 29500, _positive
            )
            config["rdzv_backend"] = q.choose("What rendezvous backend will you use?", ("static", "c10d"))
            config["same_network"] = q.yes_no("Are all the machines on the same local network?", True)
        config["debug"] = q.yes_no(
            "Should distributed operations be checked while running for errors? "
            "This can avoid timeout issues but will be slower."
        )
        if q.yes_no("Do you want to use FullyShardedDataParallel (FSDP2)?"):
            config["distributed_type"] = "FSDP"
            config["fsdp_config"] = _ask_fsdp(q)
    elif basic.use_cpu is False:
        config["use_cpu"] = q.yes_no(
            "Do you want to run your training on CPU only (even if a GPU is available)?"
        )
    else:
        config["use_cpu"] = True
    if q.yes_no("Do you wish to optimize your script with torch dynamo?"):
        config["dynamo_config"] = {
            "dynamo_backend": q.choose("Which dynamo backend would you like to use?", _DYNAMO),
            "dynamo_mode": q.choose(
                "Which mode do you want to use?", ("default", "reduce-overhead", "max-autotune")
            ),
            "dynamo_use_fullgraph": q.yes_no(
                "Do you want the fullgraph mode or it is ok to break model into several subgraphs?"
            ),
            "dynamo_use_dynamic": q.yes_no("Do you want to enable dynamic shape tracing?"),
        }
    default_processes = max(basic.num_processes, 2) if distributed else 1
    config["num_processes"] = (
        q.ask("How many processes in total will you use?", default_processes, _positive) if distributed else 1
    )
    if machine == "multi-GPU":
        config["gpu_ids"] = q.ask(
            "What GPU(s) (by id) should be used for training on this machine as a comma-separated list?",
            "all",
            str,
        )
    config["mixed_precision"] = q.choose("Do you wish to use mixed precision?", ("no", "fp16", "bf16"))
    return config


def _ask_fsdp(q: Questions) -> dict[str, object]:
    fsdp: dict[str, object] = {
        "fsdp_version": 2,
        "fsdp_sharding_strategy": q.choose(
            "What should be your sharding strategy?", ("FULL_SHARD", "SHARD_GRAD_OP")
        ),
        "fsdp_offload_params": q.yes_no("Do you want to offload parameters and gradients to CPU?"),
    }
    policy = q.choose(
        "What should be your auto wrap policy?", ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
    )
    fsdp["fsdp_auto_wrap_policy"] = policy
    if policy == "TRANSFORMER_BASED_WRAP":
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = q.ask(
            "Specify the comma-separated list of transformer layer class names (case-sensitive) to "
            "wrap, e.g. `BertLayer`, `GPTJBlock`, `T5Block`",
            "Block",
            str,
        )
    elif policy == "SIZE_BASED_WRAP":
        fsdp["fsdp_min_num_params"] = q.ask(
            "What should be your FSDP's minimum number of parameters for default auto wrapping?",
            100_000_000,
            _positive,
        )
    fsdp["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"  # fa.save's only layout under FSDP
    fsdp["fsdp_sync_module_states"] = q.yes_no(
        "Do you want each sharded module to start from rank 0's weights (sync module states)?", True
    )
    return fsdp
