"""`gather_for_metrics`: every evaluated sample exactly once, in dataset order.

How padding is known, without hidden state: an evaluation loader that evens
out the ranks' batches pads the *end* of a rank's batch with repeated
samples, and says, for each batch, how many of its leading samples are real:
``num_valid``. `fnaccel.data.sharding.eval_shards` computes exactly that
split (step ``s`` gives rank ``r`` the samples
``[s*B*W + r*B, s*B*W + (r+1)*B)``), so that concatenating the ranks' real
samples in rank order gives the dataset order. A loader that does not pad
(``even_batches=False``) yields uneven, possibly empty, batches instead;
both are handled, and they combine.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
from einops import rearrange

from fnaccel._errors import CollectiveMismatchError
from fnaccel.dist import DistLike, as_dist, data_parallel_context
from fnaccel.ops._shapes import Signature, all_gather_rows, exchange_shapes
from fnaccel.ops.objects import gather_object
from fnaccel.ops.tree import is_torch_tensor, recursively_apply, tree_leaves, tree_unflatten

__all__ = ["gather_for_metrics"]

# the outputs, gathered: the same containers, each tensor holding every rank's real samples
T = TypeVar("T")


def _all_tensors(data: object) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return bool(tree_leaves(data))


def _check_input(leaves: list[torch.Tensor], num_valid: int | None) -> tuple[int, ValueError | None]:
    """This rank's number of real samples, or the problem with its input."""
    if any(t.ndim == 0 for t in leaves):
        return 0, ValueError(
            "gather_for_metrics needs per-sample outputs (dim 0 = samples), got a 0-d "
            "tensor: a value already reduced over the batch cannot be de-duplicated. "
            "Gather the per-sample values and reduce afterwards, or use fa.ops.reduce."
        )
    counts = {t.shape[0] for t in leaves}
    if len(counts) > 1:
        return 0, ValueError(
            f"gather_for_metrics: the tensors disagree on the number of samples "
            f"(dim 0 sizes {sorted(counts)}); every leaf must hold one row per sample"
        )
    count = leaves[0].shape[0]
    valid = count if num_valid is None else num_valid
    if not 0 <= valid <= count:
        return 0, ValueError(
            f"gather_for_metrics: num_valid={num_valid} but this rank's batch holds {count} samples"
        )
    return valid, None


def gather_for_metrics(
    ctx: DistLike,
    input_data: T,
    use_gather_object: bool = False,
    *,
    num_valid: int | None = None,
) -> T:
    """Gather per-sample outputs from all ranks, dropping the padding samples.

    Over the data-parallel ranks (`fnaccel.dist.data_parallel_context`): the
    ranks of one tensor- or pipeline-parallel group hold the same samples, which
    count once.

    Args:
        ctx: a `RunState` or its `DistContext`.
        input_data: a tree of tensors whose dim 0 is the sample, or a list of
            per-sample Python objects (gathered with `gather_object`). Ranks
            may hold different numbers of samples, zero included.
        use_gather_object: gather ``input_data`` as picklable objects.
        num_valid: how many leading samples of this rank's batch are real;
            the rest is padding the loader added (default: all of them).

    Returns:
        The same structure holding every real sample once, rank by rank.

    Raises:
        ValueError: a 0-d (already reduced) tensor, leaves with different
            sample counts, or ``num_valid`` out of range (on that rank; the
            other ranks raise `CollectiveMismatchError` naming it, rather
            than wait).
        CollectiveMismatchError: the ranks' trees differ beyond dim 0.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> fa.ops.gather_for_metrics(state, torch.tensor([4, 5, 5]), num_valid=2)
    tensor([4, 5])
    """
    ctx = data_parallel_context(as_dist(ctx))  # a tp/pp group's ranks hold the same samples
    if use_gather_object or not _all_tensors(input_data):
        if not isinstance(input_data, (list, tuple)):
            raise TypeError(
                "gather_for_metrics: non-tensor outputs must be a list with one entry "
                f"per sample, got {type(input_data).__name__}"
            )
        # one entry per sample, every rank's, as a list (a tuple given comes back a list)
        return cast(T, gather_object(ctx, list(input_data[:num_valid])))
    leaves = tree_leaves(input_data)
    valid, problem = _check_input(leaves, num_valid)
    if ctx.num_processes == 1:
        if problem is not None:
            raise problem
        if valid == leaves[0].shape[0]:
            return input_data
        trimmed: T = recursively_apply(lambda t: t[:valid], input_data)
        return trimmed

    # A rank with bad input still takes part in the exchange: every rank then raises.
    signature = Signature.of("gather_for_metrics", input_data, leaves)
    table = exchange_shapes(ctx, signature, extras=[valid], problem=problem)
    rows = [shapes[0][0] for shapes in table.shapes]
    valids = [extras[0] for extras in table.extras]
    for i in range(len(leaves)):
        trailing = {shapes[i][1:] for shapes in table.shapes}
        if len(trailing) > 1:
            per_rank = "; ".join(f"rank {r}: {shapes[i]}" for r, shapes in enumerate(table.shapes))
            raise CollectiveMismatchError(
                f"gather_for_metrics: tensor {i} differs beyond dim 0 across ranks ({per_rank}); "
                "pad it first: fa.compose(fa.pad_across_processes(dim=1), fa.gather_for_metrics())"
            )
    most = max(rows)
    out = []
    for t in leaves:
        if t.shape[0] < most:
            padded = t.new_zeros((most, *t.shape[1:]))
            padded[: t.shape[0]] = t
            t = padded
        rows_in_rank_order = all_gather_rows(ctx, t)
        if all(v == most for v in valids):
            out.append(rows_in_rank_order)
        else:
            by_rank = rearrange(rows_in_rank_order, "(rank row) ... -> rank row ...", rank=ctx.num_processes)
            out.append(torch.cat([by_rank[r, :v] for r, v in enumerate(valids)]))
    return tree_unflatten(input_data, out, test_type=is_torch_tensor)
