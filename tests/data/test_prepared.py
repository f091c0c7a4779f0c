"""The prepared loader against the user's own `DataLoader`, as a careful PyTorch user would try it.

Each test builds a real `torch.utils.data.DataLoader` and compares what the
prepared loader yields with what a plain `DataLoader` yields for the same
batches of sample indices: same samples, same order, and the same collate
result (container types, dtypes, strides, non-tensor leaves). Where fnaccel
owns the order (``shuffle=True``), the reference is a plain `DataLoader` over
the documented order (docs/data.md: the user's generator plays no part).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections import UserDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
)

import fnaccel as fa
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.loader import prepare_loader
from fnaccel.data.prepared import PreparedLoader
from fnaccel.data.sampler import epoch_order

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from data import _data_fns as fns  # noqa: E402

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def identical(a: Any, b: Any) -> bool:
    """Type for type, and tensors bit for bit (NaN and complex32 too) with dtype, shape and strides."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.device == b.device
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return list(a) == list(b) and all(identical(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return identical(dataclasses.astuple(a), dataclasses.astuple(b))  # type: ignore[arg-type]
    return bool(a == b)


def _prepare(
    loader: DataLoader[Any], num_processes: int = 1, rank: int = 0, seed: int = 7, **config: Any
) -> PreparedLoader:
    ctx = fa.DistContext(num_processes=num_processes, rank=rank, device=torch.device("cpu"))
    return prepare_loader(loader, ctx, seed=seed, config=DataLoaderConfiguration(**config))


def _read(prepared: PreparedLoader, epoch: int = 0, num_batches: int = 0) -> list[Any]:
    prepared.seek(fa.DataPosition(epoch=epoch, num_batches=num_batches))
    return list(prepared.read(epoch + 1))


def _shuffled_reference(loader: DataLoader[Any], seed: int, epoch: int) -> list[Any]:
    """A plain DataLoader over the documented order of a shuffled epoch (one process)."""
    order = epoch_order(len(loader.dataset), seed=seed, epoch=epoch, shuffle=True).tolist()  # type: ignore[arg-type]
    return list(
        DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=order,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
        )
    )


def _assert_same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=False)):
        assert identical(a, b), f"batch {step}: {a!r} != {b!r}"


# ------------------------------------------------------------------ datasets


def _dtype_tensors(num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 3, generator=g)
    return TensorDataset(
        x > 0,
        (x * 10).to(torch.int8),
        x.half(),
        x.bfloat16(),
        torch.complex(x, -x),
        torch.arange(num_samples),  # 0-d per sample
        _complex32(x),
        torch.arange(num_samples, dtype=torch.float64).view(num_samples, 1, 1) * float("nan"),
    )


def _complex32(x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # "ComplexHalf support is experimental"
        warnings.simplefilter("ignore", UserWarning)
        return torch.complex(x, -x).to(torch.complex32)


class Items(Dataset[Any]):
    """Samples of a given kind, read through ``__getitems__`` (which must be used)."""

    def __init__(self, num_samples: int, kind: str) -> None:
        self.num_samples, self.kind = num_samples, kind

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> Any:
        x = torch.full((2,), i, dtype=torch.float16)
        return {
            "list": [x, i],
            "dict": {"x": x, "label": i, "name": f"s{i}"},
            "tuple": (x, float(i), True),
            "namedtuple": Pair(x, i),
            "dataclass": Sample(x=x, name=f"s{i}"),
        }[self.kind]

    def __getitem__(self, i: int) -> Any:
        raise AssertionError("read one at a time: __getitems__ was not used")

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self.sample(i) for i in indices]


def _collate_samples(samples: list[Sample]) -> dict[str, Any]:
    return {"x": torch.stack([s.x for s in samples]), "names": tuple(s.name for s in samples)}


class Batched(Dataset[Any]):
    """A dataset whose ``__getitems__`` returns the batch already made (a tensor),
    read with an identity collate_fn: torch's DataLoader passes it through."""

    def __init__(self, num_samples: int) -> None:
        self.data = torch.arange(num_samples * 2, dtype=torch.float32).view(num_samples, 2)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return self.data[indices]


class TwoWays(Batched):
    """``__getitems__`` makes a dict batch; ``__getitem__`` a sample: which one torch calls shows."""

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"x": self.data[indices]}


def _identity(batch: Any) -> Any:
    return batch


