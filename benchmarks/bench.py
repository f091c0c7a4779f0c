"""Every ratio issue 15 asks for, in one table (``make bench``, a few minutes).

Rows, each against a baseline measured in the same run, the contenders'
blocks alternating (the order rotating every round), the figure the median
over rounds:

- step: ``fa.step`` over a list of batches against the hand-written step
  (`step_overhead.py`'s ``step`` case);
- loop: ``fa.batches`` + ``fa.step`` against a plain ``DataLoader`` loop, with
  Accelerate's and Lightning Fabric's versions of the same loop in the same
  rotation (`peers.py`; the ``bench`` extra installs them);
- ddp step: the same step on 2 gloo processes against a hand-made
  ``DistributedDataParallel`` loop (at least 21 rounds);
- collectives: gather, reduce and broadcast at 1 MB and 64 MB per rank
  (`collectives.py`, at least 21 rounds), each followed by its A/A control (the raw
  call timed against itself in the same place: the row's noise floor);
- checkpoints: ``fa.save`` / ``fa.load`` / what an async save blocks, against
  raw safetensors + ``os.sync()`` and against Accelerate's ``save_state`` (+
  ``os.sync()``) / ``load_state`` (`checkpoints.py`'s cases); the load also
  against the raw load plus one read of every byte (`checkpoints.raw_load_read`:
  the raw load never reads the optimizer's state, which a verifying load must);
- import: ``import torch, fnaccel`` against ``import torch``.

``--clock cpu`` (the default) times the single-process step and loop rows by
the process's CPU time, which stays readable on a shared, loaded machine;
the ddp, collective, checkpoint and import rows are wall-clock.

    python benchmarks/bench.py [--rounds 9] [--size 150] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoints
import collectives
import step_overhead
import torch
from peers import PEERS, accelerate_checkpoint

import fnaccel as fa
from fnaccel.testing import World

Row = tuple[str, str, float, float, str]  # what, baseline, baseline s, fnaccel s, target


def alternate(
    contenders: dict[str, Callable[[], Any]], rounds: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds per call of each contender, the order rotating every round."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for fn in contenders.values():
        fn()  # warm-up
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = clock()
            contenders[name]()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def step_rows(rounds: int, clock: Callable[[], float]) -> list[Row]:
    hand, ours = step_overhead._loops(None, step_overhead.make_data(0))
    step = alternate({"hand": hand, "fnaccel": ours}, rounds, clock)
    rows: list[Row] = [
        (
            "step (MLP 32-64-10, batch 16, SGD)",
            "hand-written step",
            step["hand"] / step_overhead.STEPS,
            step["fnaccel"] / step_overhead.STEPS,
            "1.05",
        )
    ]
    hand_loop, fa_loop = step_overhead._data_loops()
    contenders = {"hand": hand_loop, "fnaccel": fa_loop}
    loader = step_overhead.shuffled_loader()
    missing = []
    for name, build in PEERS.items():
        try:
            contenders[name] = build(loader)
        except ImportError as exc:
            missing.append(f"{name}: {exc} (pip install -e '.[bench]')")
    loop = alternate(contenders, rounds, clock)
    per = step_overhead.STEPS
    rows.append(
        (
            "loop: data + step, one epoch",
            "DataLoader loop",
            loop["hand"] / per,
            loop["fnaccel"] / per,
            "1.03, below both peers",
        )
    )
    for name in PEERS:
        if name in loop:
            rows.append(
                (f"loop: the same in {name}", "DataLoader loop", loop["hand"] / per, loop[name] / per, "-")
            )
    for line in missing:
        print("not measured:", line)
    return rows


def ddp_rows(rounds: int) -> list[Row]:
    with World(2) as world:
        per_rank = world.run(step_overhead.ddp_worker, rounds)
    slowest = {
        name: statistics.median(max(r[name][i] for r in per_rank) for i in range(rounds))
        for name in ("baseline", "fnaccel")
    }
    return [("ddp step, 2 gloo processes", "hand DDP step", slowest["baseline"], slowest["fnaccel"], "1.03")]


def collective_rows(rounds: int) -> list[Row]:
    """Each collective, then its A/A control (the raw call timed against itself,
    in the same place in the sequence): how far noise alone moves that row."""
    cases = [name for op in ("gather", "reduce", "broadcast") for name in (op, f"{op} A/A")]
    # at least 21 rounds: one 1 MB round moves by up to 40% on a 2-core machine
    out = collectives.main(
        ["--cases", *cases, "--sizes", "1MB", "64MB", "--rounds", str(max(rounds, 21)), "--budget", "5"]
    )
    return [
        (
            f"{r['case']} {r['size']}",
            "the same raw call (noise)" if r["case"].endswith("A/A") else "torch.distributed call",
            r["baseline_s"],
            r["fnaccel_s"],
            "-" if r["case"].endswith("A/A") else "1.10",
        )
        for r in out
    ]


def checkpoint_rows(size: float, rounds: int) -> list[Row]:
    state, model, optimizer = checkpoints.make_state(size)
    root = Path(tempfile.mkdtemp(prefix="fnaccel-bench-"))
    rows: list[Row] = []
    try:
        raw, ours, theirs = root / "raw", root / "ours", root / "accelerate"
        checkpoints.raw_save(model, optimizer, raw)
        fa.save(state, ours)
        base, mine = checkpoints.compare(
            rounds, lambda: checkpoints.raw_save(model, optimizer, raw), lambda: fa.save(state, ours)
        )
        rows.append((f"save {size:.0f} MB: fa.save", "save_file + os.sync()", base, mine, "1.15"))
        current = [state]

        def load() -> None:
            current.append(fa.load(current.pop(), ours))

        base, mine = checkpoints.compare(rounds, lambda: checkpoints.raw_load(model, optimizer, raw), load)
        rows.append((f"load {size:.0f} MB: fa.load", "load_file + load_state_dict", base, mine, "1.5"))
        base, mine = checkpoints.compare(
            rounds, lambda: checkpoints.raw_load_read(model, optimizer, raw), load
        )
        rows.append((f"load {size:.0f} MB: fa.load", "the same + one read of every byte", base, mine, "-"))
        state = current[0]
        try:
            acc_save, acc_load = accelerate_checkpoint(model, optimizer)
        except ImportError as exc:
            print(f"not measured: accelerate save_state/load_state: {exc} (pip install -e '.[bench]')")
        else:

            def acc_save_synced() -> None:
                acc_save(theirs)
                os.sync()

            acc_save_synced()
            base, mine = checkpoints.compare(rounds, acc_save_synced, lambda: fa.save(state, ours))
            rows.append((f"save {size:.0f} MB: fa.save", "Accelerate save_state + sync", base, mine, "-"))
            base, mine = checkpoints.compare(rounds, lambda: acc_load(theirs), load)
            rows.append((f"load {size:.0f} MB: fa.load", "Accelerate load_state", base, mine, "-"))
            state = current[0]
        blocking, blocked = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            fa.save(state, ours)
            blocking.append(time.perf_counter() - start)
            start = time.perf_counter()
            handle = fa.save(state, ours, blocking=False)
            blocked.append(time.perf_counter() - start)
            handle.wait()
        rows.append(
            (
                "async save: what it blocks",
                "a blocking fa.save",
                statistics.median(blocking),
                statistics.median(blocked),
                "0.25",
            )
        )
        fa.shutdown(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def import_rows(rounds: int) -> list[Row]:
    times = step_overhead.import_times(rounds)
    return [
        (
            "import torch, fnaccel",
            "import torch",
            statistics.median(times["baseline"]),
            statistics.median(times["fnaccel"]),
            "1.05",
        )
    ]


def _fmt(seconds: float) -> str:
    return (
        f"{seconds * 1e6:.1f} us"
        if seconds < 1e-3
        else (f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--size", type=float, default=150, help="checkpoint size, MB")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows = step_rows(args.rounds, clock)
    rows += ddp_rows(max(21, args.rounds))  # a 2-process row: more rounds to read 3% through its noise
    rows += collective_rows(max(5, args.rounds))
    rows += checkpoint_rows(args.size, max(3, args.rounds // 2))
    rows += import_rows(max(5, args.rounds // 2))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"\nmake bench, {now}: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {load_before:.1f} at start and {os.getloadavg()[0]:.1f} at end, "
        f"{time.perf_counter() - started:.0f} s; step and loop rows on the {args.clock} clock"
    )
    print(f"| {'what':<36} | {'against':<30} | {'baseline':>10} | {'measured':>10} | {'ratio':>6} | target |")
    print(f"|{'-' * 38}|{'-' * 32}|{'-' * 12}|{'-' * 12}|{'-' * 8}|--------|")
    for what, against, base, mine, target in rows:
        print(
            f"| {what:<36} | {against:<30} | {_fmt(base):>10} | {_fmt(mine):>10} | {mine / base:6.2f} | {target} |"
        )


if __name__ == "__main__":
    main()
