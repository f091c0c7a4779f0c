"""Collectives as transforms: ``fa.compose(fa.pad_across_processes(dim=1), fa.gather())``.

Each factory returns a stateless `Collective` whose ``apply`` hook calls the
matching function of `fnaccel.ops`. Padding (`Phase.PAD`) comes before the one
communicating step (`Phase.COMMUNICATE`); two communicating steps conflict. When padding
precedes a gather, the shapes padding exchanged are handed on, so the gather
checks the padded shapes without another collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

from fnaccel._errors import CollectiveMismatchError
from fnaccel.dist import DistContext
from fnaccel.ops import collectives as ops
from fnaccel.ops.metrics import gather_for_metrics as _gather_for_metrics
from fnaccel.ops.tree import tree_leaves
from fnaccel.transforms.kinds import Options, options
from fnaccel.transforms.phases import Phase
from fnaccel.transforms.pipeline import CallInfo, Collective, TransformApplyFn

__all__ = [
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

_COMMUNICATING = frozenset(
    {"gather", "reduce", "broadcast", "gather_for_metrics", "gather_object", "broadcast_object_list"}
)


def _communicating(name: str, opts: Options, apply: TransformApplyFn) -> Collective:
    return Collective(
        name=name,
        options=opts,
        phase=Phase.COMMUNICATE,
        conflicts=_COMMUNICATING - {name},
        apply=apply,
    )


def gather() -> Collective:
    """`fnaccel.ops.gather` as a transform.

    >>> import fnaccel as fa, torch
    >>> fa.gather()(fa.init(cpu=True), torch.tensor(1.0))
    tensor([1.])
    """

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        if call.shapes is None:
            return ops.gather(ctx, tree), call
        leaves = tree_leaves(tree)
        first = call.shapes.shapes[0]
        for rank, shapes in enumerate(call.shapes.shapes):
            if shapes != first:
                raise CollectiveMismatchError(
                    f"gather: after padding, rank {rank} has shapes {list(shapes)} but rank 0 "
                    f"has {list(first)}; pad the other differing dimensions too"
                )
        return ops.gather_leaves(ctx, tree, leaves), call

    return _communicating("gather", (), apply)


def reduce(reduction: ops.Reduction = "mean", scale: float = 1.0) -> Collective:
    """`fnaccel.ops.reduce` as a transform: ``fa.reduce("sum")``."""
    ops.check_reduction(reduction)

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        return ops.reduce(ctx, tree, reduction, scale), call

    opts = options(reduction=reduction) + (options(scale=scale) if scale != 1.0 else ())
    return _communicating("reduce", opts, apply)


def broadcast(from_process: int = 0) -> Collective:
    """`fnaccel.ops.broadcast` as a transform: ``fa.broadcast(0)``."""

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        return ops.broadcast(ctx, tree, from_process), call

    return _communicating("broadcast", options(from_process=from_process), apply)


def broadcast_object_list(from_process: int = 0) -> Collective:
    """`fnaccel.ops.broadcast_object_list` as a transform."""

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        # a tree that is not a list is refused inside, on every rank together
        return ops.broadcast_object_list(ctx, cast(Sequence[object], tree), from_process), call

    return _communicating("broadcast_object_list", options(from_process=from_process), apply)


def gather_object() -> Collective:
    """`fnaccel.ops.gather_object` as a transform."""

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        return ops.gather_object(ctx, cast(Sequence[object], tree)), call  # (as above)

    return _communicating("gather_object", (), apply)


def gather_for_metrics(use_gather_object: bool = False) -> Collective:
    """`fnaccel.ops.gather_for_metrics` as a transform; ``num_valid`` is given per call:
    ``collect(state, outputs, num_valid=n)``."""

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        out = _gather_for_metrics(ctx, tree, use_gather_object, num_valid=call.num_valid)
        return out, call

    opts = options(use_gather_object=True) if use_gather_object else ()
    return _communicating("gather_for_metrics", opts, apply)


def pad_across_processes(dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Collective:
    """`fnaccel.ops.pad_across_processes` as a transform.

    >>> import fnaccel as fa
    >>> fa.pad_across_processes(dim=1, pad_index=-100)
    pad_across_processes(dim=1, pad_index=-100)
    """

    def apply(ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        padded, table = ops.pad_with_table(ctx, tree, dim, pad_index, pad_first)
        return padded, dataclasses.replace(call, shapes=table)

    opts = (
        options(dim=dim)
        + (options(pad_index=pad_index) if pad_index != 0 else ())
        + (options(pad_first=True) if pad_first else ())
    )
    return Collective(name="pad_across_processes", options=opts, phase=Phase.PAD, apply=apply)