# ------------------------------------------------------------------ what the batches hold


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_tensor_datasets_of_every_dtype_equal_the_plain_loader(
    shuffle: bool, batch_size: int, drop_last: bool
) -> None:
    loader = DataLoader(_dtype_tensors(11), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    prepared = _prepare(loader)
    assert type(prepared.fetch).__name__ == "IndexFetch"  # NaN and complex32 included
    for epoch in range(2):
        expected = _shuffled_reference(loader, 7, epoch) if shuffle else list(loader)
        _assert_same(_read(prepared, epoch), expected)


def test_a_plain_tensor_as_dataset_equals_the_plain_loader() -> None:
    data = torch.arange(30, dtype=torch.int16).view(10, 3)
    loader: DataLoader[torch.Tensor] = DataLoader(data, batch_size=4)  # type: ignore[arg-type]  # a tensor as dataset
    _assert_same(_read(_prepare(loader)), list(loader))
    scalars: DataLoader[torch.Tensor] = DataLoader(torch.arange(7.0), batch_size=3)  # type: ignore[arg-type]
    _assert_same(_read(_prepare(scalars)), list(scalars))


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "namedtuple", "dataclass"])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_getitems_of_every_container_equals_the_plain_loader(kind: str, num_workers: int) -> None:
    collate = _collate_samples if kind == "dataclass" else default_collate
    loader = DataLoader(Items(7, kind), batch_size=3, collate_fn=collate)
    prepared = _prepare(DataLoader(Items(7, kind), batch_size=3, collate_fn=collate, num_workers=num_workers))
    _assert_same(_read(prepared), list(loader))


def test_getitems_returning_the_batch_itself_equals_the_plain_loader() -> None:
    loader = DataLoader(Batched(7), batch_size=3, collate_fn=_identity)
    _assert_same(_read(_prepare(loader)), list(loader))


def test_a_collate_fn_returning_non_tensors_equals_the_plain_loader() -> None:
    def describe(samples: list[Any]) -> tuple[str, list[int]]:
        return "batch", [int(s) for s in samples]

    loader = DataLoader(fns.Indices(7), batch_size=3, collate_fn=describe)
    _assert_same(_read(_prepare(loader)), list(loader))


@dataclasses.dataclass
class Scaled:
    """A batch whose ``__post_init__`` transforms its fields: it must run once, in the collate_fn."""

    x: torch.Tensor
    size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.x = self.x.float() / 2
        self.size = len(self.x)


def _scaled(samples: list[int]) -> Scaled:
    return Scaled(torch.tensor(samples))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_dataclass_batch_is_placed_as_the_collate_fn_made_it(device: str) -> None:
    loader = DataLoader(fns.Indices(6), batch_size=4, collate_fn=_scaled)
    ctx = fa.DistContext(device=torch.device(device))
    got = _read(prepare_loader(loader, ctx, seed=0))
    expected = list(loader)
    assert [b.size for b in got] == [4, 2] and all(b.x.device.type == device for b in got)
    if device == "cpu":
        _assert_same(got, expected)


class Encoding(UserDict):  # type: ignore[type-arg]
    """Like a tokenizer's BatchEncoding: a mapping with state of its own, and a ``.to``."""

    def __init__(self, data: dict[str, torch.Tensor], words: list[int]) -> None:
        super().__init__(data)
        self.words = words

    def to(self, device: Any) -> Encoding:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def _encode(samples: list[int]) -> Encoding:
    return Encoding({"ids": torch.tensor(samples)}, words=list(samples))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_mapping_that_moves_itself_keeps_its_own_state(device: str) -> None:
    loader = DataLoader(fns.Indices(6), batch_size=4, collate_fn=_encode)
    got = _read(prepare_loader(loader, fa.DistContext(device=torch.device(device)), seed=0))
    assert [type(b) for b in got] == [Encoding] * 2 and [b.words for b in got] == [[0, 1, 2, 3], [4, 5]]
    assert [b["ids"].device.type for b in got] == [device] * 2
    if device == "cpu":
        assert all(torch.equal(b["ids"], e["ids"]) for b, e in zip(got, loader, strict=False))


