"""Every flag of ``accelerate launch``, same spellings, and what fnaccel does with it.

Flags that the config file can also hold default to None ("not given"), so
that a config value shows through unless the command line sets it. Flags for
engines this build does not ship are parsed like the others, then refused by
`refused_flags` with a message that names the flag.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator

__all__ = [
    "add_launch_arguments",
    "refused_flags",
    "DEEPSPEED_FLAGS",
    "DYNAMO_FLAGS",
    "FP8_FLAGS",
    "FSDP_FLAGS",
]

Flag = tuple[str, "Callable[[str], object] | None", str]  # (flag, value type or None for a switch, help)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number no smaller than ``minimum`` (no 5000-digit ones).

    >>> at_least(1)("4")
    4
    """

    def convert(text: str) -> int:
        if not re.fullmatch(r"[+-]?\d{1,18}", text.strip()):
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text[:40]!r}")
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    convert.__name__ = "int"
    return convert


def port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535.

    >>> port("29500")
    29500
    """
    value = at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {value}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text[:40]!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text[:40]!r}")
    return value


# (flag, type, help): the FSDP section, stored under its config key (the flag's name)
FSDP_FLAGS: tuple[Flag, ...] = (
    ("--fsdp_version", at_least(1), "FSDP version (fnaccel runs FSDP2 for both 1 and 2)."),
    ("--fsdp_offload_params", str, "(true|false) offload parameters and gradients to the CPU."),
    (
        "--fsdp_min_num_params",
        at_least(0),
        "Parameters a submodule needs to be sharded on its own (SIZE_BASED_WRAP).",
    ),
    ("--fsdp_sharding_strategy", str, "FULL_SHARD (1) or SHARD_GRAD_OP (2)."),
    ("--fsdp_reshard_after_forward", str, "(true|false) free gathered parameters after forward."),
    ("--fsdp_auto_wrap_policy", str, "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP."),
    (
        "--fsdp_transformer_layer_cls_to_wrap",
        str,
        "Layer class names to shard on their own, e.g. `Block,MLP`.",
    ),
    ("--fsdp_backward_prefetch", str, "BACKWARD_PRE (FSDP2's behaviour); others are refused."),
    ("--fsdp_backward_prefetch_policy", str, "Deprecated spelling of --fsdp_backward_prefetch."),
    ("--fsdp_state_dict_type", str, "SHARDED_STATE_DICT (FULL_STATE_DICT is refused: use fa.save_model)."),
    ("--fsdp_forward_prefetch", str, "(true|false) explicit forward prefetch (true is refused)."),
    ("--fsdp_use_orig_params", str, "(true|false) FSDP2 always keeps them (false is refused)."),
    ("--fsdp_cpu_ram_efficient_loading", str, "(true|false) real weights on rank 0 only (needs sync)."),
    ("--fsdp_sync_module_states", str, "(true|false) broadcast rank 0's weights before sharding."),
    (
        "--fsdp_activation_checkpointing",
        str,
        "(true|false) checkpoint the layers to wrap (fa.checkpoint_activations).",
    ),
    (
        "--fsdp_activation_checkpointing_offload",
        str,
        "(true|false) keep checkpointed blocks' inputs in host memory (needs --fsdp_activation_checkpointing).",
    ),
)

# the parallelism_config section (fnaccel.config.parallelism), stored under its config key (the flag's name)
PARALLELISM_FLAGS: tuple[Flag, ...] = (
    (
        "--parallelism_config_dp_replicate_size",
        at_least(1),
        "Data-parallel replicas (HSDP's replicate dimension).",
    ),
    ("--parallelism_config_dp_shard_size", at_least(1), "Ranks each replica is sharded over (FSDP)."),
    ("--parallelism_config_tp_size", at_least(1), "Tensor-parallel degree (fa.tp in the script's pipeline)."),
    (
        "--parallelism_config_cp_size",
        at_least(1),
        "Context-parallel degree (refused: not built, see docs/parallelism.md).",
    ),
    (
        "--parallelism_config_sp_size",
        at_least(1),
        "Ulysses sequence-parallel degree (fa.sp in the script's pipeline).",
    ),
    (
        "--parallelism_config_pp_size",
        at_least(1),
        "Pipeline-parallel stages (fa.pp in the script's pipeline).",
    ),
    ("--parallelism_config_cp_comm_strategy", str, "Context-parallel rotation: allgather or alltoall."),
)

DYNAMO_FLAGS: tuple[Flag, ...] = (
    ("--dynamo_backend", str, "torch.compile backend (e.g. INDUCTOR, AOT_EAGER, EAGER) or NO."),
    ("--dynamo_mode", str, "torch.compile mode: default, reduce-overhead, max-autotune, ..."),
    ("--dynamo_use_fullgraph", None, "Compile the whole model as one graph."),
    ("--dynamo_use_dynamic", None, "Compile with dynamic shapes."),
    ("--dynamo_use_regional_compilation", None, "Compile repeated blocks once (refused: not built)."),
)

# DeepSpeed (fa.deepspeed in the default pipeline): carried to the processes as the config's
# deepspeed_config section, with Accelerate's key names (the flag without its dashes)
DEEPSPEED_FLAGS: tuple[Flag, ...] = (
    ("--deepspeed_config_file", str, 'DeepSpeed JSON config file (its "auto" values filled from the run).'),
    ("--zero_stage", int, "ZeRO stage: 0, 1, 2 (default) or 3."),
    ("--offload_optimizer_device", str, "Optimizer offload device (none|cpu|nvme)."),
    ("--offload_param_device", str, "Parameter offload device (none|cpu|nvme), ZeRO-3."),
    ("--offload_optimizer_nvme_path", str, "NVMe path for optimizer offload."),
    ("--offload_param_nvme_path", str, "NVMe path for parameter offload."),
    ("--gradient_accumulation_steps", int, "Batches per update (fa.accumulate in the default pipeline)."),
    ("--gradient_clipping", float, "Gradient 2-norm clipping (DeepSpeed's)."),
    ("--zero3_init_flag", str, "(true|false) build the model under deepspeed.zero.Init (ZeRO-3)."),
    ("--zero3_save_16bit_model", str, "(true|false) gather 16-bit weights on save under ZeRO-3."),
    ("--deepspeed_hostfile", str, "DeepSpeed hostfile (refused: fnaccel launches with torchrun)."),
    ("--deepspeed_exclusion_filter", str, "DeepSpeed exclusion filter (refused: torchrun launches)."),
    ("--deepspeed_inclusion_filter", str, "DeepSpeed inclusion filter (refused: torchrun launches)."),
    ("--deepspeed_multinode_launcher", str, "DeepSpeed multi-node launcher (refused: torchrun launches)."),
    ("--deepspeed_moe_layer_cls_names", str, "MoE layer class names (ZeRO-3 leaf modules)."),
)

# fp8 (fa.autocast(fa.fp8) in the default pipeline with --mixed_precision fp8): carried as the
# config's fp8_config section; the key is the flag without "--fp8_" (fp8_format keeps its name)
FP8_FLAGS: tuple[Flag, ...] = (
    ("--fp8_backend", str, "FP8 backend: AO (torchao, default), TE or MSAMP (CUDA only)."),
    ("--fp8_use_autocast_during_eval", None, "FP8 autocast in evaluation."),
    ("--fp8_margin", int, "Margin for the scaling factor."),
    ("--fp8_interval", int, "Interval of scaling-factor updates."),
    ("--fp8_format", str, "FP8 format (HYBRID, E4M3 or E5M2)."),
    ("--fp8_amax_history_len", int, "amax history length."),
    ("--fp8_amax_compute_algo", str, "amax algorithm (max or most_recent)."),
    (
        "--fp8_override_linear_precision",
        str,
        "Higher precision for fprop, dgrad, wgrad (e.g. false,false,true).",
    ),
    ("--fp8_opt_level", str, "MS-AMP optimisation level (O1 or O2)."),
)

_REFUSED: tuple[tuple[str, str, tuple[Flag, ...]], ...] = (
    # (group title, why, flags as (flag, type or None for a switch, help))
    (
        "TPU arguments",
        "this build has no TPU (torch_xla) engine",
        (
            ("--tpu", None, "Launch TPU training."),
            ("--tpu_cluster", None, "Use a GCP TPU pod."),
            ("--tpu_use_sudo", None, "Run the TPU script with sudo."),
            ("--vm", str, "Compute VM instance names (TPU pods)."),
            ("--env", str, "Environment variables for the TPU VMs."),
            ("--main_training_function", str, "The function a TPU launch calls."),
            ("--downcast_bf16", None, "Downcast float and double tensors to bf16 on TPU."),
        ),
    ),
    (
        "Megatron-LM arguments",
        "this build has no Megatron-LM engine",
        (
            ("--use_megatron_lm", None, "Train with Megatron-LM."),
            ("--megatron_lm_tp_degree", int, "Tensor parallel degree."),
            ("--megatron_lm_pp_degree", int, "Pipeline parallel degree."),
            ("--megatron_lm_num_micro_batches", int, "Micro-batches when the PP degree is above 1."),
            ("--megatron_lm_sequence_parallelism", str, "(true|false) sequence parallelism."),
            ("--megatron_lm_recompute_activations", str, "(true|false) selective recompute."),
            ("--megatron_lm_use_distributed_optimizer", str, "(true|false) distributed optimizer."),
            ("--megatron_lm_gradient_clipping", float, "Global L2-norm gradient clipping."),
        ),
    ),
    (
        "AWS SageMaker arguments",
        "this build has no SageMaker launcher",
        (
            ("--aws_access_key_id", str, "AWS access key id."),
            ("--aws_secret_access_key", str, "AWS secret access key."),
        ),
    ),
    (
        "Other hardware",
        "this build supports CPUs and CUDA GPUs only",
        (
            ("--ipex", None, "Intel Extension for PyTorch (deprecated in Accelerate)."),
            ("--use_xpu", None, "Intel XPU (deprecated in Accelerate)."),
        ),
    ),
)


def _add(
    group: argparse._ActionsContainer, flag: str, kind: Callable[[str], object] | None, text: str
) -> None:
    if kind is None:
        group.add_argument(flag, action="store_true", default=None, help=text)
    else:
        group.add_argument(flag, type=kind, default=None, help=text)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``accelerate launch``'s flags to ``parser`` (script and its arguments last)."""
    parser.add_argument(
        "--config_file",
        default=None,
        help="The config file whose values are the defaults of the flags below.",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="Run the script as a Python module, as `python -m` does."
    )
    parser.add_argument(
        "--no_python",
        action="store_true",
        help="Run the script directly, without `python` (for non-Python scripts).",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=None,
        help="Full torch.distributed stack traces on failure; FNACCEL_DEBUG_MODE=1 "
        "in the script (collectives check shapes across ranks).",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="Silence the launcher's own log lines; only the relevant traceback shows.",
    )

    hardware = parser.add_argument_group("Hardware selection arguments")
    _add(hardware, "--cpu", None, "Train on the CPU even when GPUs are available.")
    _add(hardware, "--multi_gpu", None, "Distributed training over GPUs.")

    resources = parser.add_argument_group("Resource selection arguments")
    resources.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16", "fp8"),
        default=None,
        help="Mixed precision: no, fp16, bf16 or fp8 (torchao float8 layers, bf16 elsewhere).",
    )
    _add(resources, "--num_processes", at_least(1), "Total number of processes, over all machines.")
    resources.add_argument(
        "--force_num_processes",
        action="store_true",
        help="Start more processes per machine than the bound docs/cli.md gives "
        "(4 per CPU this process may use, at least 8).",
    )
    _add(resources, "--num_machines", at_least(1), "Number of machines.")
    _add(
        resources,
        "--num_cpu_threads_per_process",
        at_least(1),
        "OMP_NUM_THREADS for each process (default: this machine's cores over its processes).",
    )
    _add(resources, "--enable_cpu_affinity", None, "Pin each local process to its own share of the CPUs.")

    paradigm = parser.add_argument_group("Training paradigm arguments")
    _add(paradigm, "--use_fsdp", None, "Shard the model with FSDP2 (fa.fsdp) in the default pipeline.")
    _add(paradigm, "--use_deepspeed", None, "Train through DeepSpeed (fa.deepspeed) in the default pipeline.")

    cluster = parser.add_argument_group("Distributed GPU arguments")
    _add(cluster, "--gpu_ids", str, "Comma-separated GPU ids this machine uses (CUDA_VISIBLE_DEVICES).")
    _add(
        cluster,
        "--same_network",
        None,
        "All machines are on one local network (torchrun needs no "
        "setting for it; accepted for config compatibility).",
    )
    _add(cluster, "--machine_rank", at_least(0), "The rank of this machine.")
    _add(cluster, "--main_process_ip", str, "The IP address of the machine of rank 0.")
    _add(cluster, "--main_process_port", port, "The port of the machine of rank 0.")
    cluster.add_argument(
        "-t",
        "--tee",
        default=None,
        help="Tee the processes' std streams into the log files as well as the "
        "console (torchrun's --tee: 0 none, 1 stdout, 2 stderr, 3 both).",
    )
    _add(cluster, "--log_dir", str, "Base directory of torchrun's per-process log files.")
    _add(cluster, "--role", str, "User-defined role of the workers.")
    cluster.add_argument(
        "--rdzv_backend", default=None, help="Rendezvous: static (default) or c10d (or etcd)."
    )
    _add(cluster, "--rdzv_conf", str, "Extra rendezvous configuration (<key1>=<value1>,...).")
    _add(cluster, "--max_restarts", at_least(0), "Restarts of the worker group before the launch fails.")
    _add(cluster, "--monitor_interval", seconds, "Seconds between checks of the workers' state.")

    fsdp = parser.add_argument_group("FSDP arguments (with --use_fsdp or a config's fsdp_config)")
    for flag, kind, text in FSDP_FLAGS:
        _add(fsdp, flag, kind, text)
    mesh = parser.add_argument_group("Parallelism arguments (the device mesh; docs/parallelism.md)")
    _add(
        mesh,
        "--use_parallelism_config",
        None,
        "Accepted for Accelerate's command lines: the --parallelism_config_* flags apply without it.",
    )
    for flag, kind, text in PARALLELISM_FLAGS:
        _add(mesh, flag, kind, text)
    dynamo = parser.add_argument_group("TorchDynamo arguments")
    for flag, kind, text in DYNAMO_FLAGS:
        _add(dynamo, flag, kind, text)
    deepspeed = parser.add_argument_group(
        "DeepSpeed arguments (with --use_deepspeed or a config's deepspeed_config)"
    )
    for flag, kind, text in DEEPSPEED_FLAGS:
        _add(deepspeed, flag, kind, text)
    fp8 = parser.add_argument_group("FP8 arguments (with --mixed_precision fp8)")
    for flag, kind, text in FP8_FLAGS:
        _add(fp8, flag, kind, text)
    for title, why, flags in _REFUSED:
        group = parser.add_argument_group(f"{title} (refused: {why})")
        for flag, kind, text in flags:
            _add(group, flag, kind, text)

    parser.add_argument("training_script", help="The script (or module with -m) to launch in every process.")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="Arguments of the training script."
    )


def refused_flags(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """``(flag, why)`` for each flag given for an engine this build does not ship."""
    for _, why, flags in _REFUSED:
        for flag, _, _ in flags:
            if getattr(args, flag.lstrip("-"), None) is not None:
                yield flag, why
