"""`DataLoaderConfiguration`: how `fa.prepare` rebuilds and shards a data loader.

Pass it to `fa.init(kwargs_handlers=[DataLoaderConfiguration(...)])`; the state
keeps it under ``state.kwargs_handlers["DataLoaderConfiguration"]`` and
`fa.prepare` reads it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from fnaccel.checks import check_value, is_int, require
from fnaccel.kwargs.mixin import KwargsHandler

__all__ = ["DataLoaderConfiguration"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataLoaderConfiguration(KwargsHandler):
    """Accelerate's data loader settings, plus fnaccel's ``shard``.

    fnaccel always rebuilds a map-style loader around its own seedable,
    resumable `ShardedBatchSampler` on torchdata's `StatefulDataLoader` (the
    data order is a pure function of the seed and the epoch, and resuming is
    O(1)): Accelerate's ``use_seedable_sampler`` and
    ``use_stateful_dataloader`` are always on, so they are not fields here.
    Batches are never dispatched from rank 0: every rank reads its own shard,
    so ``dispatch_batches=True`` is refused.

    Args:
        split_batches: the loader's ``batch_size`` is the global batch, split
            evenly across the ranks (it must divide by the number of ranks);
            otherwise every rank reads ``batch_size`` samples per step.
        dispatch_batches: None or False; fnaccel has no dispatching loader.
        even_batches: when the last global batch is incomplete, pad it by
            wrapping around to the start of the epoch's order, so that every
            rank's chunk of it is full (``ShardedBatchSampler.num_valid``
            counts the real samples); otherwise the last batches are shorter,
            possibly empty.
        data_seed: the seed of the data order; None uses the run's seed.
        non_blocking: copy batches to the device with ``non_blocking=True``
            (overlaps the copy with compute when the loader pins memory).
        shard: None shards the loader across the ranks when the world is larger
            than one, unless it is already sharded (a `DistributedSampler`);
            False gives every rank the whole dataset (or your own sharding);
            True insists on sharding and refuses an already-sharded loader.

    >>> DataLoaderConfiguration(even_batches=False, data_seed=7).to_kwargs()
    {'even_batches': False, 'data_seed': 7}
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    data_seed: int | None = None
    non_blocking: bool = False
    shard: bool | None = None

    def _validate(self) -> None:
        require(
            self.dispatch_batches is not True,
            "dispatch_batches=True is not supported: fnaccel has no dispatching loader, every "
            "rank reads its own shard of the data. Leave dispatch_batches=None (or False).",
        )
        check_value(
            "data_seed",
            self.data_seed,
            self.data_seed is None or is_int(self.data_seed),
            "an int or None",
            "e.g. data_seed=42, or None to use the run's seed",
        )