def test_without_batching_each_item_goes_through_default_convert_alone() -> None:
    """batch_size=None: torch reads ``dataset[i]`` (never ``__getitems__``) and
    passes the item to the collate_fn (``default_convert``) alone."""
    loader = DataLoader(TwoWays(5), batch_size=None)
    expected = list(loader)
    assert type(expected[0]) is torch.Tensor
    for num_processes, rank in ((1, 0), (2, 1)):
        for num_workers in (0, 1):
            prepared = _prepare(
                DataLoader(TwoWays(5), batch_size=None, num_workers=num_workers), num_processes, rank
            )
            want = (
                expected if num_processes == 1 else [expected[i] for i in (1, 3, 0)]
            )  # rank 1 pads from the start
            _assert_same(_read(prepared), want)
    with pytest.raises(ValueError, match="this rank's batch is empty"):
        _read(_prepare(DataLoader(TwoWays(5), batch_size=None, num_workers=1), 2, 1, even_batches=False))
    for num_workers in (0, 1):  # resumed mid-epoch in a fresh loader: the rest of the items

        def fresh(num_workers: int = num_workers) -> PreparedLoader:
            return _prepare(
                DataLoader(TwoWays(9), batch_size=None, shuffle=True, num_workers=num_workers), 2, 1
            )

        whole = _read(fresh(), 1)
        assert len(whole) == 5
        _assert_same(_read(fresh(), 1, 2), whole[2:])


def test_fewer_samples_than_ranks_pads_every_rank_from_the_start() -> None:
    dataset = _dtype_tensors(2)
    loader = DataLoader(dataset, batch_size=1)
    ranks = [_read(_prepare(loader, 3, rank)) for rank in range(3)]
    assert [len(r) for r in ranks] == [1, 1, 1]
    expected = [list(DataLoader(dataset, batch_size=1, sampler=[i])) for i in (0, 1, 0)]
    for got, want in zip(ranks, expected, strict=False):
        _assert_same(got, want)


# ------------------------------------------------------------------ samplers the user passes


class Reversed(RandomSampler):
    """A RandomSampler subclass with an order of its own."""

    def __iter__(self) -> Any:
        return iter(range(len(self.data_source) - 1, -1, -1))


def test_samplers_kept_on_one_process_equal_the_plain_loader() -> None:
    data = fns.Indices(10)

    def both(kwargs: Any) -> None:
        _assert_same(_read(_prepare(DataLoader(data, **kwargs()))), list(DataLoader(data, **kwargs())))

    both(lambda: {"batch_size": 3, "sampler": SequentialSampler(data)})
    both(lambda: {"batch_size": 3, "sampler": SequentialSampler(range(5))})  # over the first 5 only
    both(
        lambda: {
            "batch_size": 3,
            "sampler": WeightedRandomSampler([1.0] * 10, 12, generator=torch.Generator().manual_seed(3)),
        }
    )
    both(
        lambda: {
            "batch_size": 3,
            "sampler": SubsetRandomSampler([1, 3, 5, 7], generator=torch.Generator().manual_seed(3)),
        }
    )
    both(lambda: {"batch_sampler": [[3, 1], [4], [1, 5, 9]]})
    both(lambda: {"batch_size": 3, "sampler": Reversed(data)})
    both(
        lambda: {
            "batch_size": 3,
            "sampler": RandomSampler(data, replacement=True, generator=torch.Generator().manual_seed(3)),
        }
    )


def test_a_sampler_drawing_from_the_process_generator_is_not_silently_rewound() -> None:
    """A kept sampler without a generator of its own (SubsetRandomSampler(generator=None))
    draws a new order at every pass: re-reading a position in the same process would
    give other batches, which must be refused as for a seeded one."""
    loader = DataLoader(fns.Indices(10), batch_size=2, sampler=SubsetRandomSampler(list(range(10))))
    prepared = _prepare(loader)
    state = fns.stepping(fa.init(seed=0, cpu=True), prepared)
    state, _ = fns.train(state, epochs=1, stop_after=1)  # a second batch fetched, not stepped
    with pytest.raises(ValueError, match="cannot be rewound"):
        fns.train(state, epochs=1)


class Buckets(torch.utils.data.Sampler[list[int]]):
    """A batch sampler shuffling inside (its RandomSampler draws from the process generator)."""

    def __init__(self, num_samples: int) -> None:
        self.inner = RandomSampler(range(num_samples))

    def __len__(self) -> int:
        return len(self.inner) // 2

    def __iter__(self) -> Any:
        order = list(self.inner)
        return iter([order[i : i + 2] for i in range(0, len(order), 2)])


def test_a_custom_batch_sampler_that_cannot_say_where_it_stands_is_not_silently_rewound() -> None:
    prepared = _prepare(DataLoader(fns.Indices(10), batch_sampler=Buckets(10)))
    state, head = fns.train(fns.stepping(fa.init(seed=0, cpu=True), prepared), epochs=1, stop_after=2)
    with pytest.raises(ValueError, match="cannot be rewound"):
        fns.train(state, epochs=1)
    deterministic = _prepare(DataLoader(fns.Indices(6), batch_sampler=[[5, 4], [0], [1, 2]]))
    state, head = fns.train(fns.stepping(fa.init(seed=0, cpu=True), deterministic), epochs=1, stop_after=1)
    assert head + fns.train(state, epochs=1)[1] == [[5, 4], [0], [1, 2]]  # a list re-reads exactly


