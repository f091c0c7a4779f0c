"""skip_first_batches on a user's own DataLoader: the same batches as the original from batch n on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from fnaccel.data.skip import skip_first_batches


class Counted(Dataset[int]):
    """A map-style dataset that records which samples were loaded."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(11))


def _listed(loader: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in loader]


def _shuffled(dataset: Any, seed: int, cls: type = DataLoader, **kw: Any) -> Any:
    return cls(dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 100])
def test_shuffled_map_style_skips_without_loading(n: int) -> None:
    full = _listed(_shuffled(Counted(11), seed=5))
    dataset = Counted(11)
    skipping = skip_first_batches(_shuffled(dataset, seed=5), n)
    assert _listed(skipping) == full[n:]
    assert len(skipping) == max(len(full) - n, 0)
    assert sorted(dataset.loaded) == sorted(
        i for batch in full[n:] for i in batch
    )  # skipped ones never loaded


def test_iterable_datasets_drop_last_and_no_batching() -> None:
    loader = DataLoader(Stream(), batch_size=4)
    assert _listed(skip_first_batches(loader, 2)) == [[8, 9, 10]]
    dropping = DataLoader(Counted(10), batch_size=4, drop_last=True)
    assert _listed(skip_first_batches(dropping, 1)) == [[4, 5, 6, 7]]
    unbatched = DataLoader(Counted(5), batch_size=None)
    assert _listed(skip_first_batches(unbatched, 3)) == [3, 4]


def test_workers_and_stateful_loaders_keep_their_settings() -> None:
    full = _listed(_shuffled(Counted(12), seed=1, cls=StatefulDataLoader, num_workers=2))
    skipping = skip_first_batches(_shuffled(Counted(12), seed=1, cls=StatefulDataLoader, num_workers=2), 2)
    assert (skipping.num_workers, _listed(skipping)) == (2, full[2:])


@pytest.mark.parametrize(
    ("loader", "n", "error", "match"),
    [
        ([1, 2, 3], 1, TypeError, "takes a torch.utils.data.DataLoader, got list.*islice"),
        (DataLoader(Counted(3)), -1, ValueError, "num_batches must be >= 0, got -1"),
        (DataLoader(Counted(3)), 1.0, TypeError, "num_batches must be an int, got float"),
    ],
)
def test_bad_arguments_are_refused(loader: Any, n: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        skip_first_batches(loader, n)
