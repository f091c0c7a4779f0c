"""The data path: `prepare_loader` rebuilds a loader, `batches` reads it on the device.

`prepare_loader` keeps what the user's `DataLoader` says about *reading* data
(dataset, collate_fn, workers, pinning, batch size, drop_last) and replaces
how it *orders* it: a map-style loader with a `RandomSampler` or a
`SequentialSampler` gets a `ShardedBatchSampler` (the order is a pure function
of the seed and the epoch, split across the ranks), an `IterableDataset` an
`IterableShard`, and the result is a torchdata `StatefulDataLoader`. A loader
that is already sharded (a `DistributedSampler`), or any other sampler in a
world of one, keeps its sampler.

`PreparedLoader` is a live object, like the model: it holds the loader, the
epoch and the iterator of the epoch in progress, so that its `state_dict` is
the exact mid-epoch position. Resuming a map-style loader jumps there in
O(1); an iterable one resumes through the dataset's own `state_dict`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import sampler as stateful_sampler

from fnaccel._errors import CheckpointError
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.iterable import shard_iterable
from fnaccel.data.sampler import ShardedBatchSampler
from fnaccel.dist import DistContext
from fnaccel.ops.tree import send_to_device

__all__ = ["PreparedLoader", "batches", "prepare_loader"]

_PLAIN_BATCH_SAMPLERS = (BatchSampler, stateful_sampler.BatchSampler)
_RANDOM_SAMPLERS = (RandomSampler, stateful_sampler.RandomSampler)


class _Collated(NamedTuple):
    """A collated step of an `IterableShard`, with its count of real samples."""

    batch: Any
    num_valid: int


class _Collate:
    """The user's collate_fn, applied to one rank's samples of a step (picklable for workers).

    ``unbatched``: the loader had ``batch_size=None``, so each "sample" is a whole
    item and the collate_fn (``default_convert`` by default) takes it alone.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], *, unbatched: bool) -> None:
        self.collate_fn = collate_fn
        self.unbatched = unbatched

    def __call__(self, samples: list[Any]) -> Any:
        if samples and self.unbatched:
            return self.collate_fn(samples[0])
        if samples:
            return self.collate_fn(samples)
        error = ValueError(
            "this rank's batch is empty: with even_batches=False the last step of an epoch "
            "leaves some ranks without samples, and the loader's collate_fn cannot collate an "
            "empty batch. Use DataLoaderConfiguration(even_batches=True) (the default: the batch "
            "is padded and state.loader.num_valid counts the real samples), a DataLoader with "
            "drop_last=True, or a collate_fn that accepts an empty list."
        )
        if self.unbatched:
            raise error
        try:
            return self.collate_fn(samples)
        except Exception as exc:
            raise error from exc


class _CollateSteps:
    """Collates the ``(samples, num_valid)`` steps of an `IterableShard` (picklable)."""

    def __init__(self, collate: _Collate) -> None:
        self.collate = collate

    def __call__(self, step: tuple[list[Any], int]) -> _Collated:
        samples, num_valid = step
        return _Collated(self.collate(samples), num_valid)


class _Plan(NamedTuple):
    """What orders a user's loader, and how it batches."""

    kind: str  # "random", "sequential", "distributed", "custom" or "iterable"
    sampler: Any  # the user's sampler (None for an iterable dataset)
    batch_sampler: Any  # a custom batch sampler, kept whole; None otherwise
    batch_size: int | None  # None: the loader does not batch
    drop_last: bool


def _plan(loader: DataLoader[Any]) -> _Plan:
    if isinstance(loader.dataset, IterableDataset):
        return _Plan("iterable", None, None, loader.batch_size, loader.drop_last)
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        sampler, batch_size, drop_last = loader.sampler, None, False
    elif type(batch_sampler) in _PLAIN_BATCH_SAMPLERS:
        assert isinstance(batch_sampler, BatchSampler)
        sampler, batch_size, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    else:
        return _Plan("custom", loader.sampler, batch_sampler, None, False)
    if isinstance(sampler, _RANDOM_SAMPLERS):
        # Sampling with replacement, or a number of samples other than the dataset's, is not a shuffle.
        shuffle = not sampler.replacement and sampler.num_samples == len(loader.dataset)  # type: ignore[arg-type]
        kind = "random" if shuffle else "custom"
    elif type(sampler) is SequentialSampler:
        kind = "sequential"
    elif isinstance(sampler, DistributedSampler):
        kind = "distributed"
    else:
        kind = "custom"
    return _Plan(kind, sampler, None, batch_size, drop_last)


