"""Step time of `fa.pp` on 2 gloo processes against the unsplit model in one process,
and against the same schedule written by hand with `torch.distributed.pipelining`.

The model: ``nn.Sequential`` of 8 x (Linear(512, 512), Tanh) and a Linear(512, 10)
head, batch 64 (4 micro-batches of 16), SGD, one CPU thread per process.

``unsplit``
    One process, the whole model, the hand-written loop: ``F.cross_entropy(
    model(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True)``.
``<schedule> by hand`` / ``<schedule> fa.pp``
    2 processes, two stages (four for Interleaved1F1B): a hand-written loop
    over `PipelineStage` and the schedule (``schedule.step(...)``, then the
    optimizer) against ``fa.step`` with ``fa.pp(...)``; and the hand-written
    loop with a ``dist.barrier()`` ending each step (``fa.pp`` ends each step
    with the loss broadcast, which keeps the ranks in step). Blocks of the
    three alternate; a block's time is the max over the ranks.

The figures are the median (and the fastest) over rounds of the time per
step. Run from the repository root::

    python benchmarks/pp_step.py [--rounds 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import fnaccel as fa
from fnaccel.testing import World

BATCH, MICROBATCHES, WIDTH = 64, 4, 512
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _timed(run: Any, steps: int, barrier: Any = None) -> float:
    if barrier is not None:
        barrier()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    if barrier is not None:
        barrier()
    return (time.perf_counter() - start) / steps


def unsplit_times(rounds: int, steps: int) -> list[float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_batch()

    def run() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run()
    return [_timed(run, steps) for _ in range(rounds)]


def _by_hand(state: fa.RunState, schedule: str) -> Any:
    from torch.distributed import pipelining

    rank, size = state.dist.rank, state.dist.num_processes
    model = make_model()
    num_stages = size * (2 if schedule == "Interleaved1F1B" else 1)
    children = list(model._modules.items())
    bounds = [round(i * len(children) / num_stages) for i in range(num_stages + 1)]
    stages, params = [], []
    for index in range(rank, num_stages, size):
        body = nn.Sequential(OrderedDict(children[bounds[index] : bounds[index + 1]]))
        params += list(body.parameters())
        stages.append(
            pipelining.PipelineStage(
                body, index, num_stages, torch.device("cpu"), group=state.dist.process_group
            )
        )
    kind = getattr(pipelining, f"Schedule{schedule}")
    sched = kind(
        stages if len(stages) > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=F.cross_entropy
    )
    opt = torch.optim.SGD(params, lr=0.01)
    x, y = make_batch()
    first, last = rank == 0, rank == size - 1

    def run() -> None:
        losses: list[torch.Tensor] = []
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _with_fnaccel(state: fa.RunState, schedule: str) -> Any:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pipeline = fa.compose(fa.pp(loss_fn=F.cross_entropy, num_microbatches=MICROBATCHES, schedule=schedule))
    holder = [fa.prepare(state, model, opt, pipeline=pipeline)]
    batch = make_batch()

    def run() -> None:
        holder[0], _ = fa.step(holder[0], batch)

    return run


def pp_worker(state: fa.RunState, schedule: str, rounds: int, steps: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = state.dist.process_group
    hand = _by_hand(state, schedule)

    def hand_in_step() -> None:
        hand()
        dist.barrier(group=group)

    runs = {"hand": hand, "hand + barrier": hand_in_step, "fnaccel": _with_fnaccel(state, schedule)}
    for run in runs.values():
        run()  # shape inference and warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds):
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            times[name].append(_timed(runs[name], steps, lambda: dist.barrier(group=group)))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, batch {BATCH}, {MICROBATCHES} micro-batches, one thread per process, "
        f"{args.steps} steps per block, {args.rounds} rounds (median ms per step)"
    )
    times = unsplit_times(args.rounds, args.steps)
    unsplit = statistics.median(times)
    print(f"{'unsplit, 1 process':<38} {unsplit * 1e3:8.2f} ms (fastest {min(times) * 1e3:.2f})")
    with World(2, timeout=600) as world:
        for schedule in SCHEDULES:
            per_rank = world.run(pp_worker, schedule, args.rounds, args.steps)
            for name in per_rank[0]:
                blocks = [max(r[name][i] for r in per_rank) for i in range(args.rounds)]
                slowest = statistics.median(blocks)
                label = f"{schedule} {name.replace('fnaccel', 'fa.pp')}, 2 processes"
                print(
                    f"{label:<38} {slowest * 1e3:8.2f} ms (fastest {min(blocks) * 1e3:.2f})  "
                    f"{slowest / unsplit:.2f} x unsplit"
                )


if __name__ == "__main__":
    main()
