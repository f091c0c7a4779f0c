"""`ShardedBatchSampler`: a pure, resumable batch sampler for map-style datasets.

The order of epoch ``e`` is a pure function of the seed and the epoch (not of
the number of processes):
``torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + e))``
when shuffling (the mix torch's `DistributedSampler` and Accelerate's
`SeedableRandomSampler` use), ``arange(num_samples)`` otherwise. Each step
takes the next global batch of that order and rank ``r`` takes its ``r``-th
contiguous chunk, by `fnaccel.data.sharding.shard_batch`, the same rule the
evaluation split uses. So nothing about the order depends on a generator's
hidden state, on how many epochs ran before, or on which process asks, and
the global batches (padding included) depend on the global batch size only:
2 ranks of 4 and 4 ranks of 2 read the same samples, step by step.

The sampler's position is two integers, the epoch and the batches already
handed out in it, so resuming jumps there in O(1): no earlier batch is
recomputed, let alone loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Literal, cast, overload

import torch
from torch.utils.data import Sampler

from fnaccel.checks import check_value, is_int
from fnaccel.data.sharding import num_steps, per_rank_batch_size, shard_batch

__all__ = ["ShardedBatchSampler", "epoch_order"]


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The sample indices of epoch ``epoch``, in order (an int64 tensor).

    >>> epoch_order(4, seed=0, epoch=0, shuffle=False).tolist()
    [0, 1, 2, 3]
    >>> torch.equal(epoch_order(4, seed=1, epoch=2, shuffle=True),
    ...             torch.randperm(4, generator=torch.Generator().manual_seed(3)))
    True
    """
    if not shuffle:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    ok = is_int(value) and (minimum is None or value >= minimum)
    check_value(
        f"ShardedBatchSampler: {name}", value, ok, "an int" + ("" if minimum is None else f" >= {minimum}")
    )
    return cast(int, value)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of sample indices, resumably.

    Args:
        num_samples: the dataset's length.
        batch_size: samples per rank per step; with ``split_batches``, the
            global batch, which must divide by ``num_processes``.
        num_processes: ranks sharing the dataset.
        rank: this rank.
        seed: seeds the shuffled order (with the epoch, see the module docstring).
        shuffle: shuffle every epoch; otherwise the dataset order.
        drop_last: drop the incomplete last global batch.
        even_batches: pad the incomplete last global batch to
            ``batch_size * num_processes`` samples by wrapping around to the
            start of the epoch's order (so every rank's batch keeps
            ``batch_size`` samples); otherwise its batches are shorter,
            possibly empty.
            Every rank yields the same number of batches either way.
        split_batches: ``batch_size`` is the global batch.

    Padding: `num_valid` gives, for each batch of an epoch, how many of its
    leading indices are real; the rest repeat samples from the epoch's start
    and should not be counted (pass it to `gather_for_metrics`).

    Position: `state_dict` holds the epoch and the batches already handed out
    in it; iterating continues from there, and running to the end of the
    epoch resets the position to its start (iterating again repeats the
    epoch; call `set_epoch` to move on, as with `DistributedSampler`).

    >>> s = ShardedBatchSampler(5, 2, num_processes=2, rank=1)
    >>> list(s), [s.num_valid(i) for i in range(len(s))]
    ([[2, 3], [1, 2]], [2, 0])
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        num_processes: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = False,
        drop_last: bool = False,
        even_batches: bool = True,
        split_batches: bool = False,
    ) -> None:
        super().__init__()
        _check_int("num_samples", num_samples, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("num_processes", num_processes, 1)
        _check_int("seed", seed)
        if not is_int(rank) or not 0 <= rank < num_processes:
            raise ValueError(f"ShardedBatchSampler: rank={rank!r} is not a rank of {num_processes} processes")
        for name, flag in (
            ("shuffle", shuffle),
            ("drop_last", drop_last),
            ("even_batches", even_batches),
            ("split_batches", split_batches),
        ):
            check_value(f"ShardedBatchSampler: {name}", flag, isinstance(flag, bool), "True or False")
        self.num_samples = num_samples
        self.batch_size = per_rank_batch_size(batch_size, num_processes, split_batches)
        self.num_processes = num_processes
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.even_batches = even_batches
        self._num_batches = num_steps(num_samples, self.batch_size, num_processes, drop_last)
        self.epoch = 0
        self._position = 0

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of epoch ``epoch``."""
        _check_int("epoch", epoch, 0)
        self.epoch = epoch
        self._position = 0

    def order(self) -> torch.Tensor:
        """The current epoch's sample order, before it is split across the ranks."""
        return epoch_order(self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)

    def num_valid(self, batch_index: int) -> int:
        """How many leading indices of batch ``batch_index`` (of any epoch) are real samples."""
        if not 0 <= batch_index < self._num_batches:
            raise IndexError(f"batch_index={batch_index} is outside the epoch's {self._num_batches} batches")
        start = batch_index * self.batch_size * self.num_processes + self.rank * self.batch_size
        return max(0, min(self.batch_size, self.num_samples - start))

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches(tensors=False)

    def index_batches(self) -> Iterator[torch.Tensor]:
        """The batches `__iter__` yields, from the same position, as int64 tensors
        (views of the epoch's order where no padding is needed): what a loader
        that indexes its tensors in one operation reads.

        >>> s = ShardedBatchSampler(5, 2, num_processes=2, rank=1)
        >>> [b.tolist() for b in s.index_batches()]
        [[2, 3], [1, 2]]
        """
        return self._batches(tensors=True)

    @overload
    def _batches(self, *, tensors: Literal[True]) -> Iterator[torch.Tensor]: ...

    @overload
    def _batches(self, *, tensors: Literal[False]) -> Iterator[list[int]]: ...

    def _batches(self, *, tensors: bool) -> Iterator[torch.Tensor | list[int]]:
        order = self.order()
        while self._position < self._num_batches:
            step = self._position
            # Count the batch as handed out before the consumer sees it, so that a
            # state_dict taken while it holds the batch resumes after it.
            self._position += 1
            if tensors:
                yield self._index_tensor(order, step)
            else:
                shard = shard_batch(
                    order, step, self.batch_size, self.num_processes, self.rank, self.even_batches
                )
                yield list(shard.indices)
        self._position = 0

    def _index_tensor(self, order: torch.Tensor, step: int) -> torch.Tensor:
        """`shard_batch`'s indices as a tensor (the same wrap-around padding)."""
        size, total = self.batch_size, self.num_samples
        start = step * size * self.num_processes + self.rank * size
        if start + size <= total:
            return order[start : start + size]
        if not self.even_batches:
            return order[min(start, total) : total]
        return order[torch.arange(start, start + size) % total]

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch": ..., "batches_yielded": ...}`` (plain ints)."""
        return {"epoch": self.epoch, "batches_yielded": self._position}

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Jump to a position from `state_dict`, in O(1)."""
        epoch = _check_int("state_dict['epoch']", state_dict.get("epoch"), 0)
        position = _check_int("state_dict['batches_yielded']", state_dict.get("batches_yielded"), 0)
        if position > self._num_batches:
            raise ValueError(
                f"state_dict['batches_yielded']={position} but an epoch has {self._num_batches} "
                "batches here: the checkpoint was saved with another dataset size, batch size or "
                "number of processes"
            )
        self.epoch, self._position = epoch, position

    def __repr__(self) -> str:
        return (
            f"ShardedBatchSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"num_processes={self.num_processes}, rank={self.rank}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, even_batches={self.even_batches}, epoch={self.epoch}, "
            f"batches_yielded={self._position})"
        )
