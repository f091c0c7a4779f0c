"""Train a small MLP to classify three interleaved spirals, on one or many processes.

The data is generated (no download). The same script runs unchanged on one
process or under a launcher:

    python examples/train_classifier.py
    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_classifier.py

It uses what fnaccel provides today: `fa.init` reads the launch environment,
each rank trains on its share of every batch, gradients are averaged with
`fa.ops.reduce`, dropout draws from the run's own generators through
`fa.with_rng`, and evaluation gathers every test sample exactly once with
`fa.ops.gather_for_metrics`. (`fa.prepare`/`fa.step` will replace the
hand-written step.)
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from safetensors.torch import save_file
from torch import nn

import fnaccel as fa
from fnaccel.data.sharding import eval_shards


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
        nn.Linear(2, 64), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(64, 3),
    )


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--output", default="runs/classifier.safetensors")
    args = parser.parse_args()

    state = fa.init(seed=0)
    ctx = state.dist
    train_x, train_y = spirals(3000, seed=1)
    test_x, test_y = spirals(1000, seed=2)

    # Same initial weights everywhere: built under the run's (identically seeded) RNG.
    state, model = fa.with_rng(state, make_model)
    model = model.to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    global_batch = args.batch_size * ctx.num_processes

    for epoch in range(args.epochs):
        # The epoch's order is a function of the seed and the epoch, identical on every rank.
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(epoch))
        losses = []
        for start in range(0, len(order) - global_batch + 1, global_batch):
            with fa.split_between_processes(state, order[start : start + global_batch]) as mine:
                x, y = fa.ops.send_to_device((train_x[mine], train_y[mine]), ctx.device)
            state, loss = fa.with_rng(state, train_step, model, optimizer, x, y)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            for p, g in zip(model.parameters(), fa.ops.reduce(state, grads, "mean")):
                p.grad = g
            optimizer.step()
            losses.append(loss)
        mean_loss = fa.ops.reduce(state, torch.stack(losses).mean(), "mean")

        model.eval()
        correct = []
        with torch.no_grad():
            for shard in eval_shards(len(test_x), 128, ctx.num_processes, ctx.rank):
                idx = torch.tensor(shard.indices)
                hits = model(test_x[idx].to(ctx.device)).argmax(1) == test_y[idx].to(ctx.device)
                correct.append(fa.ops.gather_for_metrics(state, hits, num_valid=shard.num_valid))
        everyone = torch.cat(correct)
        assert len(everyone) == len(test_x)  # every test sample counted exactly once
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            fa.print_on_main(
                state,
                f"epoch {epoch + 1:3d}  train loss {mean_loss.item():.4f}  "
                f"test accuracy {everyone.float().mean().item():.3f}",
            )

    if ctx.is_main_process:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.output)
        print(f"weights written to {args.output}")
    fa.shutdown(state)


if __name__ == "__main__":
    main()
