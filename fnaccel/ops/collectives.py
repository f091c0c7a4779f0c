"""Collectives over trees of tensors, context first: ``fa.ops.gather(state, tree)``.

The context is a `RunState` or its `DistContext`. In a world of one every
operation is local and returns what the same call over N processes would
return for N = 1. Inputs are never modified in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from fnaccel._errors import CollectiveMismatchError
from fnaccel.dist import DistContext, as_dist
from fnaccel.ops._shapes import (
    ShapeTable,
    all_gather_rows,
    as_wire,
    exchange_shapes,
    require_same_shapes,
)
from fnaccel.ops.tree import recursively_apply, tree_leaves, tree_unflatten

__all__ = [
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

_PAD_HINT = "pad them first with fa.ops.pad_across_processes, or use gather_for_metrics"


def _tensor_leaves(op: str, tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # the common case, without walking a tree
        return [tree]
    # error_on_other_type: a collective over a tree with a string leaf is a mistake
    try:
        recursively_apply(lambda t: t, tree, error_on_other_type=True)
    except TypeError as exc:
        raise TypeError(f"{op}: {exc}") from None
    return tree_leaves(tree)


def gather(ctx: DistContext | Any, tree: Any) -> Any:
    """Gather every tensor of ``tree`` from all processes, concatenated along dim 0.

    Each rank must pass tensors of the same shape (pad with
    `pad_across_processes` first when a dimension differs); 0-d tensors are
    gathered into 1-d ones of length ``num_processes``. The shapes are checked
    on every rank before any data moves when ``FNACCEL_DEBUG_MODE=1``.

    Args:
        ctx: a `RunState` or its `DistContext`.
        tree: a tensor or a nested container of tensors.

    Returns:
        The same structure, each tensor ``num_processes`` times longer in dim 0.

    Raises:
        CollectiveMismatchError: (debug mode) the ranks' shapes differ.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> fa.ops.gather(state, {"x": torch.tensor(3.0)})
    {'x': tensor([3.])}
    """
    ctx = as_dist(ctx)
    leaves = _tensor_leaves("gather", tree)
    if ctx.debug and ctx.num_processes > 1:
        require_same_shapes(ctx, "gather", leaves, f"gather needs equal shapes: {_PAD_HINT}")
    return _gather_leaves(ctx, tree, leaves)


def _gather_leaves(ctx: DistContext, tree: Any, leaves: Sequence[torch.Tensor]) -> Any:
    # Python run right after a collective competes with gloo's threads finishing it
    # (measured: 1.6 us of tree rebuilding cost 40 us there), so a bare tensor
    # comes back as it is.
    if isinstance(tree, torch.Tensor) and ctx.num_processes > 1:
        return all_gather_rows(ctx, tree)
    if ctx.num_processes == 1:
        return tree_unflatten(tree, [t.reshape(1) if t.ndim == 0 else t for t in leaves])
    return tree_unflatten(tree, [all_gather_rows(ctx, t) for t in leaves])


Reduction = Literal["mean", "sum", "none"]


def reduce(
    ctx: DistContext | Any, tree: Any, reduction: Reduction = "mean", scale: float = 1.0
) -> Any:
    """Reduce every tensor of ``tree`` across processes; the inputs are left untouched.

    Args:
        ctx: a `RunState` or its `DistContext`.
        tree: a tensor or a nested container of tensors.
        reduction: ``"sum"``, ``"mean"`` (sum divided by ``num_processes``), or
            ``"none"`` (no communication: each rank keeps its own values).
        scale: multiplies the result.

    >>> import fnaccel as fa
    >>> fa.ops.reduce(fa.init(cpu=True), torch.tensor([2.0, 4.0]), "sum", scale=0.5)
    tensor([1., 2.])
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduce: unknown reduction {reduction!r}; use 'mean', 'sum' or 'none'")
    ctx = as_dist(ctx)
    leaves = _tensor_leaves("reduce", tree)
    for t in leaves:
        if t.dtype == torch.bool or (reduction == "mean" and not t.is_floating_point()
                                     and not t.is_complex()):
            raise TypeError(
                f"reduce: cannot take the {reduction} of a {t.dtype} tensor; "
                "convert it to a floating dtype first (or use reduction='sum' for integers)"
            )
        if scale != 1.0 and not t.is_floating_point() and not t.is_complex():
            raise TypeError(
                f"reduce: cannot scale a {t.dtype} tensor by {scale}; convert it to a "
                "floating dtype first (or leave scale=1.0 for integers)"
            )
    communicate = ctx.num_processes > 1 and reduction != "none"
    if communicate and ctx.debug:
        require_same_shapes(ctx, "reduce", leaves, "reduce needs the same shapes on every rank.")
    out = []
    for t in leaves:
        value = t.clone()
        if communicate:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=ctx.process_group)
        if reduction == "mean":
            value /= ctx.num_processes
        if scale != 1.0:
            value *= scale
        out.append(value)
    return tree_unflatten(tree, out)


