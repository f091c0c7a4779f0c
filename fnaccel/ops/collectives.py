"""Collectives over trees of tensors, context first: ``fa.ops.gather(state, tree)``.

The context is a `RunState` or its `DistContext`. In a world of one every
operation is local and returns what the same call over N processes would
return for N = 1. Inputs are never modified in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import MappingProxyType
from typing import Literal, TypeVar, cast, get_args

import torch
import torch.distributed as dist

from fnaccel.dist import DistContext, DistLike, as_dist
from fnaccel.ops._flags import Agreed, PendingFlag, call_of, flag_carrier
from fnaccel.ops._shapes import (
    ShapeTable,
    Signature,
    all_gather_rows,
    as_wire,
    exchange_shapes,
    naming_timeouts,
    require_same_shapes,
)

# re-exported: seeding, modeling.weights and the transforms import them from here
from fnaccel.ops.objects import broadcast_object_list, gather_object
from fnaccel.ops.tree import is_other_leaf, tree_leaves, tree_paths, tree_unflatten

__all__ = [
    "REDUCTIONS",
    "CannotPadNestedTensorWarning",
    "ShapeTable",  # the shapes every rank agreed on: a pad's result, read by a following gather
    "broadcast",
    "broadcast_object_list",
    "check_reduction",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

# a tree returned with the same containers, its tensors gathered, reduced, broadcast or padded
T = TypeVar("T")
# what a data collective needs besides its leaves: the reduction's name, the source rank, or nothing
Param = str | int | None

_PAD_HINT = "pad them first with fa.ops.pad_across_processes, or use gather_for_metrics"


class CannotPadNestedTensorWarning(UserWarning):
    """`pad_across_processes` met a nested (ragged) tensor: it is returned unpadded."""


def _tensor_leaves(
    op: str, tree: object, nested_ok: bool = False
) -> tuple[list[torch.Tensor], TypeError | None]:
    """The tensor leaves of ``tree``, and the reason it is no tree this op takes (or None)."""
    if isinstance(tree, torch.Tensor):  # the common case, without walking a tree
        leaves = [tree]
    else:
        # a collective over a tree with a string leaf is a mistake: name the leaf
        others = tree_leaves(tree, test_type=is_other_leaf)
        if others:
            path = tree_paths(tree, test_type=is_other_leaf)[0]
            what = f"the leaf {path} of the tree is" if path else "got"
            return [], TypeError(
                f"{op}: {what} a {type(others[0]).__name__}; a collective sends tensors, alone or in "
                "nested lists, tuples, dicts and dataclasses: make it a tensor or leave it out"
            )
        leaves = tree_leaves(tree)
    if not nested_ok and any(t.is_nested for t in leaves):
        return [], TypeError(
            f"{op}: nested (ragged) tensors have no single shape to exchange; "
            "unbind them into a list of tensors first (tensor.unbind())"
        )
    return leaves, None


def _collect(ctx: DistContext, op: str, param: Param, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The data collectives of ``op`` (one per leaf), sizes already agreed."""
    group = ctx.process_group
    if op == "gather":
        return [all_gather_rows(ctx, t) for t in leaves]
    if op == "reduce":
        out = [t.clone() for t in leaves]
        for value in out:
            dist.all_reduce(value, op=_REDUCE_OPS[cast(str, param)], group=group)
        return out
    assert op == "broadcast", op
    out = []
    for t in leaves:
        # a contiguous buffer: as_wire would copy a strided one, and receive into the copy
        received = t if ctx.rank == param else t.new_empty(t.shape)
        dist.broadcast(as_wire(received), group=group, group_src=cast(int, param))
        out.append(received)
    return out


def _checked_collect(
    ctx: DistContext, signature: Signature, param: Param, hint: str, problem: BaseException | None
) -> list[torch.Tensor]:
    """Check that every rank makes this call with the same tree, and run its data
    collectives; otherwise raise on every rank (``ctx.num_processes > 1``).

    A call like the group's last agreed one runs its data collectives at once,
    with a flag saying whether any rank's call differs (see `fnaccel.ops._flags`):
    a gather and a reduce with a floating-point leaf carry it in their data
    (`flag_carrier`), anything else in a one-element all-reduce beside it. Any
    other call, or a mismatch, pays the header round trip before the data: gloo
    would abort, hang or return a partly written buffer if sizes differed
    inside a data collective.
    """
    with naming_timeouts(ctx, signature.op):
        return _checked_collect_now(ctx, signature, param, hint, problem)


