"""fnaccel: Accelerate-style PyTorch training as pure functions over a frozen `RunState`.

The public surface is curated here; the implementation lives in private
modules and may move freely behind it (see fnaccel/README.md for the design).

A facade: every name loads on first use from the module that owns it, so that
`import fnaccel` (or any of its modules) costs little more than `import torch`
and nothing inside the package depends on this file.
"""

from types import MappingProxyType
from typing import TYPE_CHECKING

from fnaccel._lazy import lazy_attributes

if TYPE_CHECKING:  # what type checkers and editors see; at run time, `_LAZY`
    from fnaccel._errors import (
        CheckpointError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        ConfigError,
        FnaccelError,
        StaleStateError,
    )
    from fnaccel.checkpoint.latest import (
        SkippedCheckpointWarning,
        latest_checkpoint,
    )
    from fnaccel.checkpoint.project import (
        ProjectConfiguration,
    )
    from fnaccel.checkpoint.run import (
        load,
        save,
    )
    from fnaccel.checkpoint.weights import (
        save_model,
    )
    from fnaccel.config_schema import (
        LaunchConfig,
    )
    from fnaccel.checkpoint.runinfo import (
        ResumeDriftWarning,
    )
    from fnaccel.debug.diff import (
        diff,
    )
    from fnaccel.constants import (
        DistributedType,
        PrecisionType,
    )
    from fnaccel.data.config import (
        DataLoaderConfiguration,
    )
    from fnaccel.data.evaluation import (
        eval_batches,
    )
    from fnaccel.data.prepared import (
        batches,
        end_epoch,
    )
    from fnaccel.dist import (
        DistContext,
    )
    from fnaccel.evaluation import (
        evaluate,
    )
    from fnaccel.parallelism import (
        ParallelismConfig,
    )
    from fnaccel.kwargs import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        FP8RecipeKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
    )
    from fnaccel.profile_kwargs import (
        ProfileKwargs,
    )
    from fnaccel.preemption import (
        PreemptionKwargs,
    )
    from fnaccel import ops
    from fnaccel.preparation import (
        default_pipeline,
        prepare,
    )
    from fnaccel.process import (
        local_main_process_first,
        main_process_first,
        on_main_process,
        print_on_main,
        split_between_processes,
        wait_for_everyone,
    )
    from fnaccel.rng import (
        RNGState,
    )
    from fnaccel.runtime import (
        init,
        shutdown,
    )
    from fnaccel.seeding import (
        set_seed,
        synchronize_rng_states,
        with_rng,
    )
    from fnaccel.state import (
        DataPosition,
        RunState,
    )
    from fnaccel.tracking.progress import (
        progress,
    )
    from fnaccel.tracking.throughput import (
        ThroughputMeter,
        count_flops,
        device_peak_flops,
        throughput,
        throughput_meter,
    )
    from fnaccel.tracking.run import (
        end_training,
        get_tracker,
        init_trackers,
        log,
    )
    from fnaccel.train import (
        SchedulerConfiguration,
        apply_gradients,
        backward,
        step,
    )
    from fnaccel.autocasting import autocast_context
    from fnaccel.data.skip import skip_first_batches
    from fnaccel.launchers import debug_launcher, notebook_launcher
    from fnaccel.trigger import check_trigger, set_trigger
    from fnaccel.transforms import (
        fp8,
        local_sgd,
        Collective,
        Pipeline,
        Transform,
        accumulate,
        autocast,
        bf16,
        broadcast,
        broadcast_object_list,
        checkpoint_activations,
        clip_grad_norm,
        clip_grad_value,
        compile,
        compose,
        ddp,
        deepspeed,
        fp16,
        fp32,
        fsdp,
        gather,
        gather_for_metrics,
        gather_object,
        grad_scaler,
        pad_across_processes,
        pp,
        profile,
        reduce,
        skip_nonfinite,
        tp,
    )
    from fnaccel.transforms.nonfinite import NonFiniteUpdateError
    from fnaccel import utils

