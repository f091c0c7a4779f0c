"""``fnaccel launch``: the command line resolved into one launch and handed to torchrun.

The command resolves one `LaunchConfig` (the config file, then the flags of
`fnaccel.commands.launch_flags` on top), refuses what this build cannot
launch before any process starts (`check_launchable`, which ``fnaccel env``
shares), and turns it into `torch.distributed.run` arguments and into the
environment variables `fa.init` reads, as ``accelerate launch`` does. The
script needs no arguments of its own: ranks come from torchrun's variables,
everything else from ``FNACCEL_*`` ones. Every worker starts through
`fnaccel.commands.launch_worker` (`WORKER_ENTRY`), which ties it to this
process.

What happens from the agent's start to the launch's last line (the machines
meeting, signals, the heartbeat between machines, the workers' outcome
files, the line that says what ended the run) is
`fnaccel.commands.launch_lifetime`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch.distributed.run as torchrun

from fnaccel._errors import ConfigError
from fnaccel.commands.launch_flags import (
    DEEPSPEED_FLAGS,
    DYNAMO_FLAGS,
    FP8_FLAGS,
    FSDP_FLAGS,
    PARALLELISM_FLAGS,
    add_launch_arguments,
    refused_flags,
)
from fnaccel.commands.launch_lifetime import supervise, supervise_dry_run
from fnaccel.commands.main import CommandError, Subcommands, main
from fnaccel.config.launch import LaunchConfig, default_config_file, launch_env, load_config
from fnaccel.config.parallelism import ParallelismConfig
from fnaccel.kwargs import FP8RecipeKwargs
from fnaccel.transforms.fp8 import check_fp8_recipe, recipe_from_config
from fnaccel.transforms.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, TorchDynamoPlugin
from fnaccel.transforms.plugins.megatron import megatron_refusal

__all__ = [
    "check_launchable",
    "launch_environment",
    "max_local_processes",
    "refused_keys",
    "register",
    "resolve",
    "run",
    "run_launch",
    "torchrun_arguments",
    "worker_program",
]

_REFUSED_TYPES = MappingProxyType(
    {
        "XLA": "this build has no TPU (torch_xla) engine",
    }
)

# What each worker runs first: it dies with the launcher, then executes the worker's program.
WORKER_ENTRY = "fnaccel.commands.launch_worker"

_FSDP_ALIASES = MappingProxyType({"fsdp_backward_prefetch_policy": "fsdp_backward_prefetch"})


def register(subparsers: Subcommands) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="Launch a training script on every process of a run (torchrun's agent).",
        description="Launch a script on one or many processes and machines with torch.distributed.run. "
        "Values come from the config file; flags given here win.",
    )
    add_launch_arguments(parser)
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Check the launch on this machine instead: the script runs as the first and last "
        "rank of the configured world on torch's fake process group (CPU) up to its "
        "fa.prepare and one step; prints the mesh, each rank's bytes, the checkpoint "
        "layout (docs/cli.md).",
    )
    parser.add_argument(
        "--dry_run_json",
        metavar="PATH",
        help="With --dry_run: also write its figures as JSON to PATH (every rank's bytes, the "
        "simulated ranks' own measurements, the mesh and the tensors), for scripts and CI.",
    )
    parser.set_defaults(handler=run, command_name="launch")


def _given(args: argparse.Namespace, name: str) -> object:
    return getattr(args, name, None)


def resolve(args: argparse.Namespace) -> LaunchConfig:
    """The config file (``--config_file``, else the default file if any) with the
    flags that were given laid over it; refused engines raise `CommandError`."""
    for flag, why in refused_flags(args):
        if "megatron" in flag:
            why = megatron_refusal()
        raise CommandError(f"{flag}: {why}")
    if args.config_file is not None:
        config = load_config(args.config_file)
    elif default_config_file().is_file():
        config = load_config(default_config_file())
    else:
        config = LaunchConfig()
    changes: dict[str, Any] = {}
    for name in (
        "mixed_precision",
        "num_processes",
        "num_machines",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "gpu_ids",
        "same_network",
        "enable_cpu_affinity",
        "debug",
    ):
        if _given(args, name) is not None:
            changes[name] = _given(args, name)
    if args.cpu:
        changes["use_cpu"] = True
    if args.multi_gpu:
        if args.cpu:
            raise CommandError("--cpu and --multi_gpu contradict each other; pass one")
        changes["distributed_type"] = "MULTI_GPU"
    if args.use_fsdp:
        changes["distributed_type"] = "FSDP"
    fsdp = {
        _FSDP_ALIASES.get(flag[2:], flag[2:]): _given(args, flag[2:])
        for flag, _, _ in FSDP_FLAGS
        if _given(args, flag[2:]) is not None
    }
    if fsdp:
        changes["fsdp_config"] = {**config.fsdp_config, **fsdp}
    if args.use_deepspeed:
        changes["distributed_type"] = "DEEPSPEED"
    deepspeed = {
        flag[2:]: _given(args, flag[2:])
        for flag, _, _ in DEEPSPEED_FLAGS
        if _given(args, flag[2:]) is not None
    }
    if deepspeed:
        changes["deepspeed_config"] = {**config.deepspeed_config, **deepspeed}
    fp8 = {
        _fp8_key(flag): _given(args, flag[2:])
        for flag, _, _ in FP8_FLAGS
        if _given(args, flag[2:]) is not None
    }
    if fp8:
        changes["fp8_config"] = {**config.fp8_config, **fp8}
    dynamo = {
        flag[2:]: _given(args, flag[2:]) for flag, _, _ in DYNAMO_FLAGS if _given(args, flag[2:]) is not None
    }
    if dynamo:
        changes["dynamo_config"] = {**config.dynamo_config, **dynamo}
    mesh = {
        flag[2:]: _given(args, flag[2:])
        for flag, _, _ in PARALLELISM_FLAGS
        if _given(args, flag[2:]) is not None
    }
    if mesh:
        changes["parallelism_config"] = {**config.parallelism_config, **mesh}
    config = dataclasses.replace(config, **changes)
    # a dry run starts two processes whatever the world's size: no processes-per-CPU limit
    check_launchable(config, force=args.force_num_processes or bool(_given(args, "dry_run")))
    return config


def _fp8_key(flag: str) -> str:
    """``--fp8_margin`` -> ``margin``, as Accelerate's fp8_config names it (``fp8_format`` stays)."""
    name = flag[2:]
    return name if name == "fp8_format" else name.removeprefix("fp8_")


