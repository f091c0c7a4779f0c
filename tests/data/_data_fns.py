"""Datasets and the functions gloo workers run, for the data-path tests.

Importable by spawned workers as ``data._data_fns`` once ``tests/`` is on
``sys.path`` (see ``tests/ops/_dist_fns.py`` for why the worker functions live
in a helper module). The datasets are module-level so that loader workers
(``num_workers > 0``) can unpickle them too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.loader import prepare_loader
from fnaccel.data.prepared import batches


class Indices(Dataset[int]):
    """Sample ``i`` is the int ``i``; counts ``__getitem__`` calls (in this process)."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.reads = 0

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        return index


class Noisy(Dataset[torch.Tensor]):
    """Sample ``i`` is a random draw, as a random augmentation would make."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


class Stream(IterableDataset[int]):
    """Yields ``0 .. num_samples - 1``; resumable (``state_dict``), counts reads.

    With loader workers, worker ``w`` of ``n`` yields the samples ``i`` with
    ``i % n == w``, as an `IterableDataset` must to avoid duplicates.
    """

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.position = 0
        self.reads = 0
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = range(worker, self.num_samples, workers)
        while self.position < len(mine):
            self.position += 1  # counted before the sample leaves: a state taken now resumes after it
            self.reads += 1
            yield mine[self.position - 1]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.position = state_dict["position"]


class PlainStream(IterableDataset[int]):
    """Yields ``0 .. num_samples - 1``, with no state of its own."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __iter__(self) -> Any:
        return iter(range(self.num_samples))


def collate_list(samples: list[int]) -> list[int]:
    """Collates to a plain list (empty batches included)."""
    return list(samples)


def as_lists(loader_batches: Any) -> list[list[int]]:
    return [b.tolist() if isinstance(b, torch.Tensor) else list(b) for b in loader_batches]


# ------------------------------------------------------------------ worker functions


def epoch_batches(
    state: Any, num_samples: int, batch_size: int, shuffle: bool, epochs: int, config: dict[str, Any]
) -> list[tuple[list[int], int | None, int]]:
    """Every batch this rank reads in ``epochs`` epochs: (indices, num_valid, epoch)."""
    loader = DataLoader(Indices(num_samples), batch_size=batch_size, shuffle=shuffle, collate_fn=collate_list,
                        generator=torch.Generator().manual_seed(100 + state.dist.rank))
    state = state.replace(loader=prepare_loader(loader, state.dist, seed=5, config=DataLoaderConfiguration(**config)))
    out = []
    for batch in batches(state, epochs=epochs):
        out.append((batch, state.loader.num_valid, state.loader.epoch))
    return out


def iterable_batches(state: Any, num_samples: int, batch_size: int) -> list[tuple[list[int], int | None]]:
    """This rank's batches of one pass over a `Stream`."""
    state = state.replace(loader=prepare_loader(DataLoader(Stream(num_samples), batch_size=batch_size),
                                                state.dist, seed=0))
    return [(batch.tolist(), state.loader.num_valid) for batch in batches(state)]


def distributed_sampler_batches(state: Any, num_samples: int, batch_size: int) -> dict[str, Any]:
    """A `DistributedSampler` loader, prepared: its batches over two epochs, and the sampler's own."""
    dist = state.dist
    sampler = DistributedSampler(Indices(num_samples), num_replicas=dist.num_processes, rank=dist.rank,
                                 shuffle=True, seed=3)
    loader = DataLoader(Indices(num_samples), batch_size=batch_size, sampler=sampler)
    state = state.replace(loader=prepare_loader(loader, dist, seed=0))
    got = [batch.tolist() for batch in batches(state, epochs=2)]
    expected = []
    for epoch in range(2):
        reference = DistributedSampler(Indices(num_samples), num_replicas=dist.num_processes, rank=dist.rank,
                                       shuffle=True, seed=3)
        reference.set_epoch(epoch)
        order = list(reference)
        expected += [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return {"got": got, "expected": expected, "len": len(state.loader)}


def resumed_batches(state: Any, num_samples: int, batch_size: int, stop_after: int) -> dict[str, Any]:
    """Read ``stop_after`` batches, save, resume in a fresh loader: what each reads."""
    def prepared() -> Any:
        loader = DataLoader(Indices(num_samples), batch_size=batch_size, shuffle=True)
        return prepare_loader(loader, state.dist, seed=1)

    first = prepared()
    stream = iter(first)
    head = [next(stream).tolist() for _ in range(stop_after)]
    saved = first.state_dict()
    tail = [b.tolist() for b in stream]
    fresh = prepared()
    fresh.load_state_dict(saved)
    resumed = [b.tolist() for b in fresh]
    return {"head": head, "tail": tail, "resumed": resumed, "reads": fresh.dataloader.dataset.reads}
