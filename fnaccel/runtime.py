"""`fa.init` and `fa.shutdown`: from the launch environment to a `RunState`, and back.

`init` reads, in increasing precedence: the YAML launch config, the
environment that `fnaccel launch` / torchrun set, then its own arguments. When
the world is larger than one it starts a process group and keeps it in the
state's `DistContext`; nothing is stored at module level.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from fnaccel import dryrun
from fnaccel._errors import ConfigError
from fnaccel.calls import Calls, collective, collective_timeout
from fnaccel.config.launch import LaunchConfig, resolve_config
from fnaccel.config.parallelism import ParallelismConfig, build_mesh
from fnaccel.constants import DistributedType, PrecisionType
from fnaccel.dist import DistContext
from fnaccel.kwargs import InitProcessGroupKwargs
from fnaccel.kwargs.mixin import KwargsHandler
from fnaccel.preemption import PreemptionKwargs, check_main_thread, install
from fnaccel.resources import GroupOwner, Resources
from fnaccel.rng import RNGState
from fnaccel.state import RunState

__all__ = ["COLLECTIVE_TIMEOUT", "init", "shutdown"]

# How long a collective waits for a rank that never arrives, unless
# InitProcessGroupKwargs(timeout=...) says otherwise (torch's own default is 30 min).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer; "
            "launch with `fnaccel launch` or torchrun, which set it for you"
        ) from None


def _read_launch_env(config: LaunchConfig, rendezvous: str) -> dict[str, int]:
    """Ranks and sizes from torchrun's variables, checked for consistency."""
    num_processes = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    num_local = _env_int("LOCAL_WORLD_SIZE", num_processes)
    node_rank = _env_int("GROUP_RANK", config.machine_rank if num_processes > 1 else 0)
    num_nodes = _env_int("GROUP_WORLD_SIZE", max(1, num_processes // max(num_local, 1)))
    if num_processes < 1:
        raise ConfigError(f"WORLD_SIZE={num_processes} must be at least 1")
    if not 0 <= rank < num_processes:
        raise ConfigError(f"RANK={rank} is outside the world of WORLD_SIZE={num_processes}")
    if not 0 <= local_rank < num_local:
        raise ConfigError(f"LOCAL_RANK={local_rank} is outside this machine's LOCAL_WORLD_SIZE={num_local}")
    if num_processes > 1 and rendezvous == "env://" and not os.environ.get("MASTER_ADDR"):
        raise ConfigError(
            f"WORLD_SIZE={num_processes} but MASTER_ADDR is not set; start the script "
            "with `fnaccel launch` or torchrun, which set the rendezvous variables"
        )
    return {
        "num_processes": num_processes,
        "rank": rank,
        "local_rank": local_rank,
        "num_local_processes": num_local,
        "node_rank": node_rank,
        "num_nodes": num_nodes,
    }


def _pin_to_cpus(local_rank: int, num_local: int) -> None:
    """``fnaccel launch --enable_cpu_affinity``: each local process gets its own
    contiguous share of the CPUs this machine lets it use (so processes do not
    migrate over each other's cores and caches)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // max(num_local, 1))
    mine = cpus[local_rank * share : (local_rank + 1) * share] or cpus[-share:]
    os.sched_setaffinity(0, mine)


def _start_process_group(
    handler: InitProcessGroupKwargs, backend: str, device: torch.device, env: Mapping[str, int]
) -> tuple[dist.ProcessGroup | None, GroupOwner]:
    options = handler.to_kwargs()
    timeout = options.get("timeout") or COLLECTIVE_TIMEOUT
    if dist.is_initialized():
        # The process already has a default group (the user's, or another run's):
        # this run gets its own communicator over the same ranks.
        if "init_method" in options:
            raise ConfigError(
                "this process already has a default process group, so the new run's group "
                "is formed over it and InitProcessGroupKwargs(init_method=...) cannot apply; "
                "drop init_method for this run"
            )
        if dist.get_world_size() != env["num_processes"]:
            raise ConfigError(
                f"a default process group of size {dist.get_world_size()} already exists "
                f"but the launch environment says WORLD_SIZE={env['num_processes']}"
            )
        group = dist.new_group(backend=backend, timeout=timeout)
        return group, GroupOwner(group, is_default=False, shares_default=True)
    kwargs: dict[str, Any] = {
        "backend": backend,
        "rank": env["rank"],
        "world_size": env["num_processes"],
        "timeout": timeout,
        "store": _group_store(
            options.get("init_method", "env://"), env["rank"], env["num_processes"], timeout
        ),
    }
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    group = dist.group.WORLD
    return group, GroupOwner(group, is_default=True)


def _group_store(init_method: str, rank: int, num_processes: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store of a new default group, seen under keys no earlier group used.

    A store outlives the groups formed on it: torchrun's agent keeps one for the
    whole job (``TORCHELASTIC_USE_AGENT_STORE``), and torch forms every default
    group under the same keys (its name starts again at "0" once the last group
    is destroyed). A group formed after `fa.shutdown` in the same process then
    read the ended group's gloo addresses and hung or was refused a connection,
    and after a restart (``--max_restarts``) the new workers read the dead ones'
    (pytorch issue 135712). So every group gets keys of its own: under the
    restart count, then under the count of groups formed before it in this
    attempt. That count is read from the store itself, each rank adding one as
    it joins: no rank can join the next group before every rank joined this one
    (a group forms only once all have), so the joins of one group are one
    contiguous block of ``num_processes`` and every rank computes the same count.
    """
    store, _, _ = next(dist.rendezvous(init_method, rank, num_processes, timeout=timeout))
    store.set_timeout(timeout)
    attempt = dist.PrefixStore(f"fnaccel/attempt_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    joined = attempt.add("joined", 1)
    return dist.PrefixStore(f"group_{(joined - 1) // num_processes}", attempt)


def _handlers_by_name(kwargs_handlers: Iterable[KwargsHandler]) -> dict[str, KwargsHandler]:
    by_name: dict[str, KwargsHandler] = {}
    for handler in kwargs_handlers:
        if not isinstance(handler, KwargsHandler):
            raise TypeError(
                f"kwargs_handlers takes fnaccel kwargs handlers (AutocastKwargs, "
                f"GradScalerKwargs, ...), got {type(handler).__name__}"
            )
        name = type(handler).__name__
        if name in by_name:
            raise ValueError(f"kwargs_handlers holds two {name}; pass one and merge their fields")
        by_name[name] = handler
    return by_name


def _resolve_precision(argument: str | PrecisionType | None, config: LaunchConfig) -> PrecisionType:
    raw = argument or config.mixed_precision
    try:
        return PrecisionType(str(raw).lower())
    except ValueError:
        choices = ", ".join(p.value for p in PrecisionType)
        raise ConfigError(f"unknown mixed_precision {raw!r}; use one of {choices}") from None


def _quiet_repeated_warnings() -> None:
    """On ranks other than 0, fnaccel's own warnings (messages starting ``fa.`` or
    ``fnaccel``) are not shown: every rank would print the same one, and rank 0 does."""
    warnings.filterwarnings("ignore", message=r"(fa\.|fnaccel)", category=UserWarning)


def init(
    *,
    seed: int | None = None,
    cpu: bool = False,
    mixed_precision: str | PrecisionType | None = None,
    config: str | os.PathLike[str] | LaunchConfig | None = None,
    kwargs_handlers: Iterable[KwargsHandler] = (),
    project_dir: str | os.PathLike[str] | None = None,
    parallelism: ParallelismConfig | None = None,
    device_specific: bool = False,
) -> RunState:
    """Create the first `RunState` of a run from its launch environment.

    Reads the YAML launch config (``config``, else ``FNACCEL_CONFIG_FILE``,
    else the default file when it exists), then the variables torchrun and
    `fnaccel launch` set; explicit arguments win. Starts a process group when
    the world is larger than one (gloo on CPU, nccl on CUDA, unless an
    `InitProcessGroupKwargs` says otherwise).

    Args:
        seed: gives the run its own generator states, as if every generator
            were seeded with it; no process generator is reseeded. None starts
            from the process's current generator states.
        cpu: compute on the CPU even when CUDA is available.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        config: a config file path or a `LaunchConfig`.
        kwargs_handlers: kwargs handlers, at most one of each class.
        project_dir: where checkpoints and logs go by default.
        parallelism: the layout of the ranks on the device mesh; default: the
            config's ``parallelism_config`` section, else every rank a
            data-parallel rank (see docs/parallelism.md).
        device_specific: seed each rank's generators with ``seed + rank`` (the
            global rank; Accelerate's ``set_seed`` spelling, nanoGPT's ``seed +
            rank``), so dropout and augmentation differ across ranks. The data
            order stays global: the loader is shuffled with ``seed`` itself
            (``state.seed``). Needs a ``seed``.

    Returns:
        A fresh `RunState` at step 0.

    Raises:
        ConfigError: an invalid config file or launch environment, or a
            parallelism layout that does not fit the world.
        ValueError: ``device_specific`` without a ``seed``.
        TypeError: ``device_specific`` is not a bool.

    >>> import fnaccel as fa
    >>> state = fa.init(seed=0, cpu=True)
    >>> state.dist.num_processes, state.dist.device.type, state.step
    (1, 'cpu', 0)
    """
    if not isinstance(device_specific, bool):
        raise TypeError(f"fa.init: device_specific must be True or False, got {device_specific!r}")
    if device_specific and seed is None:
        raise ValueError(
            "fa.init: device_specific=True seeds each rank with seed + rank, so it needs a seed: "
            "fa.init(seed=1337, device_specific=True)"
        )
    launch_config = resolve_config(config)
    handlers = _handlers_by_name(kwargs_handlers)
    preemption = handlers.get("PreemptionKwargs")
    if preemption is not None:
        assert isinstance(preemption, PreemptionKwargs)
        check_main_thread()  # before any group starts: signal handlers need the main thread
    pg_handler = handlers.get("InitProcessGroupKwargs", InitProcessGroupKwargs())
    assert isinstance(pg_handler, InitProcessGroupKwargs)
    env = _read_launch_env(launch_config, pg_handler.init_method or "env://")
    call_timeout = collective_timeout()  # checked before any group starts
    if launch_config.enable_cpu_affinity:
        _pin_to_cpus(env["local_rank"], env["num_local_processes"])
    dry_run = dryrun.active()  # a simulated rank of `fnaccel launch --dry_run`: fake group, CPU
    use_cpu = cpu or launch_config.use_cpu or dry_run
    if not use_cpu and torch.cuda.is_available():
        device = torch.device("cuda", env["local_rank"])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    layout = _resolve_parallelism(parallelism, launch_config, env, device)
    group: dist.ProcessGroup | None = None
    owner: GroupOwner | None = None
    backend: str | None = None
    distributed_type = DistributedType.NO
    if env["num_processes"] > 1:
        backend = (
            "fake"
            if dry_run
            else pg_handler.to_kwargs().get("backend") or ("nccl" if device.type == "cuda" else "gloo")
        )
        group, owner = (
            dryrun.start_fake_group(env["rank"], env["num_processes"])
            if dry_run
            else _start_process_group(pg_handler, backend, device, env)
        )
        distributed_type = (
            DistributedType.FSDP
            if launch_config.distributed_type == "FSDP"
            else DistributedType.DEEPSPEED
            if launch_config.distributed_type == "DEEPSPEED"
            else DistributedType.MULTI_GPU
            if device.type == "cuda"
            else DistributedType.MULTI_CPU
        )

    resources = Resources()
    if owner is not None:
        assert group is not None  # formed with its owner
        resources.register("process_group", owner)
        # the mesh is the owner's too: fa.shutdown ends its groups with the run's
        owner.hold_meshes(build_mesh(layout, device.type, group))
        if not dry_run:  # closed before the group: registered after it
            owner.calls = Calls.start(
                group,
                env["rank"],
                env["num_processes"],
                call_timeout,
                pg_handler.to_kwargs().get("timeout") or COLLECTIVE_TIMEOUT,
            )
            if owner.calls is not None:
                resources.register("calls", owner.calls)
    del group  # the owner is its only holder: see fnaccel.resources
    ctx = DistContext(
        **env,
        device=device,
        backend=backend,
        distributed_type=distributed_type,
        debug=launch_config.debug,
        parallelism=layout,
        _owner=owner,
    )
    precision = _resolve_precision(mixed_precision, launch_config)
    if env["rank"] != 0 and env["num_processes"] > 1:
        _quiet_repeated_warnings()
    if preemption is not None:
        install(resources, preemption, ctx)  # fa.shutdown puts the previous handlers back
    return RunState(
        dist=ctx,
        rng=RNGState.capture()
        if seed is None
        else RNGState.seeded(seed + env["rank"] if device_specific else seed),
        seed=seed,  # the data order's seed: the same on every rank, device_specific or not
        mixed_precision=precision,
        # what the run uses, arguments included: this is what a checkpoint's config.yaml records
        config=dataclasses.replace(
            launch_config, mixed_precision=precision.value, use_cpu=use_cpu, debug=ctx.debug
        ),
        kwargs_handlers=MappingProxyType(handlers),
        project_dir=None if project_dir is None else os.fspath(project_dir),
        resources=resources,
    )


def _resolve_parallelism(
    parallelism: ParallelismConfig | None, config: LaunchConfig, env: Mapping[str, int], device: torch.device
) -> ParallelismConfig:
    """The run's layout: the argument, else the config's section, else FSDP's
    HYBRID_SHARD (replicas across machines, shards within one), else all data-parallel;
    checked against the world before any group forms."""
    if parallelism is not None and not isinstance(parallelism, ParallelismConfig):
        raise TypeError(
            f"fa.init: parallelism takes a fa.ParallelismConfig, got {type(parallelism).__name__}"
        )
    if parallelism is None and config.parallelism_config:
        where = f"{config.source}: parallelism_config" if config.source else "parallelism_config"
        parallelism = ParallelismConfig.from_config(config.parallelism_config, where)
    strategy = str(config.fsdp_config.get("fsdp_sharding_strategy", "")).upper()
    if (
        parallelism is None
        and config.distributed_type == "FSDP"
        and strategy in ("4", "5", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    ):
        parallelism = ParallelismConfig(dp_replicate_size=env["num_nodes"])
    if parallelism is not None and parallelism.cp_size > 1:
        why = (
            "CPU attention kernels have no sharding strategy for "
            "aten._scaled_dot_product_flash_attention_for_cpu, so context parallelism cannot run on "
            "the CPU"
            if device.type == "cpu"
            else "context parallelism is not built in fnaccel yet"
        )
        raise ConfigError(
            f"fa.init: cp_size={parallelism.cp_size}: {why}; set cp_size=1 (shard long "
            "sequences with tp_size or dp_shard_size instead)"
        )
    try:
        return (parallelism or ParallelismConfig()).resolved(env["num_processes"])
    except ValueError as exc:
        raise ConfigError(f"fa.init: {exc}") from None


@collective("fa.shutdown")
def shutdown(state: RunState) -> None:
    """End the run: close its live resources in reverse order of registration: the
    trackers (flushed), transform states that hold something live (a `profile()`
    profiler writes its trace), the last asynchronous save (waited for, raising its
    error), the process group. Consumes nothing and may be called twice.

    On a clean end the process group waits, boundedly, for every rank before it
    is destroyed. Called while an exception propagates (from a ``finally``), it
    waits for no other rank: the group is left to the process's exit, and the
    launcher ends the other ranks (see docs/cli.md, "When a rank fails").
    A group left open is ended at interpreter exit in the same way.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> fa.shutdown(state); fa.shutdown(state)
    """
    state.resources.close()
