"""`prepare_loader`: a user's `DataLoader`, rebuilt sharded, seeded and resumable.

`prepare_loader` keeps what the user's `DataLoader` says about *reading* data
(dataset, collate_fn, workers, pinning, batch size, drop_last) and replaces
how it *orders* it: a map-style loader with a `RandomSampler` or a
`SequentialSampler` gets a `ShardedBatchSampler` (the order is a pure function
of the seed and the epoch, split across the ranks), an `IterableDataset` an
`IterableShard`, and the result is a torchdata `StatefulDataLoader`. A loader
that is already sharded (a `DistributedSampler`), or any other sampler in a
world of one, keeps its sampler.

The result is a `PreparedLoader` (`fnaccel.data.prepared`). Resuming a
map-style loader jumps to its position in O(1); an iterable one resumes
through the dataset's own `state_dict`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any, NamedTuple

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import sampler as stateful_sampler

from fnaccel.checks import is_int
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.fetch import BatchFetch, batch_fetch
from fnaccel.data.iterable import Step, shard_iterable
from fnaccel.data.prepared import Collated, LoaderLayout, PreparedLoader
from fnaccel.data.sampler import ShardedBatchSampler
from fnaccel.data.sharding import per_rank_batch_size
from fnaccel.data.skip import ReaderSettings
from fnaccel.dist import DistContext, data_parallel


def _stateful_loader(dataset: Dataset[object], /, **kwargs: object) -> StatefulDataLoader:
    """`StatefulDataLoader(...)`, without the warning torchdata 0.11 emits on every
    construction under torch 2.13 ("'set_vital' is deprecated": torchdata calls a
    deprecated torch function; nothing the user can act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(dataset, **kwargs)


__all__ = ["prepare_loader"]

_PLAIN_BATCH_SAMPLERS = (BatchSampler, stateful_sampler.BatchSampler)
_RANDOM_SAMPLERS = (RandomSampler, stateful_sampler.RandomSampler)


class Collate:
    """The user's collate_fn, applied to one rank's samples of a step (picklable for workers).

    ``unbatched``: the loader had ``batch_size=None``, so each "sample" is a whole
    item and the collate_fn (``default_convert`` by default) takes it alone.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], *, unbatched: bool) -> None:
        self.collate_fn = collate_fn
        self.unbatched = unbatched

    def __call__(self, samples: Any) -> Any:
        # ``samples`` is what the dataset's ``__getitems__`` returned: a list of samples, or
        # anything else its collate_fn takes (a batch already made), never tested for truth.
        empty = type(samples) is list and not samples
        if self.unbatched:
            if empty:  # there is no item to give the collate_fn
                raise _empty_batch_error()
            return self.collate_fn(samples[0])
        try:
            return self.collate_fn(samples)
        except Exception as exc:
            if empty:
                raise _empty_batch_error() from exc
            raise


def _empty_batch_error() -> ValueError:
    return ValueError(
        "this rank's batch is empty: with even_batches=False the last step of an epoch "
        "leaves some ranks without samples, and the loader's collate_fn cannot collate an "
        "empty batch. Use DataLoaderConfiguration(even_batches=True) (the default: the batch "
        "is padded), a DataLoader with "
        "drop_last=True, or a collate_fn that accepts an empty list."
    )


class EachItem(Sampler[int]):
    """The one index of each of a `ShardedBatchSampler`'s batches, for a loader without
    batching: torch's fetcher then reads ``dataset[i]`` (under a batch sampler it would
    call ``__getitems__([i])``)."""

    def __init__(self, sampler: ShardedBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        for batch in self.sampler:
            if not batch:
                raise _empty_batch_error()
            yield batch[0]


class CollateSteps:
    """Collates the ``(samples, num_valid)`` steps of an `IterableShard` (picklable)."""

    def __init__(self, collate: Collate) -> None:
        self.collate = collate

    def __call__(self, step: Step) -> Collated:
        samples, num_valid = step
        return Collated(self.collate(samples), num_valid)


class LoaderPlan(NamedTuple):
    """What orders a user's loader, and how it batches."""

    kind: str  # "random", "sequential", "distributed", "custom" or "iterable"
    sampler: object  # the user's sampler (None for an iterable dataset)
    batch_sampler: object  # a custom batch sampler, kept whole; None otherwise
    batch_size: int | None  # None: the loader does not batch
    drop_last: bool


