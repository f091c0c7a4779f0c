"""fnaccel: Accelerate-style PyTorch training as pure functions over a frozen `RunState`.

The public surface is curated here; the implementation lives in private
modules and may move freely behind it (see fnaccel/README.md for the design).
"""

from types import MappingProxyType

# isort: off
# `fnaccel.utils` first: it re-exports modules that import `fnaccel.utils.constants`.
from fnaccel import utils
# isort: on
from fnaccel import ops
from fnaccel._errors import (
    CheckpointError,
    CollectiveMismatchError,
    ConfigError,
    FnaccelError,
    StaleStateError,
)
from fnaccel._lazy import lazy_attributes
from fnaccel.checkpoint.project import ProjectConfiguration
from fnaccel.config import LaunchConfig
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.prepared import batches
from fnaccel.dist import DistContext
from fnaccel.process import (
    local_main_process_first,
    main_process_first,
    on_main_process,
    print_on_main,
    split_between_processes,
    wait_for_everyone,
)
from fnaccel.rng import RNGState
from fnaccel.runtime import init, shutdown
from fnaccel.seeding import set_seed, synchronize_rng_states, with_rng
from fnaccel.state import DataPosition, RunState
from fnaccel.train import apply_gradients, backward, prepare, step
from fnaccel.transforms import (
    Pipeline,
    Transform,
    accumulate,
    autocast,
    bf16,
    clip_grad_norm,
    clip_grad_value,
    compile,
    ddp,
    fp16,
    fp32,
    fsdp,
    grad_scaler,
    profile,
    broadcast,
    broadcast_object_list,
    compose,
    gather,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    reduce,
)
from fnaccel.utils.constants import DistributedType, PrecisionType
from fnaccel.utils.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)

__version__ = "0.1.0"

# Loaded on first use, so that `import fnaccel` costs little more than `import torch`:
# the checkpoint writer and reader, the trackers, and evaluation.
_LAZY = MappingProxyType({
    "save": "fnaccel.checkpoint.run",
    "load": "fnaccel.checkpoint.run",
    "save_model": "fnaccel.checkpoint.weights",
    "init_trackers": "fnaccel.tracking.run",
    "log": "fnaccel.tracking.run",
    "get_tracker": "fnaccel.tracking.run",
    "end_training": "fnaccel.tracking.run",
    "progress": "fnaccel.tracking.progress",
    "evaluate": "fnaccel.evaluation",
    "eval_batches": "fnaccel.data.evaluation",
})


__getattr__, __dir__ = lazy_attributes("fnaccel", _LAZY, globals())

__all__ = [
    # the run
    "RunState",
    "DataPosition",
    "DistContext",
    "RNGState",
    "LaunchConfig",
    "init",
    "shutdown",
    "with_rng",
    # training
    "prepare",
    "step",
    "backward",
    "apply_gradients",
    "batches",
    "DataLoaderConfiguration",
    # evaluation
    "evaluate",
    "eval_batches",
    # checkpoints
    "save",
    "load",
    "save_model",
    "ProjectConfiguration",
    # tracking and progress
    "init_trackers",
    "log",
    "get_tracker",
    "end_training",
    "progress",
    # training transforms
    "autocast",
    "grad_scaler",
    "ddp",
    "fsdp",
    "accumulate",
    "clip_grad_norm",
    "clip_grad_value",
    "compile",
    "profile",
    "fp16",
    "bf16",
    "fp32",
    # transforms and collectives
    "Transform",
    "Pipeline",
    "compose",
    "gather",
    "reduce",
    "broadcast",
    "pad_across_processes",
    "gather_object",
    "broadcast_object_list",
    "gather_for_metrics",
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
    "DistributedType",
    "PrecisionType",
    # errors
    "FnaccelError",
    "StaleStateError",
    "ConfigError",
    "CollectiveMismatchError",
    "CheckpointError",
    # modules
    "ops",
    "utils",
]
