"""Datasets and the functions gloo workers run, for the data-path tests.

Importable by spawned workers as ``data._data_fns`` once ``tests/`` is on
``sys.path`` (see ``tests/ops/_dist_fns.py`` for why the worker functions live
in a helper module). The datasets are module-level so that loader workers
(``num_workers > 0``) can unpickle them too.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

import fnaccel as fa
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.loader import prepare_loader
from fnaccel.data.prepared import batches
from fnaccel.data.sampler import ShardedBatchSampler


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


class Logged(Dataset[int]):
    """Sample ``i`` is the int ``i``; every read appends ``i`` to a file, so that reads in
    loader workers are counted too."""

    def __init__(self, num_samples: int, path: str) -> None:
        self.num_samples = num_samples
        self.path = path

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        with open(self.path, "a") as log:
            log.write(f"{index}\n")
        return index

    def reads(self) -> list[int]:
        with open(self.path) as log:
            return [int(line) for line in log]


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


# ------------------------------------------------------------------ stepping a loader


def _no_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(torch.zeros(1, 1)).sum() * 0.0


def stepping(state: Any, prepared: Any) -> Any:
    """Consumes ``state``: it holds ``prepared`` (a `PreparedLoader`, possibly another
    rank's) and a model that reads no batch and learns nothing, so that `fa.step`
    consumes the loader's batches as a training loop does."""
    model = torch.nn.Linear(1, 1, bias=False)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        pipeline=fa.compose(fa.ddp()),
        loss_fn=_no_loss,
    )
    return state.replace(loader=prepared)


def as_list(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)


def train(state: Any, epochs: int | None = None, stop_after: int | None = None) -> tuple[Any, list[Any]]:
    """The users' loop: `fa.batches` with `fa.step`. With ``stop_after``, the loop breaks
    right after fetching batch ``stop_after + 1``, before stepping it (that batch is
    not consumed). Returns the newest state and the batches stepped."""
    stepped: list[Any] = []
    for batch in batches(state, epochs=epochs):
        if stop_after is not None and len(stepped) == stop_after:
            break
        state, _ = fa.step(state, batch)
        stepped.append(as_list(batch))
    return state, stepped


def through_json(position: Any) -> Any:
    """``position`` as a checkpoint stores it: its fields, as JSON, read back."""
    fields = json.loads(
        json.dumps(
            {
                "epoch": position.epoch,
                "num_batches": position.num_batches,
                "loader_state": None if position.loader_state is None else dict(position.loader_state),
            }
        )
    )
    return fa.DataPosition(**fields)


# ------------------------------------------------------------------ worker functions


def epoch_batches(
    state: Any, num_samples: int, batch_size: int, shuffle: bool, epochs: int, config: dict[str, Any]
) -> dict[str, Any]:
    """Every batch this rank steps in ``epochs`` epochs, with the epoch it was stepped in,
    and the position the run ends at."""
    loader = DataLoader(
        Indices(num_samples),
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_list,
        generator=torch.Generator().manual_seed(100 + state.dist.rank),
    )
    state = stepping(
        state, prepare_loader(loader, state.dist, seed=5, config=DataLoaderConfiguration(**config))
    )
    out = []
    for batch in batches(state, epochs=epochs):
        out.append((batch, state.epoch))
        state, _ = fa.step(state, batch)
    return {"batches": out, "end": state.data_position.key}


def iterable_batches(state: Any, num_samples: int, batch_size: int) -> list[list[int]]:
    """This rank's batches of one pass over a `Stream`."""
    state = state.replace(
        loader=prepare_loader(DataLoader(Stream(num_samples), batch_size=batch_size), state.dist, seed=0)
    )
    return [batch.tolist() for batch in batches(state)]


