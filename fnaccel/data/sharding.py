"""How a dataset's samples are split across ranks, as pure functions of the sizes.

Evaluation split: step ``s`` covers the global batch of samples
``[s*B*W, (s+1)*B*W)``; rank ``r`` takes the slice ``[s*B*W + r*B, s*B*W +
(r+1)*B)``. Concatenating the ranks' slices in rank order therefore gives the
dataset order, which is what `gather_for_metrics` relies on. Every rank runs
the same number of steps, so no rank waits in a collective for a batch that
never comes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EvalShard", "eval_shards"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalShard:
    """One step's batch on one rank: its sample indices and how many are real."""

    indices: tuple[int, ...]
    num_valid: int


def eval_shards(
    num_samples: int, batch_size: int, num_processes: int, rank: int, even_batches: bool = True
) -> list[EvalShard]:
    """The batches rank ``rank`` evaluates, in order.

    Args:
        num_samples: the dataset's length.
        batch_size: samples per rank per step.
        num_processes: ranks in the run.
        rank: this rank.
        even_batches: pad every batch to ``batch_size`` by wrapping around to
            the dataset's start (``num_valid`` says how many are real); without
            it, the last batches are shorter, possibly empty.

    >>> [s.indices for s in eval_shards(5, 2, 2, 1)]
    [(2, 3), (0, 1)]
    >>> [s.num_valid for s in eval_shards(5, 2, 2, 1)]
    [2, 0]
    """
    if num_samples < 1 or batch_size < 1 or num_processes < 1:
        raise ValueError(
            f"eval_shards: num_samples={num_samples}, batch_size={batch_size} and "
            f"num_processes={num_processes} must all be at least 1"
        )
    if not 0 <= rank < num_processes:
        raise ValueError(f"eval_shards: rank={rank} is not a rank of {num_processes} processes")
    per_step = batch_size * num_processes
    shards = []
    for step in range(math.ceil(num_samples / per_step)):
        start = step * per_step + rank * batch_size
        real = tuple(range(start, min(start + batch_size, num_samples)))
        if even_batches:
            pad = tuple(i % num_samples for i in range(batch_size - len(real)))
            shards.append(EvalShard(indices=real + pad, num_valid=len(real)))
        else:
            shards.append(EvalShard(indices=real, num_valid=len(real)))
    return shards
