"""The loader's own fetch: batches read from the sampler's indices without the
DataLoader iterator, in one indexing per tensor where default_collate allows it.

Every test compares, bit for bit (type, dtype, shape, strides, values), against
what a plain torch `DataLoader` yields for the same batches of indices.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

import fnaccel as fa
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.loader import prepare_loader
from fnaccel.data.prepared import PreparedLoader

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from data import _data_fns as fns  # noqa: E402


def identical(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.device == b.device
            and torch.equal(a, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    return bool(a == b)


def _prepare(
    loader: DataLoader[Any], num_processes: int = 1, rank: int = 0, device: str = "cpu", **config: Any
) -> PreparedLoader:
    ctx = fa.DistContext(num_processes=num_processes, rank=rank, device=torch.device(device))
    return prepare_loader(loader, ctx, seed=7, config=DataLoaderConfiguration(**config))


def _epochs(prepared: PreparedLoader, epochs: int) -> list[Any]:
    out: list[Any] = []
    for epoch in range(epochs):
        prepared.seek(fa.DataPosition(epoch=epoch))
        out += list(prepared.read(epoch + 1))
    return out


class Records(Dataset[dict[str, Any]]):
    """Dict samples, read a batch at a time through ``__getitems__`` (counted)."""

    def __init__(self, num_samples: int) -> None:
        self.data = fns.tensor_data(num_samples)
        self.batch_reads = 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        raise AssertionError("read one at a time: __getitems__ was not used")

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        self.batch_reads += 1
        return [{"x": self.data[i][0], "label": int(self.data[i][1])} for i in indices]


@pytest.mark.parametrize("kind", ["tensor_dataset", "tensor"])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("num_processes", "rank"), [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("cut", [{}, {"drop_last": True}, {"even_batches": False}])
def test_one_indexing_equals_the_plain_loader(
    kind: str, shuffle: bool, num_processes: int, rank: int, cut: dict[str, bool]
) -> None:
    data = fns.tensor_data(29)
    dataset = data if kind == "tensor_dataset" else data.tensors[0]
    loader = DataLoader(dataset, batch_size=4, shuffle=shuffle, drop_last=cut.get("drop_last", False))
    if "even_batches" in cut:
        rank = 0  # the others' last batch is short or empty (see test_an_empty_batch_keeps_the_clear_error)
    prepared = _prepare(loader, num_processes, rank, even_batches=cut.get("even_batches", True))
    assert type(prepared.fetch).__name__ == "IndexFetch"
    got = _epochs(prepared, 2)
    expected = fns.plain_reference(dataset, prepared, 2)
    assert len(got) == len(expected) == 2 * len(prepared) and identical(got, expected)


def test_an_empty_batch_keeps_the_clear_error() -> None:
    loader = DataLoader(fns.tensor_data(5), batch_size=2)
    prepared = _prepare(loader, 2, 1, even_batches=False)  # rank 1's second batch is empty
    with pytest.raises(ValueError, match="this rank's batch is empty"):
        _epochs(prepared, 1)


def test_a_dataset_with_getitems_is_read_once_a_batch() -> None:
    dataset = Records(10)
    prepared = _prepare(DataLoader(dataset, batch_size=4, shuffle=True))
    got = _epochs(prepared, 2)
    assert dataset.batch_reads == 6
    assert identical(got, fns.plain_reference(dataset, prepared, 2))


@pytest.mark.parametrize("case", ["collate_fn", "requires_grad", "subclass", "unbatched", "transposed"])
def test_what_indexing_may_not_equal_is_read_as_the_loader_reads_it(case: str) -> None:
    data = fns.tensor_data(9)
    dataset: Any = data
    kwargs: dict[str, Any] = {"batch_size": 2, "shuffle": True}
    if case == "collate_fn":
        kwargs["collate_fn"] = lambda samples: default_collate(samples)[0] * 2
    elif case == "requires_grad":
        dataset = TensorDataset(data.tensors[0].requires_grad_())
    elif case == "subclass":
        dataset = TensorDataset(torch.nn.Parameter(data.tensors[0], requires_grad=False))
    elif case == "unbatched":
        kwargs = {"batch_size": None}
    else:
        dataset = TensorDataset(data.tensors[0].transpose(1, 2))
    loader = DataLoader(dataset, **kwargs)
    prepared = _prepare(loader)
    assert type(prepared.fetch).__name__ == "ItemFetch"
    got = _epochs(prepared, 2)
    if case == "unbatched":  # a sample at a time, through default_convert
        expected = [
            next(iter(DataLoader(dataset, batch_size=None, sampler=[i])))
            for epoch in range(2)
            for i in fns.epoch_order_of(prepared, epoch)
        ]
    else:
        expected = fns.plain_reference(dataset, prepared, 2, loader.collate_fn)
    assert identical(got, expected)


def test_a_changed_default_collate_for_tensors_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data._utils import collate

    def as_double(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
        return torch.stack(batch).double()

    monkeypatch.setitem(collate.default_collate_fn_map, torch.Tensor, as_double)
    dataset = fns.tensor_data(6)
    prepared = _prepare(DataLoader(dataset, batch_size=4))
    assert type(prepared.fetch).__name__ == "ItemFetch"
    got = _epochs(prepared, 1)
    assert got[0][0].dtype == torch.float64 and identical(got, fns.plain_reference(dataset, prepared, 1))


def test_workers_read_through_the_dataloader() -> None:
    assert _prepare(DataLoader(fns.tensor_data(6), batch_size=2, num_workers=1)).fetch is None


def test_indexed_batches_are_placed_on_the_device() -> None:
    prepared = _prepare(DataLoader(fns.tensor_data(6), batch_size=4), device="meta", non_blocking=True)
    batch = _epochs(prepared, 1)[0]
    assert [t.device.type for t in batch] == ["meta"] * 3 and [t.shape[0] for t in batch] == [4] * 3


def test_sharded_over_real_worlds_and_resumed_through_save_and_load(world: Any, tmp_path: Path) -> None:
    n = world.num_processes
    num_samples, batch_size, stop_after = 37, 3, 2
    saved = world.run(fns.indexed_save, str(tmp_path / "ckpt"), num_samples, batch_size, stop_after)
    resumed = world.run(fns.indexed_resume, str(tmp_path / "ckpt"), num_samples, batch_size)
    steps = -(-num_samples // (batch_size * n))
    for rank in range(n):
        run = saved[rank]
        assert run["fetch"] == "IndexFetch" and len(run["reference"]) == 2 * steps
        assert identical(run["head"] + run["tail"], run["reference"])
        assert identical(resumed[rank], run["tail"]) and len(run["head"]) == stop_after
    # the ranks' batches of a step cover distinct samples (a shuffled, sharded epoch)
    first = [saved[r]["reference"][0][1].tolist() for r in range(n)]
    assert len({tuple(f) for f in first}) == n
