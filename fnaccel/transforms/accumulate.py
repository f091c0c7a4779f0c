"""Gradient accumulation: `accumulate(num_steps)`.

The optimizer steps once every ``num_steps`` batches. Loss normalisation is
explicit: each micro-batch's loss is divided by ``num_steps`` before backward,
so the accumulated gradient is the mean over the micro-batches, and
``accumulate(k)`` with batch ``b`` equals one batch of ``k * b`` (for a loss
that averages over its batch). On non-boundary micro-steps gradient
communication is off (DDP's and FSDP2's sync switches), unless
``sync_each_batch=True`` (which trades communication for memory).
"""

from __future__ import annotations

from fnaccel.transforms.base import Transform, options

__all__ = ["accumulate"]

ACCUMULATE_PHASE = 140


def accumulate(num_steps: int, sync_each_batch: bool = False) -> Transform:
    """Step the optimizer once every ``num_steps`` batches.

    >>> import fnaccel as fa
    >>> fa.accumulate(4)
    accumulate(num_steps=4)
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(
            f"accumulate: num_steps must be a positive int, got {num_steps!r}; "
            "accumulate(1) steps every batch"
        )
    opts = options(num_steps=num_steps) + (
        options(sync_each_batch=True) if sync_each_batch else ()
    )
    return Transform(
        name="accumulate",
        options=opts,
        phase=ACCUMULATE_PHASE,
        micro_steps=num_steps,
        sync_each_batch=sync_each_batch,
    )
