"""Accelerate's kwargs handlers: frozen records that customise the PyTorch objects fnaccel builds.

Each handler has Accelerate's class name, field names, order and defaults, is
validated when built, and gives back with `to_kwargs()` only the fields the user
changed, so torch's own defaults apply to everything else. `ProfileKwargs` also
builds the profiler it describes (`ProfileKwargs.build`).

>>> GradScalerKwargs(init_scale=1024.0).to_kwargs()
{'init_scale': 1024.0}
>>> ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2}).to_kwargs()
{'schedule_option': {'wait': 1, 'warmup': 1, 'active': 2}}
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from fnaccel.checks import check_choice, check_value, is_int, is_number, require
from fnaccel.constants import PROFILE_PATTERN_NAME, DDPCommunicationHookType
from fnaccel.kwargs.mixin import KwargsHandler

__all__ = [
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "FP8RecipeKwargs",
    "ProfileKwargs",
]

_Hook = DDPCommunicationHookType
_POWER_SGD_HOOKS = (_Hook.POWER_SGD, _Hook.BATCHED_POWER_SGD)
_USE_POWER_SGD = "set comm_hook='power_sgd' or 'batched_power_sgd'"
_KNOWN_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "ccl", "hccl", "cncl", "mccl", "smddp", "xla")


@dataclass(frozen=True, slots=True, kw_only=True)
class AutocastKwargs(KwargsHandler):
    """Arguments for `torch.autocast` beyond the device type and dtype.

    Args:
        enabled: Whether autocasting is on inside the region.
        cache_enabled: Whether to cache weight casts; None keeps torch's default.

    >>> AutocastKwargs(cache_enabled=False).to_kwargs()
    {'cache_enabled': False}
    """

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for `torch.nn.parallel.DistributedDataParallel`, plus its comm hook.

    `to_kwargs()` gives the constructor's arguments only; as in Accelerate, the hook
    fields are applied after wrapping, by `register_comm_hook`. Hook names may be
    strings and are stored as `DDPCommunicationHookType`. torch accepts the "bf16"
    hook only on NCCL (or XCCL) process groups.

    Args:
        dim, broadcast_buffers, find_unused_parameters, check_reduction,
        gradient_as_bucket_view, static_graph: As in `DistributedDataParallel`.
        bucket_cap_mb: The gradient bucket size in megabytes (> 0).
        comm_hook: "no", "fp16", "bf16", "power_sgd" or "batched_power_sgd".
        comm_wrapper: "fp16" or "bf16" to compress a PowerSGD hook's traffic.
        comm_state_option: Keyword arguments of `PowerSGDState` (PowerSGD hooks only).

    Raises:
        ValueError: A field is out of range or the hook fields do not fit together.

    >>> kw = DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16")
    >>> kw.comm_hook, kw.to_kwargs()
    (<DDPCommunicationHookType.FP16: 'fp16'>, {'find_unused_parameters': True})
    """

    _not_kwargs: ClassVar[frozenset[str]] = frozenset({"comm_hook", "comm_wrapper", "comm_state_option"})

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: Mapping[str, Any] = field(default_factory=dict)

    def _validate(self) -> None:
        check_value("dim", self.dim, is_int(self.dim), "an int")
        check_value(
            "bucket_cap_mb",
            self.bucket_cap_mb,
            is_number(self.bucket_cap_mb) and self.bucket_cap_mb > 0,
            "a positive number of megabytes",
            "pass e.g. bucket_cap_mb=25 (the default)",
        )
        hook, wrapper = (
            _to_hook_type("comm_hook", self.comm_hook),
            _to_hook_type("comm_wrapper", self.comm_wrapper),
        )
        check_value(
            "comm_wrapper",
            wrapper.value,
            wrapper in (_Hook.NO, _Hook.FP16, _Hook.BF16),
            "'no', 'fp16' or 'bf16'",
            "PowerSGD is a comm_hook, not a wrapper",
        )
        require(
            wrapper is _Hook.NO or hook in _POWER_SGD_HOOKS,
            f"comm_wrapper={wrapper.value!r} wraps a PowerSGD hook but comm_hook={hook.value!r}: "
            f"{_USE_POWER_SGD}, or leave comm_wrapper='no'",
        )
        check_value(
            "comm_state_option", self.comm_state_option, isinstance(self.comm_state_option, Mapping), "a dict"
        )
        options = dict(self.comm_state_option)
        if options:
            require(
                hook in _POWER_SGD_HOOKS,
                f"comm_state_option configures PowerSGD but comm_hook={hook.value!r}: "
                f"{_USE_POWER_SGD}, or drop comm_state_option",
            )
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            valid = [
                p
                for p in inspect.signature(PowerSGDState.__init__).parameters
                if p not in ("self", "process_group")
            ]
            unknown = sorted(set(options) - set(valid))
            require(not unknown, f"unknown comm_state_option keys {unknown}: use among {', '.join(valid)}")
        object.__setattr__(self, "comm_hook", hook)
        object.__setattr__(self, "comm_wrapper", wrapper)
        object.__setattr__(self, "comm_state_option", MappingProxyType(options))

    def register_comm_hook(self, model: DistributedDataParallel) -> None:
        """Registers the configured communication hook on a DDP-wrapped model.

        Does nothing when `comm_hook` is "no". PowerSGD hooks get a fresh
        `PowerSGDState(process_group=None, **comm_state_option)`.

        Args:
            model: The `DistributedDataParallel` model, before its first backward.

        Raises:
            TypeError: `model` is not a `DistributedDataParallel`.
        """
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"register_comm_hook needs a DistributedDataParallel model, "
                f"got {type(model).__name__}: wrap the model in DDP first"
            )
        if self.comm_hook is _Hook.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: dict[str, Callable[..., Any]] = {
            _Hook.FP16: default_hooks.fp16_compress_hook,
            _Hook.BF16: default_hooks.bf16_compress_hook,
            _Hook.POWER_SGD: powerSGD_hook.powerSGD_hook,
            _Hook.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {
            _Hook.FP16: default_hooks.fp16_compress_wrapper,
            _Hook.BF16: default_hooks.bf16_compress_wrapper,
        }
        hook = hooks[self.comm_hook]
        if self.comm_wrapper is not _Hook.NO:
            hook = wrappers[_Hook(self.comm_wrapper)](hook)
        state = None
        if self.comm_hook in _POWER_SGD_HOOKS:
            state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


def _to_hook_type(name: str, value: object) -> DDPCommunicationHookType:
    require(
        isinstance(value, str) and value.lower() in _Hook,
        f"unknown {name} {value!r}: use one of {', '.join(_Hook.list())}",
    )
    return _Hook(str(value).lower())


@dataclass(frozen=True, slots=True, kw_only=True)
class GradScalerKwargs(KwargsHandler):
    """Arguments for `torch.amp.GradScaler`, the loss scaler of fp16 training.

    Args:
        init_scale: The first loss scale (> 0).
        growth_factor: Factor the scale grows by after `growth_interval` good steps (> 1).
        backoff_factor: Factor the scale shrinks by after an overflow (in (0, 1)).
        growth_interval: Good steps between two growths (>= 1).
        enabled: Whether scaling happens at all.

    >>> GradScalerKwargs(backoff_factor=0.25).to_kwargs()
    {'backoff_factor': 0.25}
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def _validate(self) -> None:
        scale, growth, backoff, interval = (
            self.init_scale,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        check_value(
            "init_scale", scale, is_number(scale) and scale > 0, "a number > 0", "try 65536.0 (the default)"
        )
        check_value(
            "growth_factor", growth, is_number(growth) and growth > 1, "a number > 1", "try 2.0 (the default)"
        )
        check_value(
            "backoff_factor",
            backoff,
            is_number(backoff) and 0 < backoff < 1,
            "a number strictly between 0 and 1",
            "try 0.5 (the default)",
        )
        check_value(
            "growth_interval",
            interval,
            is_int(interval) and interval >= 1,
            "an int >= 1",
            "try 2000 (the default)",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`.

    As in Accelerate, `to_kwargs()` drops defaults, so the default `backend="nccl"`
    means "let fnaccel pick" (gloo on CPU, nccl on CUDA); any other backend, such
    as "gloo", is honoured. `timeout=None` keeps torch's default for the backend.

    Args:
        backend: A backend name, or a device mapping such as "cpu:gloo,cuda:nccl".
        init_method: A rendezvous URL ("env://", "tcp://host:port", "file:///path").
        timeout: How long collectives wait before failing; must be positive.

    >>> from datetime import timedelta
    >>> InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=60)).to_kwargs()
    {'backend': 'gloo', 'timeout': datetime.timedelta(seconds=60)}
    """

    backend: str = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    def _validate(self) -> None:
        known = sorted(set(_KNOWN_BACKENDS) | _registered_backends())
        hint = f"use one of {', '.join(known)}, or a mapping such as 'cpu:gloo,cuda:nccl'"
        check_value("backend", self.backend, isinstance(self.backend, str), "a string", hint)
        if ":" in self.backend:
            for pair in self.backend.split(","):
                device, _, name = pair.partition(":")
                require(
                    bool(device.strip()) and name.strip() in known,
                    f"bad entry {pair!r} in backend {self.backend!r}: write 'device:backend' pairs, {hint}",
                )
        else:
            check_choice("backend", self.backend, known)
        method, timeout = self.init_method, self.timeout
        check_value(
            "init_method",
            method,
            method is None or (isinstance(method, str) and "://" in method),
            "a URL such as 'env://' or 'tcp://10.0.0.1:29500'",
        )
        check_value(
            "timeout",
            timeout,
            timeout is None or (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0),
            "a positive datetime.timedelta",
            "pass e.g. timeout=timedelta(minutes=30)",
        )


def _registered_backends() -> set[str]:
    if not torch.distributed.is_available():
        return set()
    return {name for name in torch.distributed.Backend.backend_list if name not in ("undefined", "fake")}


@dataclass(frozen=True, slots=True, kw_only=True)
class FP8RecipeKwargs(KwargsHandler):
    """The FP8 recipe for TransformerEngine ("TE"), MS-AMP ("MSAMP") or torchao ("AO").

    Every field defaults to None, meaning the engine's own default. `backend`,
    `fp8_format` and `opt_level` are stored upper-cased.

    Args:
        backend: "MSAMP", "TE" or "AO"; None picks an installed one.
        use_autocast_during_eval: Whether FP8 autocast stays on in eval mode.
        opt_level: MS-AMP's optimisation level, "O1" or "O2".
        margin: The margin for the scaling factor (>= 0).
        interval: Steps between two scaling-factor updates (>= 1).
        fp8_format: "HYBRID", "E4M3" or "E5M2".
        amax_history_len: Length of the amax history (>= 1).
        amax_compute_algo: "max" or "most_recent".
        override_linear_precision: Three bools: run fprop, dgrad, wgrad in higher precision.
        enable_fsdp_float8_all_gather: torchao under `fa.fsdp()`: all-gather the
            sharded weights in float8 (torchao's ``Float8LinearConfig`` option).
        module_filter_func: torchao: ``fn(module, fqn) -> bool``, True for the
            ``nn.Linear`` layers to train in float8 (Accelerate's `AORecipeKwargs`
            name); None keeps the first and last linear layers, and those with
            features not multiples of 16, in high precision.

    >>> FP8RecipeKwargs(backend="te", fp8_format="hybrid").to_kwargs()
    {'backend': 'TE', 'fp8_format': 'HYBRID'}
    """

    backend: str | None = None
    use_autocast_during_eval: bool | None = None
    opt_level: str | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    enable_fsdp_float8_all_gather: bool | None = None
    module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None

    def __repr__(self) -> str:  # the fields set, as the code that built it reads
        return f"FP8RecipeKwargs({', '.join(f'{k}={v!r}' for k, v in self.to_kwargs().items())})"

    def _validate(self) -> None:
        check_value(
            "module_filter_func",
            self.module_filter_func,
            self.module_filter_func is None or callable(self.module_filter_func),
            "a function (module, fqn) -> bool or None",
        )
        for name, choices in (
            ("backend", ("MSAMP", "TE", "AO")),
            ("fp8_format", ("HYBRID", "E4M3", "E5M2")),
            ("opt_level", ("O1", "O2")),
        ):
            value = getattr(self, name)
            if value is not None:
                check_value(name, value, isinstance(value, str), "a string")
                check_choice(f"fp8 {name}", value.upper(), choices)
                object.__setattr__(self, name, value.upper())
        if self.amax_compute_algo is not None:
            check_choice("fp8 amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        for name, minimum in (("margin", 0), ("interval", 1), ("amax_history_len", 1)):
            value = getattr(self, name)
            check_value(
                name,
                value,
                value is None or (is_int(value) and value >= minimum),
                f"an int >= {minimum} or None",
            )
        precision = self.override_linear_precision
        if precision is not None:
            check_value(
                "override_linear_precision",
                precision,
                isinstance(precision, Sequence)
                and len(precision) == 3
                and all(isinstance(p, bool) for p in precision),
                "three bools (fprop, dgrad, wgrad)",
            )
            object.__setattr__(self, "override_linear_precision", tuple(precision))


_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first", "skip_first_wait")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileKwargs(KwargsHandler):
    """Arguments for `torch.profiler.profile`; `build()` makes the profiler.

    Args:
        activities: Names of the activities to profile ("cpu", "cuda", "xpu", ...);
            None profiles every activity torch supports here. Stored as a tuple.
        schedule_option: Keyword arguments of `torch.profiler.schedule`: `wait`,
            `warmup` and `active` are required; `repeat`, `skip_first` optional.
        on_trace_ready: Called with the profiler each time a trace is ready.
        record_shapes: Record operator input shapes.
        profile_memory: Track tensor memory allocation and release.
        with_stack: Record source file and line of each operator.
        with_flops: Estimate the FLOPs of some operators.
        with_modules: Record the module hierarchy of each operator.
        output_trace_dir: A directory where a Chrome trace `profile_<rank>.json`
            is written each time a trace is ready (so it holds the last one).

    >>> kw = ProfileKwargs(activities=["cpu"], record_shapes=True)
    >>> kw.to_kwargs()
    {'activities': ('cpu',), 'record_shapes': True}
    >>> with kw.build() as prof:
    ...     _ = torch.ones(8) * 2
    >>> len(prof.key_averages()) > 0
    True
    """

    activities: Sequence[str] | None = None
    schedule_option: Mapping[str, int] | None = None
    on_trace_ready: Callable[[torch.profiler.profile], object] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | os.PathLike[str] | None = None

    def _validate(self) -> None:
        if self.activities is not None:
            known = list(_profiler_activities())
            check_value(
                "activities",
                self.activities,
                isinstance(self.activities, Sequence) and not isinstance(self.activities, str),
                "a list of names",
                "e.g. ['cpu', 'cuda']",
            )
            names = tuple(str(a).lower() for a in self.activities)
            unknown = [a for a in names if a not in known]
            require(not unknown, f"unknown profiler activities {unknown}: use among {', '.join(known)}")
            object.__setattr__(self, "activities", names)
        if self.schedule_option is not None:
            check_value(
                "schedule_option", self.schedule_option, isinstance(self.schedule_option, Mapping), "a dict"
            )
            options = dict(self.schedule_option)
            unknown = sorted(set(options) - set(_SCHEDULE_KEYS))
            require(
                not unknown, f"unknown schedule_option keys {unknown}: use among {', '.join(_SCHEDULE_KEYS)}"
            )
            missing = [k for k in ("wait", "warmup", "active") if k not in options]
            require(not missing, f"schedule_option lacks {missing}: give wait, warmup and active")
            bad = {k: v for k, v in options.items() if not (is_int(v) and v >= 0)}
            require(not bad, f"schedule_option values must be ints >= 0, got {bad}")
            require(options["active"] >= 1, "schedule_option active must be >= 1: profile at least one step")
            object.__setattr__(self, "schedule_option", MappingProxyType(options))
        check_value(
            "on_trace_ready",
            self.on_trace_ready,
            self.on_trace_ready is None or callable(self.on_trace_ready),
            "callable",
        )
        out = self.output_trace_dir
        if out is not None:
            check_value(
                "output_trace_dir",
                out,
                isinstance(out, (str, os.PathLike)) and os.fspath(out) != "",
                "a directory path",
            )
            object.__setattr__(self, "output_trace_dir", os.fspath(out))

    def build(self, *, process_index: int = 0) -> torch.profiler.profile:
        """Builds a `torch.profiler.profile` from these settings.

        Args:
            process_index: The rank, naming the trace file `profile_<process_index>.json`.

        Returns:
            The profiler, to be used as a context manager.
        """
        activities = None
        if self.activities is not None:
            table = _profiler_activities()
            activities = [table[name] for name in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        on_trace_ready = self.on_trace_ready
        if self.output_trace_dir is not None:
            path = os.path.join(self.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=process_index))
            on_trace_ready = _chrome_trace_writer(path, then=on_trace_ready)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


def _profiler_activities() -> dict[str, torch.profiler.ProfilerActivity]:
    return {name.lower(): act for name, act in torch.profiler.ProfilerActivity.__members__.items()}


def _chrome_trace_writer(
    path: str, *, then: Callable[[torch.profiler.profile], object] | None
) -> Callable[[torch.profiler.profile], None]:
    def on_trace_ready(prof: torch.profiler.profile) -> None:
        if then is not None:
            then(prof)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)

    return on_trace_ready
