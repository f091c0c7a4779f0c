"""Evaluation runs on each rank of a `fnaccel.testing.World` (importable by spawned workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fnaccel as fa

SIZES = (1, 2, 7, 10, 203)


class Rows(Dataset[dict[str, Any]]):
    """Sample i: its index, a vector, a label string and a ragged row of i % 3 + 1 values."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "x": torch.full((3,), float(i)), "name": f"s{i}"}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "index": torch.tensor([s["index"] for s in samples]),
        "x": torch.stack([s["x"] for s in samples]),
        "names": [s["name"] for s in samples],
    }


class Outputs:
    """Nested per-sample outputs: tensors, a tuple, Python objects, and a ragged leaf whose
    second dim changes from batch to batch (the same on every rank within a step, as the
    documentation asks)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        index = batch["index"]
        return {
            "index": index,
            "pair": (model(batch["x"]), index * 2),
            "names": batch["names"],
            "ragged": index[:, None].float().expand(-1, self.calls % 3 + 1),
        }


def outputs(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    return Outputs()(model, batch)


def model_and_state(state: fa.RunState) -> fa.RunState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    return fa.prepare(
        state, model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda m, b: m(b[0]).pow(2).mean()
    )


def check_sizes(state: fa.RunState, batch_size: int) -> dict[int, dict[str, Any]]:
    """For each dataset size: what came back, summarised for the test."""
    state = model_and_state(fa.init(seed=0, cpu=True))
    model = state.model
    assert model is not None
    seen = {}
    for n in SIZES:
        out = fa.evaluate(state, DataLoader(Rows(n), batch_size=batch_size, collate_fn=collate), Outputs())
        with torch.no_grad():
            expected = model.eval()(torch.arange(n, dtype=torch.float32)[:, None].expand(-1, 3))
        model.train()
        ragged = out["ragged"]
        seen[n] = {
            "index": out["index"].tolist(),
            "doubled": out["pair"][1].tolist(),
            "names": out["names"],
            "outputs_match": torch.allclose(out["pair"][0], expected, atol=1e-6),
            "ragged_rows": [int(r[0]) for r in ragged]
            if isinstance(ragged, list)
            else ragged[:, 0].int().tolist(),
            "mode_restored": model.training,
        }
    fa.shutdown(state)
    return seen


def train_with_and_without_evaluation(state: fa.RunState) -> bool:
    """Evaluating between steps changes nothing about the run (RNG, position, mode)."""
    data = TensorDataset(torch.randn(24, 3, generator=torch.Generator().manual_seed(1)))
    test = DataLoader(Rows(7), batch_size=2, collate_fn=collate)
    runs = []
    for evaluate in (False, True):
        run = model_and_state(fa.init(seed=0, cpu=True))
        run = fa.prepare(run, loader=DataLoader(data, batch_size=4, shuffle=True))
        losses = []
        for batch in fa.batches(run, epochs=2):
            if evaluate:
                before = (run.rng, run.data_position, run.micro_step)
                fa.evaluate(run, test, outputs)
                assert (run.rng, run.data_position, run.micro_step) == before
                assert run.model is not None and run.model.training
            run, metrics = fa.step(run, batch)
            losses.append(metrics["loss"])
        runs.append((torch.stack(losses), [p.detach().clone() for p in run.model.parameters()]))  # type: ignore[union-attr]
        fa.shutdown(run)
    (a, pa), (b, pb) = runs
    return torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(pa, pb, strict=False))


def literal_port_counts(
    state: fa.RunState, sizes: tuple[int, ...], batch_size: int
) -> dict[int, dict[str, Any]]:
    """run_glue_no_trainer's evaluation loop (Accelerate's multi_process_metrics too),
    ported literally: gather every batch, and truncate the last one (``step ==
    len(eval_dataloader) - 1``) to the dataset's length only when distributed. What it
    counts, per dataset size."""
    seen = {}
    for n in sizes:
        loader = DataLoader(Rows(n), batch_size=batch_size, collate_fn=collate)
        eval_dataloader = fa.eval_batches(state, loader)
        samples_seen, indices, num_valid_is_length, num_batches = 0, [], True, 0
        for step, (batch, num_valid) in enumerate(eval_dataloader):
            num_valid_is_length &= num_valid == len(batch["index"])
            num_batches += 1
            index = fa.ops.gather(state, batch["index"])
            if state.dist.num_processes > 1:
                if step == len(eval_dataloader) - 1:
                    index = index[: len(loader.dataset) - samples_seen]  # type: ignore[arg-type]
                else:
                    samples_seen += index.shape[0]
            indices += index.tolist()
        seen[n] = {
            "indices": indices,
            "num_valid_is_length": num_valid_is_length,
            "length": len(eval_dataloader),
            "num_batches": num_batches,
        }
    return seen


class Wrapped(Dataset[tuple[torch.Tensor, ...]]):
    """The same samples behind a plain Dataset: read one at a time, as any dataset is."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.data[index]


def tensor_dataset_reads(
    state: fa.RunState, sizes: tuple[int, ...], batch_size: int
) -> dict[int, dict[str, Any]]:
    """A TensorDataset's evaluation batches (one indexing per tensor) against the same
    samples read one at a time, step for step; and how many samples the TensorDataset
    read one at a time (its type made exact again, so the indexed read applies)."""
    state = model_and_state(state)
    seen = {}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        data = TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 5, (n,), generator=g))
        plain, reads = TensorDataset.__getitem__, [0]

        def counted(
            self: TensorDataset, index: int, plain: Any = plain, reads: list[int] = reads
        ) -> tuple[torch.Tensor, ...]:
            reads[0] += 1
            return plain(self, index)

        TensorDataset.__getitem__ = counted  # type: ignore[method-assign]
        try:
            indexed = list(fa.eval_batches(state, DataLoader(data, batch_size=batch_size)))
        finally:
            TensorDataset.__getitem__ = plain  # type: ignore[method-assign]
        one_by_one = list(fa.eval_batches(state, DataLoader(Wrapped(data), batch_size=batch_size)))
        same = len(indexed) == len(one_by_one) and all(
            v == w
            and len(b) == len(c)
            and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(b, c, strict=False))
            for (b, v), (c, w) in zip(indexed, one_by_one, strict=False)
        )
        fn = lambda m, b: {"out": m(b[0]), "label": b[1]}  # noqa: E731
        a, b = (
            fa.evaluate(state, DataLoader(data, batch_size=batch_size), fn),
            fa.evaluate(state, DataLoader(Wrapped(data), batch_size=batch_size), fn),
        )
        seen[n] = {
            "same_batches": same,
            "reads": reads[0],
            "num_steps": len(indexed),
            "same_outputs": torch.equal(a["out"], b["out"]) and torch.equal(a["label"], b["label"]),
            "labels_in_order": torch.equal(a["label"], data.tensors[1]),
        }
    return seen
