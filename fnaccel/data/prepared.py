"""`PreparedLoader`, the live prepared loader, and `batches` (`fa.batches`), which reads it.

A `PreparedLoader` is a live object, like the model: it holds the torchdata
`StatefulDataLoader`, the epoch and the iterator of the epoch in progress, so
that its `state_dict` is the exact mid-epoch position and a fresh loader given
it resumes there. Iterating it yields the rest of the current epoch on the
device; `batches` iterates it over epochs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from fnaccel._errors import CheckpointError
from fnaccel.data.sampler import ShardedBatchSampler
from fnaccel.ops.tree import send_to_device

__all__ = ["PreparedLoader", "batches"]


class _Collated(NamedTuple):
    """A collated step of an `IterableShard`, with its count of real samples."""

    batch: Any
    num_valid: int


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
    >>> from fnaccel.data.loader import prepare_loader
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
