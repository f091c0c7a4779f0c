"""How a dataset's samples are split across ranks, as pure functions of the sizes.

One rule serves training and evaluation. Given an epoch's order of sample
indices, step ``s`` covers the global batch ``order[s*B*W : (s+1)*B*W]`` (``B``
samples per rank, ``W`` ranks) and rank ``r`` takes its ``r``-th contiguous
chunk ``order[s*B*W + r*B : s*B*W + (r+1)*B]``. Concatenating the ranks'
chunks of a step in rank order therefore gives the batch one process with the
global batch size ``B*W`` would see, which is what `gather_for_metrics`
relies on. Every rank runs the same number of steps, so no rank waits in a
collective for a batch that never comes.

When the last global batch is incomplete, ``even_batches`` pads the *global*
batch to ``B*W`` samples by wrapping around to the start of the order
(position ``p`` of the epoch reads ``order[p % len(order)]``) and rank ``r``
takes its chunk of that: `EvalShard.num_valid` says how many of its leading
samples are real. Without it the last chunks are shorter, possibly empty.

So every global batch, padding included, is a function of the order and the
global batch size ``B*W`` alone: ``W`` ranks of ``B`` samples and ``W'`` ranks
of ``B'`` samples with ``B*W == B'*W'`` read the same samples in the same
global order, step by step (what resuming on another number of processes
relies on). `fnaccel.dist.data_parallel` says which ranks share the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["EvalShard", "eval_shards", "num_steps", "per_rank_batch_size", "shard_batch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalShard:
    """One step's batch on one rank: its sample indices and how many are real."""

    indices: tuple[int, ...]
    num_valid: int


def _check_sizes(where: str, num_samples: int, batch_size: int, num_processes: int, rank: int) -> None:
    if num_samples < 1 or batch_size < 1 or num_processes < 1:
        raise ValueError(
            f"{where}: num_samples={num_samples}, batch_size={batch_size} and "
            f"num_processes={num_processes} must all be at least 1"
        )
    if not 0 <= rank < num_processes:
        raise ValueError(f"{where}: rank={rank} is not a rank of {num_processes} processes")


def num_steps(num_samples: int, batch_size: int, num_processes: int, drop_last: bool = False) -> int:
    """How many steps (batches per rank) an epoch of ``num_samples`` takes.

    Args:
        num_samples: samples in the epoch's order.
        batch_size: samples per rank per step.
        num_processes: ranks in the run.
        drop_last: drop an incomplete last global batch instead of splitting it.

    >>> num_steps(10, 2, 2), num_steps(10, 2, 2, drop_last=True)
    (3, 2)
    """
    per_step = batch_size * num_processes
    return num_samples // per_step if drop_last else math.ceil(num_samples / per_step)


def shard_batch(
    order: Sequence[int] | torch.Tensor,
    step: int,
    batch_size: int,
    num_processes: int,
    rank: int,
    even_batches: bool = True,
) -> EvalShard:
    """Rank ``rank``'s batch at step ``step`` of an epoch with the given order.

    Args:
        order: the epoch's sample indices, in order (a sequence or a 1-d tensor).
        step: the step, counted from the epoch's start.
        batch_size: samples per rank per step.
        num_processes: ranks in the run.
        rank: this rank.
        even_batches: pad the global batch by wrapping around to the order's start.

    >>> shard_batch([4, 3, 2, 1, 0], 1, 2, 2, 0), shard_batch([4, 3, 2, 1, 0], 1, 2, 2, 1)
    (EvalShard(indices=(0, 4), num_valid=1), EvalShard(indices=(3, 2), num_valid=0))
    >>> shard_batch([4, 3, 2, 1, 0], 1, 1, 4, 2)  # 4 ranks of 1: the same global batch
    EvalShard(indices=(3,), num_valid=0)
    """
    num_samples = len(order)
    _check_sizes("shard_batch", num_samples, batch_size, num_processes, rank)
    start = step * batch_size * num_processes + rank * batch_size
    num_valid = max(0, min(batch_size, num_samples - start))
    if start + batch_size <= num_samples or not even_batches:
        return EvalShard(
            indices=_as_ints(order[min(start, num_samples) : start + num_valid]), num_valid=num_valid
        )
    # The global batch wraps around to the order's start (as often as a tiny dataset needs).
    ints = _as_ints(order)
    return EvalShard(
        indices=tuple(ints[p % num_samples] for p in range(start, start + batch_size)), num_valid=num_valid
    )


def _as_ints(part: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    return tuple(part.tolist() if isinstance(part, torch.Tensor) else part)


def eval_shards(
    num_samples: int, batch_size: int, num_processes: int, rank: int, even_batches: bool = True
) -> list[EvalShard]:
    """The batches rank ``rank`` evaluates, in order: the dataset order, split by `shard_batch`.

    Args:
        num_samples: the dataset's length.
        batch_size: samples per rank per step.
        num_processes: ranks in the run.
        rank: this rank.
        even_batches: pad every batch to ``batch_size`` by wrapping around to
            the dataset's start (``num_valid`` says how many are real); without
            it, the last batches are shorter, possibly empty.

    >>> [s.indices for s in eval_shards(5, 2, 2, 1)]
    [(2, 3), (1, 2)]
    >>> [s.num_valid for s in eval_shards(5, 2, 2, 1)]
    [2, 0]
    """
    _check_sizes("eval_shards", num_samples, batch_size, num_processes, rank)
    order = range(num_samples)
    return [
        shard_batch(order, step, batch_size, num_processes, rank, even_batches)
        for step in range(num_steps(num_samples, batch_size, num_processes))
    ]


def per_rank_batch_size(batch_size: int | None, num_processes: int, split_batches: bool) -> int:
    """Samples per rank per step: ``batch_size`` split across the ranks with
    ``split_batches`` (it must divide), else ``batch_size`` itself; a loader without
    batching reads one item per rank per step.

    >>> per_rank_batch_size(8, 2, True), per_rank_batch_size(8, 2, False)
    (4, 8)
    """
    if not split_batches or num_processes == 1:
        return batch_size or 1
    if batch_size is None:
        raise ValueError(
            "split_batches=True needs a DataLoader with a batch_size to split, got batch_size=None"
        )
    if batch_size % num_processes:
        raise ValueError(
            f"split_batches=True splits each batch of {batch_size} samples across {num_processes} "
            f"processes, which does not divide evenly: use a batch_size that is a multiple of "
            f"{num_processes}, or split_batches=False"
        )
    return batch_size // num_processes
