"""fnaccel's own cost per training step, against the same hand-written loop.

Four measurements, each a ratio against a baseline taken in the same run:

``step``
    A 32-64-10 MLP, batch 16, SGD, one CPU thread, 200 steps per block:
    ``loss = F.cross_entropy(model(x), y); loss.backward(); opt.step();
    opt.zero_grad(set_to_none=True)`` against ``state, metrics =
    fa.step(state, (x, y))`` with the same loss function. Blocks of the two
    alternate (which goes first alternates too); the figure is the median over
    rounds of time per step.
``loop``
    The loop a user writes, data included: a shuffled ``DataLoader`` (batch
    16) over a ``TensorDataset`` of 200 batches, ``for x, y in loader:`` and
    the same four lines, against ``for batch in fa.batches(state): state,
    metrics = fa.step(state, batch)`` with that ``DataLoader`` prepared. A
    block is one epoch.
``ddp step``
    The same on 2 gloo processes (`fnaccel.testing.World`): a hand-written
    ``DistributedDataParallel`` loop against ``fa.step`` with ``fa.ddp()``;
    a block's time is the max over the ranks.
``ddp loop``
    The same with data: a hand DDP loop over a ``DistributedSampler``'s
    ``DataLoader`` against ``fa.batches`` + ``fa.step`` with ``fa.ddp()``,
    each rank reading 200 batches.
``ddp preempt/K``
    What watching for preemption adds (`fa.PreemptionKwargs`, one
    asynchronous all-reduce every K steps; ``--preemption K ...``, default 8):
    the ``ddp loop``'s fnaccel loop as the baseline, the same loop watched.
``import``
    ``python -c "import torch"`` against ``python -c "import torch, fnaccel"``
    in fresh interpreters, alternating, median of the wall times.

Run from the repository root::

    python benchmarks/step_overhead.py [--rounds 21] [--clock cpu] [--skip-ddp] [--skip-import]
        [--preemption K ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.testing import World

STEPS = 200


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def make_data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)
    ]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _loops(state: fa.RunState | None, data: list[Any], wrap_ddp: Any = None) -> tuple[Any, Any]:
    """The baseline and the fnaccel loop over ``data``, each timing one block."""
    hand_model = make_model()
    if wrap_ddp is not None:
        hand_model = wrap_ddp(hand_model)
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.01)

    def hand() -> None:
        for batch in data:
            loss = loss_fn(hand_model, batch)
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pipeline = fa.compose(fa.ddp()) if wrap_ddp is not None else fa.compose()
    holder = [fa.prepare(state or fa.init(seed=0, cpu=True), model, opt, loss_fn=loss_fn, pipeline=pipeline)]

    def fnaccel() -> None:
        s = holder[0]
        for batch in data:
            s, _ = fa.step(s, batch)
        holder[0] = s

    return hand, fnaccel


def shuffled_loader() -> DataLoader:
    """A shuffled ``DataLoader`` (batch 16) over a TensorDataset of ``STEPS`` batches."""
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.randn(STEPS * 16, 32, generator=g), torch.randint(0, 10, (STEPS * 16,), generator=g)
    )
    return DataLoader(dataset, batch_size=16, shuffle=True)


def _data_loops() -> tuple[Any, Any]:
    """The hand-written ``DataLoader`` loop and the `fa.batches` + `fa.step` loop,
    each over one epoch of the same shuffled TensorDataset."""
    loader = shuffled_loader()
    hand_model = make_model()
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.01)

    def hand() -> None:
        for batch in loader:
            loss = loss_fn(hand_model, batch)
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    holder = [
        fa.prepare(fa.init(seed=0, cpu=True), model, opt, loader, loss_fn=loss_fn, pipeline=fa.compose())
    ]

    def fnaccel() -> None:
        s = holder[0]
        for batch in fa.batches(s):
            s, _ = fa.step(s, batch)
        holder[0] = s

    return hand, fnaccel


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time_blocks(
    hand: Any, fnaccel: Any, rounds: int, barrier: Any = None, clock: str = "wall"
) -> dict[str, list[float]]:
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {"baseline": [], "fnaccel": []}
    hand(), fnaccel()  # warm-up
    for r in range(rounds):
        order = [("baseline", hand), ("fnaccel", fnaccel)]
        for name, fn in order if r % 2 == 0 else reversed(order):
            if barrier is not None:
                barrier()
            start = now()
            fn()
            times[name].append((now() - start) / STEPS)
    return times


def ddp_worker(state: fa.RunState, rounds: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    group = state.dist.process_group

    def wrap(model: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(model, process_group=group)

    hand, fnaccel = _loops(state, make_data(state.dist.rank), wrap_ddp=wrap)
    return _time_blocks(hand, fnaccel, rounds, barrier=lambda: dist.barrier(group=group))


def ddp_loop_worker(
    state: fa.RunState, rounds: int, check_every: int | None, clock: str = "wall"
) -> dict[str, list[float]]:
    """The ``ddp loop`` rows: `fa.batches` + `fa.step` with ``fa.ddp()``, each rank reading
    ``STEPS`` batches, against a hand DDP loop over a ``DistributedSampler`` (``check_every``
    None); or, with ``check_every``, the same fnaccel loop with a `fa.PreemptionKwargs` watch
    (one asynchronous all-reduce every ``check_every`` steps) against it without."""
    from torch.utils.data.distributed import DistributedSampler

    from fnaccel.preemption import install
    from fnaccel.resources import Resources
    from fnaccel.state import Lease

    torch.set_num_threads(1)
    group = state.dist.process_group
    g = torch.Generator().manual_seed(0)
    n = STEPS * 16 * state.dist.num_processes
    dataset = TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))

    def fnaccel_loop(resources: Resources) -> Any:
        model = make_model()
        fresh = dataclasses.replace(state, resources=resources, _lease=Lease())  # a run of its own
        holder = [
            fa.prepare(
                fresh,
                model,
                torch.optim.SGD(model.parameters(), lr=0.01),
                DataLoader(dataset, batch_size=16, shuffle=True),
                loss_fn=loss_fn,
                pipeline=fa.compose(fa.ddp()),
            )
        ]

        def loop() -> None:
            s = holder[0]
            for batch in fa.batches(s):
                s, _ = fa.step(s, batch)
            holder[0] = s

        return loop

    if check_every is None:
        sampler = DistributedSampler(dataset, state.dist.num_processes, state.dist.rank, seed=0)
        hand_loader = DataLoader(dataset, batch_size=16, sampler=sampler)
        hand_model = nn.parallel.DistributedDataParallel(make_model(), process_group=group)
        hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.01)

        def hand() -> None:
            for batch in hand_loader:
                loss = loss_fn(hand_model, batch)
                loss.backward()
                hand_opt.step()
                hand_opt.zero_grad(set_to_none=True)

        return _time_blocks(
            hand, fnaccel_loop(Resources()), rounds, barrier=lambda: dist.barrier(group=group), clock=clock
        )
    watched = Resources()
    install(watched, fa.PreemptionKwargs(check_every=check_every), state.dist)
    try:
        return _time_blocks(
            fnaccel_loop(Resources()),
            fnaccel_loop(watched),
            rounds,
            barrier=lambda: dist.barrier(group=group),
            clock=clock,
        )
    finally:
        watched.close()  # the watch's handlers go back


def import_times(rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"baseline": [], "fnaccel": []}
    commands = {"baseline": "import torch", "fnaccel": "import torch, fnaccel"}
    for r in range(rounds):
        names = ["baseline", "fnaccel"] if r % 2 == 0 else ["fnaccel", "baseline"]
        for name in names:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", commands[name]], check=True)
            times[name].append(time.perf_counter() - start)
    return times


def _row(label: str, times: dict[str, list[float]], unit: float, suffix: str) -> dict[str, Any]:
    base, ours = statistics.median(times["baseline"]), statistics.median(times["fnaccel"])
    print(
        f"{label:<10} {base * unit:10.1f} {suffix} {ours * unit:10.1f} {suffix}  {ours / base:6.3f}",
        flush=True,
    )
    return {"case": label, "baseline": base, "fnaccel": ours, "ratio": ours / base}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description="fa.step's overhead over a hand-written loop")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--skip-import", action="store_true")
    parser.add_argument(
        "--preemption",
        type=int,
        nargs="*",
        default=[8],
        metavar="K",
        help="ddp preempt/K rows: the ddp loop watching for preemption, agreeing every K steps",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: this process's CPU time (robust on a loaded machine; for ddp, only the preempt rows)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, one CPU thread per process, {STEPS} steps per block, "
        f"{args.rounds} rounds, {args.clock} clock"
    )
    print(f"{'case':<10} {'baseline':>13} {'fnaccel':>13}  {'ratio':>6}")
    rows = [
        _row(
            "step", _time_blocks(*_loops(None, make_data(0)), rounds=args.rounds, clock=args.clock), 1e6, "us"
        )
    ]
    rows.append(_row("loop", _time_blocks(*_data_loops(), rounds=args.rounds, clock=args.clock), 1e6, "us"))
    if not args.skip_ddp:
        with World(2) as world:
            per_rank = world.run(ddp_worker, args.rounds)
            slowest = {
                name: [max(r[name][i] for r in per_rank) for i in range(args.rounds)]
                for name in ("baseline", "fnaccel")
            }
            rows.append(_row("ddp step", slowest, 1e6, "us"))
            for label, check_every in [("ddp loop", None)] + [
                (f"ddp preempt/{k}", k) for k in args.preemption
            ]:
                # the cpu clock suits the preempt rows (two fnaccel loops, the same waits)
                per_rank = world.run(ddp_loop_worker, args.rounds, check_every, args.clock)
                slowest = {
                    name: [max(r[name][i] for r in per_rank) for i in range(args.rounds)]
                    for name in ("baseline", "fnaccel")
                }
                rows.append(_row(label, slowest, 1e6, "us"))
    if not args.skip_import:
        rows.append(_row("import", import_times(max(5, args.rounds // 2)), 1e3, "ms"))
    return rows


if __name__ == "__main__":
    main()