# ------------------------------------------------------------------ order, workers, resume


def test_shuffle_is_reproducible_for_a_seed_and_differs_across_seeds() -> None:
    def run(seed: int) -> list[Any]:
        return _read(_prepare(DataLoader(_dtype_tensors(12), batch_size=4, shuffle=True), seed=seed))

    _assert_same(run(1), run(1))
    assert not identical(run(1), run(2))


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator:UserWarning")
@pytest.mark.parametrize(("num_processes", "rank"), [(1, 0), (3, 2)])
def test_workers_and_pinning_yield_the_same_batches(num_processes: int, rank: int) -> None:
    dataset = _dtype_tensors(13)
    plain = _prepare(DataLoader(dataset, batch_size=2, shuffle=True), num_processes, rank)
    expected = _read(plain, 1)
    for kwargs in ({"num_workers": 2}, {"pin_memory": True}, {"num_workers": 1, "pin_memory": True}):
        prepared = _prepare(DataLoader(dataset, batch_size=2, shuffle=True, **kwargs), num_processes, rank)
        _assert_same(_read(prepared, 1), expected)


@pytest.mark.parametrize(("num_processes", "rank"), [(1, 0), (2, 1), (3, 0)])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_resuming_mid_epoch_in_a_fresh_loader_reads_the_rest(
    num_processes: int, rank: int, num_workers: int
) -> None:
    def fresh() -> PreparedLoader:
        return _prepare(
            DataLoader(Items(17, "dict"), batch_size=2, shuffle=True, num_workers=num_workers),
            num_processes,
            rank,
        )

    whole = _read(fresh(), 1)
    for k in (1, len(whole) - 1):
        _assert_same(_read(fresh(), 1, k), whole[k:])


class EpochAware(Dataset[int]):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_reaches_a_map_style_dataset_each_epoch_and_on_resume() -> None:
    dataset = EpochAware()
    prepared = _prepare(DataLoader(dataset, batch_size=2, shuffle=True))
    for epoch in range(3):
        _read(prepared, epoch)
    _read(prepared, 5, 1)
    assert dataset.epochs == [0, 1, 2, 5]


# ------------------------------------------------------------------ iterable datasets


class Records(IterableDataset[dict[str, Any]]):
    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __iter__(self) -> Any:
        return ({"x": torch.tensor([i], dtype=torch.bfloat16), "id": i} for i in range(self.num_samples))


@pytest.mark.parametrize("split_batches", [False, True])
def test_an_iterable_dataset_equals_the_plain_loader_split_across_ranks(split_batches: bool) -> None:
    assert identical(
        _read(_prepare(DataLoader(Records(7), batch_size=2))), list(DataLoader(Records(7), batch_size=2))
    )
    per_rank = 2 if split_batches else 1
    loader = DataLoader(Records(8), batch_size=per_rank * 2 if split_batches else per_rank)
    ranks = [_read(_prepare(loader, 2, rank, split_batches=split_batches)) for rank in range(2)]
    plain = list(DataLoader(Records(8), batch_size=2 * per_rank, collate_fn=list))
    for step, global_batch in enumerate(plain):
        expected = [default_collate(global_batch[r * per_rank : (r + 1) * per_rank]) for r in range(2)]
        assert identical([ranks[r][step] for r in range(2)], expected)


# ------------------------------------------------------------------ bad input