def distributed_sampler_batches(state: Any, num_samples: int, batch_size: int) -> dict[str, Any]:
    """A `DistributedSampler` loader, prepared: its batches over two epochs, and the sampler's own."""
    dist = state.dist
    sampler: DistributedSampler[int] = DistributedSampler(
        Indices(num_samples), num_replicas=dist.num_processes, rank=dist.rank, shuffle=True, seed=3
    )
    loader = DataLoader(Indices(num_samples), batch_size=batch_size, sampler=sampler)
    state = state.replace(loader=prepare_loader(loader, dist, seed=0))
    got = [batch.tolist() for batch in batches(state, epochs=2)]
    expected = []
    for epoch in range(2):
        reference: DistributedSampler[int] = DistributedSampler(
            Indices(num_samples), num_replicas=dist.num_processes, rank=dist.rank, shuffle=True, seed=3
        )
        reference.set_epoch(epoch)
        order = list(reference)
        expected += [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return {"got": got, "expected": expected, "len": len(state.loader)}


def resumed_batches(state: Any, num_samples: int, batch_size: int, stop_after: int) -> dict[str, Any]:
    """Step ``stop_after`` batches (and fetch one more), keep the position as a checkpoint
    would, finish the epoch; then read from that position with a fresh loader: what each reads."""

    def prepared() -> Any:
        loader = DataLoader(Indices(num_samples), batch_size=batch_size, shuffle=True)
        return prepare_loader(loader, state.dist, seed=1)

    state = stepping(state, prepared())
    lengths = {"epoch": len(batches(state)), "three_epochs": len(batches(state, epochs=3))}
    state, head = train(state, epochs=1, stop_after=stop_after)
    saved = through_json(state.data_position)
    lengths["rest"] = len(batches(state, epochs=1))
    state, tail = train(state, epochs=1)
    lengths["after_the_epoch"] = len(batches(state, epochs=1))
    fresh = prepared()
    rest = batches(state.replace(loader=fresh, data_position=saved))
    lengths["resumed"] = len(rest)
    resumed = [b.tolist() for b in rest]
    return {
        "head": head,
        "tail": tail,
        "resumed": resumed,
        "reads": fresh.dataloader.dataset.reads,
        "saved": saved.key,
        "end": state.data_position.key,
        "lengths": lengths,
    }


def ended_epoch(state: Any, num_samples: int, batch_size: int, stop_after: int) -> dict[str, Any]:
    """Step ``stop_after`` batches of epoch 0, end the epoch on every rank, read epoch 1."""
    loader = DataLoader(Indices(num_samples), batch_size=batch_size, shuffle=True)
    state = stepping(state, prepare_loader(loader, state.dist, seed=7))
    state, _ = train(state, stop_after=stop_after)
    state = fa.end_epoch(state)
    ended = state.data_position.key
    state, epoch_1 = train(state)
    return {"ended": ended, "epoch_1": epoch_1, "end": state.data_position.key}


# ------------------------------------------------------------------ the one-indexing fetch


def tensor_data(num_samples: int) -> torch.utils.data.TensorDataset:
    """Floats, int64 labels and a bool mask per sample: the dtypes a fetch must keep."""
    g = torch.Generator().manual_seed(num_samples)
    x = torch.randn(num_samples, 3, 2, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 9, (num_samples,), generator=g), x[:, 0, 0] > 0)


def plain_reference(dataset: Any, prepared: Any, epochs: int, collate_fn: Any = None) -> list[Any]:
    """What a plain torch `DataLoader` yields for the prepared loader's batches of
    sample indices (the same sampler, fresh): the result the fetch must equal."""
    sampler = prepared.sampler
    out: list[Any] = []
    for epoch in range(epochs):
        fresh = ShardedBatchSampler(
            sampler.num_samples,
            sampler.batch_size,
            num_processes=sampler.num_processes,
            rank=sampler.rank,
            seed=sampler.seed,
            shuffle=sampler.shuffle,
            drop_last=sampler.drop_last,
            even_batches=sampler.even_batches,
        )
        fresh.set_epoch(epoch)
        out += list(DataLoader(dataset, batch_sampler=list(fresh), collate_fn=collate_fn))
    return out


def indexed_save(
    state: Any, directory: str, num_samples: int, batch_size: int, stop_after: int
) -> dict[str, Any]:
    """Train two epochs over a shuffled TensorDataset through `fa.batches`, saving the run
    (`fa.save`) after ``stop_after`` steps of epoch 0 with one batch fetched and not stepped."""
    dataset = tensor_data(num_samples)
    prepared = prepare_loader(DataLoader(dataset, batch_size=batch_size, shuffle=True), state.dist, seed=4)
    state = stepping(state, prepared)
    state, head = train_tensors(state, epochs=1, stop_after=stop_after)
    fa.save(state, directory)
    state, tail = train_tensors(state, epochs=2)
    return {
        "head": head,
        "tail": tail,
        "reference": plain_reference(dataset, prepared, 2),
        "fetch": type(prepared.fetch).__name__,
    }