# Keys Accelerate writes for TPU launches only (their defaults are what it writes otherwise).
_TPU_KEYS = (
    "tpu_name",
    "tpu_zone",
    "tpu_vm",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "command_file",
    "commands",
    "downcast_bf16",
    "main_training_function",
)

# Sections of engines this build does not ship: any value in them is refused, with the reason.
_REFUSED_SECTIONS = MappingProxyType(
    {
        "megatron_lm_config": "this build has no Megatron-LM engine; remove the section",
        "mpirun_config": "fnaccel launches with torchrun, not mpirun; for several machines give "
        "num_machines, machine_rank, main_process_ip and main_process_port",
    }
)


def refused_keys(config: LaunchConfig) -> list[tuple[str, str]]:
    """``(key, why)`` for each key of an Accelerate config that asks for what this
    build cannot do; an empty or default value asks for nothing."""
    defaults = LaunchConfig()
    refused = [
        (key, "it configures TPU launches and this build has no TPU (torch_xla) engine")
        for key in _TPU_KEYS
        if getattr(config, key) != getattr(defaults, key)
    ]
    refused += [
        (key, why)
        for key, why in _REFUSED_SECTIONS.items()
        if any(value not in (None, {}, [], "") for value in getattr(config, key).values())
    ]
    ipex = {key: value for key, value in config.ipex_config.items() if value not in (None, False)}
    if ipex:
        refused.append(
            (
                "ipex_config",
                f"{sorted(ipex)[0]}: this build has no Intel Extension for "
                "PyTorch (IPEX) or XPU support; remove the section",
            )
        )
    return refused


def max_local_processes() -> int:
    """The most processes `fnaccel launch` starts on one machine without
    ``--force_num_processes``: 4 per CPU this process may use, and at least 8."""
    return max(8, 4 * _usable_cpus())