class Lying(Dataset[int]):
    """Says it holds 10 samples; holds 8."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i >= 8:
            raise IndexError(f"sample {i} of 8")
        return i


class Miscounting(Dataset[int]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:
        return indices[:-1]


def _refuse(batch: Any) -> Any:
    raise RuntimeError("my collate refuses")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_bad_datasets_and_collate_fns_raise_their_own_clear_error(num_workers: int) -> None:
    with pytest.raises(IndexError, match="sample 8 of 8"):
        _read(_prepare(DataLoader(Lying(), batch_size=4, num_workers=num_workers)))
    with pytest.raises(RuntimeError, match="my collate refuses"):
        _read(_prepare(DataLoader(fns.Indices(4), batch_size=2, collate_fn=_refuse, num_workers=num_workers)))
    if num_workers == 0:  # fnaccel's own fetch checks; workers run torch's fetcher, which does not
        with pytest.raises(
            ValueError, match=r"Miscounting.__getitems__ returned 1 sample\(s\) for 2 indices"
        ):
            _read(_prepare(DataLoader(Miscounting(), batch_size=2)))


class Unsized(Dataset[int]):
    """A map-style dataset without ``__len__``: torch reads it through a custom sampler."""

    def __getitem__(self, i: int) -> int:
        return i * 10


def test_a_dataset_without_len_read_by_a_custom_batch_sampler_equals_the_plain_loader(tmp_path: Path) -> None:
    def fresh() -> fa.RunState:
        loader = DataLoader(Unsized(), batch_sampler=[[3, 1], [0], [2, 4]])
        return fns.stepping(fa.init(seed=0, cpu=True), _prepare(loader))

    plain = DataLoader(Unsized(), batch_sampler=[[3, 1], [0], [2, 4]])
    state, head = fns.train_tensors(fresh(), epochs=1, stop_after=1)
    fa.save(state, tmp_path / "ckpt")
    _, tail = fns.train_tensors(fa.load(fresh(), tmp_path / "ckpt"), epochs=1)
    _assert_same(head + tail, list(plain))


def test_an_empty_dataset_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="dataset is empty"):
        _prepare(DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=2))


# ------------------------------------------------------------------ real worlds


def test_on_real_worlds_dict_batches_equal_the_plain_loader_and_resume(world: Any) -> None:
    """2 and 3 gloo ranks: each rank's dict batches (bf16 tensors, ints, strs) are the plain
    DataLoader's over its chunk of the global batch, and a fresh loader resumed mid-epoch
    reads exactly the rest."""
    n, num_samples, batch_size, stop_after = world.num_processes, 19, 2, 3
    results = world.run(fns.dict_records_resumed, num_samples, batch_size, stop_after)
    dataset = fns.DictRecords(num_samples)
    global_size = batch_size * n
    for rank, result in enumerate(results):
        assert len(result["head"]) == stop_after
        whole = result["head"] + result["tail"]
        _assert_same(result["resumed"], result["tail"])
        expected: list[Any] = []
        for epoch in range(2):
            order = epoch_order(num_samples, seed=11, epoch=epoch, shuffle=True).tolist()
            steps = -(-num_samples // global_size)
            padded = [order[p % num_samples] for p in range(steps * global_size)]  # even_batches
            chunks = [padded[s * global_size + rank * batch_size :][:batch_size] for s in range(steps)]
            expected += list(DataLoader(dataset, batch_sampler=chunks))
        _assert_same(whole, expected)


def test_a_value_that_is_no_state_is_refused_naming_the_call() -> None:
    """Before: a raw AttributeError ('NoneType' object has no attribute 'check_fresh')."""
    for call, name in ((fa.end_epoch, "fa.end_epoch"), (fa.batches, "fa.batches")):
        with pytest.raises(
            TypeError,
            match=rf"{name}: state must be a fa.RunState \(from fa.init and fa.prepare\), "
            "got NoneType",
        ):
            call(None)  # type: ignore[arg-type]


def test_an_epoch_resumed_on_other_numbers_of_processes_and_global_batches_reads_each_sample_once(
    worlds: Any, tmp_path: Path
) -> None:
    """Elastic data (issue 33 point 9): 2 processes x 4 samples step 3 times (24 of the epoch's 60, shuffled)
    and save; the rest of the epoch, loaded with allow_global_batch_change=True, on 3 processes x 2 and on
    1 process x 12: across the whole run every sample is stepped exactly once, none twice, none dropped."""
    first = [i for ids in worlds.get(2).run(fns.elastic_part, str(tmp_path), 4, 3) for i in ids]
    assert len(first) == 24 == len(set(first))
    on_three = [i for ids in worlds.get(3).run(fns.elastic_part, str(tmp_path), 2, None) for i in ids]
    assert sorted(first + on_three) == list(range(fns.ELASTIC_SAMPLES))
    on_one = fns.elastic_part(None, str(tmp_path), 12, None)
    assert sorted(first + on_one) == list(range(fns.ELASTIC_SAMPLES))
    # The limit, as documented (docs/checkpoints.md): a global batch that does not divide the samples
    # consumed (7 into 24) resumes at the last batch boundary before them (21): nothing is dropped, and
    # the 3 samples between are stepped again, fewer than one batch.
    by_seven = fns.elastic_part(None, str(tmp_path), 7, None)
    assert set(first + by_seven) == set(range(fns.ELASTIC_SAMPLES)) and len(by_seven) == 60 - 21
    twice = sorted(i for i in set(by_seven) if i in first)
    assert len(twice) == 3 and set(by_seven[:3]) == set(twice), (twice, by_seven[:7])  # the first 3 it reads