def indexed_resume(state: Any, directory: str, num_samples: int, batch_size: int) -> list[Any]:
    """`fa.load` the run `indexed_save` saved into fresh objects; the batches it then steps."""
    prepared = prepare_loader(
        DataLoader(tensor_data(num_samples), batch_size=batch_size, shuffle=True), state.dist, seed=4
    )
    state = fa.load(stepping(state, prepared), directory)
    return train_tensors(state, epochs=2)[1]


def train_tensors(
    state: Any, epochs: int | None = None, stop_after: int | None = None
) -> tuple[Any, list[Any]]:
    """`train`, keeping the batches themselves (tensors) rather than lists."""
    stepped: list[Any] = []
    for batch in batches(state, epochs=epochs):
        if stop_after is not None and len(stepped) == stop_after:
            break
        state, _ = fa.step(state, batch)
        stepped.append(batch)
    return state, stepped


def epoch_order_of(prepared: Any, epoch: int) -> list[int]:
    """The prepared loader's sample order of ``epoch`` (one process)."""
    from fnaccel.data.sampler import epoch_order

    return epoch_order(
        prepared.sampler.num_samples,
        seed=prepared.sampler.seed,
        epoch=epoch,
        shuffle=prepared.sampler.shuffle,
    ).tolist()


# ------------------------------------------------------------------ the data campaign


class DictRecords(Dataset[dict[str, Any]]):
    """Dict samples of mixed dtypes and a str leaf, read through ``__getitems__``."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{"x": torch.full((2,), i, dtype=torch.bfloat16), "id": i, "name": f"s{i}"} for i in indices]


def dict_records_resumed(state: Any, num_samples: int, batch_size: int, stop_after: int) -> dict[str, Any]:
    """Two shuffled epochs of `DictRecords` through `fa.batches` + `fa.step`, breaking after
    ``stop_after`` steps (a batch fetched, not stepped); then the rest from the saved position
    in a freshly prepared loader."""

    def prepared() -> Any:
        return prepare_loader(
            DataLoader(DictRecords(num_samples), batch_size=batch_size, shuffle=True), state.dist, seed=11
        )

    state = stepping(state, prepared())
    state, head = train_tensors(state, epochs=2, stop_after=stop_after)
    saved = through_json(state.data_position)
    state, tail = train_tensors(state, epochs=2)
    fresh = state.replace(loader=prepared(), data_position=saved)
    return {"head": head, "tail": tail, "resumed": list(batches(fresh, epochs=2))}


# ---- an epoch resumed on another number of processes, with another global batch -------------------

ELASTIC_SAMPLES = 60


def elastic_part(state: Any, root: str, batch_size: int, num_steps: int | None) -> list[int]:
    """Runs on each rank (or in one process): a fresh run over samples 0..59 (sample i is the float i),
    shuffled, ``batch_size`` per process. With ``num_steps``, its first steps of the epoch, saved to
    ``root``; with None, the rest of the epoch from that checkpoint, loaded with
    ``allow_global_batch_change=True``. Returns the sample ids this rank stepped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    data = torch.utils.data.TensorDataset(torch.arange(float(ELASTIC_SAMPLES)).unsqueeze(1))
    run = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        DataLoader(data, batch_size=batch_size, shuffle=True),
        loss_fn=lambda m, b: m(b[0]).mean(),
    )
    if num_steps is None:
        run = fa.load(run, f"{root}/elastic", allow_global_batch_change=True)
    ids: list[int] = []
    for batch in fa.batches(run):
        ids += [int(i) for i in batch[0].view(-1).tolist()]
        run, _ = fa.step(run, batch)
        if run.step == num_steps:
            fa.save(run, f"{root}/elastic")
            break
    fa.shutdown(run)
    return ids