def _checked_collect_now(
    ctx: DistContext, signature: Signature, param: Param, hint: str, problem: BaseException | None
) -> list[torch.Tensor]:
    owner = ctx.group_owner
    agreed: Agreed | None = owner.agreed
    call = call_of(signature)
    if agreed is not None:
        mine = problem is None and call == agreed.call
        leaves = signature.leaves if mine else agreed.zeros(ctx.device)
        if agreed.carrier is not None:
            carried = agreed.carrier.run(ctx, leaves, not mine)
            out, raised = carried or [], carried is None
        else:
            changed = PendingFlag(ctx, not mine)
            out = _collect(ctx, agreed.op, agreed.param, leaves)
            raised = changed.raised()
        if not raised:
            return out
        owner.agreed = None
    require_same_shapes(ctx, signature, hint, problem)
    reduce_op = _REDUCE_OPS[cast(str, param)] if signature.op == "reduce" else None
    owner.agreed = Agreed(call=call, param=param, carrier=flag_carrier(call, ctx, reduce_op))
    return _collect(ctx, signature.op, param, signature.leaves)


def gather(ctx: DistLike, tree: T) -> T:
    """Gather every tensor of ``tree`` from all processes, concatenated along dim 0.

    Each rank must pass the same tree (keys, dtypes, shapes: pad with
    `pad_across_processes` first when a dimension differs); 0-d tensors are
    gathered into 1-d ones of length ``num_processes``. Every rank's tree is
    checked on every call (a repeated layout beside the data, a new one before
    it): a difference raises on every rank, never returns.

    Args:
        ctx: a `RunState` or its `DistContext`.
        tree: a tensor or a nested container of tensors.

    Returns:
        The same structure, each tensor ``num_processes`` times longer in dim 0.

    Raises:
        CollectiveMismatchError: the ranks' trees differ (keys, dtype, ndim or
            shape), or another rank's input was not a tree of tensors.
        TypeError: this rank's tree holds a leaf that is not a tensor.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> fa.ops.gather(state, {"x": torch.tensor(3.0)})
    {'x': tensor([3.])}
    """
    ctx = as_dist(ctx)
    leaves, problem = _tensor_leaves("gather", tree)
    if ctx.num_processes == 1:
        if problem is not None:
            raise problem
        return gather_leaves(ctx, tree, leaves)
    out = _checked_collect(
        ctx, Signature.of("gather", tree, leaves), None, f"gather needs equal trees: {_PAD_HINT}", problem
    )
    # Python run right after a collective competes with gloo's threads finishing it:
    # a bare tensor comes back as it is (see gather_leaves)
    return cast(T, out[0]) if isinstance(tree, torch.Tensor) else tree_unflatten(tree, out)


def gather_leaves(ctx: DistContext, tree: T, leaves: Sequence[torch.Tensor]) -> T:
    # Python run right after a collective competes with gloo's threads finishing it
    # (measured: 1.6 us of tree rebuilding cost 40 us there), so a bare tensor
    # comes back as it is.
    if isinstance(tree, torch.Tensor) and ctx.num_processes > 1:
        return cast(T, all_gather_rows(ctx, tree))
    if ctx.num_processes == 1:
        return tree_unflatten(tree, [t.reshape(1) if t.ndim == 0 else t for t in leaves])
    return tree_unflatten(tree, [all_gather_rows(ctx, t) for t in leaves])


Reduction = Literal["mean", "sum", "none", "max", "min"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)
_REDUCE_OPS = MappingProxyType(
    {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
)


def check_reduction(reduction: str) -> None:
    """Raise `ValueError` unless ``reduction`` is one `reduce` knows."""
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduce: unknown reduction {reduction!r}; use one of {', '.join(map(repr, REDUCTIONS))}"
        )


def _reduce_problem(t: torch.Tensor, reduction: str, scale: float) -> TypeError | None:
    exact = not t.is_floating_point() and not t.is_complex()
    if (
        t.dtype == torch.bool
        or (reduction == "mean" and exact)
        or (reduction in ("max", "min") and t.is_complex())
    ):
        fix = "(or use reduction='sum' for integers)" if reduction == "mean" and exact else ""
        return TypeError(
            f"reduce: cannot take the {reduction} of a {t.dtype} tensor; "
            f"convert it to a {'real ' if t.is_complex() else ''}floating dtype first {fix}".rstrip()
        )
    if scale != 1.0 and exact:
        return TypeError(
            f"reduce: cannot scale a {t.dtype} tensor by {scale}; convert it to a "
            "floating dtype first (or leave scale=1.0 for integers)"
        )
    return None


