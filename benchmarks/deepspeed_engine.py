"""What fa.deepspeed costs next to fa.ddp() on this machine: engine start and time per step.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/deepspeed_engine.py

Over 2 gloo processes (`fnaccel.testing.World(2)`), an MLP of 8 -> 512 -> 512 ->
1 (about 270 k parameters, AdamW), batches of 32 per rank. For ``ddp`` and ZeRO
stages 1, 2 and 3 it measures:

``prepare``  the first `fa.prepare` of a fresh model (``deepspeed.initialize``
             for the engines; DDP's wrapping for ``ddp``), the slowest rank;
``step``     the median over blocks of 20 `fa.step` calls (after 5 warm-up
             steps), the slowest rank.

The cases run in alternating rounds (ddp, z1, z2, z3, ddp, ...) so that a
burst of load from other work on the machine hits them alike; the table
gives each case's median over the rounds. It also prints how long ``import
deepspeed`` takes in a fresh interpreter after torch.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

import fnaccel as fa
from fnaccel.testing import World

ROUNDS, BLOCK, WARMUP = 3, 20, 5
CASES = ("ddp", "zero1", "zero2", "zero3")


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def measure(state: fa.RunState, case: str) -> tuple[float, float]:
    """(prepare seconds, median seconds per step) on this rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pipeline = fa.compose(fa.ddp() if case == "ddp" else fa.deepspeed(zero_stage=int(case[-1])))
    start = time.perf_counter()
    state = fa.prepare(state, model, opt, pipeline=pipeline, loss_fn=_loss)
    prepare = time.perf_counter() - start
    batch = (torch.randn(32, 8), torch.randn(32))
    for _ in range(WARMUP):
        state, _ = fa.step(state, batch)
    blocks = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(BLOCK):
            state, metrics = fa.step(state, batch)
        float(metrics["loss"])
        blocks.append((time.perf_counter() - start) / BLOCK)
    fa.shutdown(state)
    return prepare, statistics.median(blocks)


def main() -> None:
    code = "import time, torch; t = time.perf_counter(); import deepspeed; print(time.perf_counter() - t)"
    imports = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout.split()[-1]
        )
        for _ in range(3)
    ]
    print(f"import deepspeed after torch: {statistics.median(imports):.2f} s (median of 3)")
    results: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
    with World(2, timeout=600) as world:
        for _ in range(ROUNDS):
            for case in CASES:
                ranks = world.run(measure, case)
                results[case].append((max(r[0] for r in ranks), max(r[1] for r in ranks)))
    ddp_step = statistics.median(s for _, s in results["ddp"])
    print(f"{'case':8} {'prepare (s)':>12} {'step (ms)':>10} {'vs ddp':>7}")
    for case in CASES:
        prepare = statistics.median(p for p, _ in results[case])
        step = statistics.median(s for _, s in results[case])
        print(f"{case:8} {prepare:12.3f} {step * 1e3:10.2f} {step / ddp_step:7.2f}")


if __name__ == "__main__":
    main()