def _resolve_shard(shard: bool | None, plan: _Plan, num_processes: int) -> bool:
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


def _reader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """How the user's loader reads data, for the rebuilt loader."""
    if not getattr(loader, "in_order", True):
        raise ValueError(
            "the DataLoader has in_order=False, which makes the batch order depend on worker "
            "timing and cannot be resumed exactly; use in_order=True (the default)"
        )
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        # Seeds the workers; PreparedLoader reseeds it every epoch (see _worker_seed).
        "generator": torch.Generator(),
        "snapshot_every_n_steps": 1,  # a snapshot at every batch: resuming replays nothing
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def prepare_loader(
    loader: DataLoader[Any], ctx: DistContext, *, seed: int, config: DataLoaderConfiguration | None = None
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
            ``split_batches`` that does not apply or divide, ``in_order=False``).

    >>> import torch, fnaccel as fa
    >>> data = torch.utils.data.DataLoader(torch.arange(6), batch_size=4)
    >>> prepared = prepare_loader(data, fa.DistContext(), seed=0)
    >>> [b.tolist() for b in prepared], prepared.epoch
    ([[0, 1, 2, 3], [4, 5]], 1)
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"prepare_loader takes a torch.utils.data.DataLoader, got {type(loader).__name__}; "
            "wrap your dataset in a DataLoader (fnaccel rebuilds it sharded and resumable)"
        )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"prepare_loader: seed must be an int, got {seed!r}")
    if config is None:
        config = DataLoaderConfiguration()
    if not isinstance(config, DataLoaderConfiguration):
        raise TypeError(f"prepare_loader: config must be a DataLoaderConfiguration, got {type(config).__name__}")
    seed = seed if config.data_seed is None else config.data_seed
    world = ctx.num_processes
    plan = _plan(loader)
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

    def live(built: StatefulDataLoader, sampler: ShardedBatchSampler | None, hooks: tuple[Any, ...]) -> PreparedLoader:
        return PreparedLoader(built, sampler=sampler, epoch_hooks=hooks, seed=seed, device=ctx.device,
                              non_blocking=config.non_blocking, num_processes=world, rank=ctx.rank,
                              unbatched=plan.batch_size is None)

    if not ours:
        if plan.batch_sampler is not None:
            built = StatefulDataLoader(loader.dataset, batch_sampler=plan.batch_sampler,
                                       collate_fn=loader.collate_fn, **reader)
        else:
            built = StatefulDataLoader(loader.dataset, batch_size=plan.batch_size, sampler=plan.sampler,
                                       drop_last=plan.drop_last, collate_fn=loader.collate_fn, **reader)
        return live(built, None, hooks)

    per_rank = plan.batch_size or 1
    if config.split_batches and num_processes > 1:
        if plan.batch_size is None or per_rank % num_processes:
            raise ValueError(
                f"split_batches=True splits each batch of {plan.batch_size} samples across "
                f"{num_processes} processes, which does not divide evenly: use a batch_size that "
                f"is a multiple of {num_processes}, or split_batches=False"
            )
        per_rank //= num_processes
    rank = ctx.rank if num_processes > 1 else 0
    collate = _Collate(loader.collate_fn, unbatched=plan.batch_size is None)
    even_batches = config.even_batches and num_processes > 1  # one process has nobody to be even with
    if plan.kind == "iterable":
        dataset = shard_iterable(loader.dataset, batch_size=per_rank, num_processes=num_processes,
                                 rank=rank, drop_last=plan.drop_last, even_batches=even_batches)
        built = StatefulDataLoader(dataset, batch_size=None, collate_fn=_CollateSteps(collate), **reader)
        return live(built, None, hooks)
    sampler = ShardedBatchSampler(
        len(loader.dataset), per_rank, num_processes=num_processes, rank=rank,  # type: ignore[arg-type]
        seed=seed, shuffle=plan.kind == "random", drop_last=plan.drop_last, even_batches=even_batches,
    )
    built = StatefulDataLoader(loader.dataset, batch_sampler=sampler, collate_fn=collate, **reader)
    hooks = (sampler, *(h for h in hooks if h is loader.dataset))
    return live(built, sampler, hooks)


