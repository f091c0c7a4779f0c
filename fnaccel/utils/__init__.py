"""Accelerate's utilities under Accelerate's names, adapted to take the run's state.

A facade: it defines nothing and nothing inside fnaccel imports it (see the
layers in fnaccel/README.md); every name loads on first use from the module
that owns it.
"""

from types import MappingProxyType

from fnaccel._lazy import lazy_attributes

# The public names, each with the module that defines it: the one list of them. `__all__` and the
# loading on first use come from it (most training scripts never touch the plugins, the engines'
# configs or the memory and modelling utilities, and importing them all would add to every
# `import fnaccel`), and so does __init__.pyi, what type checkers read (`make stubs` writes it;
# tests/test_exported_members.py checks it).
_PUBLIC = MappingProxyType(
    {
        # constants and enums
        **dict.fromkeys(
            (
                "MODEL_NAME",
                "OPTIMIZER_NAME",
                "PROFILE_PATTERN_NAME",
                "RNG_STATE_NAME",
                "SAFE_MODEL_NAME",
                "SAFE_WEIGHTS_INDEX_NAME",
                "SAFE_WEIGHTS_NAME",
                "SAMPLER_NAME",
                "SCALER_NAME",
                "SCHEDULER_NAME",
                "WEIGHTS_INDEX_NAME",
                "WEIGHTS_NAME",
                "ComputeEnvironment",
                "DDPCommunicationHookType",
                "DistributedType",
                "DynamoBackend",
                "LoggerType",
                "PrecisionType",
                "RNGType",
                "SageMakerDistributedType",
            ),
            "fnaccel.constants",
        ),
        # environment
        **dict.fromkeys(
            (
                "check_os_kernel",
                "clear_environment",
                "convert_dict_to_env_variables",
                "is_bf16_available",
                "is_bitsandbytes_available",
                "is_bnb_available",
                "is_cuda_available",
                "is_deepspeed_available",
                "is_ipex_available",
                "is_mps_available",
                "is_msamp_available",
                "is_npu_available",
                "is_numpy_available",
                "is_tensorboard_available",
                "is_torch_version",
                "is_torch_xla_available",
                "is_torchao_available",
                "is_tpu_available",
                "is_transformer_engine_available",
                "is_xpu_available",
                "parse_flag_from_env",
                "patch_environment",
            ),
            "fnaccel.config.environment",
        ),
        "str_to_bool": "fnaccel.checks",
        # kwargs handlers
        **dict.fromkeys(
            (
                "AutocastKwargs",
                "DistributedDataParallelKwargs",
                "FP8RecipeKwargs",
                "GradScalerKwargs",
                "InitProcessGroupKwargs",
                "KwargsHandler",
                "ProfileKwargs",
            ),
            "fnaccel.kwargs",
        ),
        # data loading
        "DataLoaderConfiguration": "fnaccel.data.config",
        # data operations
        "CannotPadNestedTensorWarning": "fnaccel.ops",
        "DistributedOperationException": "fnaccel._errors",
        **dict.fromkeys(
            (
                "broadcast",
                "broadcast_object_list",
                "concatenate",
                "convert_outputs_to_fp32",
                "convert_to_fp32",
                "gather",
                "gather_for_metrics",
                "gather_object",
                "listify",
                "pad_across_processes",
                "recursively_apply",
                "reduce",
                "send_to_device",
                "slice_tensors",
            ),
            "fnaccel.ops",
        ),
        **dict.fromkeys(("find_device", "is_namedtuple", "pad_input_tensors"), "fnaccel.ops.tree"),
        # processes and random
        **dict.fromkeys(
            (
                "local_main_process_first",
                "main_process_first",
                "on_local_main_process",
                "on_main_process",
                "on_process",
                "print_on_main",
                "split_between_processes",
                "wait_for_everyone",
            ),
            "fnaccel.process",
        ),
        **dict.fromkeys(("set_seed", "synchronize_rng_states"), "fnaccel.seeding"),
        "get_logger": "fnaccel.tracking.logger",
        # checkpoints
        "ProjectConfiguration": "fnaccel.checkpoint.project",
        # configs, plugins, memory and modelling
        "write_basic_config": "fnaccel.config.launch",
        "DeepSpeedPlugin": "fnaccel.transforms.plugins.deepspeed",
        "FullyShardedDataParallelPlugin": "fnaccel.transforms.plugins.fsdp",
        "GradientAccumulationPlugin": "fnaccel.transforms.plugins.accumulation",
        "MegatronLMPlugin": "fnaccel.transforms.plugins.megatron",
        "TorchDynamoPlugin": "fnaccel.transforms.plugins.dynamo",
        **dict.fromkeys(("load", "save"), "fnaccel.checkpoint.single"),
        "register_for_checkpointing": "fnaccel.checkpoint.extras",
        "save_model": "fnaccel.modeling.weights",
        "shard_checkpoint": "fnaccel.checkpoint.storage.weightfiles",
        **dict.fromkeys(
            (
                "calculate_maximum_sizes",
                "compute_module_sizes",
                "compute_module_total_buffer_size",
                "dtype_byte_size",
                "get_max_layer_size",
                "named_module_tensors",
            ),
            "fnaccel.modeling.sizes",
        ),
        **dict.fromkeys(("init_empty_weights", "init_on_device"), "fnaccel.modeling.empty"),
        **dict.fromkeys(("find_tied_parameters", "retie_parameters"), "fnaccel.modeling.tied"),
        **dict.fromkeys(
            ("check_device_map", "clean_device_map", "infer_auto_device_map"), "fnaccel.modeling.device_map"
        ),
        "convert_file_size_to_int": "fnaccel.checkpoint.storage.weightfiles",
        **dict.fromkeys(("get_balanced_memory", "get_max_memory"), "fnaccel.modeling.memory_budget"),
        "set_module_tensor_to_device": "fnaccel.modeling.tensors",
        **dict.fromkeys(
            (
                "OffloadedWeightsLoader",
                "PrefixedDataset",
                "extract_submodules_state_dict",
                "load_offloaded_weight",
                "load_offloaded_weights",
                "offload_state_dict",
                "offload_weight",
                "read_offload_index",
                "save_offload_index",
            ),
            "fnaccel.modeling.offload",
        ),
        **dict.fromkeys(("load_state_dict", "load_checkpoint_in_model"), "fnaccel.modeling.loading"),
        **dict.fromkeys(("dispatch_model", "load_checkpoint_and_dispatch"), "fnaccel.modeling.dispatch"),
        **dict.fromkeys(
            (
                "AlignDevicesHook",
                "ModelHook",
                "SequentialHook",
                "add_hook_to_module",
                "remove_hook_from_module",
                "remove_hook_from_submodules",
            ),
            "fnaccel.modeling.hooks",
        ),
        **dict.fromkeys(
            (
                "attach_align_device_hook",
                "attach_align_device_hook_on_blocks",
                "attach_execution_device_hook",
            ),
            "fnaccel.modeling.attach",
        ),
        **dict.fromkeys(
            (
                "CpuOffload",
                "UserCpuOffloadHook",
                "align_module_device",
                "cpu_offload",
                "cpu_offload_with_hook",
                "disk_offload",
                "get_state_dict_offloaded_model",
                "has_offloaded_params",
            ),
            "fnaccel.modeling.big_modeling",
        ),
        **dict.fromkeys(
            (
                "LayerwiseCastingHook",
                "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
                "attach_layerwise_casting_hooks",
            ),
            "fnaccel.modeling.layerwise_casting",
        ),
        **dict.fromkeys(
            (
                "clear_device_cache",
                "find_executable_batch_size",
                "release_memory",
                "should_reduce_batch_size",
            ),
            "fnaccel.modeling.memory",
        ),
        "extract_model_from_parallel": "fnaccel.modeling.unwrap",
        "get_model_tp_size": "fnaccel.modeling.tp_size",
        **dict.fromkeys(
            ("BnbQuantizationConfig", "load_and_quantize_model"), "fnaccel.modeling.quantization"
        ),
        "merge_fsdp_weights": "fnaccel.checkpoint.consolidate",
        **dict.fromkeys(("get_grad_scaler", "get_mixed_precision_context_manager"), "fnaccel.precision"),
        **dict.fromkeys(("override_numa_affinity", "set_numa_affinity"), "fnaccel.config.numa"),
        **dict.fromkeys(
            ("purge_accelerate_environment", "purge_fnaccel_environment"), "fnaccel.config.purge"
        ),
        # launching from a notebook, and the small helpers of a training loop
        **dict.fromkeys(("ProcessFailedError", "debug_launcher", "notebook_launcher"), "fnaccel.launchers"),
        **dict.fromkeys(("check_trigger", "set_trigger"), "fnaccel.trigger"),
        "autocast_context": "fnaccel.precision",
        **dict.fromkeys(
            ("CheckpointHooks", "register_load_state_pre_hook", "register_save_state_pre_hook"),
            "fnaccel.checkpoint.storage.parts",
        ),
        "skip_first_batches": "fnaccel.data.skip",
        **dict.fromkeys(("LocalSGDState", "local_sgd"), "fnaccel.transforms.local_sgd"),
        # trackers
        **dict.fromkeys(
            ("TrackerClasses", "register_tracker", "register_tracker_class"), "fnaccel.tracking.registry"
        ),
        **dict.fromkeys(
            ("GeneralTracker", "JSONLTracker", "TensorBoardTracker"), "fnaccel.tracking.trackers"
        ),
        **dict.fromkeys(
            ("ClearMLTracker", "CometMLTracker", "SwanLabTracker", "TrackioTracker", "WandBTracker"),
            "fnaccel.tracking.hosted",
        ),
        **dict.fromkeys(("AimTracker", "DVCLiveTracker", "MLflowTracker"), "fnaccel.tracking.stores"),
    }
)

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_attributes("fnaccel.utils", _PUBLIC, globals())
