"""Local SGD: each process trains on its own and the parameters are averaged every k steps.

    fnaccel launch --cpu --num_processes 2 examples/local_sgd.py --local-sgd-steps 8
    python examples/local_sgd.py      # one process: nothing to average, a plain run

Plain data parallelism all-reduces the gradients at every step. `fa.local_sgd(k)`, composed
after `fa.ddp()`, replaces that with one all-reduce of the parameters every `k` optimizer
steps: between two averages the processes do not communicate at all, which pays off when the
network, not the computation, is the bottleneck. The optimizers' states stay local. The script
prints how far the replicas have drifted apart: zero right after each average.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 20, generator=generator)
    return TensorDataset(x, (x[:, :10].sum(dim=1) > x[:, 10:].sum(dim=1)).long())


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def replica_spread(state: fa.RunState, model: nn.Module) -> float:
    """The largest difference of one parameter between any two processes (a collective: every
    process calls it)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = fa.ops.gather(state, flat[None])  # one row per process
    return (every - every[0]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-sgd-steps", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(make_dataset(256 if args.tiny else 8192), batch_size=args.batch_size, shuffle=True)
    state = fa.prepare(
        state,
        model,
        optimizer,
        loader,
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.ddp(), fa.local_sgd(args.local_sgd_steps)),
    )

    for epoch in range(args.epochs):
        for batch in fa.batches(state, epochs=epoch + 1):
            state, metrics = fa.step(state, batch)
            if state.step % args.local_sgd_steps in (0, args.local_sgd_steps - 1):
                spread = replica_spread(state, model)  # `model` is the module the processes share
                fa.print_on_main(
                    state,
                    f"step {state.step}: loss {metrics['loss'].item():.4f}, "
                    f"replicas differ by up to {spread:.2e}",
                )
    fa.shutdown(state)


if __name__ == "__main__":
    main()
