"""Evaluate across processes: every sample counted exactly once, whatever the number of processes.

    fnaccel launch --cpu --num_processes 2 examples/multi_process_metrics.py
    python examples/multi_process_metrics.py

The evaluation set (103 samples by default) does not split evenly: with 2 processes and
batches of 16, the last step has 7 samples for 2 x 16 places. To keep every process in step,
the last batches are padded with repeated samples, and those must not be counted.

- `fa.evaluate(state, loader, fn)` runs `fn(model, batch)` under `no_grad` in eval mode on each
  process's share and returns every sample's outputs once, in dataset order, on every process.
- The hand-written form: `fa.eval_batches(state, loader)` yields each batch with the number of
  its real samples, and `fa.ops.gather_for_metrics(..., num_valid=...)` gathers the outputs of
  every process and drops the padding.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(x, (x[:, 0] + x[:, 1] ** 2 > 1).long())


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def f1_score(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    true_positives = ((predictions == 1) & (labels == 1)).sum().item()
    return 2 * true_positives / max(1, (predictions == 1).sum().item() + (labels == 1).sum().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-eval-samples", type=int, default=103)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = DataLoader(
        make_dataset(128 if args.tiny else 4096, seed=1), batch_size=args.batch_size, shuffle=True
    )
    evaluation = DataLoader(make_dataset(args.num_eval_samples, seed=2), batch_size=args.batch_size)
    state = fa.prepare(state, model, optimizer, train, loss_fn=loss_fn)
    for batch in fa.batches(state, epochs=1 if args.tiny else args.epochs):
        state, _metrics = fa.step(state, batch)

    # 1. The one-call form: outputs per sample, already gathered and in order.
    outputs = fa.evaluate(
        state, evaluation, lambda model, batch: {"prediction": model(batch[0]).argmax(1), "label": batch[1]}
    )
    accuracy = (outputs["prediction"] == outputs["label"]).float().mean().item()
    fa.print_on_main(
        state,
        f"fa.evaluate: {len(outputs['label'])} samples, accuracy {accuracy:.4f}, "
        f"F1 {f1_score(outputs['prediction'], outputs['label']):.4f}",
    )

    # 2. The hand-written loop: eval mode and no_grad are yours to set, num_valid drops the padding.
    batches = []
    model.eval()
    with torch.no_grad():
        for (x, y), num_valid in fa.eval_batches(state, evaluation):
            batches.append(fa.ops.gather_for_metrics(state, (model(x).argmax(1), y), num_valid=num_valid))
    model.train()
    predictions, labels = (torch.cat(column) for column in zip(*batches, strict=True))
    accuracy = (predictions == labels).float().mean().item()
    fa.print_on_main(
        state,
        f"eval_batches + gather_for_metrics: {len(labels)} samples, accuracy {accuracy:.4f}, "
        f"F1 {f1_score(predictions, labels):.4f}",
    )
    fa.shutdown(state)


if __name__ == "__main__":
    main()
