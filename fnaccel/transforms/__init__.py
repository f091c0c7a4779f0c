"""Transforms and collectives: small named records of hooks, combined by `compose`."""

from fnaccel.transforms.accumulate import accumulate
from fnaccel.transforms.checkpointing import checkpoint_activations
from fnaccel.transforms.clip import clip_grad_norm, clip_grad_value
from fnaccel.transforms.collective_steps import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    reduce,
)
from fnaccel.transforms.compile import compile
from fnaccel.transforms.contract import EngineRequest, PrepareRequest
from fnaccel.transforms.declared import Capability
from fnaccel.transforms.deepspeed import deepspeed
from fnaccel.transforms.kinds import (
    EngineTransform,
    ParallelismTransform,
    PrecisionTransform,
    StepTransform,
    Transform,
)
from fnaccel.transforms.local_sgd import local_sgd
from fnaccel.transforms.mixed_precision import autocast, bf16, fp8, fp16, fp32, grad_scaler
from fnaccel.transforms.nonfinite import skip_nonfinite
from fnaccel.transforms.parallel import ddp, fsdp
from fnaccel.transforms.phases import Phase
from fnaccel.transforms.pipeline import CallInfo, Collective, Pipeline, compose
from fnaccel.transforms.pipelining import pp
from fnaccel.transforms.profile import profile
from fnaccel.transforms.tensor_parallel import tp

__all__ = [
    "accumulate",
    "autocast",
    "bf16",
    "checkpoint_activations",
    "clip_grad_norm",
    "clip_grad_value",
    "compile",
    "ddp",
    "deepspeed",
    "fp8",
    "fp16",
    "fp32",
    "local_sgd",
    "pp",
    "fsdp",
    "grad_scaler",
    "profile",
    "skip_nonfinite",
    "tp",
    "CallInfo",
    "Capability",
    "Collective",
    "EngineRequest",
    "EngineTransform",
    "ParallelismTransform",
    "PrecisionTransform",
    "PrepareRequest",
    "StepTransform",
    "Phase",
    "Pipeline",
    "Transform",
    "broadcast",
    "broadcast_object_list",
    "compose",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "pad_across_processes",
    "reduce",
]
