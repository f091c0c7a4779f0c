"""`skip_first_batches(loader, num_batches)`: a user's own `DataLoader` without its first batches.

For a map-style dataset the skipping happens on the batch sampler: the
skipped batches' indices are drawn (so a shuffled order is the same as the
original loader's) but their samples are never loaded. An iterable dataset
has no indices to skip, so its first batches are read and dropped. Either
way the result is a plain `DataLoader` with the original's settings
(workers, collate function, pinning, generator).

`fa.batches` resumes a prepared loader from the state's data position by
itself; this is for loaders fnaccel does not manage.
"""

from __future__ import annotations

import itertools
import multiprocessing.context
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Generic, TypedDict, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from fnaccel.checks import is_int

__all__ = ["skip_first_batches"]

T = TypeVar("T")


class ReaderSettings(TypedDict, total=False):
    """How a `DataLoader` reads (its workers, pinning, generator): the keyword arguments a
    loader rebuilt from a user's keeps of it."""

    num_workers: int
    pin_memory: bool
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: str | multiprocessing.context.BaseContext | None
    generator: torch.Generator | None
    persistent_workers: bool
    pin_memory_device: str
    prefetch_factor: int | None
    in_order: bool


class LoaderSettings(ReaderSettings, Generic[T], total=False):
    """A `DataLoader`'s keyword arguments but for its sampling: how it reads and collates."""

    collate_fn: Callable[[list[T]], object]


class _SkipFirst(Sampler[T]):
    """``sampler``'s items without the first ``num_skipped`` (all of them still drawn)."""

    def __init__(self, sampler: Iterable[T], num_skipped: int) -> None:
        self.sampler, self.num_skipped = sampler, num_skipped

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(iter(self.sampler), self.num_skipped, None)

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError(f"{type(self.sampler).__name__} has no len()")
        return max(len(self.sampler) - self.num_skipped, 0)


class _SkipFirstLoader(DataLoader[T]):
    """An iterable dataset's loader that reads and drops its first ``num_skipped`` batches."""

    num_skipped: int

    def __iter__(self) -> Iterator[T]:  # type: ignore[override]  # an iterator, not torch's own class
        return itertools.islice(super().__iter__(), self.num_skipped, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.num_skipped, 0)


def _settings(loader: DataLoader[T]) -> LoaderSettings[T]:
    """The constructor arguments ``loader`` was built with, but for its sampling."""
    settings: LoaderSettings[T] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


def skip_first_batches(loader: DataLoader[T], num_batches: int = 0) -> DataLoader[T]:
    """A new `DataLoader` yielding ``loader``'s batches from batch ``num_batches`` on.

    Args:
        loader: a `torch.utils.data.DataLoader` (or a subclass such as
            torchdata's `StatefulDataLoader`; the result is a plain `DataLoader`).
        num_batches: how many batches to skip; any count from 0 on (past
            the end, the result yields nothing).

    Returns:
        A `DataLoader` yielding ``list(loader)[num_batches:]`` when both start
        from the same random state. Every pass over it skips: use it for the
        resumed epoch and ``loader`` for the epochs after.

    Raises:
        TypeError: ``loader`` is not a `DataLoader`, or ``num_batches`` not an int.
        ValueError: ``num_batches`` is negative.

    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> from fnaccel.data.skip import skip_first_batches
    >>> loader = DataLoader(torch.arange(10), batch_size=3)
    >>> [b.tolist() for b in skip_first_batches(loader, 2)]
    [[6, 7, 8], [9]]
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"skip_first_batches takes a torch.utils.data.DataLoader, got {type(loader).__name__}; "
            "for any other iterable use itertools.islice(iterable, n, None)"
        )
    if not is_int(num_batches):
        raise TypeError(f"skip_first_batches: num_batches must be an int, got {type(num_batches).__name__}")
    if num_batches < 0:
        raise ValueError(f"skip_first_batches: num_batches must be >= 0, got {num_batches}")
    settings = _settings(loader)
    if isinstance(loader.dataset, IterableDataset):
        skipping = _SkipFirstLoader(
            loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **settings
        )
        skipping.num_skipped = num_batches
        return skipping
    if loader.batch_sampler is None:  # automatic batching off: each sample is a batch
        return DataLoader(
            loader.dataset, batch_size=None, sampler=_SkipFirst(loader.sampler, num_batches), **settings
        )
    return DataLoader(loader.dataset, batch_sampler=_SkipFirst(loader.batch_sampler, num_batches), **settings)