class PreparedLoader:
    """A prepared data loader: a live object, like the model, that knows its position.

    Iterating it yields the rest of the current epoch, each batch on
    ``device``; when the epoch runs out, ``epoch`` advances and the next
    iteration starts the next one. `fa.batches` iterates it over epochs. Build
    one with `prepare_loader` (`fa.prepare` does).

    Attributes:
        dataloader: the torchdata `StatefulDataLoader` that reads the data.
        sampler: the `ShardedBatchSampler` ordering a map-style dataset, or None.
        epoch: the current epoch.
        device: where batches are placed.
        non_blocking: whether the copies to ``device`` are non-blocking.
        num_valid: how many leading samples of the batch yielded last are real
            (the rest is padding from ``even_batches``); pass it to
            `gather_for_metrics`. None when every sample is real as far as
            fnaccel knows (a loader it did not shard, or before the first batch).
    """

    def __init__(
        self,
        dataloader: StatefulDataLoader,
        *,
        sampler: ShardedBatchSampler | None,
        epoch_hooks: tuple[Any, ...],
        seed: int,
        device: torch.device,
        non_blocking: bool,
        num_processes: int,
        rank: int,
        unbatched: bool,
    ) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.device = device
        self.non_blocking = non_blocking
        self.epoch = 0
        self.num_valid: int | None = None
        self._epoch_hooks = epoch_hooks
        self._seed = seed
        self._num_processes = num_processes
        self._rank = rank
        self._unbatched = unbatched
        self._iterator: Iterator[Any] | None = None
        self._batches_yielded = 0
        self._resume: dict[str, Any] = {}  # a loaded mid-epoch position, until the epoch resumes

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.dataloader)

    def __repr__(self) -> str:
        return (f"PreparedLoader(epoch={self.epoch}, batches_yielded={self._batches_yielded}, "
                f"sampler={self.sampler!r}, device={self.device})")

    @property
    def batches_yielded(self) -> int:
        """Batches of the current epoch already yielded."""
        return self._batches_yielded

    def _worker_seed(self) -> int:
        # Pure in (seed, epoch, rank): resuming an epoch seeds its workers as before,
        # and ranks augment differently.
        return (self._seed + self.epoch) * self._num_processes + self._rank

    def _start_epoch(self) -> Iterator[Any]:
        for hook in self._epoch_hooks:
            hook.set_epoch(self.epoch)
        generator = self.dataloader.generator
        assert generator is not None  # prepare_loader always gives one
        generator.manual_seed(self._worker_seed())
        self._resume = {}  # the StatefulDataLoader took it in load_state_dict
        return iter(self.dataloader)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch, on ``device``; ``epoch`` advances at its end."""
        if self._iterator is None:
            self._iterator = self._start_epoch()
        while True:
            try:
                item = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self._batches_yielded = 0
                self.epoch += 1
                return
            num_valid: int | None
            if isinstance(item, _Collated):
                batch, num_valid = item
            elif self.sampler is not None:
                batch, num_valid = item, self.sampler.num_valid(self._batches_yielded)
            else:
                batch, num_valid = item, None
            if self._unbatched and num_valid is not None:
                num_valid = None if num_valid else 0  # a whole item is real or padding
            self._batches_yielded += 1
            self.num_valid = num_valid
            yield send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def state_dict(self) -> dict[str, Any]:
        """The exact position: plain ints, strings, None and dicts (no pickle).

        ``{"epoch", "batches_yielded", "num_processes", "num_workers", "dataloader"}``,
        where ``dataloader`` is the `StatefulDataLoader`'s own state mid-epoch
        (holding the sampler's or iterable dataset's state) and ``{}`` at an
        epoch's start.
        """
        if self._iterator is not None:
            position = copy.deepcopy(self.dataloader.state_dict())
        else:
            position = copy.deepcopy(self._resume)
        return {
            "epoch": self.epoch,
            "batches_yielded": self._batches_yielded,
            "num_processes": self._num_processes,
            "num_workers": self.dataloader.num_workers,
            "dataloader": position,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go to the position in ``state_dict``; the next iteration resumes there.

        Raises:
            CheckpointError: the state is malformed, or was saved with another
                number of processes or workers, or another epoch length.
        """
        expected = ("epoch", "batches_yielded", "num_processes", "num_workers", "dataloader")
        missing = [key for key in expected if key not in state_dict]
        if missing:
            raise CheckpointError(f"the loader state lacks {missing}: it is not a PreparedLoader.state_dict()")
        for key in expected[:4]:
            value = state_dict[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointError(f"the loader state's {key!r} must be an int >= 0, got {value!r}")
        for key, here in (("num_processes", self._num_processes), ("num_workers", self.dataloader.num_workers)):
            if state_dict[key] != here:
                raise CheckpointError(
                    f"the loader state was saved with {key}={state_dict[key]} but this loader has "
                    f"{key}={here}: resume with the same {key}"
                )
        if self.sampler is not None and state_dict["batches_yielded"] > len(self.sampler):
            raise CheckpointError(
                f"the loader state is {state_dict['batches_yielded']} batches into an epoch of "
                f"{len(self.sampler)}: it was saved with another dataset size or batch size"
            )
        if not isinstance(state_dict["dataloader"], dict):
            raise CheckpointError("the loader state's 'dataloader' must be a dict")
        self._iterator = None
        self.epoch = state_dict["epoch"]
        self._batches_yielded = state_dict["batches_yielded"]
        self.num_valid = None
        self._resume = copy.deepcopy(state_dict["dataloader"])
        self.dataloader.load_state_dict(copy.deepcopy(self._resume))


def batches(state: Any, *, epochs: int | None = None) -> Iterator[Any]:
    """Reads the state's prepared loader: its batches, on the device, from its position.

    Args:
        state: a `RunState` whose ``loader`` was prepared (`fa.prepare`).
        epochs: run through the end of epoch ``epochs - 1``, starting each new
            epoch (which reshuffles); None yields the rest of the current epoch.

    Returns:
        A generator of batches placed on ``state.dist.device``. The loader is a
        live object: after an epoch ends, ``state.loader.epoch`` has advanced.

    Raises:
        ValueError: the state has no prepared loader, or ``epochs`` is negative.

    >>> import torch, fnaccel as fa
    >>> state = fa.init(seed=0, cpu=True)
    >>> data = torch.utils.data.DataLoader(torch.arange(4), batch_size=2, shuffle=True)
    >>> state = state.replace(loader=prepare_loader(data, state.dist, seed=0))
    >>> [b.tolist() for b in batches(state, epochs=2)]
    [[0, 1], [3, 2], [1, 3], [2, 0]]
    >>> state.loader.epoch
    2
    """
    loader = getattr(state, "loader", None)
    if loader is None:
        raise ValueError(
            "fa.batches: the state has no prepared loader; prepare one first with "
            "state = fa.prepare(state, loader=your_dataloader)"
        )
    if not isinstance(loader, PreparedLoader):
        raise TypeError(
            f"fa.batches: state.loader is a {type(loader).__name__}, not a prepared loader; "
            "pass your DataLoader through fa.prepare(state, loader=...)"
        )
    if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0):
        raise ValueError(f"fa.batches: epochs must be an int >= 0 or None, got {epochs!r}")
    return _epochs(loader, loader.epoch + 1 if epochs is None else epochs)


def _epochs(loader: PreparedLoader, end: int) -> Iterator[Any]:
    while loader.epoch < end:
        yield from loader