def loader_plan(loader: DataLoader[object]) -> LoaderPlan:
    if isinstance(loader.dataset, IterableDataset):
        return LoaderPlan("iterable", None, None, loader.batch_size, loader.drop_last)
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        sampler, batch_size, drop_last = loader.sampler, None, False
    elif type(batch_sampler) in _PLAIN_BATCH_SAMPLERS:
        assert isinstance(batch_sampler, BatchSampler)
        sampler, batch_size, drop_last = (
            batch_sampler.sampler,
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
    else:
        return LoaderPlan("custom", None, batch_sampler, None, False)
    # torch's or torchdata's own RandomSampler; a subclass may order otherwise (its own __iter__): custom
    if isinstance(sampler, _RANDOM_SAMPLERS) and type(sampler) in _RANDOM_SAMPLERS:
        # Sampling with replacement, or a number of samples other than the dataset's, is not a shuffle.
        shuffle = not sampler.replacement and sampler.num_samples == dataset_length(loader.dataset)
        kind = "random" if shuffle else "custom"
    elif type(sampler) is SequentialSampler and len(sampler) == dataset_length(loader.dataset):
        kind = "sequential"  # (over another data source it reads another set of indices: custom)
    elif isinstance(sampler, DistributedSampler):
        kind = "distributed"
    else:
        kind = "custom"
    return LoaderPlan(kind, sampler, None, batch_size, drop_last)


def dataset_length(dataset: object) -> int | None:
    """A map-style dataset's length; None when it has none (torch needs one only for its
    own samplers: a custom sampler may index a dataset without ``__len__``)."""
    return len(dataset) if isinstance(dataset, Sized) else None


def _rewinds(sampler: object) -> bool:
    """Whether a sampler fnaccel keeps gives the same batches when a position is read again
    in the same process: one that says where it stands (``load_state_dict``), or one known
    to be deterministic (a `SequentialSampler`, a `DistributedSampler` at its epoch, a
    list of indices or batches). Any other may draw from a generator it advances (its own,
    or the process's: `RandomSampler(replacement=True)`, `WeightedRandomSampler`, a
    bucketing batch sampler shuffling inside), and re-reading would give other batches."""
    if sampler is None or callable(getattr(sampler, "load_state_dict", None)):
        return True
    return isinstance(sampler, (SequentialSampler, DistributedSampler, list, tuple, range))


def _resolve_shard(shard: bool | None, plan: LoaderPlan, num_processes: int) -> bool:
    """Whether fnaccel shards the loader, or why it cannot."""
    if plan.kind == "distributed":
        if shard:
            raise ValueError(
                "shard=True but the DataLoader already shards its data with a DistributedSampler: "
                "fnaccel would shard it twice. Pass a plain DataLoader (shuffle=True or False) and "
                "let fnaccel shard it, or leave shard=None to keep your DistributedSampler."
            )
        return False
    if shard is None:
        shard = num_processes > 1
    if plan.kind == "custom" and shard and num_processes > 1:
        name = type(plan.batch_sampler if plan.batch_sampler is not None else plan.sampler).__name__
        raise ValueError(
            f"cannot shard a DataLoader with the custom {name} across {num_processes} processes: "
            "fnaccel shards loaders with a RandomSampler (shuffle=True) or a SequentialSampler "
            "(shuffle=False). Pass a plain DataLoader, or shard the data yourself and prepare it "
            "with DataLoaderConfiguration(shard=False)."
        )
    return shard


def _reader_kwargs(loader: DataLoader[object]) -> ReaderSettings:
    """How the user's loader reads data, for the rebuilt loader."""
    if not getattr(loader, "in_order", True):
        raise ValueError(
            "the DataLoader has in_order=False, which makes the batch order depend on worker "
            "timing and cannot be resumed exactly; use in_order=True (the default)"
        )
    kwargs: ReaderSettings = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        # Seeds the workers; PreparedLoader reseeds it every epoch (see _worker_seed).
        "generator": torch.Generator(),
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def prepare_loader(
    loader: DataLoader[object], ctx: DistContext, *, seed: int, config: DataLoaderConfiguration | None = None
) -> PreparedLoader:
    """Rebuild ``loader`` as a sharded, seeded, resumable `PreparedLoader`.

    Sharding (``config.shard``; None shards when the world is larger than one):

    - a `RandomSampler` or `SequentialSampler` (``shuffle=True``/``False``) is
      replaced by a `ShardedBatchSampler`: the order of epoch ``e`` is
      ``randperm(len(dataset), Generator().manual_seed(seed + e))`` (or the
      dataset order) whatever generator the user gave, split by global batch;
    - an `IterableDataset` is read in global batches, each rank keeping its
      chunk (`fnaccel.data.iterable`);
    - a `DistributedSampler` is already sharded and kept (its ``set_epoch`` is
      called every epoch); ``shard=True`` with it is an error;
    - any other sampler or batch sampler is kept in a world of one, or with
      ``shard=False``; on more ranks it is an error.

    Args:
        loader: a `torch.utils.data.DataLoader` or torchdata `StatefulDataLoader`.
        ctx: where this process stands (``state.dist``).
        seed: the seed of the data order (``config.data_seed`` overrides it).
        config: the data loader configuration; None uses the defaults.

    Returns:
        A `PreparedLoader` at the start of epoch 0.

    Raises:
        TypeError: ``loader`` is not a `DataLoader`, ``seed`` not an int, or
            ``config`` not a `DataLoaderConfiguration`.
        ValueError: the loader cannot be prepared as configured (a custom
            sampler on several ranks, ``shard=True`` with a `DistributedSampler`,
            ``split_batches`` that does not apply or divide, ``in_order=False``,
            an empty map-style dataset).

    >>> import torch, fnaccel as fa
    >>> data = torch.utils.data.DataLoader(torch.arange(6), batch_size=4)
    >>> prepared = prepare_loader(data, fa.DistContext(), seed=0)
    >>> [b.tolist() for b in prepared.read(1)], len(prepared)
    ([[0, 1, 2, 3], [4, 5]], 2)
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"prepare_loader takes a torch.utils.data.DataLoader, got {type(loader).__name__}; "
            "wrap your dataset in a DataLoader (fnaccel rebuilds it sharded and resumable)"
        )
    if not is_int(seed):
        raise TypeError(f"prepare_loader: seed must be an int, got {seed!r}")
    if config is None:
        config = DataLoaderConfiguration()
    if not isinstance(config, DataLoaderConfiguration):
        raise TypeError(
            f"prepare_loader: config must be a DataLoaderConfiguration, got {type(config).__name__}"
        )
    seed = seed if config.data_seed is None else config.data_seed
    # the data-parallel ranks share the data; ranks of one tp/pp group read the same batches
    dp_rank, world = data_parallel(ctx)
    plan = loader_plan(loader)
    num_samples = None if plan.kind == "iterable" else dataset_length(loader.dataset)
    if num_samples == 0:
        raise ValueError(
            f"prepare_loader: the DataLoader's dataset is empty ({type(loader.dataset).__name__} has "
            "len() == 0), so there is no batch to train on: check how the dataset was built or filtered"
        )
    num_processes = world if _resolve_shard(config.shard, plan, world) else 1
    ours = plan.kind in ("random", "sequential") or (plan.kind == "iterable" and num_processes > 1)
    if config.split_batches and world > 1 and not (ours and num_processes > 1):
        raise ValueError(
            "split_batches=True splits each batch across the processes, which needs fnaccel to "
            "shard the loader; with shard=False, a DistributedSampler or a custom sampler the "
            "batch_size is already per process: drop split_batches"
        )
    reader = _reader_kwargs(loader)
    user_sampler = plan.batch_sampler if plan.batch_sampler is not None else plan.sampler
    hooks = tuple(h for h in (user_sampler, loader.dataset) if hasattr(h, "set_epoch"))

    def prepared(
        built: StatefulDataLoader,
        sampler: ShardedBatchSampler | None,
        batch_size: int | None,
        even_batches: bool,
        fetch: BatchFetch | None = None,
    ) -> PreparedLoader:
        sized = plan.kind != "iterable"
        layout = LoaderLayout(
            num_samples=num_samples,
            batch_size=batch_size,
            num_processes=world,
            num_shards=num_processes,
            num_workers=loader.num_workers,
            drop_last=plan.drop_last,
            even_batches=even_batches,
            split_batches=config.split_batches,
        )
        return PreparedLoader(
            built,
            sampler=sampler,
            epoch_hooks=hooks,
            seed=seed,
            device=ctx.device,
            non_blocking=config.non_blocking,
            layout=layout,
            rank=dp_rank,
            sized=sized,
            # fnaccel owns the order of a replaced sampler and of a sharded stream
            rewindable=ours or _rewinds(user_sampler),
            fetch=fetch,
        )

    # A loader whose position fnaccel does not own is located by torchdata's snapshot
    # of the batch stepped last: one at every batch, so resuming replays nothing.
    snapshots = {"snapshot_every_n_steps": 1}
    if not ours:
        if plan.batch_sampler is not None:
            built = _stateful_loader(
                loader.dataset,
                batch_sampler=plan.batch_sampler,
                collate_fn=loader.collate_fn,
                **reader,
                **snapshots,
            )
        else:
            built = _stateful_loader(
                loader.dataset,
                batch_size=plan.batch_size,
                sampler=plan.sampler,
                drop_last=plan.drop_last,
                collate_fn=loader.collate_fn,
                **reader,
                **snapshots,
            )
        return prepared(built, None, plan.batch_size, False)

    per_rank = per_rank_batch_size(plan.batch_size, num_processes, config.split_batches)
    rank = dp_rank if num_processes > 1 else 0
    collate = Collate(loader.collate_fn, unbatched=plan.batch_size is None)
    even_batches = config.even_batches and num_processes > 1  # one process has nobody to be even with
    if plan.kind == "iterable":
        assert isinstance(loader.dataset, IterableDataset)  # what made the plan's kind
        dataset = shard_iterable(
            loader.dataset,
            batch_size=per_rank,
            num_processes=num_processes,
            rank=rank,
            drop_last=plan.drop_last,
            even_batches=even_batches,
        )
        built = _stateful_loader(
            dataset, batch_size=None, collate_fn=CollateSteps(collate), **reader, **snapshots
        )
        return prepared(built, None, per_rank, even_batches)
    sampler = ShardedBatchSampler(
        len(loader.dataset),  # type: ignore[arg-type]
        per_rank,
        num_processes=num_processes,
        rank=rank,
        seed=seed,
        shuffle=plan.kind == "random",
        drop_last=plan.drop_last,
        even_batches=even_batches,
    )
    hooks = (sampler, *(h for h in hooks if h is loader.dataset))  # the user's sampler is replaced
    # Its position is (epoch, batches stepped): no snapshots needed, none taken.
    if plan.batch_size is None:  # read dataset[i] alone, as torch does without batching
        built = _stateful_loader(
            loader.dataset,
            batch_size=None,
            sampler=EachItem(sampler),
            collate_fn=loader.collate_fn,
            **reader,
            snapshot_every_n_steps=2**31 - 1,
        )
    else:
        built = _stateful_loader(
            loader.dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            **reader,
            snapshot_every_n_steps=2**31 - 1,
        )
    fetch = batch_fetch(loader, collate, ctx.device, non_blocking=config.non_blocking)
    return prepared(built, sampler, per_rank, even_batches, fetch)
