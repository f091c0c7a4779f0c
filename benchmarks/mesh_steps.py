"""Step times of the mesh layouts on this machine (gloo, CPU): DDP, FSDP, TP,
FSDP + TP, HSDP, each with and without activation checkpointing where it applies.

    .venv/bin/python benchmarks/mesh_steps.py [--steps N]

Model: 4 residual MLP blocks of width 256 (hidden 1024; 2.1 M parameters),
batch 16 per data-parallel rank, SGD, one `fa.step` per batch. Each layout runs
in a `fnaccel.testing.World` of its size (one world per size, reused), warms up
for 3 steps, then times blocks of N steps; a layout's figure is its least
disturbed block (the minimum over blocks and over ``--rounds`` passes through
the table, of the slowest rank's mean step). On a shared 2-core machine other
processes inflate single blocks many times over: compare layouts within one
run, never against a number from another day.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

import fnaccel as fa
from fnaccel.testing import World

WIDTH, BATCH = 256, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def time_layout(
    base: fa.RunState, layout: dict[str, int], names: tuple[str, ...], steps: int, blocks: int = 5
) -> list[float]:
    makers = {
        "ddp": fa.ddp,
        "fsdp": lambda: fa.fsdp(transformer_cls_names_to_wrap=["Block"]),
        "tp": lambda: fa.tp(_plan()),
        "ckpt": fa.checkpoint_activations,
    }
    state = fa.init(cpu=True, seed=0, parallelism=fa.ParallelismConfig(**layout))
    try:
        torch.manual_seed(0)
        model = Net()
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=1e-3),
            pipeline=fa.compose(*(makers[n]() for n in names)),
            loss_fn=lambda m, x: m(x),
        )
        x = torch.randn(BATCH, WIDTH)
        for _ in range(3):
            state, _ = fa.step(state, x)
        times = []
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = fa.step(state, x)
            float(metrics["loss"])
            times.append((time.perf_counter() - start) / steps)
        return times
    finally:
        fa.shutdown(state)


CASES = (
    (2, "DDP", {}, ("ddp",)),
    (2, "FSDP", {}, ("fsdp",)),
    (2, "TP", {"tp_size": 2}, ("tp",)),
    (2, "TP + activation checkpointing", {"tp_size": 2}, ("tp", "ckpt")),
    (4, "FSDP + TP (2x2)", {"dp_shard_size": 2, "tp_size": 2}, ("tp", "fsdp")),
    (4, "HSDP (2x2)", {"dp_replicate_size": 2, "dp_shard_size": 2}, ("fsdp",)),
    (
        4,
        "HSDP (2x2) + activation checkpointing",
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        ("ckpt", "fsdp"),
    ),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=2, help="passes through the table")
    args = parser.parse_args()
    worlds: dict[int, World] = {}
    best: dict[str, float] = {}
    try:
        for _ in range(args.rounds):
            for size, label, layout, names in CASES:
                world = worlds.get(size) or worlds.setdefault(size, World(size, timeout=600))
                per_rank = world.run(time_layout, layout, names, args.steps)
                # the slowest rank of each block, then the best block
                block = min(max(ranks) for ranks in zip(*per_rank, strict=True))
                best[label] = min(best.get(label, float("inf")), block)
        print("| layout | processes | ms/step |\n|---|---|---|")
        for size, label, _, _ in CASES:
            print(f"| {label} | {size} | {1000 * best[label]:.1f} |")
    finally:
        for world in worlds.values():
            world.close()


if __name__ == "__main__":
    main()
