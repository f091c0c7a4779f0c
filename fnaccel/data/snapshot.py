"""`loader_snapshot`: a `StatefulDataLoader`'s position after a batch, as a value.

A loader whose order fnaccel does not own (a custom sampler, a `DistributedSampler`,
a stream) is located by torchdata's own ``state_dict()``, taken after every batch
(`PreparedLoader` keeps it in the state's `DataPosition`). torchdata's single-process
iterator builds that dict by asking five of its parts ``isinstance(part,
Stateful)``, a runtime `Protocol` check that costs about 5 us each on Python 3.11:
more than reading a small batch. The parts do not change while an iterator lives,
so the snapshot here asks once per iterator and then builds the same dict from the
same calls. Its keys are checked against torchdata's own dict on that first
snapshot (at every depth); any other iterator (worker processes) or a torchdata whose
dict differs is read by torchdata's ``state_dict()`` as before. torchdata's batch-sampler
iterator asks the same question of its sampler at every call and is read the same way.
"""

from __future__ import annotations

import copy
from typing import Protocol, cast

from torchdata.stateful_dataloader import Stateful, StatefulDataLoader

__all__ = ["loader_snapshot"]

try:  # private to torchdata: a version without them takes the general path
    from torch.utils.data.dataloader import _DatasetKind
    from torchdata.stateful_dataloader import stateful_dataloader as _sdl

    _SINGLE_PROCESS: type | None = _sdl._StatefulSingleProcessDataLoaderIter
    _KEYS = (
        _sdl._INDEX_SAMPLER_STATE,
        _sdl._SAMPLER_ITER_STATE,
        _sdl._SAMPLER_ITER_YIELDED,
        _sdl._StatefulSingleProcessDataLoaderIter._NUM_YIELDED,
        _sdl._ITERABLEDATASET_LEN_CALLED,
        _sdl._SHARED_SEED,
        _sdl._FETCHER_STATE,
        _sdl._DATASET_STATE,
        _sdl._ITERATOR_FINISHED,
    )
    _ITER_KEYS = (_sdl._DATASET_ITER_STATE, _sdl._FETCHER_ENDED)
    from torchdata.stateful_dataloader.sampler import _BatchSamplerIterator

    _BATCH_ITER: type | None = _BatchSamplerIterator
    _BATCH_KEYS = (
        _BatchSamplerIterator._SAMPLES_YIELDED,
        _BatchSamplerIterator._SAMPLER_STATE,
        _BatchSamplerIterator._SAMPLER_ITER_STATE,
    )
except (ImportError, AttributeError):  # pragma: no cover - another torchdata
    _SINGLE_PROCESS = _BATCH_ITER = None

_SCALARS = frozenset({int, float, bool, str, type(None)})


class _Stateful(Protocol):
    """A part torchdata serializes (its `Stateful`)."""

    def state_dict(self) -> dict[str, object]: ...


# (the part, itself when torchdata serializes it, else None)
_Found = tuple[object, _Stateful | None]


class _Fetcher(Protocol):
    dataset: object
    dataset_iter: object
    ended: bool


class _SingleProcessIter(Protocol):
    """What the snapshot reads of torchdata's single-process iterator (torchdata's private
    attributes, those its own ``state_dict()`` reads)."""

    _dataset_fetcher: _Fetcher
    _dataset_kind: int
    _index_sampler: object
    _sampler_iter: object
    _sampler_iter_yielded: int
    _num_yielded: int
    _IterableDataset_len_called: int | None
    _shared_seed: int | None
    _finished: bool


class _BatchSamplerIter(Protocol):
    """torchdata's batch-sampler iterator, as its ``state_dict()`` reads it."""

    sampler: object
    sampler_iter: object
    samples_yielded: int


class _Parts:
    """What one single-process iterator's snapshot reads, its `Stateful` parts found once."""

    __slots__ = (
        "batch_iter",
        "dataset",
        "dataset_iter",
        "fast",
        "index_sampler",
        "iterable",
        "iterator",
        "sampler_iter",
    )

    def __init__(self, iterator: _SingleProcessIter) -> None:
        self.iterator = iterator
        fetcher = iterator._dataset_fetcher
        self.iterable = iterator._dataset_kind == _DatasetKind.Iterable
        self.index_sampler = _stateful(iterator._index_sampler)
        self.sampler_iter = _stateful(iterator._sampler_iter)
        self.batch_iter = _BatchIterParts() if type(iterator._sampler_iter) is _BATCH_ITER else None
        self.dataset = _stateful(fetcher.dataset)
        self.dataset_iter = _stateful(fetcher.dataset_iter) if self.iterable else None
        self.fast = True

    def current(self) -> bool:
        """Whether the iterator still reads the parts found (torchdata may reset them)."""
        it = self.iterator
        fetcher = it._dataset_fetcher
        return (
            _same(self.index_sampler, it._index_sampler)
            and _same(self.sampler_iter, it._sampler_iter)
            and _same(self.dataset, fetcher.dataset)
            and (not self.iterable or _same(self.dataset_iter, fetcher.dataset_iter))
        )

    def state(self) -> dict[str, object]:
        """The dict torchdata's ``state_dict()`` builds, its parts' states copied."""
        it = self.iterator
        if self.iterable:
            fetcher = it._dataset_fetcher
            fetcher_state: dict[str, object] | None = dict(
                zip(_ITER_KEYS, (_state(self.dataset_iter), fetcher.ended), strict=True)
            )
            dataset_state = None if fetcher.dataset_iter is fetcher.dataset else _state(self.dataset)
        else:
            fetcher_state, dataset_state = None, _state(self.dataset)
        return dict(
            zip(
                _KEYS,
                (
                    _state(self.index_sampler),
                    _state(self.sampler_iter, self.batch_iter),
                    it._sampler_iter_yielded,
                    it._num_yielded,
                    it._IterableDataset_len_called,
                    it._shared_seed,
                    fetcher_state,
                    dataset_state,
                    it._finished,
                ),
                strict=True,
            )
        )


