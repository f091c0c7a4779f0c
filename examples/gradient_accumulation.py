"""Gradient accumulation: one optimizer update every `--accumulation-steps` batches.

    python examples/gradient_accumulation.py --accumulation-steps 4
    fnaccel launch --cpu --num_processes 2 examples/gradient_accumulation.py
    fnaccel launch --cpu --num_processes 2 --mixed_precision bf16 examples/gradient_accumulation.py

Accumulation is a transform added to the pipeline the launch asked for (`fa.default_pipeline`:
the launch's mixed precision, DDP or FSDP), so the same script follows every launch flag.
Each batch's loss is divided by the number of accumulated batches, so an update with batch `b`
and 4 accumulation steps averages the same gradient as one batch of `4 * b`. Between two updates
the processes do not exchange gradients (DDP's sync is off); the update's metrics (`lr`,
`grad_norm`) appear only at the step that completed an accumulation.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 16, generator=generator)
    y = x @ torch.randn(16, 1, generator=generator) + 0.1 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="per process and per micro-step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(make_dataset(96 if args.tiny else 2048), batch_size=args.batch_size, shuffle=True)
    pipeline = fa.compose(
        fa.default_pipeline(state), fa.accumulate(args.accumulation_steps), fa.clip_grad_norm(1.0)
    )
    state = fa.prepare(state, model, optimizer, loader, loss_fn=loss_fn, pipeline=pipeline)
    fa.print_on_main(state, f"pipeline: {state.pipeline}")

    for batch in fa.batches(state, epochs=args.epochs):
        state, metrics = fa.step(state, batch)
        if "grad_norm" in metrics and state.step % 5 == 0:  # an update happened at this batch
            fa.print_on_main(
                state,
                f"update {state.step} (batch {state.micro_step}): "
                f"loss {metrics['loss'].item():.4f}, grad norm {metrics['grad_norm'].item():.3f}",
            )

    # Updates count accumulation windows; batches keep counting across epoch ends.
    fa.print_on_main(state, f"{state.micro_step} batches, {state.step} optimizer updates")
    fa.shutdown(state)


if __name__ == "__main__":
    main()
