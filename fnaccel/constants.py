"""Accelerate's enums and checkpoint file names, spelled the same way.

Every enum mixes in `str`, so a member equals its value (`PrecisionType.FP16 ==
"fp16"`), prints as its value, and can be written to YAML or JSON unchanged.
`"fp16" in PrecisionType` tests values, and `PrecisionType.list()` gives them
all, as in Accelerate.

>>> PrecisionType("bf16") is PrecisionType.BF16
True
>>> str(DistributedType.MULTI_GPU), "fp8" in PrecisionType
('MULTI_GPU', True)
"""

from __future__ import annotations

import enum

__all__ = [
    "ComputeEnvironment",
    "DDPCommunicationHookType",
    "DistributedType",
    "DynamoBackend",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
    "FINISHED_MARK",
    "LAUNCH_DIR_ENV",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_MARK",
    "PROFILE_PATTERN_NAME",
    "RANK_MARK",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
]

# Checkpoint file names, identical to Accelerate's so a checkpoint directory
# reads the same to users of either library.
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
SAMPLER_NAME = "sampler"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# The directory `fnaccel launch` hands its workers (its path in LAUNCH_DIR_ENV), where each
# worker records its global rank (``rank.<rank>``) and a run with PreemptionKwargs that it
# was preempted (``preempted.<rank>``, holding the signal's name) or finished
# (``finished.<rank>``): what the launcher's exit status and last line say.
LAUNCH_DIR_ENV = "FNACCEL_LAUNCH_DIR"
RANK_MARK = "rank"
PREEMPTED_MARK = "preempted"
FINISHED_MARK = "finished"
# The exit status of a preempted run, whichever signal stopped it and wherever it arrived
# (the launcher, one worker, all): 128 + SIGTERM, what schedulers' requeue rules expect.
PREEMPTED_EXIT_CODE = 143


class _ValueContainsMeta(enum.EnumMeta):
    """Lets `value in Enum` test member values, on every Python version."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _StrEnum(enum.StrEnum, metaclass=_ValueContainsMeta):
    """A string enum that prints and formats as its value."""

    @classmethod
    def list(cls) -> list[str]:
        """Returns every member's value, in definition order."""
        return [str(member.value) for member in cls]

    @classmethod
    def _missing_(cls, value: object) -> None:
        raise ValueError(f"{value!r} is not a valid {cls.__name__}: use one of {', '.join(cls.list())}")


class DistributedType(_StrEnum):
    """The kind of distributed environment a run is in."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


class SageMakerDistributedType(_StrEnum):
    """The kind of distributed environment on Amazon SageMaker."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class ComputeEnvironment(_StrEnum):
    """Where the run's hardware lives."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class DynamoBackend(_StrEnum):
    """A `torch.compile` (TorchDynamo) backend; `NO` means do not compile."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"


class LoggerType(_StrEnum):
    """An experiment tracker; `ALL` means every tracker that is installed.

    fnaccel builds in `JSONL` (always available) and `TENSORBOARD`; the others
    are Accelerate's names, accepted by passing your own tracker object
    (`fnaccel.tracking.GeneralTracker`).
    """

    ALL = "all"
    JSONL = "jsonl"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class PrecisionType(_StrEnum):
    """The floating-point precision of a run; `NO` is full fp32."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_StrEnum):
    """A random number generator whose state a run carries and restores."""

    TORCH = "torch"
    CUDA = "cuda"
    NPU = "npu"
    MLU = "mlu"
    MUSA = "musa"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"
    PYTHON = "python"
    NUMPY = "numpy"


class DDPCommunicationHookType(_StrEnum):
    """A `DistributedDataParallel` gradient communication hook (or wrapper)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"
