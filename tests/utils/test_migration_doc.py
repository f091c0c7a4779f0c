"""docs/migration.md names every public name of Accelerate's reference pages, and what it calls
available is exported by fnaccel.utils."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fnaccel.utils

_MIGRATION = (Path(__file__).resolve().parents[2] / "docs" / "migration.md").read_text()

# The names on Accelerate's reference pages: the kwargs handlers, utilities, big modeling and hooks pages.
KWARGS_HANDLERS = (
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "KwargsHandler",
)
UTILITIES = (
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "ComputeEnvironment",
    "DistributedType",
    "DynamoBackend",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
    "DeepSpeedPlugin",
    "deepspeed_config_process",
    "FullyShardedDataParallelPlugin",
    "get_module_class_from_name",
    "GradientAccumulationPlugin",
    "MegatronLMPlugin",
    "TorchDynamoPlugin",
    "BnbQuantizationConfig",
    "ProjectConfiguration",
    "set_directories",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "gather",
    "gather_object",
    "listify",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
    "is_bf16_available",
    "is_ipex_available",
    "is_mps_available",
    "is_npu_available",
    "is_torch_version",
    "is_tpu_available",
    "is_xpu_available",
    "patch_environment",
    "clear_environment",
    "write_basic_config",
    "find_executable_batch_size",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "extract_model_from_parallel",
    "get_balanced_memory",
    "get_max_layer_size",
    "infer_auto_device_map",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "load_state_dict",
    "offload_state_dict",
    "retie_parameters",
    "set_module_tensor_to_device",
    "shard_checkpoint",
    "save",
    "wait_for_everyone",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "install_xla",
    "load_and_quantize_model",
)
BIG_MODELING_AND_HOOKS = (
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
    "get_mixed_precision_context_manager",
    "get_grad_scaler",
    "has_offloaded_params",
    "align_module_device",
    "ModelHook",
    "SequentialHook",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "LayerwiseCastingHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
)
# Named in migration.md with the reason there is no counterpart.
NOT_PROVIDED = {
    "deepspeed_config_process",
    "get_module_class_from_name",
    "set_directories",
    "synchronize_rng_state",
    "install_xla",
}


@pytest.mark.parametrize("name", sorted({*KWARGS_HANDLERS, *UTILITIES, *BIG_MODELING_AND_HOOKS}))
def test_migration_names_every_reference_name(name: str) -> None:
    assert f"`{name}`" in _MIGRATION or f"`{name}(" in _MIGRATION, f"docs/migration.md does not name {name}"
    assert hasattr(fnaccel.utils, name) != (name in NOT_PROVIDED), name


def test_every_identical_call_is_exported() -> None:
    row = next(line for line in _MIGRATION.splitlines() if line.startswith("| identical calls"))
    arguments = {"reduce_batch_size_fn", "fallback_allocation", "tied_params_map"}  # named in passing
    names = [n for n in re.findall(r"`(\w+)`", row) if not n.startswith("is_") and n not in arguments]
    missing = [n for n in names if not hasattr(fnaccel.utils, n)]
    assert not missing, missing