def reduce(ctx: DistLike, tree: T, reduction: Reduction = "mean", scale: float = 1.0) -> T:
    """Reduce every tensor of ``tree`` across processes; the inputs are left untouched.

    Every rank's tree (keys, dtypes, shapes) is checked on every call:
    a difference raises on every rank.

    Args:
        ctx: a `RunState` or its `DistContext`.
        tree: a tensor or a nested container of tensors.
        reduction: ``"sum"``, ``"mean"`` (sum divided by ``num_processes``),
            ``"max"``, ``"min"`` (elementwise), or ``"none"`` (no
            communication: each rank keeps its own values).
        scale: multiplies the result.

    Raises:
        CollectiveMismatchError: the ranks' trees or reductions differ, or
            another rank's input was refused.
        TypeError: a leaf this reduction cannot take (bool; integers for
            ``"mean"`` or a scale; complex for ``"max"``/``"min"``).

    >>> import fnaccel as fa
    >>> fa.ops.reduce(fa.init(cpu=True), torch.tensor([2.0, 4.0]), "sum", scale=0.5)
    tensor([1., 2.])
    >>> fa.ops.reduce(fa.init(cpu=True), torch.tensor([2, 4]), "max")
    tensor([2, 4])
    """
    check_reduction(reduction)
    ctx = as_dist(ctx)
    leaves, problem = _tensor_leaves("reduce", tree)
    problem = problem or next(
        (p for t in leaves if (p := _reduce_problem(t, reduction, scale)) is not None), None
    )
    if ctx.num_processes > 1 and reduction != "none":
        signature = Signature.of("reduce", tree, leaves, key=f"reduction={reduction!r}")
        out = _checked_collect(
            ctx, signature, reduction, "reduce needs the same tree on every rank.", problem
        )
    elif problem is not None:
        raise problem
    else:
        out = [t.clone() for t in leaves]
    for value in out:
        if reduction == "mean":
            value /= ctx.num_processes
        if scale != 1.0:
            value *= scale
    return tree_unflatten(tree, out)


def broadcast(ctx: DistLike, tree: T, from_process: int = 0) -> T:
    """Every rank receives ``from_process``'s tensors; each rank passes the same
    tree (keys, dtypes, shapes; the values only matter on ``from_process``),
    checked on every call (a repeated layout beside the data, a new one before
    it): a difference raises on every rank, never returns.

    >>> import fnaccel as fa
    >>> fa.ops.broadcast(fa.init(cpu=True), [torch.ones(2)])
    [tensor([1., 1.])]
    """
    ctx = as_dist(ctx)
    if not 0 <= from_process < ctx.num_processes:
        raise ValueError(
            f"broadcast: from_process={from_process} is not a rank of this {ctx.num_processes}-process run"
        )
    leaves, problem = _tensor_leaves("broadcast", tree)
    if ctx.num_processes == 1:
        if problem is not None:
            raise problem
        return tree
    signature = Signature.of("broadcast", tree, leaves, key=f"from_process={from_process}")
    out = _checked_collect(
        ctx, signature, from_process, "broadcast needs the same tree on every rank.", problem
    )
    return tree_unflatten(tree, out)


def pad_across_processes(
    ctx: DistLike, tree: T, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> T:
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
    ctx: DistContext, tree: T, dim: int, pad_index: int, pad_first: bool
) -> tuple[T, ShapeTable | None]:
    """`pad_across_processes`, also returning the shape table it exchanged
    (the shapes after padding), so a following gather needs no check of its own."""
    op = "pad_across_processes"
    leaves, problem = _tensor_leaves(op, tree, nested_ok=True)
    if any(t.is_nested for t in leaves):
        warnings.warn(
            f"{op}: a nested tensor has no single size along dim {dim} to pad; it is returned unchanged",
            CannotPadNestedTensorWarning,
            stacklevel=3,
        )
    if ctx.num_processes == 1:
        if problem is not None:
            raise problem
        return tree, None
    signature = Signature.of(op, tree, leaves, key=f"dim={dim}")
    table = exchange_shapes(ctx, signature, hint="Pad the same tree on every rank.", problem=problem)
    out = []
    padded_shapes: list[list[tuple[int, ...]]] = [list(s) for s in table.shapes]
    for i, t in enumerate(leaves):
        if t.is_nested or not -t.ndim <= dim < t.ndim:  # nothing to pad (a 0-d leaf, ids)
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