def check_launchable(config: LaunchConfig, *, force: bool = False) -> None:
    """Raise `CommandError` naming the key when ``config`` asks for what this build
    cannot launch: what `fnaccel launch` refuses, `fnaccel env` refuses too."""
    where = config.source or "the command line"
    if config.compute_environment != "LOCAL_MACHINE":
        raise CommandError(
            f"{where}: compute_environment {config.compute_environment}: "
            "this build launches on local machines only (LOCAL_MACHINE)"
        )
    if config.distributed_type == "MEGATRON_LM":
        raise CommandError(f"{where}: distributed_type MEGATRON_LM: {megatron_refusal()}")
    if config.distributed_type in _REFUSED_TYPES:
        raise CommandError(
            f"{where}: distributed_type {config.distributed_type}: {_REFUSED_TYPES[config.distributed_type]}"
        )
    _check_engines(config, where)
    for key, why in refused_keys(config):
        raise CommandError(f"{where}: key '{key}': {why}")
    if not 0 <= config.machine_rank < config.num_machines:
        raise CommandError(
            f"{where}: machine_rank {config.machine_rank} is outside "
            f"0..{config.num_machines - 1} for num_machines {config.num_machines}"
        )
    local = -(-config.num_processes // config.num_machines)
    if local > max_local_processes() and not force:
        raise CommandError(
            f"{where}: num_processes {config.num_processes} is {local} processes on this machine, "
            f"more than the {max_local_processes()} it can run (4 per usable CPU); pass "
            "--force_num_processes to start them anyway"
        )
    if config.distributed_type == "FSDP":
        FullyShardedDataParallelPlugin.from_config(config.fsdp_config, f"{where}: fsdp_config")
    if config.parallelism_config:
        layout = ParallelismConfig.from_config(config.parallelism_config, f"{where}: parallelism_config")
        try:
            layout.resolved(config.num_processes)
        except ValueError as exc:
            raise CommandError(f"{where}: parallelism_config: {exc}") from None
    TorchDynamoPlugin.from_config(config.dynamo_config, f"{where}: dynamo_config")


def _check_engines(config: LaunchConfig, where: str) -> None:
    """DeepSpeed and fp8 settings checked before any process starts, naming the key and the fix."""
    if config.distributed_type == "DEEPSPEED":
        DeepSpeedPlugin.from_config(config.deepspeed_config, f"{where}: deepspeed_config")
        if importlib.util.find_spec("deepspeed") is None:
            raise CommandError(
                f"{where}: distributed_type DEEPSPEED needs DeepSpeed: pip install "
                "'fnaccel[deepspeed]' (docs/deepspeed.md)"
            )
    elif any(value not in (None, "", {}) for value in config.deepspeed_config.values()):
        raise CommandError(
            f"{where}: key 'deepspeed_config' is set but distributed_type is "
            f"{config.distributed_type}; pass --use_deepspeed (distributed_type: DEEPSPEED) "
            "or remove the section"
        )
    recipe = recipe_from_config(config.fp8_config, f"{where}: fp8_config")
    if config.mixed_precision == "fp8":
        try:
            check_fp8_recipe(recipe or FP8RecipeKwargs())
        except (ValueError, ImportError) as exc:
            raise CommandError(f"{where}: mixed_precision fp8: {exc}") from None
        if config.distributed_type == "DEEPSPEED":
            raise CommandError(
                f"{where}: mixed_precision fp8 does not run through DeepSpeed here; use "
                "bf16 with DeepSpeed, or fp8 with distributed_type MULTI_CPU/MULTI_GPU or FSDP"
            )
    elif recipe is not None:
        raise CommandError(
            f"{where}: key 'fp8_config' (or an --fp8_* flag) is set but mixed_precision is "
            f"{config.mixed_precision}; pass --mixed_precision fp8 or remove it"
        )


def _num_processes(args: argparse.Namespace, config: LaunchConfig) -> int:
    import torch

    if args.num_processes is None and config.source is None and config.distributed_type == "MULTI_GPU":
        if not torch.cuda.is_available():
            raise CommandError(
                "--multi_gpu needs CUDA GPUs and this machine has none; "
                "use --cpu --num_processes N for processes on the CPU"
            )
        return torch.cuda.device_count()
    return config.num_processes


def worker_program(args: argparse.Namespace) -> list[str]:
    """What each worker runs, as torchrun would run it (``python -u [-m] script args``)."""
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    python = os.getenv("PYTHON_EXEC", sys.executable)  # torchrun's own override
    return [python, "-u", *(["-m"] if args.module else []), args.training_script, *args.training_script_args]


def torchrun_arguments(args: argparse.Namespace, config: LaunchConfig) -> list[str]:
    """The ``torch.distributed.run`` command line for this launch: every worker runs
    `WORKER_ENTRY` with this process's pid, then `worker_program`."""
    num_processes = _num_processes(args, config)
    num_machines = config.num_machines
    if num_processes % num_machines:
        raise CommandError(
            f"--num_processes {num_processes} is the total over all machines and "
            f"must divide evenly over --num_machines {num_machines}"
        )
    argv = ["--nproc_per_node", str(num_processes // num_machines)]
    if num_machines > 1:
        if config.main_process_ip is None or config.main_process_port is None:
            raise CommandError(
                f"--num_machines {num_machines} needs --main_process_ip and "
                "--main_process_port (the machine of rank 0)"
            )
        argv += ["--nnodes", str(num_machines)]
        if config.rdzv_backend == "static":
            argv += [
                "--node_rank",
                str(config.machine_rank),
                "--master_addr",
                config.main_process_ip,
                "--master_port",
                str(config.main_process_port),
            ]
        else:
            argv += [
                "--rdzv_backend",
                config.rdzv_backend,
                "--rdzv_endpoint",
                f"{config.main_process_ip}:{config.main_process_port}",
            ]
    elif config.main_process_port is not None:
        argv += [
            "--master_addr",
            config.main_process_ip or "127.0.0.1",
            "--master_port",
            str(config.main_process_port),
        ]
    else:
        argv += ["--standalone"]  # one machine, no port named: torchrun picks a free one
    for flag, value in (
        ("--rdzv_conf", args.rdzv_conf),
        ("--max_restarts", args.max_restarts),
        ("--monitor_interval", args.monitor_interval),
        ("--role", args.role),
        ("--tee", args.tee),
        ("--log_dir", args.log_dir),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.module and args.no_python:
        raise CommandError("-m/--module and --no_python contradict each other; pass one")
    return [*argv, "--module", WORKER_ENTRY, str(os.getpid()), *worker_program(args)]


def launch_environment(args: argparse.Namespace, config: LaunchConfig) -> dict[str, str]:
    """The variables every process gets: the resolved config (`fnaccel.config.launch.launch_env`),
    plus thread and GPU settings."""
    env = launch_env(config)
    if config.gpu_ids not in ("all", ""):
        env["CUDA_VISIBLE_DEVICES"] = config.gpu_ids
    threads = args.num_cpu_threads_per_process
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        local = max(1, _num_processes(args, config) // config.num_machines)
        threads = max(1, _usable_cpus() // local)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _usable_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _check_script(args: argparse.Namespace) -> None:
    if args.module or args.no_python:
        return
    if not Path(args.training_script).is_file():
        raise CommandError(
            f"no such script: {args.training_script} (pass a Python file, or a module with -m)"
        )


def run(args: argparse.Namespace) -> int:
    """Launch ``args.training_script`` and return the run's exit status."""
    try:
        config = resolve(args)
    except ConfigError as exc:
        raise CommandError(str(exc)) from None
    _check_script(args)
    if args.dry_run_json is not None and not args.dry_run:
        raise CommandError(
            "--dry_run_json writes a dry run's figures; add --dry_run (or drop --dry_run_json)"
        )
    if args.dry_run:
        from fnaccel.commands.dry_run import dry_run

        # its two workers start as the real ones do: through the entry that ties them to this process
        program = [sys.executable, "-u", "-m", WORKER_ENTRY, str(os.getpid()), *worker_program(args)]
        return supervise_dry_run(
            lambda: dry_run(
                config,
                _num_processes(args, config),
                args.training_script,
                program,
                launch_environment(args, config),
                json_path=args.dry_run_json,
            )
        )
    torchrun_args = torchrun.get_args_parser().parse_args(torchrun_arguments(args, config))
    if args.quiet:  # each of torch's elastic modules sets its own logger's level: set them all
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.ERROR)
    return supervise(
        torchrun_args,
        config,
        launch_environment(args, config),
        script=args.training_script,
        num_local=max(1, _num_processes(args, config) // config.num_machines),
        rdzv_conf=args.rdzv_conf,
        debug=args.debug,
    )


def run_launch(argv: Sequence[str]) -> int:
    """Parse ``argv`` exactly as ``fnaccel launch <argv>`` would, and launch.

    Used by ``fnaccel test``; errors are reported as the command line does.
    """
    return main(["launch", *argv])
