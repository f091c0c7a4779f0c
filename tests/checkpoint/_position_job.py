"""The issue's loop shape, split across interpreters (see test_position.py).

    python _position_job.py first  DIR      # each case: train, break before stepping a fetched batch, save
    python _position_job.py second DIR      # each case: a new interpreter loads, finishes, and
                                            # compares with the uninterrupted run; DIR/<rank>.json
`in_world` runs the distributed cases on the ranks of a `fnaccel.testing.World`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import fnaccel as fa

NUM_SAMPLES = 36


def _tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(NUM_SAMPLES, 6, generator=g), torch.randint(0, 3, (NUM_SAMPLES,), generator=g)


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.x, self.y = _tensors()

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ResumableStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A stream with its own state_dict; worker w of n reads the samples i % n == w."""

    def __init__(self) -> None:
        self.x, self.y = _tensors()
        self.position = 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = range(worker, NUM_SAMPLES, workers)
        while self.position < len(mine):
            self.position += 1
            i = mine[self.position - 1]
            yield self.x[i], self.y[i]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.position = state_dict["position"]


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


# name: (pipeline, loader kwargs, dataset, epochs, break at micro_step K or None: save after the loop)
CASES: dict[str, tuple[Any, dict[str, Any], Any, int, int | None]] = {
    "fp32": (lambda: fa.compose(fa.ddp()), {"shuffle": True}, Samples, 2, 11),
    "fp16": (lambda: fa.compose(fa.autocast(fa.fp16), fa.ddp()), {"shuffle": True}, Samples, 2, 11),
    "accumulate3_mid_window": (
        lambda: fa.compose(fa.ddp(), fa.accumulate(3)),
        {"shuffle": True},
        Samples,
        2,
        13,
    ),
    "first_fetch_of_epoch": (lambda: fa.compose(fa.ddp()), {"shuffle": True}, Samples, 3, 9),
    "after_last_step_of_epoch": (lambda: fa.compose(fa.ddp()), {"shuffle": True}, Samples, 3, None),
    "workers2": (lambda: fa.compose(fa.ddp()), {"shuffle": True, "num_workers": 2}, Samples, 2, 11),
    "iterable_with_state": (lambda: fa.compose(fa.ddp()), {}, ResumableStream, 2, 6),
    "iterable_workers2": (lambda: fa.compose(fa.ddp()), {"num_workers": 2}, ResumableStream, 2, 5),
}
DIST_CASES: dict[str, tuple[Any, dict[str, Any], Any, int, int | None]] = {
    "bf16_accumulate2": (
        lambda: fa.compose(fa.autocast(fa.bf16), fa.ddp(), fa.accumulate(2)),
        {"shuffle": True},
        Samples,
        2,
        7,
    ),
    "first_fetch_of_epoch": (lambda: fa.compose(fa.ddp()), {"shuffle": True}, Samples, 3, 5),
}


def fresh(case: tuple[Any, ...]) -> tuple[fa.RunState, nn.Module]:
    pipeline, loader_kwargs, dataset, _, _ = case
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=4, **loader_kwargs)
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, optimizer, loader, pipeline=pipeline(), loss_fn=loss_fn
    )
    return state, model


def run(state: fa.RunState, epochs: int, stop_at: int | None = None) -> tuple[fa.RunState, list[float]]:
    """The loop users write: the break comes after the fetch, before the step."""
    losses = []
    for batch in fa.batches(state, epochs=epochs):
        if state.micro_step == stop_at:
            break  # the batch just fetched is never stepped
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"].item())
    return state, losses


def first(directory: Path, cases: dict[str, Any]) -> None:
    for name, case in cases.items():
        state, _ = fresh(case)
        epochs, stop_at = case[3], case[4]
        state, losses = run(state, epochs if stop_at is not None else 1, stop_at)
        fa.save(state, directory / name)
        rank = state.dist.rank
        (directory / f"{name}.{rank}.first.json").write_text(json.dumps(losses))
        fa.shutdown(state)


def second(directory: Path, cases: dict[str, Any]) -> None:
    results = {}
    rank = 0
    for name, case in cases.items():
        epochs = case[3]
        whole, whole_model = fresh(case)
        whole, whole_losses = run(whole, epochs)
        fa.shutdown(whole)
        resumed, model = fresh(case)
        resumed = fa.load(resumed, directory / name)
        rank = resumed.dist.rank
        resumed, rest = run(resumed, epochs)
        fa.shutdown(resumed)
        before = json.loads((directory / f"{name}.{rank}.first.json").read_text())
        results[name] = {
            "losses_equal": before + rest == whole_losses,
            "weights_equal": all(
                torch.equal(p, q) for p, q in zip(model.parameters(), whole_model.parameters(), strict=False)
            ),
            "counters": [
                resumed.step,
                resumed.micro_step,
                resumed.epoch,
                whole.step,
                whole.micro_step,
                whole.epoch,
            ],
        }
    (directory / f"results.{rank}.json").write_text(json.dumps(results))


def in_world(state: fa.RunState, part: str, directory: str) -> None:
    """The distributed cases, on each rank of a `fnaccel.testing.World`."""
    {"first": first, "second": second}[part](Path(directory), DIST_CASES)


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    {"first": first, "second": second}[sys.argv[1]](Path(sys.argv[2]), CASES)
