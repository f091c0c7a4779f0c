"""What a training transform declares about itself: its capabilities and its settings records.

`fa.prepare`, `fa.step`, the engines and the checkpoint ask these, never a
transform's name: ``capabilities`` (`Capability`) say what it does,
``settings`` (a typed record: `Precision`, `GradientClipping`,
`Accumulation`; found with ``pipeline.settings(kind)``) what other code reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from fnaccel.constants import PrecisionType

if TYPE_CHECKING:
    import torch

__all__ = ["Accumulation", "Capability", "GradientClipping", "Precision"]


class Capability(Enum):
    """What a training transform does, declared on it (`Transform.capabilities`).

    `fa.prepare`, `fa.step` and the checkpoint ask a pipeline for these, never
    for a transform's name, so a transform written outside fnaccel (a
    data-parallel wrapper of one's own) takes part as fnaccel's own do. A
    capability is kept only where several transforms declare it or several
    places ask it; what one hook or the engine already says is asked there
    (a ``forward_backward`` hook, `Pipeline.engine`, ``mesh_dims``).
    """

    # Who declares each, and who asks:
    # ddp, fsdp, deepspeed; fa.prepare needs one (or SPLITS_MODEL) on several data-parallel ranks,
    # and fa.load ignores one present on one side only when the number of processes changed
    AVERAGES_GRADIENTS = "averages the data-parallel replicas' gradients"
    # fsdp; the launch's FSDP is what the pipeline has (fa.prepare's warning)
    SHARDS_PARAMETERS = "holds the model's parameters as shards (DTensor) across ranks"
    # pp; its ranks hold different layers, not replicas to average (fa.prepare)
    SPLITS_MODEL = "keeps only part of the model on each rank (pipeline stages)"
    # grad_scaler, deepspeed; autocast(fa.fp16) adds a grad_scaler() only when none is there
    SCALES_LOSS = "scales the loss before backward (fp16)"
    # clip_grad_norm, clip_grad_value; an engine that takes it over skips their before_update
    CLIPS_GRADIENTS = "clips the gradients before the optimizer step"


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """The precision a transform makes the model compute in (`fa.autocast`'s settings).

    Attributes:
        precision: fp16, bf16, fp8, or ``PrecisionType.NO`` (fp32, no autocast).
        dtype: the dtype autocast computes in (bf16 for what fp8's float8
            layers leave).
        cache_enabled: ``torch.autocast``'s weight-cast cache (None: torch's default).
    """

    precision: PrecisionType
    dtype: torch.dtype
    cache_enabled: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientClipping:
    """How a transform clips the gradients' global norm (`fa.clip_grad_norm`'s settings)."""

    max_norm: float
    norm_type: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Accumulation:
    """How a transform accumulates gradients over batches (`fa.accumulate`'s settings).

    Attributes:
        micro_steps: batches per optimizer update.
        sync_each_batch: gradients are communicated on every batch anyway.
        sums_items: the loss is a sum over items, normalised at the update.
    """

    micro_steps: int
    sync_each_batch: bool = False
    sums_items: bool = False
