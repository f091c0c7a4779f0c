"""``fnaccel launch``: run a script on every process of a run, under torchrun's elastic agent.

The command resolves one `LaunchConfig` (the config file, then the command
line on top), turns it into `torch.distributed.run` arguments and into the
environment variables `fa.init` reads, and runs the agent in this process, as
``accelerate launch`` does. The script needs no arguments of its own: ranks
come from torchrun's variables, everything else from ``FNACCEL_*`` ones.

Around the agent, the launcher keeps three promises torchrun alone does not
(docs/cli.md, "The launcher's own life"): every worker starts through
`fnaccel.commands.launch_worker`, which ends it when the launcher dies, even
by SIGKILL; the machines of a multi-machine launch meet on the launcher's
own store first, with a line every 30 s, Ctrl-C honoured at once and one line
when the wait times out (a port in use is refused before any worker starts);
SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 reach the workers and end the
launch with one line and status 128 + the signal's number.

Two more, which need the workers' word (docs/cli.md, "Exit status"): the
launcher hands them a private directory (`LAUNCH_DIR_ENV`) where each worker
records its global rank, and where a run with `fa.PreemptionKwargs` records
that it was preempted or that it finished. A preempted run ends the launch
with `PREEMPTED_EXIT_CODE` wherever the signal arrived; a run that finished
ends it with 0 whatever signal arrives after. And the launchers of a
multi-machine launch keep each other in sight on the rendezvous store
(`_Machines`), so that a machine that vanishes is named by the survivors
instead of their own ranks, which only saw a connection close.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType, MappingProxyType
from typing import Any

import torch.distributed.run as torchrun
from torch.distributed import DistNetworkError, TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

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
from fnaccel.commands.main import CommandError, Subcommands, main
from fnaccel.config.environment import patch_environment as _patched_environment
from fnaccel.config.launch import LaunchConfig, default_config_file, launch_env, load_config
from fnaccel.config.parallelism import ParallelismConfig
from fnaccel.constants import FINISHED_MARK, LAUNCH_DIR_ENV, PREEMPTED_EXIT_CODE, PREEMPTED_MARK, RANK_MARK
from fnaccel.kwargs import FP8RecipeKwargs
from fnaccel.resources import FAILED_AT_KEY
from fnaccel.transforms.fp8 import check_fp8_recipe, recipe_from_config
from fnaccel.transforms.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, TorchDynamoPlugin
from fnaccel.transforms.plugins.megatron import megatron_refusal

__all__ = [
    "check_launchable",
    "first_failure",
    "launch_environment",
    "max_local_processes",
    "refused_keys",
    "register",
    "rendezvous_timeout",
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

# Seconds between the lines a launcher prints while it waits for the other machines;
# FNACCEL_LAUNCH_REPORT_INTERVAL overrides it (the tests wait seconds, not minutes).
REPORT_INTERVAL_S = 30.0

# torchrun's rendezvous timeouts when --rdzv_conf names none: static's (LaunchConfig's
# default "timeout") and c10d's ("join_timeout").
_RDZV_TIMEOUT_S = MappingProxyType({"static": 900.0, "c10d": 600.0})

# The signals torchrun's agent forwards to the workers, and SIGUSR1 (Slurm's early warning,
# `--signal=USR1@90`, whose default action ended the launcher and so every worker, unsaved);
# the launcher handles them the same way from its start, so one arriving before the workers
# exist ends it as cleanly.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

# A launcher of a multi-machine launch adds to its counter on the rendezvous store every
# HEARTBEAT_S; a machine whose counter stays still for LOST_AFTER_S, its end unmarked, is lost.
HEARTBEAT_S = 0.5
LOST_AFTER_S = 5.0

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


class _Ended(Exception):
    """The launch ends before or instead of the agent's result: ``status``, and the one line why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
        try:
            with _signals_raise(SignalException):  # the workers are ended on the way out (dry_run's own)
                return dry_run(
                    config,
                    _num_processes(args, config),
                    args.training_script,
                    program,
                    launch_environment(args, config),
                    json_path=args.dry_run_json,
                )
        except SignalException as exc:
            print(
                f"fnaccel launch --dry_run: stopped by {exc.sigval.name}; its simulated ranks were ended",
                file=sys.stderr,
            )
            return 128 + int(exc.sigval)
    torchrun_args = torchrun.get_args_parser().parse_args(torchrun_arguments(args, config))
    if args.quiet:  # each of torch's elastic modules sets its own logger's level: set them all
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.ERROR)
    local = max(1, _num_processes(args, config) // config.num_machines)
    launch_dir = Path(tempfile.mkdtemp(prefix="fnaccel-launch-"))
    machines: _Machines | None = None
    try:
        with (
            _patched_environment(**launch_environment(args, config), **{LAUNCH_DIR_ENV: str(launch_dir)}),
            _signals_raise(SignalException),
        ):
            try:
                with _machines_met(args, config) as store:
                    if store is not None and config.num_machines > 1:
                        machines = _Machines(store, config, launch_dir, local)
                    torchrun.run(torchrun_args)
            except _Ended as exc:
                print(exc, file=sys.stderr)
                return exc.status
            except SignalException as exc:
                outcome = _Outcome.read(launch_dir, local)
                if outcome.preempted is not None:
                    return _preempted(outcome.preempted)
                if outcome.finished:
                    print(
                        f"fnaccel launch: got {exc.sigval.name} after the run had finished (every rank's "
                        "fa.shutdown came first): exit 0",
                        file=sys.stderr,
                    )
                    return 0
                grace = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
                print(
                    f"fnaccel launch: stopped by {exc.sigval.name}: the workers got it and had {grace} s "
                    "to end (torchrun's shutdown timeout)",
                    file=sys.stderr,
                )
                return 128 + int(exc.sigval)
            except ChildFailedError as exc:
                if args.debug:
                    raise
                lost = machines.lost() if machines is not None else []
                if lost:
                    print(machines.lost_line(lost), file=sys.stderr)  # type: ignore[union-attr]
                    return 1
                outcome = _Outcome.read(launch_dir, local)
                if outcome.preempted is not None and all(
                    _by_signal(f.exitcode) for f in exc.failures.values()
                ):
                    return _preempted(outcome.preempted)
                rank, first = first_failure(exc)
                elsewhere = (
                    machines.failed_first(_failed_at_ns(first), rank) if machines is not None else None
                )
                if elsewhere is not None:
                    machine, rank = elsewhere
                    print(
                        f"fnaccel launch: {args.training_script} failed: rank {rank} (machine {machine}) "
                        f"failed first (its traceback is in that machine's output); the ranks of this "
                        f"machine failed after it (their errors are above)",
                        file=sys.stderr,
                    )
                    return first.exitcode if first.exitcode > 0 else 1
                print(
                    f"fnaccel launch: {args.training_script} failed: rank {rank} exited with code "
                    f"{first.exitcode} (its traceback is above; --debug shows the launcher's)",
                    file=sys.stderr,
                )
                return first.exitcode if first.exitcode > 0 else 1
        outcome = _Outcome.read(launch_dir, local)
        return 0 if outcome.preempted is None else _preempted(outcome.preempted)
    finally:
        if machines is not None:
            machines.close()
        shutil.rmtree(launch_dir, ignore_errors=True)


def _failed_at_ns(failure: ProcessFailure) -> int:
    """When a worker failed: its own record (ns) where it wrote one, else torchrun's (seconds)."""
    recorded = _recorded_ns(failure)
    return recorded if recorded is not None else int(failure.timestamp) * 1_000_000_000


def _by_signal(exitcode: int) -> bool:
    """Whether a worker's exit status says a signal ended it (killed: negative; or a
    script that exited 128 + the signal's number, as the docs suggest without the launcher)."""
    return exitcode < 0 or exitcode > 128


def _preempted(reason: str) -> int:
    print(
        f"fnaccel launch: preempted by {reason}: every rank stopped at the same step (fa.PreemptionKwargs); "
        f"exit {PREEMPTED_EXIT_CODE}, requeue the job to resume from its checkpoint",
        file=sys.stderr,
    )
    return PREEMPTED_EXIT_CODE


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Outcome:
    """What this machine's workers recorded in the launch directory (fnaccel.preemption).

    Attributes:
        preempted: the signal a rank's run stopped on, or None.
        finished: every local rank's run ended through `fa.shutdown` (or the exit's) unpreempted.
    """

    preempted: str | None
    finished: bool

    @classmethod
    def read(cls, launch_dir: Path, local: int) -> _Outcome:
        reasons = sorted(
            path.read_text(encoding="utf-8")[:40] for path in launch_dir.glob(f"{PREEMPTED_MARK}.*")
        )
        finished = len(list(launch_dir.glob(f"{FINISHED_MARK}.*")))
        return cls(preempted=reasons[-1] if reasons else None, finished=finished >= local)


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 2-3`` or ``ranks 1, 5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class _Machines:
    """The launchers of a multi-machine launch keep each other in sight on the rendezvous store.

    Each launcher adds one to its own counter every `HEARTBEAT_S` (a thread: the main
    thread is torchrun's) and publishes the global ranks its workers got (each worker
    records its rank in the launch directory first thing). A launcher that ends through
    Python marks its end before it stops. When a worker fails, its launcher asks who is
    gone: a machine whose counter did not move for `LOST_AFTER_S` and that marked no end
    vanished (SIGKILL, power, network), and the errors of this machine's ranks (a closed
    connection) follow from it. One whose store stopped answering lost the machine of rank
    0, which holds the store. Only the failure path waits; a launch that runs pays one
    store operation every `HEARTBEAT_S` per machine.
    """

    def __init__(self, store: TCPStore, config: LaunchConfig, launch_dir: Path, local: int) -> None:
        self._store = store
        self._rank = config.machine_rank
        self._total = config.num_machines
        self._where = f"{config.main_process_ip}:{config.main_process_port}"
        self._local = local
        self._launch_dir = launch_dir
        self._published = False
        self._broken: str | None = None  # why the store stopped answering this launcher
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fnaccel-launch-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(what: str, machine: int) -> str:
        return f"fnaccel/launch/{what}_{machine}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key("alive", self._rank), 1)
                if not self._published:
                    ranks = sorted(
                        int(path.name.split(".", 1)[1]) for path in self._launch_dir.glob(f"{RANK_MARK}.*")
                    )
                    if len(ranks) >= self._local:
                        self._store.set(self._key("ranks", self._rank), ",".join(map(str, ranks)))
                        self._published = True
            except Exception as exc:  # the store's server (the machine of rank 0) is gone
                self._broken = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                return
            self._stop.wait(HEARTBEAT_S)

    def _counter(self, machine: int) -> int:
        return int(self._store.add(self._key("alive", machine), 0))

    def _ended(self, machine: int) -> bool:
        return bool(self._store.check([self._key("ended", machine)]))

    def lost(self) -> list[int]:
        """The machines that vanished, waiting up to `LOST_AFTER_S` for the others to show life."""
        others = [machine for machine in range(self._total) if machine != self._rank]
        try:
            if self._broken is None:
                start = {machine: self._counter(machine) for machine in others}
                deadline = time.monotonic() + LOST_AFTER_S
                while others and time.monotonic() < deadline and self._broken is None:
                    others = [
                        machine
                        for machine in others
                        if not self._ended(machine) and self._counter(machine) == start[machine]
                    ]
                    if others:
                        time.sleep(HEARTBEAT_S / 2)
                if self._broken is None:
                    return others
        except Exception as exc:
            self._broken = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return [0] if self._rank != 0 else []

    def _ranks_of(self, machine: int) -> list[int]:
        try:
            if self._broken is None and self._store.check([self._key("ranks", machine)]):
                return [
                    int(rank) for rank in self._store.get(self._key("ranks", machine)).decode().split(",")
                ]
        except Exception:
            pass
        # the machine vanished before publishing, or with the store: torchrun's static
        # rendezvous numbers a machine's ranks after the machines before it
        return list(range(machine * self._local, (machine + 1) * self._local))

    def lost_line(self, lost: Sequence[int]) -> str:
        """The launch's last line when ``lost`` machines vanished."""
        named = ", ".join(f"machine {machine} ({_ranks_text(self._ranks_of(machine))})" for machine in lost)
        if self._broken is not None:
            why = (
                f"connection closed: its launcher's store at {self._where} stopped answering ({self._broken})"
            )
        else:
            why = (
                f"connection closed: its launcher stopped answering on the store at {self._where} "
                f"for {LOST_AFTER_S:g} s"
            )
        return (
            f"fnaccel launch: {named} was lost: {why}; the errors of this machine's ranks above follow from "
            "it. Check that machine, then start the launch again on every machine (fa.load resumes from the "
            "last checkpoint)"
        )

    def failed_first(self, failed_at_ns: int, rank: int) -> tuple[int, int] | None:
        """Publish this machine's first failure and wait (at most `LOST_AFTER_S`) for the other
        machines' (or their end); ``(machine, rank)`` of another machine's that came first, else
        None. A rank whose peer on another machine failed fails too, on a closed connection,
        moments later: without this, its launcher named it."""
        try:
            self._store.set(self._key("failed", self._rank), f"{failed_at_ns} {rank}")
            pending = [machine for machine in range(self._total) if machine != self._rank]
            earliest: tuple[int, int, int] | None = None
            deadline = time.monotonic() + LOST_AFTER_S
            while pending and time.monotonic() < deadline:
                for machine in list(pending):
                    if self._store.check([self._key("failed", machine)]):
                        at, other = map(int, self._store.get(self._key("failed", machine)).decode().split())
                        earliest = min(earliest or (at, machine, other), (at, machine, other))
                        pending.remove(machine)
                    elif self._ended(machine):
                        pending.remove(machine)
                if pending:
                    time.sleep(HEARTBEAT_S / 2)
        except Exception:
            return None  # the store is gone: this machine's own failure is all it knows
        if earliest is None or earliest[0] >= failed_at_ns:
            return None
        return earliest[1], earliest[2]

    def close(self) -> None:
        """Mark this launcher's end; the machine of rank 0, whose store the others read, waits
        (at most `LOST_AFTER_S`) until they have ended too, or vanished."""
        self._stop.set()
        self._thread.join()
        if self._broken is not None:
            return
        try:
            self._store.set(self._key("ended", self._rank), "1")
            if self._rank == 0:
                others = list(range(1, self._total))
                deadline = time.monotonic() + LOST_AFTER_S
                while others and time.monotonic() < deadline:
                    others = [machine for machine in others if not self._ended(machine)]
                    if others:
                        time.sleep(HEARTBEAT_S / 2)
        except Exception:
            pass  # the store's server went first: nothing is waiting to read it


@contextlib.contextmanager
def _signals_raise(exception: type[SignalException]) -> Iterator[None]:
    """While the launch runs, each forwarded signal raises ``exception(message, signal)``
    (torch's `SignalException`) in the main thread, as torchrun's agent makes it do once
    the workers run: one path ends the launch whenever the signal comes."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise exception(f"fnaccel launch got {signal.Signals(signum).name}", signal.Signals(signum))

    previous = {sig: signal.signal(sig, handler) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, action in previous.items():
            signal.signal(sig, action)


def rendezvous_timeout(args: argparse.Namespace, config: LaunchConfig) -> float:
    """Seconds the machines may take to meet: ``--rdzv_conf timeout=S`` (Accelerate's and
    torchrun's spelling; c10d's ``join_timeout`` too), else torchrun's default."""
    settings = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    raw = settings.get("timeout") or settings.get("join_timeout")
    if raw is None:
        return _RDZV_TIMEOUT_S.get(config.rdzv_backend, _RDZV_TIMEOUT_S["static"])
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise CommandError(f"--rdzv_conf: timeout must be a positive number of seconds, got {raw[:40]!r}")
    return value


@contextlib.contextmanager
def _machines_met(args: argparse.Namespace, config: LaunchConfig) -> Iterator[TCPStore | None]:
    """Before the agent starts: the machine of rank 0 holds the rendezvous port (a port in
    use is refused here, before any worker starts) and, with several machines, every
    launcher waits until all have joined, on fnaccel's own keys in that same store; yields
    that store (None where torchrun keeps its own).

    The store is created multi-tenant, as torchrun's static and c10d rendezvous create
    theirs, so the agent's store in this process shares its server; waiting here, in
    Python, keeps Ctrl-C and the progress lines alive where torchrun's wait blocks in C++.
    """
    port = config.main_process_port
    if port is None or (config.num_machines > 1 and config.rdzv_backend not in _RDZV_TIMEOUT_S):
        yield None  # one machine on a port torchrun picks, or an etcd rendezvous: torchrun's own
        return
    host = config.main_process_ip or "127.0.0.1"
    timeout = rendezvous_timeout(args, config)
    store: TCPStore | None = None
    if config.machine_rank == 0:
        try:
            store = TCPStore(
                host, port, None, True, timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True
            )
        except DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            raise CommandError(
                f"--main_process_port {port} is already in use on this machine; pass a free "
                "port (or end what holds it)"
            ) from None
    if config.num_machines > 1:
        store = _join(store, host, port, config, timeout)
    try:
        yield store
    finally:
        del store  # the agent's store (multi-tenant) keeps the server while the run needs it


def _join(store: TCPStore | None, host: str, port: int, config: LaunchConfig, timeout: float) -> TCPStore:
    """Announce this machine on the rendezvous store and wait until every machine has;
    return the store (the server's owner must keep it). Prints a line at the start and
    every `REPORT_INTERVAL_S`; a timeout or a forwarded signal raises `_Ended`."""
    rank, total = config.machine_rank, config.num_machines
    where = f"{host}:{port}"
    interval = float(os.environ.get("FNACCEL_LAUNCH_REPORT_INTERVAL", REPORT_INTERVAL_S))
    keys = [f"fnaccel/launch/machine_{other}" for other in range(total)]
    start = time.monotonic()
    next_report = start
    lead = f"waiting up to {timeout:g} s for the machines"
    joined: list[int] = []

    def missing() -> str:
        return ", ".join(str(other) for other in range(total) if other not in joined)

    def report(lead: str) -> str:
        reached = (
            f"{len(joined)} of {total} machines joined, missing machine_rank {missing()}"
            if store is not None
            else "the machine of rank 0 does not answer"
        )
        return f"fnaccel launch: machine {rank}: {lead} at {where}: {reached}"

    try:
        while True:
            if store is None and _answers(host, port):
                store = _client_store(host, port, timeout - (time.monotonic() - start))
            if store is not None:
                store.set(keys[rank], socket.gethostname())
                joined = [other for other, key in enumerate(keys) if store.check([key])]
                if len(joined) == total:
                    return store
            now = time.monotonic()
            if now - start >= timeout:
                absent = missing() if store is not None else "0"
                raise _Ended(
                    1,
                    report(f"gave up after {timeout:g} s waiting for the machines")
                    + f"; start fnaccel launch --machine_rank {absent} there, or wait longer with "
                    "--rdzv_conf timeout=SECONDS",
                )
            if now >= next_report:
                print(report(lead), file=sys.stderr, flush=True)
                next_report += interval
                lead = f"still waiting ({next_report - start:.0f} s of {timeout:g} s)"
            time.sleep(0.2)
    except SignalException as exc:
        raise _Ended(
            128 + int(exc.sigval), report(f"stopped by {exc.sigval.name} while waiting for the machines")
        ) from None


def _answers(host: str, port: int) -> bool:
    """Whether something listens at ``host:port`` (a plain connect: interruptible, where
    a store's client blocks in C++ until its timeout)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _client_store(host: str, port: int, timeout: float) -> TCPStore:
    return TCPStore(host, port, None, False, timedelta(seconds=max(timeout, 1.0)), wait_for_workers=False)


def first_failure(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank of a failed launch that failed first, and its failure.

    torchrun orders failures by whole seconds, so a rank whose collective broke
    because the first one exited often ties with it and is blamed instead.
    fnaccel's workers record when they failed to the nanosecond (see
    `fnaccel.resources`); torchrun's order decides only where none did.
    """
    timed = {rank: at for rank, failure in exc.failures.items() if (at := _recorded_ns(failure)) is not None}
    if not timed:
        first: tuple[int, ProcessFailure] = exc.get_first_failure()
        return first
    rank = min(timed, key=timed.__getitem__)
    return rank, exc.failures[rank]


def _recorded_ns(failure: ProcessFailure) -> int | None:
    """When a worker recorded it failed (ns, `fnaccel.resources`), if it did."""
    message = failure.error_file_data.get("message")
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    recorded = str(extra.get(FAILED_AT_KEY, ""))
    return int(recorded) if recorded.isdigit() else None


def run_launch(argv: Sequence[str]) -> int:
    """Parse ``argv`` exactly as ``fnaccel launch <argv>`` would, and launch.

    Used by ``fnaccel test``; errors are reported as the command line does.
    """
    return main(["launch", *argv])
