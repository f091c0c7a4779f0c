"""The position a prepared loader records after each batch of a loader whose order fnaccel
does not own: the same value as torchdata's ``state_dict()`` deep-copied, without its cost.

issue 37 point 5: the port of a plain script that keeps its `RandomSampler(replacement=True)`
paid torchdata's ``state_dict()`` and a deep copy at every batch (about 70 us under load,
more than reading the batch), nearly all of it runtime `Protocol` checks repeated on parts
that do not change while an epoch is read.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torchdata.stateful_dataloader import Stateful

import fnaccel as fa
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.loader import prepare_loader


class LiveStateSampler(Sampler[int]):
    """A stateful sampler whose ``state_dict`` returns its live (mutable) record."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.record = {"drawn": [0]}

    def __iter__(self) -> Iterator[int]:
        start = self.record["drawn"][0]
        for i in range(start, self.n):
            self.record["drawn"][0] = i + 1
            yield (i * 7) % self.n

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return self.record

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.record = copy.deepcopy(state)


class Stream(IterableDataset[torch.Tensor]):
    """A stream with a position of its own."""

    def __init__(self) -> None:
        self.at = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.at < 22:
            self.at += 1
            yield torch.tensor([float(self.at)])

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(40.0).view(20, 2))


LOADERS = {
    "random with replacement": lambda: DataLoader(
        _data(),
        batch_size=3,
        sampler=RandomSampler(
            _data(), replacement=True, num_samples=30, generator=torch.Generator().manual_seed(3)
        ),
    ),
    "subset random": lambda: DataLoader(
        _data(),
        batch_size=3,
        sampler=SubsetRandomSampler(range(2, 19), generator=torch.Generator().manual_seed(3)),
    ),
    "weighted": lambda: DataLoader(
        _data(),
        batch_size=4,
        sampler=WeightedRandomSampler([1.0] * 20, 20, generator=torch.Generator().manual_seed(3)),
    ),
    "live stateful sampler": lambda: DataLoader(_data(), batch_size=3, sampler=LiveStateSampler(20)),
    "batch sampler": lambda: DataLoader(
        _data(),
        batch_sampler=BatchSampler(
            WeightedRandomSampler([1.0] * 20, 20, generator=torch.Generator().manual_seed(4)), 4, False
        ),
    ),
    "stream": lambda: DataLoader(Stream(), batch_size=4),
    "weighted, a worker (torchdata's own path)": lambda: DataLoader(
        _data(),
        batch_size=4,
        num_workers=1,
        sampler=WeightedRandomSampler([1.0] * 20, 20, generator=torch.Generator().manual_seed(3)),
    ),
}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_each_batch_position_equals_torchdatas_state_and_owns_it(name: str) -> None:
    prepared = prepare_loader(
        LOADERS[name](), fa.DistContext(), seed=0, config=DataLoaderConfiguration(shard=False)
    )
    assert prepared.sampler is None, "the snapshot path: fnaccel does not own this order"
    taken = []
    for _ in prepared.read(1):
        position = prepared._at
        if position.num_batches == 0:  # the epoch's last batch: the next epoch's start, no snapshot
            assert position.loader_state is None
            continue
        expected = copy.deepcopy(prepared.dataloader.state_dict())
        assert _equal(position.loader_state, expected), (position.loader_state, expected)
        taken.append((position.loader_state, expected))
    assert len(taken) >= 4
    for snapshot, expected in taken:  # reading on changed none of them
        assert _equal(snapshot, expected)


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_position_resumes_a_fresh_loader_at_the_next_batch(name: str) -> None:
    config = DataLoaderConfiguration(shard=False)
    whole = [
        b.clone() if isinstance(b, torch.Tensor) else b[0].clone()
        for b in prepare_loader(LOADERS[name](), fa.DistContext(), seed=0, config=config).read(1)
    ]
    first = prepare_loader(LOADERS[name](), fa.DistContext(), seed=0, config=config)
    reading = first.read(1)
    for _ in range(3):
        next(reading)
    position = first._at
    for _ in reading:  # the live loader reads on; the position stays where it was
        pass
    fresh = prepare_loader(LOADERS[name](), fa.DistContext(), seed=0, config=config)
    fresh.seek(position)
    rest = [b if isinstance(b, torch.Tensor) else b[0] for b in fresh.read(1)]
    assert len(rest) == len(whole) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[3:], strict=True))


def test_the_protocol_checks_are_paid_once_per_epoch_not_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the port's loader cost per batch: torchdata asked isinstance(part, Stateful) of
    # the same five to seven parts at every batch (~5 us each on Python 3.11).
    checks = {"n": 0}
    meta = type(Stateful)
    original: Any = meta.__instancecheck__

    def counting(cls: Any, instance: Any) -> bool:
        if cls is Stateful:
            checks["n"] += 1
        return original(cls, instance)

    assert meta is typing._ProtocolMeta
    monkeypatch.setattr(meta, "__instancecheck__", counting)
    prepared = prepare_loader(
        LOADERS["random with replacement"](),
        fa.DistContext(),
        seed=0,
        config=DataLoaderConfiguration(shard=False),
    )
    reading = prepared.read(1)
    next(reading)
    next(reading)
    after_two = checks["n"]
    rest = list(reading)
    assert len(rest) == 8
    assert checks["n"] == after_two, f"{checks['n'] - after_two} Stateful checks over 8 batches"
