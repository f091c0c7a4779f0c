"""Collectives and tree operations as plain functions, context first.

``fa.ops.gather(state, tree)``: the context is a `RunState` or its
`DistContext`. The composable forms of the collectives are `fa.gather()`,
`fa.reduce(...)` and friends (see `fnaccel.transforms`).
"""

from fnaccel.ops.collectives import (
    CannotPadNestedTensorWarning,
    broadcast,
    gather,
    pad_across_processes,
    reduce,
)
from fnaccel.ops.metrics import gather_for_metrics
from fnaccel.ops.objects import broadcast_object_list, gather_object
from fnaccel.ops.tree import (
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)

__all__ = [
    "CannotPadNestedTensorWarning",
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
]