__version__ = "0.1.0"

_LAZY = MappingProxyType({
    "autocast_context": "fnaccel.autocasting",
    "check_trigger": "fnaccel.trigger",
    "set_trigger": "fnaccel.trigger",
    "skip_first_batches": "fnaccel.data.skip",
    "debug_launcher": "fnaccel.launchers",
    "notebook_launcher": "fnaccel.launchers",
    "local_sgd": "fnaccel.transforms.local_sgd",
    "fp8": "fnaccel.transforms.precision",
    "CheckpointError": "fnaccel._errors",
    "CollectiveMismatchError": "fnaccel._errors",
    "CollectiveTimeoutError": "fnaccel._errors",
    "ConfigError": "fnaccel._errors",
    "FnaccelError": "fnaccel._errors",
    "StaleStateError": "fnaccel._errors",
    "ProjectConfiguration": "fnaccel.checkpoint.project",
    "load": "fnaccel.checkpoint.run",
    "latest_checkpoint": "fnaccel.checkpoint.latest",
    "SkippedCheckpointWarning": "fnaccel.checkpoint.latest",
    "save": "fnaccel.checkpoint.run",
    "save_model": "fnaccel.checkpoint.weights",
    "LaunchConfig": "fnaccel.config_schema",
    "diff": "fnaccel.debug.diff",
    "ResumeDriftWarning": "fnaccel.checkpoint.runinfo",
    "DistributedType": "fnaccel.constants",
    "PrecisionType": "fnaccel.constants",
    "DataLoaderConfiguration": "fnaccel.data.config",
    "eval_batches": "fnaccel.data.evaluation",
    "batches": "fnaccel.data.prepared",
    "end_epoch": "fnaccel.data.prepared",
    "DistContext": "fnaccel.dist",
    "evaluate": "fnaccel.evaluation",
    "ParallelismConfig": "fnaccel.parallelism",
    "AutocastKwargs": "fnaccel.kwargs",
    "DistributedDataParallelKwargs": "fnaccel.kwargs",
    "FP8RecipeKwargs": "fnaccel.kwargs",
    "GradScalerKwargs": "fnaccel.kwargs",
    "InitProcessGroupKwargs": "fnaccel.kwargs",
    "ProfileKwargs": "fnaccel.profile_kwargs",
    "PreemptionKwargs": "fnaccel.preemption",
    "ops": "fnaccel.ops",
    "prepare": "fnaccel.preparation",
    "default_pipeline": "fnaccel.preparation",
    "local_main_process_first": "fnaccel.process",
    "main_process_first": "fnaccel.process",
    "on_main_process": "fnaccel.process",
    "print_on_main": "fnaccel.process",
    "split_between_processes": "fnaccel.process",
    "wait_for_everyone": "fnaccel.process",
    "RNGState": "fnaccel.rng",
    "init": "fnaccel.runtime",
    "shutdown": "fnaccel.runtime",
    "set_seed": "fnaccel.seeding",
    "synchronize_rng_states": "fnaccel.seeding",
    "with_rng": "fnaccel.seeding",
    "DataPosition": "fnaccel.state",
    "RunState": "fnaccel.state",
    "progress": "fnaccel.tracking.progress",
    "ThroughputMeter": "fnaccel.tracking.throughput",
    "count_flops": "fnaccel.tracking.throughput",
    "device_peak_flops": "fnaccel.tracking.throughput",
    "throughput": "fnaccel.tracking.throughput",
    "throughput_meter": "fnaccel.tracking.throughput",
    "end_training": "fnaccel.tracking.run",
    "get_tracker": "fnaccel.tracking.run",
    "init_trackers": "fnaccel.tracking.run",
    "log": "fnaccel.tracking.run",
    "SchedulerConfiguration": "fnaccel.train",
    "apply_gradients": "fnaccel.train",
    "backward": "fnaccel.train",
    "step": "fnaccel.train",
    "Collective": "fnaccel.transforms",
    "Pipeline": "fnaccel.transforms",
    "Transform": "fnaccel.transforms",
    "accumulate": "fnaccel.transforms.accumulate",
    "autocast": "fnaccel.transforms",
    "bf16": "fnaccel.transforms",
    "broadcast": "fnaccel.transforms",
    "broadcast_object_list": "fnaccel.transforms",
    "checkpoint_activations": "fnaccel.transforms",
    "clip_grad_norm": "fnaccel.transforms",
    "clip_grad_value": "fnaccel.transforms",
    "compile": "fnaccel.transforms.compile",
    "compose": "fnaccel.transforms",
    "ddp": "fnaccel.transforms",
    "fp16": "fnaccel.transforms",
    "fp32": "fnaccel.transforms",
    "fsdp": "fnaccel.transforms",
    "deepspeed": "fnaccel.transforms.deepspeed",
    "gather": "fnaccel.transforms",
    "gather_for_metrics": "fnaccel.transforms",
    "gather_object": "fnaccel.transforms",
    "grad_scaler": "fnaccel.transforms",
    "pad_across_processes": "fnaccel.transforms",
    "pp": "fnaccel.transforms",
    "profile": "fnaccel.transforms.profile",
    "reduce": "fnaccel.transforms",
    "skip_nonfinite": "fnaccel.transforms.nonfinite",
    "NonFiniteUpdateError": "fnaccel.transforms.nonfinite",
    "tp": "fnaccel.transforms",
    "utils": "fnaccel.utils",
})

