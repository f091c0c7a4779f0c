"""fnaccel: Accelerate-style PyTorch training as pure functions over a frozen `RunState`.

The public surface is curated here; the implementation lives in private
modules and may move freely behind it (see fnaccel/README.md for the design).

A facade: every name loads on first use from the module that owns it, so that
`import fnaccel` (or any of its modules) costs little more than `import torch`
and nothing inside the package depends on this file.
"""

from types import MappingProxyType

from fnaccel._lazy import lazy_attributes

__version__ = "0.1.0"

# The public names, each with the module that defines it, in docs/api.md's order: the one list of
# them. `__all__` and the loading on first use come from it, and so does __init__.pyi, what type
# checkers read (`make stubs` writes it); tests/test_exported_members.py keeps the three identical.
# A name defined in a package's submodule of the same name is read from that submodule
# (`fa.compile`: fnaccel.transforms.compile), since importing it replaces the package's attribute.
_PUBLIC = MappingProxyType(
    {
        # The run
        "RunState": "fnaccel.state",
        "DataPosition": "fnaccel.state",
        "DistContext": "fnaccel.dist",
        "RNGState": "fnaccel.rng",
        "LaunchConfig": "fnaccel.config.launch",
        "ParallelismConfig": "fnaccel.config.parallelism",
        "init": "fnaccel.runtime",
        "shutdown": "fnaccel.runtime",
        "with_rng": "fnaccel.seeding",
        # Training
        "prepare": "fnaccel.preparation",
        "step": "fnaccel.train",
        "backward": "fnaccel.train",
        "apply_gradients": "fnaccel.train",
        "batches": "fnaccel.data.prepared",
        "end_epoch": "fnaccel.data.prepared",
        "default_pipeline": "fnaccel.preparation",
        "DataLoaderConfiguration": "fnaccel.data.config",
        "SchedulerConfiguration": "fnaccel.train",
        "SchedulerRuleWarning": "fnaccel.train",
        # Evaluation
        "evaluate": "fnaccel.evaluation",
        "eval_batches": "fnaccel.data.eval_batches",
        # The loop's helpers and launching from a notebook
        "autocast_context": "fnaccel.precision",
        "skip_first_batches": "fnaccel.data.skip",
        "set_trigger": "fnaccel.trigger",
        "check_trigger": "fnaccel.trigger",
        "notebook_launcher": "fnaccel.launchers",
        "debug_launcher": "fnaccel.launchers",
        # Checkpoints
        "save": "fnaccel.checkpoint.saveload",
        "load": "fnaccel.checkpoint.saveload",
        "ProjectConfiguration": "fnaccel.checkpoint.project",
        "latest_checkpoint": "fnaccel.checkpoint.latest",
        "save_policy": "fnaccel.checkpoint.policy",
        "autosave": "fnaccel.checkpoint.policy",
        "save_model": "fnaccel.modeling.weights",
        "CheckpointLayout": "fnaccel.checkpoint.storage.layout",
        "CheckpointFiles": "fnaccel.checkpoint.storage.layout",
        "read_checkpoint_tensors": "fnaccel.checkpoint.storage.layout",
        "read_checkpoint_json": "fnaccel.checkpoint.storage.layout",
        # Debugging
        "diff": "fnaccel.debug.diff",
        # Tracking and progress
        "init_trackers": "fnaccel.tracking.run",
        "log": "fnaccel.tracking.run",
        "get_tracker": "fnaccel.tracking.run",
        "end_training": "fnaccel.tracking.run",
        "progress": "fnaccel.tracking.progress",
        "count_flops": "fnaccel.tracking.throughput",
        "throughput_meter": "fnaccel.tracking.throughput",
        "throughput": "fnaccel.tracking.throughput",
        "ThroughputMeter": "fnaccel.tracking.throughput",
        "device_peak_flops": "fnaccel.tracking.throughput",
        # Training transforms
        "autocast": "fnaccel.transforms",
        "grad_scaler": "fnaccel.transforms",
        "ddp": "fnaccel.transforms",
        "fsdp": "fnaccel.transforms",
        "tp": "fnaccel.transforms",
        "sp": "fnaccel.transforms.sequence",
        "checkpoint_activations": "fnaccel.transforms",
        "deepspeed": "fnaccel.transforms.deepspeed",
        "accumulate": "fnaccel.transforms.accumulate",
        "clip_grad_norm": "fnaccel.transforms",
        "clip_grad_value": "fnaccel.transforms",
        "skip_nonfinite": "fnaccel.transforms.nonfinite",
        "compile": "fnaccel.transforms.compile",
        "profile": "fnaccel.transforms.profile",
        "fp16": "fnaccel.transforms",
        "bf16": "fnaccel.transforms",
        "fp32": "fnaccel.transforms",
        "fp8": "fnaccel.transforms.mixed_precision",
        "local_sgd": "fnaccel.transforms.local_sgd",
        "pp": "fnaccel.transforms",
        # Collective transforms
        "Transform": "fnaccel.transforms",
        "StepTransform": "fnaccel.transforms",
        "PrecisionTransform": "fnaccel.transforms",
        "ParallelismTransform": "fnaccel.transforms",
        "EngineTransform": "fnaccel.transforms",
        "PrepareRequest": "fnaccel.transforms",
        "EngineRequest": "fnaccel.transforms",
        "Capability": "fnaccel.transforms",
        "Phase": "fnaccel.transforms",
        "Collective": "fnaccel.transforms",
        "Pipeline": "fnaccel.transforms",
        "compose": "fnaccel.transforms",
        "gather": "fnaccel.transforms",
        "reduce": "fnaccel.transforms",
        "broadcast": "fnaccel.transforms",
        "pad_across_processes": "fnaccel.transforms",
        "gather_object": "fnaccel.transforms",
        "broadcast_object_list": "fnaccel.transforms",
        "gather_for_metrics": "fnaccel.transforms",
        # Process and random helpers
        "wait_for_everyone": "fnaccel.process",
        "main_process_first": "fnaccel.process",
        "local_main_process_first": "fnaccel.process",
        "on_main_process": "fnaccel.process",
        "split_between_processes": "fnaccel.process",
        "print_on_main": "fnaccel.process",
        "set_seed": "fnaccel.seeding",
        "synchronize_rng_states": "fnaccel.seeding",
        # Kwargs handlers and enums
        "AutocastKwargs": "fnaccel.kwargs",
        "DistributedDataParallelKwargs": "fnaccel.kwargs",
        "FP8RecipeKwargs": "fnaccel.kwargs",
        "GradScalerKwargs": "fnaccel.kwargs",
        "InitProcessGroupKwargs": "fnaccel.kwargs",
        "ProfileKwargs": "fnaccel.kwargs",
        "PreemptionKwargs": "fnaccel.preemption",
        "DistributedType": "fnaccel.constants",
        "PrecisionType": "fnaccel.constants",
        # Errors, all subclasses of `FnaccelError`
        "FnaccelError": "fnaccel._errors",
        "StaleStateError": "fnaccel._errors",
        "ConfigError": "fnaccel._errors",
        "CollectiveMismatchError": "fnaccel._errors",
        "CollectiveTimeoutError": "fnaccel._errors",
        "CollectiveCallError": "fnaccel._errors",
        "CheckpointError": "fnaccel._errors",
        "NonFiniteUpdateError": "fnaccel.transforms.nonfinite",
        "ResumeDriftWarning": "fnaccel.checkpoint.manifest",
        "SkippedCheckpointWarning": "fnaccel.checkpoint.latest",
        # Modules
        "ops": "fnaccel.ops",
        "utils": "fnaccel.utils",
    }
)

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_attributes("fnaccel", _PUBLIC, globals())
