"""Accelerate's utilities under Accelerate's names, adapted to take the run's state.

Leaf modules first: `fnaccel.dist` imports `fnaccel.utils.constants`, so the
modules re-exported at the bottom (which import `fnaccel.dist`) must come after.
"""

from fnaccel.utils.constants import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    PROFILE_PATTERN_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    ComputeEnvironment,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from fnaccel.utils.environment import (
    clear_environment,
    is_bf16_available,
    is_bitsandbytes_available,
    is_bnb_available,
    is_cuda_available,
    is_deepspeed_available,
    is_ipex_available,
    is_mps_available,
    is_msamp_available,
    is_npu_available,
    is_numpy_available,
    is_tensorboard_available,
    is_torch_version,
    is_torch_xla_available,
    is_torchao_available,
    is_tpu_available,
    is_transformer_engine_available,
    is_xpu_available,
    parse_flag_from_env,
    patch_environment,
    str_to_bool,
)
from fnaccel.utils.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)

# isort: split
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.ops import (
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    gather,
    gather_for_metrics,
    gather_object,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)
from fnaccel.process import (
    local_main_process_first,
    main_process_first,
    on_local_main_process,
    on_main_process,
    on_process,
    print_on_main,
    split_between_processes,
    wait_for_everyone,
)
from fnaccel.seeding import set_seed, synchronize_rng_states
from fnaccel.checkpoint.extras import register_for_checkpointing
from fnaccel.checkpoint.project import ProjectConfiguration
from fnaccel.checkpoint.weights import load_checkpoint_in_model, save_model, shard_checkpoint

__all__ = [
    # constants and enums
    "MODEL_NAME", "OPTIMIZER_NAME", "PROFILE_PATTERN_NAME", "RNG_STATE_NAME",
    "SAFE_MODEL_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME", "SAMPLER_NAME",
    "SCALER_NAME", "SCHEDULER_NAME", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME",
    "ComputeEnvironment", "DDPCommunicationHookType", "DistributedType", "DynamoBackend",
    "LoggerType", "PrecisionType", "RNGType", "SageMakerDistributedType",
    # environment
    "clear_environment", "is_bf16_available", "is_bitsandbytes_available", "is_bnb_available",
    "is_cuda_available", "is_deepspeed_available", "is_ipex_available", "is_mps_available",
    "is_msamp_available", "is_npu_available", "is_numpy_available", "is_tensorboard_available",
    "is_torch_version", "is_torch_xla_available", "is_torchao_available", "is_tpu_available",
    "is_transformer_engine_available", "is_xpu_available", "parse_flag_from_env",
    "patch_environment", "str_to_bool",
    # kwargs handlers
    "AutocastKwargs", "DistributedDataParallelKwargs", "FP8RecipeKwargs", "GradScalerKwargs",
    "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs",
    # data loading
    "DataLoaderConfiguration",
    # data operations
    "broadcast", "broadcast_object_list", "concatenate", "convert_outputs_to_fp32",
    "convert_to_fp32", "gather", "gather_for_metrics", "gather_object", "listify",
    "pad_across_processes", "recursively_apply", "reduce", "send_to_device", "slice_tensors",
    # processes and random
    "local_main_process_first", "main_process_first", "on_local_main_process",
    "on_main_process", "on_process", "print_on_main", "split_between_processes",
    "wait_for_everyone", "set_seed", "synchronize_rng_states",
    # checkpoints
    "register_for_checkpointing", "ProjectConfiguration",
    "save_model", "shard_checkpoint", "load_checkpoint_in_model",
]