__getattr__, __dir__ = lazy_attributes("fnaccel", _LAZY, globals())

__all__ = [
    # the run
    "RunState",
    "DataPosition",
    "DistContext",
    "RNGState",
    "LaunchConfig",
    "ParallelismConfig",
    "init",
    "shutdown",
    "with_rng",
    # training
    "prepare",
    "step",
    "backward",
    "apply_gradients",
    "batches",
    "end_epoch",
    "default_pipeline",
    "DataLoaderConfiguration",
    "SchedulerConfiguration",
    # evaluation
    "evaluate",
    "eval_batches",
    # checkpoints
    "save",
    "load",
    "latest_checkpoint",
    "save_model",
    "ProjectConfiguration",
    # debugging
    "diff",
    # tracking and progress
    "init_trackers",
    "log",
    "get_tracker",
    "end_training",
    "progress",
    "count_flops",
    "throughput_meter",
    "throughput",
    "ThroughputMeter",
    "device_peak_flops",
    # training transforms
    "autocast",
    "grad_scaler",
    "ddp",
    "fsdp",
    "tp",
    "checkpoint_activations",
    "deepspeed",
    "accumulate",
    "clip_grad_norm",
    "clip_grad_value",
    "skip_nonfinite",
    "compile",
    "profile",
    "fp16",
    "bf16",
    "fp32",
    "fp8",
    "local_sgd",
    "pp",
    # transforms and collectives
    "Transform",
    "Collective",
    "Pipeline",
    "compose",
    "gather",
    "reduce",
    "broadcast",
    "pad_across_processes",
    "gather_object",
    "broadcast_object_list",
    "gather_for_metrics",
    # the loop's helpers and launching from a notebook
    "autocast_context",
    "skip_first_batches",
    "set_trigger",
    "check_trigger",
    "notebook_launcher",
    "debug_launcher",
    # process and random helpers
    "wait_for_everyone",
    "main_process_first",
    "local_main_process_first",
    "on_main_process",
    "split_between_processes",
    "print_on_main",
    "set_seed",
    "synchronize_rng_states",
    # kwargs handlers and enums
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "PreemptionKwargs",
    "DistributedType",
    "PrecisionType",
    # errors
    "FnaccelError",
    "StaleStateError",
    "ConfigError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CheckpointError",
    "NonFiniteUpdateError",
    "ResumeDriftWarning",
    "SkippedCheckpointWarning",
    # modules
    "ops",
    "utils",
]
