"""`PreparedLoader`, the live prepared loader, and `batches` (`fa.batches`), which reads it.

The run's data position is a value in the state (`fnaccel.state.DataPosition`),
advanced when a step consumes a batch. The `PreparedLoader` is a cache behind
it: the torchdata `StatefulDataLoader`, its workers and the iterator of the
epoch in progress. `batches` positions the cache from the state (for free
when it already stands there); every batch it yields carries, on the side,
the position right after it, which `fa.step` takes into the new state. So a
batch fetched and never stepped is fetched again after `fa.load`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import torch
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader

from fnaccel._errors import CheckpointError
from fnaccel.checks import is_int
from fnaccel.data.fetch import BatchFetch
from fnaccel.data.sampler import ShardedBatchSampler
from fnaccel.data.sharding import num_steps
from fnaccel.data.snapshot import loader_snapshot, new_cache
from fnaccel.ops.tree import send_to_device
from fnaccel.state import DataPosition, RunState

__all__ = ["Batches", "LoaderLayout", "PreparedLoader", "batches", "end_epoch"]


class SetsEpoch(Protocol):
    """A sampler or dataset told each epoch before it is read (``DistributedSampler``'s rule)."""

    def set_epoch(self, epoch: int) -> None: ...


class Collated(NamedTuple):
    """A collated step of an `IterableShard`, with its count of real samples."""

    batch: object
    num_valid: int


class Batches(Iterator[Any]):
    """What `fa.batches` and `fa.eval_batches` return: an iterator with a ``len()``
    where the count is known, as Accelerate's prepared loader has, so that a ported
    loop's ``if step == len(loader) - 1`` means this rank's last batch.

    ``len()`` is fixed when the iterator is made; where the count is unknown (a
    stream without a length) it raises `TypeError`, naming why.
    """

    __slots__ = ("_items", "_length", "_unknown")

    def __init__(self, items: Iterator[Any], length: int | None, unknown: str = "") -> None:
        self._items = items
        self._length = length
        self._unknown = unknown

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._items)

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(self._unknown)
        return self._length


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderLayout:
    """What a data position means: a position resumes exactly only under a layout
    that reads the same global batches.

    Attributes:
        num_samples: the dataset's length (None for a stream without one).
        batch_size: samples per rank per step (None: the loader does not batch).
        num_processes: the data-parallel ranks reading the data.
        num_shards: the ranks fnaccel splits each global batch over
            (``num_processes`` when it shards the loader; 1 when every rank
            reads the whole order or the loader shards itself).
        num_workers: loader worker processes (their snapshots differ in shape).
        drop_last, even_batches, split_batches: how the epoch is cut.
    """

    num_samples: int | None
    batch_size: int | None
    num_processes: int
    num_shards: int
    num_workers: int
    drop_last: bool
    even_batches: bool
    split_batches: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all the ranks splitting the data."""
        return (self.batch_size or 1) * self.num_shards

    def check_resume(
        self, saved: object, where: str, *, allow_global_batch_change: bool = False
    ) -> LoaderLayout:
        """``saved`` (a `to_dict`, from a checkpoint) as a layout, checked against this one.

        On the same number of processes every field must be equal. On another
        one the dataset length, workers and ``drop_last`` must be, and so must
        the global batch size (``batch_size * num_shards``) unless
        ``allow_global_batch_change``; ``even_batches`` only where both sides
        split the data over several processes (one never pads).

        Raises:
            CheckpointError: ``saved`` is malformed, or reads other batches.
        """
        layout = _parse_layout(saved, where)
        if layout.num_processes == self.num_processes:
            fixed: tuple[str, ...] = tuple(self.to_dict())
        else:
            fixed = ("num_samples", "num_workers", "drop_last")
            if min(layout.num_shards, self.num_shards) > 1:
                fixed += ("even_batches",)
        if allow_global_batch_change:
            fixed = tuple(key for key in fixed if key not in ("batch_size", "num_shards", "split_batches"))
        else:
            self._check_global_batch(layout, where)
        for key in fixed:
            was, here = getattr(layout, key), getattr(self, key)
            if was != here:
                raise CheckpointError(
                    f"{where}: the checkpoint's data position was saved with {key}={was!r} but "
                    f"this run's loader has {key}={here!r}; the same position would start at another "
                    f"sample. Resume with {key}={was!r} (or start a new run from the weights)"
                )
        return layout

    def _check_global_batch(self, saved: LoaderLayout, where: str) -> None:
        was, here = saved.global_batch_size, self.global_batch_size
        if was == here:
            return
        split = f" (or split_batches=True with batch_size={was})" if self.num_shards > 1 else ""
        per_rank = (
            f"a per-process batch_size of {was // self.num_shards}{split}"
            if was % self.num_shards == 0
            else f"{saved.num_shards} process(es) (a global batch of {was} does not split over "
            f"{self.num_shards})"
        )
        raise CheckpointError(
            f"{where}: the checkpoint's data position was saved with a global batch of {was} samples per step "
            f"({saved.batch_size} per process x {saved.num_shards} process(es)) but this run reads {here} "
            f"({self.batch_size} x {self.num_shards}); the data continues exactly only with the same "
            f"global batch. Resume with {per_rank}, or pass fa.load(..., allow_global_batch_change=True) "
            "to continue from the samples consumed so far (the rest of the epoch is then cut into other "
            "batches)"
        )


_LAYOUT_TYPES = MappingProxyType(
    {
        "num_samples": (int, None),
        "batch_size": (int, None),
        "num_processes": (int,),
        "num_shards": (int,),
        "num_workers": (int,),
        "drop_last": (bool,),
        "even_batches": (bool,),
        "split_batches": (bool,),
    }
)


def _parse_layout(saved: object, where: str) -> LoaderLayout:
    """A saved layout, each field checked for its kind and range (the file may be hostile)."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: the data layout must be a mapping, got {saved!r}"[:300])
    values: dict[str, Any] = {}  # each checked below, then the record's fields
    for key, kinds in _LAYOUT_TYPES.items():
        if key not in saved:
            raise CheckpointError(f"{where}: the data layout lacks {key!r}")
        value = saved[key]
        if value is None and None in kinds:
            values[key] = value
            continue
        wanted, minimum = kinds[0], 0 if key == "num_workers" else 1
        if type(value) is not wanted or (wanted is int and value < minimum):
            raise CheckpointError(
                f"{where}: the data layout's {key} must be "
                f"{'True or False' if wanted is bool else f'an integer >= {minimum}'}"
                f"{' or null' if None in kinds else ''}, got {value!r}"[:300]
            )
        values[key] = value
    unknown = sorted(str(k) for k in saved if k not in _LAYOUT_TYPES)
    if unknown:
        raise CheckpointError(f"{where}: the data layout has unknown key {unknown[0]!r}")
    return LoaderLayout(**values)