def _stateful(part: object) -> _Found:
    # the one slow isinstance per part (torchdata ships no types: the cast says what it proved)
    return part, cast(_Stateful, part) if isinstance(part, Stateful) else None


def _same(found: _Found | None, part: object) -> bool:
    return found is not None and found[0] is part


class _BatchIterParts:
    """torchdata's batch-sampler iterator, whose ``state_dict()`` asks the same
    `Protocol` question of its sampler and of the sampler's iterator at every call."""

    __slots__ = ("sampler", "sampler_iter")

    def __init__(self) -> None:
        self.sampler: _Found | None = None
        self.sampler_iter: _Found | None = None

    def state(self, batch_iter: _BatchSamplerIter) -> dict[str, object]:
        sampler, sampler_iter = self.sampler, self.sampler_iter
        if sampler is None or sampler[0] is not batch_iter.sampler:
            sampler = self.sampler = _stateful(batch_iter.sampler)
        # a new sampler iterator after load_state_dict
        if sampler_iter is None or sampler_iter[0] is not batch_iter.sampler_iter:
            sampler_iter = self.sampler_iter = _stateful(batch_iter.sampler_iter)
        state: dict[str, object] = {_BATCH_KEYS[0]: batch_iter.samples_yielded}
        if sampler[1] is not None:
            state[_BATCH_KEYS[1]] = sampler[1].state_dict()
        if sampler_iter[1] is not None:
            state[_BATCH_KEYS[2]] = sampler_iter[1].state_dict()
        return state


def _state(found: _Found | None, batch_iter: _BatchIterParts | None = None) -> dict[str, object] | None:
    if found is None or found[1] is None:
        return None
    # the batch-sampler iterator's own state_dict() asks the slow question again: built here
    state = (
        batch_iter.state(cast(_BatchSamplerIter, found[0]))
        if batch_iter is not None
        else found[1].state_dict()
    )
    # A dict of scalars (a sampler's counters) needs no deep copy; anything else may
    # be the part's live object, which the next batch changes.
    if type(state) is dict and all(type(value) in _SCALARS for value in state.values()):
        return dict(state)
    return copy.deepcopy(state)


class _Cache:
    """The parts of the iterator a loader read last (one per `PreparedLoader`)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: _Parts | None = None


def loader_snapshot(dataloader: StatefulDataLoader, cache: _Cache) -> dict[str, object]:
    """``copy.deepcopy(dataloader.state_dict())``, built without torchdata's per-call
    `Protocol` checks where its iterator runs in this process.

    Args:
        dataloader: the loader, standing after the batch fetched last.
        cache: where the parts of its live iterator are kept between calls
            (`new_cache`; one per loader).

    Returns:
        A snapshot that ``dataloader.load_state_dict`` resumes from; nothing in it
        is shared with the live loader.
    """
    iterator = dataloader._iterator
    if _SINGLE_PROCESS is None or type(iterator) is not _SINGLE_PROCESS:
        cache.parts = None
        return copy.deepcopy(dataloader.state_dict())
    parts = cache.parts
    if parts is None or parts.iterator is not iterator or not parts.current():
        parts = cache.parts = _Parts(cast(_SingleProcessIter, iterator))  # its type, checked above
        general = dataloader.state_dict()
        built = parts.state()
        parts.fast = _shape(built) == _shape(general)
        return built if parts.fast else copy.deepcopy(general)
    if not parts.fast:
        return copy.deepcopy(dataloader.state_dict())
    return parts.state()


def _shape(state: object) -> object:
    # The keys at every depth and the kinds of the leaves: what a torchdata whose
    # dict differs from the one built here would change.
    if isinstance(state, dict):
        return {key: _shape(value) for key, value in state.items()}
    return type(state)


def new_cache() -> _Cache:
    """An empty cache for `loader_snapshot`."""
    return _Cache()
