"""Sharding an `IterableDataset` across ranks, one global batch at a time.

As in Accelerate's `IterableDatasetShard`, every rank reads the whole stream
in global batches of ``batch_size * num_processes`` samples and keeps the
``rank``-th contiguous chunk of each (`fnaccel.data.sharding.shard_batch`, the
rule map-style datasets follow), so the ranks' batches of a step, concatenated
in rank order, are the batch one process with the global batch size would
read. An incomplete last global batch is dropped (``drop_last``), padded by
cycling through its own samples (``even_batches``: a stream cannot be rewound
to its start) or split as it is, leaving short or empty chunks.

Each step yields ``(samples, num_valid)``, so the loader collates whole steps
and knows how many samples of each batch are real.

Resuming: the shard reads whole global batches between two steps, so the
dataset's own position at a step boundary is the shard's position. When the
dataset (or its iterator) has ``state_dict``/``load_state_dict``, the shard
has them too and torchdata's `StatefulDataLoader` saves and restores them in
O(1); otherwise the loader falls back to replaying the stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Protocol, cast, runtime_checkable

from torch.utils.data import IterableDataset

from fnaccel.data.sharding import num_steps, shard_batch

__all__ = ["IterableShard", "StatefulIterableShard", "shard_iterable"]

Step = tuple[list[object], int]


@runtime_checkable
class _StatefulIterator(Iterator[object], Protocol):
    """An iterator that saves and restores its position (torchdata's `Stateful`)."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...


@runtime_checkable
class _StatefulIterable(Iterable[object], Protocol):
    """A dataset that saves and restores its position (torchdata's `Stateful`)."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...


class _ShardIterator(Iterator[Step]):
    """One pass over the dataset, yielding this rank's chunk of each global batch."""

    def __init__(self, shard: IterableShard, source: Iterator[object]) -> None:
        self._shard = shard
        self._source = source
        self._done = False

    def __next__(self) -> Step:
        shard = self._shard
        per_step = shard.batch_size * shard.num_processes
        samples = [] if self._done else list(itertools.islice(self._source, per_step))
        if len(samples) < per_step:
            self._done = True
            if not samples or shard.drop_last:
                raise StopIteration
        chunk = shard_batch(
            range(len(samples)), 0, shard.batch_size, shard.num_processes, shard.rank, shard.even_batches
        )
        return [samples[i] for i in chunk.indices], chunk.num_valid


class _StatefulShardIterator(_ShardIterator):
    """A `_ShardIterator` over a stateful iterator: its state is the source's."""

    def __init__(self, shard: IterableShard, source: _StatefulIterator) -> None:
        super().__init__(shard, source)
        self._stateful = source

    def state_dict(self) -> dict[str, object]:
        return self._stateful.state_dict()

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self._stateful.load_state_dict(state_dict)


class IterableShard(IterableDataset[Step]):
    """This rank's share of an iterable dataset, one step's chunk at a time.

    Args:
        dataset: the iterable dataset; it is read whole on every rank.
        batch_size: samples per rank per step.
        num_processes: ranks sharing the stream.
        rank: this rank.
        drop_last: drop an incomplete last global batch.
        even_batches: pad an incomplete last global batch by cycling its samples.

    >>> shard = IterableShard(range(5), batch_size=2, num_processes=2, rank=1)
    >>> list(shard)
    [([2, 3], 2), ([4, 4], 0)]
    """

    def __init__(
        self,
        dataset: Iterable[object],
        *,
        batch_size: int,
        num_processes: int,
        rank: int,
        drop_last: bool = False,
        even_batches: bool = True,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.rank = rank
        self.drop_last = drop_last
        self.even_batches = even_batches

    def __len__(self) -> int:
        """Steps per pass, when the dataset has a length (one worker's view)."""
        if not isinstance(self.dataset, Sized):
            raise TypeError(f"object of type {type(self.dataset).__name__!r} has no len()")
        return num_steps(len(self.dataset), self.batch_size, self.num_processes, self.drop_last)

    def __iter__(self) -> Iterator[Step]:
        source = iter(self.dataset)
        if isinstance(source, _StatefulIterator) and source is not self.dataset:
            return _StatefulShardIterator(self, source)
        return _ShardIterator(self, source)


class StatefulIterableShard(IterableShard):
    """An `IterableShard` over a dataset with ``state_dict``: its state is the dataset's."""

    def state_dict(self) -> dict[str, object]:
        return self._stateful().state_dict()

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self._stateful().load_state_dict(state_dict)

    def _stateful(self) -> _StatefulIterable:
        # `shard_iterable` builds this class only over a dataset that has both methods
        return cast(_StatefulIterable, self.dataset)


def shard_iterable(
    dataset: Iterable[object],
    *,
    batch_size: int,
    num_processes: int,
    rank: int,
    drop_last: bool = False,
    even_batches: bool = True,
) -> IterableShard:
    """An `IterableShard` of ``dataset``, stateful exactly when the dataset is (it has
    ``state_dict`` and ``load_state_dict``, torchdata's `Stateful`)."""
    cls = StatefulIterableShard if isinstance(dataset, _StatefulIterable) else IterableShard
    return cls(
        dataset,
        batch_size=batch_size,
        num_processes=num_processes,
        rank=rank,
        drop_last=drop_last,
        even_batches=even_batches,
    )
