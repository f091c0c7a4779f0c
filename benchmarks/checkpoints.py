"""Checkpoint save and load against raw safetensors, and what an asynchronous save blocks.

An MLP of ``Linear(1024, 1024)`` layers with AdamW state (one optimizer step
taken, so ``exp_avg``/``exp_avg_sq`` exist): model + optimizer come to about
``--size`` MB in float32. Three ratios, each against a baseline taken in the
same run, blocks of the two sides alternating (which goes first alternates
too), the figure the median over ``--rounds``:

``save``
    ``safetensors.torch.save_file`` of the model's and the optimizer's tensors
    (two files) + ``os.sync()``, against a blocking ``fa.save`` (atomic,
    checksummed, every file and the directory fsynced), in two rows: into a
    new directory each round (the previous round's removed outside the timed
    part, on both sides), and over the existing checkpoint (``save_file`` over
    the existing files). Over an existing checkpoint, ``fa.save`` deletes the
    replaced one on a thread beside the run, which a training loop overlaps
    with its steps; here it is waited for outside the timed part (the next
    save would wait for it), and ``os.sync()`` follows each side untimed.
``load``
    ``load_file`` of those two files + ``model.load_state_dict`` +
    ``optimizer.load_state_dict``, against ``fa.load`` of the checkpoint
    (bounded reads, every file's size and sha256 checked).
``async``
    The time ``fa.save(state, path, blocking=False)`` holds the caller (the
    snapshot copied to the CPU), against a blocking ``fa.save``; the
    background write is waited for outside the timed part.

``--clock cpu`` times each side by the process's CPU time (every thread's,
the checksum helper's included) instead of the wall clock: on a shared,
loaded machine that leaves out the time the process waited for a core. It
also leaves out the time spent waiting for the disk, so it is for the load
and async rows; read the save row on the wall clock.

Run from the repository root (``--dir`` on the disk you care about)::

    python benchmarks/checkpoints.py [--size 150] [--rounds 7] [--dir /tmp] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import fnaccel as fa

WIDTH = 1024


def make_state(size_mb: float) -> tuple[fa.RunState, nn.Module, torch.optim.Optimizer]:
    """A prepared state whose model + AdamW state is about ``size_mb`` MB."""
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3  # weights, exp_avg, exp_avg_sq
    layers = max(1, round(size_mb * 1e6 / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = fa.prepare(fa.init(seed=0, cpu=True), model, optimizer)
    return state, model, optimizer


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{key}": value
        for i, per in optimizer.state_dict()["state"].items()
        for key, value in per.items()
    }


def raw_save(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    save_file(model.state_dict(), folder / "model.safetensors")
    save_file(optimizer_tensors(optimizer), folder / "optimizer.safetensors")
    os.sync()


def raw_load(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    model.load_state_dict(load_file(folder / "model.safetensors"))
    flat = load_file(folder / "optimizer.safetensors")
    saved = optimizer.state_dict()
    per: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in flat.items():
        index, key = name.split(".", 1)
        per.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": per, "param_groups": saved["param_groups"]})


def raw_load_read(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """`raw_load`, then one read of every byte of the two files: the least any load
    that verifies what it reads must add. ``load_state_dict`` copies the model's
    weights, but the optimizer's state stays a view of the file's mapping, never
    read (paged in at the first step): the raw load reads a third of the bytes."""
    raw_load(model, optimizer, folder)
    for name in ("model.safetensors", "optimizer.safetensors"):
        with open(folder / name, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as data:
            words = torch.frombuffer(data, dtype=torch.int64, count=len(data) // 8)
            words.sum()
            del words  # the mapping closes only once no tensor views it


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def timed(fn: Callable[[], object]) -> float:
    start = clock()
    fn()
    return clock() - start


def compare(
    rounds: int,
    baseline: Callable[[], object],
    ours: Callable[[], object],
    settle: Callable[[], object] = lambda: None,
) -> tuple[float, float]:
    """Median seconds of ``baseline`` and of ``ours``, alternating which runs first;
    ``settle`` runs untimed after each."""
    base, mine = [], []
    for r in range(rounds):
        for side in ((ours, mine), (baseline, base)) if r % 2 else ((baseline, base), (ours, mine)):
            side[1].append(timed(side[0]))
            settle()
    return statistics.median(base), statistics.median(mine)


class Fresh:
    """A new directory under ``root`` for each save (``name-0``, ``name-1``, ...); ``settle``
    removes every earlier one and syncs, outside the timed part."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name, self.count = root, name, 0

    def next(self) -> Path:
        self.count += 1
        return self.root / f"{self.name}-{self.count}"

    def settle(self) -> None:
        for old in range(1, self.count):
            shutil.rmtree(self.root / f"{self.name}-{old}", ignore_errors=True)
        os.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=150, help="model + optimizer state, MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (a temporary folder inside it)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument(
        "--only", nargs="+", choices=["save", "load", "async"], default=["save", "load", "async"]
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    state, model, optimizer = make_state(args.size)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for t in optimizer_tensors(optimizer).values())
    root = Path(tempfile.mkdtemp(prefix="fnaccel-bench-", dir=args.dir))
    try:
        raw, ckpt = root / "raw", root / "ckpt"
        raw_save(model, optimizer, raw)
        fa.save(state, ckpt)
        rows = []
        if "save" in args.only:
            raw_new, ckpt_new = Fresh(root, "raw"), Fresh(root, "ckpt")

            def settle_new() -> None:
                raw_new.settle()
                ckpt_new.settle()

            base, ours = compare(
                args.rounds,
                lambda: raw_save(model, optimizer, raw_new.next()),
                lambda: fa.save(state, ckpt_new.next()),
                settle_new,
            )
            rows.append(("save, new directory: fa.save / save_file + os.sync()", base, ours))

            def settle_over() -> None:
                state.resources.get("saves").wait()  # the replaced checkpoint's removal, beside the run
                os.sync()

            base, ours = compare(
                args.rounds,
                lambda: raw_save(model, optimizer, raw),
                lambda: fa.save(state, ckpt),
                settle_over,
            )
            rows.append(("save over the last: fa.save / save_file + os.sync()", base, ours))
        current = [state]  # fa.load consumes the state it is given: each load takes the last one's

        def load() -> None:
            current.append(fa.load(current.pop(), ckpt))

        if "load" in args.only:
            base, ours = compare(args.rounds, lambda: raw_load(model, optimizer, raw), load)
            state = current[0]
            rows.append(("load: fa.load / load_file + load_state_dict", base, ours))
        handles: list[fa.SaveHandle] = []

        def background() -> None:
            handles.append(fa.save(state, ckpt, blocking=False))

        def blocking() -> None:
            if handles:
                handles.pop().wait()  # the previous background write, outside the timed part of the next
            fa.save(state, ckpt)

        async_base, async_ours = [], []
        for _ in range(args.rounds if "async" in args.only else 0):
            async_base.append(timed(blocking))
            async_ours.append(timed(background))
            handles.pop().wait()
        if async_ours:
            rows.append(
                (
                    "async: fa.save(blocking=False) blocks / blocking fa.save",
                    statistics.median(async_base),
                    statistics.median(async_ours),
                )
            )
        fa.shutdown(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"checkpoint of {nbytes / 1e6:.0f} MB (model + AdamW state), median of {args.rounds} rounds, "
        f"torch {torch.__version__}, in {args.dir or tempfile.gettempdir()}, {args.clock} clock"
    )
    print(f"{'what':58} {'baseline s':>10} {'fnaccel s':>10} {'ratio':>6}")
    for name, base, ours in rows:
        print(f"{name:58} {base:10.3f} {ours:10.3f} {ours / base:6.2f}")


if __name__ == "__main__":
    main()
