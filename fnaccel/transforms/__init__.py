"""Transforms: small named records of hooks, combined by `compose`."""

from fnaccel.transforms.base import CallInfo, Pipeline, Transform, compose
from fnaccel.transforms.collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    reduce,
)

__all__ = [
    "CallInfo",
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
