"""Train a small MLP to classify three interleaved spirals, on one or many processes.

The data is generated (no download). The same script runs unchanged on one
process or under a launcher:

    python examples/train_classifier.py
    fnaccel launch --cpu --num_processes 2 examples/train_classifier.py
    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_classifier.py

`fa.init` reads the launch environment; `fa.prepare` wraps the model for the
world it finds (DDP over gloo here) and shards the shuffling loader across the
ranks; `fa.step` runs forward, backward, clipping, the optimizer and the
scheduler; dropout draws from the run's own generators. `fa.evaluate` splits
the test set across the ranks and gathers every sample's prediction exactly
once, in order, without touching the run's state. Each epoch's
metrics go to ``<output's directory>/classifier/metrics.jsonl`` (one JSON
object per line, written by the main process), and a progress display follows
the epochs on stderr.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def spirals(num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three noisy spiral arms in 2-D; the label is the arm."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_samples) % 3
    radius = torch.rand(num_samples, generator=generator)
    angle = 4.0 * radius + labels * (2 * math.pi / 3)
    angle = angle + 0.2 * torch.randn(num_samples, generator=generator)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return points, labels


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 3),
    )


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def accuracy(state: fa.RunState, test: DataLoader[tuple[torch.Tensor, ...]]) -> float:
    """Every test sample counted once, whatever the number of processes."""
    hits = fa.evaluate(state, test, lambda model, batch: model(batch[0]).argmax(1) == batch[1])
    assert len(hits) == len(test.dataset)  # type: ignore[arg-type]
    return hits.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--output", default="runs/classifier.safetensors")
    args = parser.parse_args()

    # the weights and the logs share a directory: runs/ by default
    state = fa.init(seed=0, project_dir=os.path.dirname(args.output) or ".")
    train_x, train_y = spirals(3000, seed=1)
    test_x, test_y = spirals(1000, seed=2)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True)
    test = DataLoader(TensorDataset(test_x, test_y), batch_size=128)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    state = fa.prepare(
        state,
        model,
        optimizer,
        loader,
        scheduler,
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.ddp(), fa.clip_grad_norm(1.0)),
    )

    state = fa.init_trackers(state, "classifier", config=vars(args))

    for epoch in fa.progress(state, range(state.epoch, args.epochs), desc="epochs"):
        losses = []
        for batch in fa.batches(state):  # the rest of the current epoch
            state, metrics = fa.step(state, batch)
            losses.append(metrics["loss"])  # device tensors: no sync per step
        # Every rank takes part in the reduction; fa.log reads the tensors once, on the main process.
        logged = {
            "train_loss": fa.ops.reduce(state, torch.stack(losses).mean(), "mean"),
            "grad_norm": metrics["grad_norm"],
            "lr": metrics["lr"],
            "epoch": epoch + 1,
        }
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            logged["test_accuracy"] = accuracy(state, test)
            fa.print_on_main(
                state,
                f"epoch {epoch + 1:3d}  step {state.step:5d}  train loss {logged['train_loss']:.4f}  "
                f"test accuracy {logged['test_accuracy']:.3f}",
            )
        fa.log(state, logged)

    if state.dist.is_main_process:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        # `model` is still the user's module: DDP wraps it, the weights are the same
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.output)
        print(f"weights written to {args.output}")
    fa.shutdown(state)  # also closes the trackers


if __name__ == "__main__":
    main()