class PreparedLoader:
    """A prepared data loader: a live cache behind the state's `DataPosition`.

    Build one with `prepare_loader` (`fa.prepare` does); read it with
    `fa.batches`. It holds no position of its own that could disagree with
    the state's: only where its live iterator stands, and the position right
    after the batch it fetched last, for `consumed`.

    Attributes:
        dataloader: the torchdata `StatefulDataLoader` that reads the data; a
            loader with a sampler and no workers is read by a `BatchFetch` from
            the sampler's indices instead (the same batches, without the
            iterator's cost per batch).
        sampler: the `ShardedBatchSampler` ordering a map-style dataset, or None
            (then the loader's own snapshots locate a position).
        layout: what a position of this loader means (`LoaderLayout`).
        device: where batches are placed.
        non_blocking: whether the copies to ``device`` are non-blocking.
        fetch: the `BatchFetch` reading batches from the sampler's indices, or
            None (the DataLoader's iterator reads them).
    """

    def __init__(
        self,
        dataloader: StatefulDataLoader,
        *,
        sampler: ShardedBatchSampler | None,
        epoch_hooks: tuple[SetsEpoch, ...],
        seed: int,
        device: torch.device,
        non_blocking: bool,
        layout: LoaderLayout,
        rank: int,
        sized: bool,
        rewindable: bool = True,
        fetch: BatchFetch | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.layout = layout
        self.device = device
        self.non_blocking = non_blocking
        self._epoch_hooks = epoch_hooks
        self._seed = seed
        self._rank = rank
        self._num_batches = len(dataloader) if sized else None
        self._rewindable = rewindable
        # With a sampler, batches may be read without the DataLoader's iterator.
        self.fetch = fetch if sampler is not None else None
        self._placed = self.fetch is not None and self.fetch.placed
        self._read = False  # whether a batch was fetched since the loader was built
        self._iterator: Iterator[object] | None = None
        dataset = dataloader.dataset
        # A dataset with a position of its own (a stream's reader) as a fresh process
        # builds it, for `start_epoch` (a sampler's order is pure in seed and epoch).
        self._fresh_dataset_state = (
            copy.deepcopy(dataset.state_dict()) if sampler is None and isinstance(dataset, Stateful) else None
        )
        self._snapshots = new_cache()  # what `loader_snapshot` found in the live iterator
        self._iter_epoch = 0
        self._at = DataPosition()  # where the live iterator continues
        self._start: DataPosition | None = None  # where the current reading began
        self._last: tuple[DataPosition, DataPosition] | None = None  # (before, after) the last fetch

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.dataloader)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the epoch where the live iterator stands (for inspection and tests;
        training reads through `fa.batches`, which positions it from the state first)."""
        return self.read(self._at.epoch + 1)

    def __repr__(self) -> str:
        return f"PreparedLoader(at={self._at.key}, sampler={self.sampler!r}, device={self.device})"

    def seek(self, position: DataPosition) -> None:
        """Make the next fetch the batch right after ``position`` (free when the live
        iterator already stands there; otherwise the next fetch starts a new one)."""
        if self._iterator is None or position.key != self._at.key:
            if self._read and not self._rewindable and position.key != self._at.key:
                raise ValueError(
                    f"fa.batches: the state is at batch {position.num_batches} of epoch {position.epoch} but "
                    f"this loader already read up to {self._at.key}, and its sampler cannot be rewound: it "
                    "may draw from a generator (its own, or the process's) and has no state_dict/"
                    "load_state_dict to say where it stands, so re-reading could give other batches. Use "
                    "shuffle=True (fnaccel then owns the order), a sampler with state_dict/load_state_dict, "
                    "or fa.load the run into freshly prepared objects"
                )
            self._iterator = None
            self._at = position
        self._start, self._last = position, None

    def start_epoch(self, epoch: int) -> None:
        """Stand at the start of ``epoch``, dropping the live iterator without reading the
        rest of its epoch: its worker processes end with it (persistent workers are
        reset by the next epoch's iterator instead). Jumping forward to an epoch's start
        re-reads nothing, so it is allowed where `seek` refuses a rewind. A dataset with a
        position of its own (a stateful stream read in this process) is put back where a
        fresh process starts it, so the next pass is the next epoch whole, as after
        resuming a checkpoint saved now."""
        self._iterator = None
        if self._fresh_dataset_state is not None:
            self.dataloader.dataset.load_state_dict(copy.deepcopy(self._fresh_dataset_state))
        if not self.dataloader.persistent_workers:
            # torchdata holds the epoch's iterator (and its workers) until the next epoch
            # begins; an empty state drops it now, as an epoch's natural end stops them.
            self.dataloader.load_state_dict({})
        self._at = DataPosition(epoch=epoch)
        self._start, self._last = None, None

    def forget(self) -> None:
        """Drop what ties the live iterator to a state (`fa.load` replaced the position)."""
        self._start, self._last = None, None

    def consumed(self, position: DataPosition) -> DataPosition:
        """The position after consuming the batch fetched last, when it follows
        ``position`` in the current reading; ``position`` itself otherwise (no batch
        fetched since, or the state is not the one this reading started from)."""
        last, start = self._last, self._start
        if last is None or start is None or not start.key <= position.key <= last[0].key:
            return position
        return last[1]

    def resume_position(
        self,
        saved_layout: object,
        position: DataPosition,
        where: str,
        *,
        allow_global_batch_change: bool = False,
    ) -> DataPosition:
        """Where this loader continues from ``position``, saved under ``saved_layout``.

        Under the same global batch the position is the same (the sample order
        of an epoch depends on the seed and the epoch only, and each step reads
        the next global batch of it), whatever the number of processes. Under
        another global batch (only with ``allow_global_batch_change``) the run
        continues at the first batch that starts at or before the samples the
        saved run had consumed in the epoch: no sample is skipped, up to one
        batch's worth less than a batch is read twice.

        Raises:
            CheckpointError: the layouts do not allow it (`LoaderLayout.check_resume`),
                the position lies past its epoch, or it is a snapshot of a loader
                whose order fnaccel does not own and the number of processes changed.
        """
        saved = self.layout.check_resume(
            saved_layout, where, allow_global_batch_change=allow_global_batch_change
        )
        sampler = self.sampler
        if sampler is None:
            same = (saved.num_processes, saved.global_batch_size) == (
                self.layout.num_processes,
                self.layout.global_batch_size,
            )
            if not same and position.loader_state is not None:
                raise CheckpointError(
                    f"{where}: the data position is a snapshot of each process's loader (an IterableDataset, "
                    f"a DistributedSampler or a custom sampler), saved by {saved.num_processes} processes "
                    f"reading {saved.batch_size} samples each; it resumes only so, not on "
                    f"{self.layout.num_processes} reading {self.layout.batch_size}. Resume like the saved run, or "
                    "train with a map-style dataset and shuffle=True/False (fnaccel then owns the order and "
                    "resumes it on any number of processes)"
                )
            if position.num_batches > 0 and position.loader_state is None:
                raise CheckpointError(
                    f"{where}: the data position is {position.num_batches} batches into an "
                    "epoch but holds no loader_state to resume this loader from"
                )
            return position
        assert saved.num_samples is not None, "a sampler's layout has a length"
        saved_steps = num_steps(saved.num_samples, saved.batch_size or 1, saved.num_shards, saved.drop_last)
        if position.num_batches >= saved_steps:
            raise CheckpointError(
                f"{where}: the data position is {position.num_batches} batches into an epoch of {saved_steps}"
            )
        if saved.global_batch_size == self.layout.global_batch_size:
            return position
        num_batches = position.num_batches * saved.global_batch_size // self.layout.global_batch_size
        if num_batches >= len(sampler):
            return DataPosition(epoch=position.epoch + 1)
        return DataPosition(epoch=position.epoch, num_batches=num_batches)

    def _worker_seed(self, epoch: int) -> int:
        # Pure in (seed, epoch, rank): resuming an epoch seeds its workers as before,
        # and ranks augment differently.
        return (self._seed + epoch) * self.layout.num_processes + self._rank

    def _begin(self) -> Iterator[object]:
        at = self._at
        self._iter_epoch = at.epoch
        for hook in self._epoch_hooks:
            hook.set_epoch(at.epoch)
        generator = self.dataloader.generator
        assert generator is not None  # prepare_loader always gives one
        generator.manual_seed(self._worker_seed(at.epoch))
        if self.sampler is not None:
            self.sampler.load_state_dict({"epoch": at.epoch, "batches_yielded": at.num_batches})
        elif at.loader_state is not None:
            self.dataloader.load_state_dict(copy.deepcopy(dict(at.loader_state)))
        if self.fetch is not None and self.sampler is not None:
            return map(self.fetch, self.sampler.index_batches())
        return iter(self.dataloader)

    def _after(self, before: DataPosition) -> DataPosition:
        num_batches = before.num_batches + 1
        if num_batches == self._num_batches:
            return DataPosition(epoch=before.epoch + 1)
        snapshot = None if self.sampler is not None else loader_snapshot(self.dataloader, self._snapshots)
        return DataPosition(epoch=before.epoch, num_batches=num_batches, loader_state=snapshot)

    def read(self, end_epoch: int) -> Iterator[object]:
        """Batches on ``device`` from where the live iterator stands, through epoch
        ``end_epoch - 1``."""
        while self._at.epoch < end_epoch:
            if self._iterator is None:
                self._iterator = self._begin()
            self._read = True
            try:
                item = next(self._iterator)
            except StopIteration:
                self._iterator = None
                if self._at.epoch == self._iter_epoch:  # a stream without a length ended
                    self._at = DataPosition(epoch=self._iter_epoch + 1)
                continue
            before = self._at
            self._at = after = self._after(before)
            self._last = (before, after)
            if self._placed:
                yield item
                continue
            batch = item.batch if isinstance(item, Collated) else item
            yield send_to_device(batch, self.device, non_blocking=self.non_blocking)


def batches(state: RunState, *, epochs: int | None = None) -> Batches:
    """Reads the state's prepared loader: its batches, on the device, from the state's data position.

    The position is the state's (`RunState.data_position`); `fa.step` advances
    it when it steps a batch from here. A batch fetched and not stepped (a
    ``break`` right after the fetch) comes again from the next ``fa.batches``,
    in this process or after `fa.load` in a new one; `fa.end_epoch` before the
    ``break`` skips the rest of the epoch instead (early stopping).

    With `PreemptionKwargs` at `fa.init`, the batches end early on every rank,
    at the same update boundary, once any rank received a watched signal
    (``state.preempted`` says which); this assumes each batch is stepped with
    `fa.step`, as in the loop below.

    Args:
        state: a `RunState` whose ``loader`` was prepared (`fa.prepare`).
        epochs: run through the end of epoch ``epochs - 1``, starting each new
            epoch (which reshuffles); None yields the rest of the current epoch.

    Returns:
        An iterator of batches placed on ``state.dist.device``. Its ``len()`` is the
        number of batches it yields on this rank, counted from the state's position:
        at the start of an epoch, ``fa.batches(state)`` has ``len(state.loader)``
        (this rank's batches per epoch, what Accelerate's prepared loader's ``len()``
        is and its scripts size schedulers by); mid-epoch, the rest of the epoch (as
        Accelerate's ``skip_first_batches`` loader); with ``epochs=N``, the rest of the
        current epoch plus every whole epoch through ``N - 1``. Preemption may end
        the batches sooner.

    Raises:
        ValueError: the state has no prepared loader, or ``epochs`` is negative.
        StaleStateError: ``state`` was already consumed (use the newest one).
        TypeError: from ``len()`` only, when the loader reads a stream without a
            length (an ``IterableDataset``).

    >>> import torch, fnaccel as fa
    >>> model = torch.nn.Linear(1, 1)
    >>> data = torch.utils.data.DataLoader(torch.arange(4.0).view(4, 1), batch_size=2, shuffle=True)
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1),
    ...                    data, loss_fn=lambda m, b: m(b).mean())
    >>> len(fa.batches(state)), len(fa.batches(state, epochs=2))
    (2, 4)
    >>> for batch in fa.batches(state, epochs=2):
    ...     state, metrics = fa.step(state, batch)
    >>> state.epoch, state.step
    (2, 4)
    """
    loader = _prepared_loader(state, "fa.batches")
    if epochs is not None and (not is_int(epochs) or epochs < 0):
        raise ValueError(f"fa.batches: epochs must be an int >= 0 or None, got {epochs!r}")
    position = state.data_position
    loader.seek(position)
    end = position.epoch + 1 if epochs is None else epochs
    batches = loader.read(end)
    watch = state.resources.get("preemption")  # fa.init(kwargs_handlers=[PreemptionKwargs()])
    if watch is not None:
        batches = watch.guard(batches, state.micro_step, state.plan.micro_steps if state.plan else 1)
    per_epoch = loader._num_batches
    length = (
        None
        if per_epoch is None
        else max(end - position.epoch, 0) * per_epoch - (position.num_batches if end > position.epoch else 0)
    )
    return Batches(
        batches,
        length,
        "fa.batches: the loader reads a stream (an IterableDataset) whose "
        "length is unknown, so what fa.batches returns has no len(); count the batches as they "
        "come, or size a schedule from the dataset's known length",
    )


def end_epoch(state: RunState) -> RunState:
    """Consumes ``state``: the rest of the epoch in progress is skipped without being
    read, so the next `fa.batches` starts the next epoch whole (early stopping).

    The new state stands at the start of the next epoch (``DataPosition(epoch=e + 1)``),
    exactly where the epoch's last batch would have left it: `fa.save` right after it
    resumes there. The loader's live iterator is dropped unread (its workers stop with
    it). An epoch of which no batch was stepped (``num_batches == 0``, as right after an
    epoch's last batch) is left whole: ending an epoch never skips the next one.

    Gradients and counters are untouched: under `fa.accumulate`, a window that was
    partly stepped stays open and the next epoch's first batches complete it, as at
    any epoch end (the update always averages ``num_steps`` stepped batches).

    Args:
        state: a `RunState` whose ``loader`` was prepared (`fa.prepare`).

    Returns:
        The state at the start of the next epoch.

    Raises:
        ValueError: the state has no prepared loader.
        StaleStateError: ``state`` was already consumed (use the newest one).

    >>> import torch, fnaccel as fa
    >>> model = torch.nn.Linear(1, 1)
    >>> data = torch.utils.data.DataLoader(torch.arange(6.0).view(6, 1), batch_size=2)
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1),
    ...                    data, loss_fn=lambda m, b: m(b).mean())
    >>> for batch in fa.batches(state):
    ...     state, metrics = fa.step(state, batch)
    ...     state = fa.end_epoch(state)  # stop early: one batch of epoch 0 is enough
    ...     break
    >>> state.data_position
    DataPosition(epoch=1, num_batches=0, loader_state=None)
    >>> [batch.view(-1).tolist() for batch in fa.batches(state)]  # epoch 1, whole
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    by = "fa.end_epoch"
    loader = _prepared_loader(state, by)
    position = state.data_position
    if position.num_batches == 0:
        return state.advance(by)
    loader.start_epoch(position.epoch + 1)
    return state.advance(by, data_position=DataPosition(epoch=position.epoch + 1))


def _prepared_loader(state: object, action: str) -> PreparedLoader:
    """The state's `PreparedLoader`, after checking that ``state`` is a fresh state holding one."""
    if not isinstance(state, RunState):
        raise TypeError(
            f"{action}: state must be a fa.RunState (from fa.init and fa.prepare), got "
            f"{type(state).__name__}"[:300]
        )
    state.check_fresh(action)
    loader = state.loader
    if loader is None:
        raise ValueError(
            f"{action}: the state has no prepared loader; prepare one first with "
            "state = fa.prepare(state, loader=your_dataloader)"
        )
    if not isinstance(loader, PreparedLoader):
        raise TypeError(
            f"{action}: state.loader is a {type(loader).__name__}, not a prepared loader; "
            "pass your DataLoader through fa.prepare(state, loader=...)"
        )
    return loader