def broadcast(ctx: DistContext | Any, tree: Any, from_process: int = 0) -> Any:
    """Every rank receives ``from_process``'s tensors; each rank passes tensors of
    the same shapes and dtypes (their values only matter on ``from_process``).

    >>> import fnaccel as fa
    >>> fa.ops.broadcast(fa.init(cpu=True), [torch.ones(2)])
    [tensor([1., 1.])]
    """
    ctx = as_dist(ctx)
    if not 0 <= from_process < ctx.num_processes:
        raise ValueError(
            f"broadcast: from_process={from_process} is not a rank of this "
            f"{ctx.num_processes}-process run"
        )
    leaves = _tensor_leaves("broadcast", tree)
    if ctx.num_processes == 1:
        return tree
    if ctx.debug:
        require_same_shapes(ctx, "broadcast", leaves, "broadcast needs the same shapes on every rank.")
    out = []
    for t in leaves:
        # a contiguous buffer: as_wire would copy a strided one, and receive into the copy
        received = t if ctx.rank == from_process else t.new_empty(t.shape)
        wire = as_wire(received)
        dist.broadcast(wire, src=from_process, group=ctx.process_group)
        out.append(received)
    return tree_unflatten(tree, out)


def broadcast_object_list(
    ctx: DistContext | Any, object_list: Sequence[Any], from_process: int = 0
) -> list[Any]:
    """``from_process``'s list of picklable objects, on every rank.

    Unlike `torch.distributed.broadcast_object_list` the argument is not
    modified; a new list is returned. Each rank passes a list of the same
    length. Objects travel pickled between the run's own processes.
    """
    ctx = as_dist(ctx)
    if not isinstance(object_list, (list, tuple)):
        raise TypeError(
            f"broadcast_object_list takes a list, got {type(object_list).__name__}; "
            "wrap a single object: broadcast_object_list(state, [obj])"
        )
    received = list(object_list)
    if ctx.num_processes > 1:
        if ctx.debug:
            lengths = gather_object(ctx, [len(received)])
            if len(set(lengths)) > 1:
                raise CollectiveMismatchError(
                    f"broadcast_object_list: list lengths differ by rank: {lengths}"
                )
        dist.broadcast_object_list(received, src=from_process, group=ctx.process_group)
    return received


def gather_object(ctx: DistContext | Any, object: Sequence[Any]) -> list[Any]:
    """Gather a list of picklable objects from every rank into one list, in rank order.

    >>> import fnaccel as fa
    >>> fa.ops.gather_object(fa.init(cpu=True), ["a", "b"])
    ['a', 'b']
    """
    ctx = as_dist(ctx)
    if not isinstance(object, (list, tuple)):
        raise TypeError(
            f"gather_object takes a list of objects, got {type(object).__name__}; "
            "wrap a single object: gather_object(state, [obj])"
        )
    if ctx.num_processes == 1:
        return list(object)
    everyone: list[Any] = [None] * ctx.num_processes
    dist.all_gather_object(everyone, list(object), group=ctx.process_group)
    return [item for part in everyone for item in part]


def pad_across_processes(
    ctx: DistContext | Any, tree: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad every tensor of ``tree`` along ``dim`` to the largest size any rank has.

    Each leaf is padded independently; dtypes (bool included) are kept, and a
    leaf that has no dimension ``dim`` is returned unchanged. One
    small collective exchanges every rank's shapes, which also checks that the
    ranks passed the same structure and dtypes.

    Args:
        ctx: a `RunState` or its `DistContext`.
        tree: a tensor or a nested container of tensors.
        dim: the dimension to pad; negative values count from the end.
        pad_index: the value padding is filled with.
        pad_first: pad before the data instead of after it.

    >>> import fnaccel as fa
    >>> fa.ops.pad_across_processes(fa.init(cpu=True), torch.ones(2, 3), dim=1)
    tensor([[1., 1., 1.],
            [1., 1., 1.]])
    """
    padded, _ = pad_with_table(as_dist(ctx), tree, dim, pad_index, pad_first)
    return padded


def pad_with_table(
    ctx: DistContext, tree: Any, dim: int, pad_index: int, pad_first: bool
) -> tuple[Any, ShapeTable | None]:
    """`pad_across_processes`, also returning the shape table it exchanged
    (the shapes after padding), so a following gather needs no check of its own."""
    leaves = _tensor_leaves("pad_across_processes", tree)
    if ctx.num_processes == 1:
        return tree, None
    table = exchange_shapes(ctx, "pad_across_processes", leaves, hint="Pad the same tree on every rank.")
    out = []
    padded_shapes: list[list[tuple[int, ...]]] = [list(s) for s in table.shapes]
    for i, t in enumerate(leaves):
        if not -t.ndim <= dim < t.ndim:  # no such dim (a 0-d leaf, ids beside labels)
            out.append(t)
            continue
        axis = dim % t.ndim
        target = max(shapes[i][axis] for shapes in table.shapes)
        for rank_shapes in padded_shapes:
            shape = list(rank_shapes[i])
            shape[axis] = target
            rank_shapes[i] = tuple(shape)
        if t.shape[axis] == target:
            out.append(t)
            continue
        shape = list(t.shape)
        shape[axis] = target
        new = t.new_full(shape, pad_index)
        size = t.shape[axis]
        start = target - size if pad_first else 0
        new.narrow(axis, start, size).copy_(t)
        out.append(new)
    after = ShapeTable(shapes=tuple(tuple(s) for s in padded_shapes), extras=table.extras)
    return tree_unflatten(tree, out), after
