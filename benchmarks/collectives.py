"""Overhead of fnaccel's collectives against hand-written torch.distributed code.

What it measures, over 2 gloo processes on this machine (`fnaccel.testing.World(2)`),
at payloads of 1 KB, 1 MB and 64 MB per rank (float32, 256 / 262144 / 16777216
elements):

``gather``
    baseline: ``out = torch.empty(2 * n); all_gather_single(out, t, group=pg)``
    (``all_gather_into_tensor`` on torch releases without ``all_gather_single``),
    which checks nothing;
    fnaccel:  ``fa.ops.gather(state, t)``, which checks every rank's tree
    (paths, dtypes, shapes) on every call, in every mode: the first call in
    one small collective before the data, the repeated (timed) ones with a
    one-element flag beside it (docs/collectives.md).

``reduce``
    baseline: ``out = t.clone(); all_reduce(out, SUM, group=pg)``;
    fnaccel:  ``fa.ops.reduce(state, t, "sum")``, which checks the same way.

``broadcast``
    baseline: rank 0 sends ``t``, the others receive into ``torch.empty_like(t)``;
    fnaccel:  ``fa.ops.broadcast(state, t)``, which checks the same way.

``pad+gather``
    A 2-D tensor of shape ``(rows_r, 256)`` whose row count differs by one
    between the ranks: the larger one holds the stated size (so after padding
    every rank sends the stated size), the other one row less (at 1 KB that is
    one row against zero rows).
    baseline: what a user writes by hand with torch.distributed: all-gather the
    local row counts as an int64 tensor, take the max, allocate a padded tensor
    with ``new_full(..., pad_index)`` and copy the rows in (skipped on the rank
    that already has the max, as Accelerate does), all-gather that;
    fnaccel:  ``fa.compose(fa.pad_across_processes(dim=0), fa.gather())(state, t)``
    with the pipeline built once, outside the timed loop; padding's exchange
    carries the whole check, so both sides make two collectives.

How: each (case, size) runs in one worker function on both ranks. It checks
that the two paths return identical tensors (which also warms them up), times
a probe of each to estimate the per-call time (the max over ranks, agreed with
an all-reduce so both ranks use the same block length), and picks k calls per
block so a block takes at least ``--min-block`` seconds (0.2 s) while the
timed part stays within ``--budget`` seconds (10 s). Then ``--rounds`` rounds
(21; up to 3x as many when a single call already fills a block, as at 64 MB),
each one block of baseline and one of fnaccel, alternating which goes first;
a barrier precedes every block, and every rank times its block with
`time.perf_counter`. The block times come back through `World.run`'s return
values; a block's time is the max over ranks (the collective is done when the
slowest rank is), and the reported figure is the median over rounds of block
time / k. The ratio is fnaccel / baseline: 1.00 means no overhead.

The workers run with ``OMP_NUM_THREADS=1``. On a small machine the figures
are noisy: ``--cases "gather A/A" "reduce A/A" "broadcast A/A" "pad+gather A/A"`` times the baseline
against itself, and how far those ratios stray from 1.00 is the noise floor
(about +-8% per row on a 2-core machine). The JSON keeps the per-round values
beside each median.

Run it from the repository root (takes about a minute)::

    python benchmarks/collectives.py [--json results.json] [--rounds 21]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fnaccel as fa
from fnaccel.testing import World

NUM_PROCESSES = 2
COLS = 256  # columns of the pad+gather case's 2-D tensor
SIZES = {"1KB": 256, "1MB": 262_144, "64MB": 16_777_216}  # float32 elements per rank
# The "A/A" cases time the baseline against itself: their ratios show how far
# from 1.0 noise alone moves a row on this machine.
CASES = (
    "gather",
    "reduce",
    "broadcast",
    "pad+gather",
    "gather A/A",
    "reduce A/A",
    "broadcast A/A",
    "pad+gather A/A",
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --- the hand-written baselines --------------------------------------------------


def raw_gather(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Plain torch.distributed gather of an equal-sized 1-D tensor."""
    out = torch.empty(world * t.shape[0], dtype=t.dtype)
    _all_gather_single(out, t, group=group)
    return out


def raw_pad_gather(t: torch.Tensor, group: Any, world: int, pad_index: int = 0) -> torch.Tensor:
    """Pad dim 0 to the largest rank's size and gather, by hand."""
    size = torch.tensor([t.shape[0]], dtype=torch.int64)
    sizes = torch.empty(world, dtype=torch.int64)
    _all_gather_single(sizes, size, group=group)
    max_rows = int(sizes.max().item())
    if t.shape[0] != max_rows:
        padded = t.new_full((max_rows, *t.shape[1:]), pad_index)
        padded[: t.shape[0]].copy_(t)
    else:
        padded = t
    out = torch.empty((world * max_rows, *t.shape[1:]), dtype=t.dtype)
    _all_gather_single(out, padded, group=group)
    return out


def raw_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def raw_broadcast(t: torch.Tensor, group: Any, rank: int) -> torch.Tensor:
    out = t if rank == 0 else torch.empty_like(t)
    dist.broadcast(out, src=0, group=group)
    return out


# --- the worker ----------------------------------------------------------------


def _block(fn: Callable[[], Any], k: int, group: Any) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(k):
        fn()
    return time.perf_counter() - start


def bench_worker(
    state: Any, case: str, numel: int, rounds: int, min_block: float, budget: float
) -> dict[str, Any]:
    """Runs on every rank: this rank's block times for one (case, size)."""
    ctx = state.dist
    group, world, rank = ctx.process_group, ctx.num_processes, ctx.rank
    gen = torch.Generator().manual_seed(rank)
    control = case.endswith(" A/A")
    if case.startswith("gather"):
        t = torch.randn(numel, generator=gen)

        def baseline() -> torch.Tensor:
            return raw_gather(t, group, world)

        def fnaccel() -> torch.Tensor:
            return baseline() if control else fa.ops.gather(state, t)

    elif case.startswith("reduce"):
        t = torch.randn(numel, generator=gen)

        def baseline() -> torch.Tensor:
            return raw_reduce(t, group)

        def fnaccel() -> torch.Tensor:
            return baseline() if control else fa.ops.reduce(state, t, "sum")

    elif case.startswith("broadcast"):
        t = torch.randn(numel, generator=gen)

        def baseline() -> torch.Tensor:
            return raw_broadcast(t, group, rank)

        def fnaccel() -> torch.Tensor:
            return baseline() if control else fa.ops.broadcast(state, t)

    elif case.startswith("pad+gather"):
        rows = numel // COLS - (1 if rank == 0 else 0)  # rank 0 is one row short
        t = torch.randn(rows, COLS, generator=gen)
        pipeline = fa.compose(fa.pad_across_processes(dim=0), fa.gather())

        def baseline() -> torch.Tensor:
            return raw_pad_gather(t, group, world)

        def fnaccel() -> torch.Tensor:
            return baseline() if control else pipeline(state, t)

    else:
        raise ValueError(f"unknown case {case!r}")

    # same answer both ways, and the first calls (allocator, gloo buffers) untimed
    expected, got = baseline(), fnaccel()
    if not torch.equal(expected, got):
        raise AssertionError(f"{case}/{numel}: fnaccel and the baseline disagree")
    del expected, got

    # per-call estimate (also the warm-up), agreed on by all ranks so that they
    # run the same number of calls: one call each, more when calls are short
    probe = 1
    while True:
        est = max(_block(baseline, probe, group), _block(fnaccel, probe, group)) / probe
        agreed = torch.tensor([est], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        est = float(agreed.item())
        if probe > 1 or est * 10 > min_block:
            break
        probe = math.ceil(0.1 / est)  # a longer probe: 0.1 s per side
    k = max(1, min(math.ceil(min_block / est), int(budget / (2 * rounds * est))))
    if k == 1:  # long calls: spend the budget on more rounds instead (at most 3x)
        rounds = max(rounds, min(3 * rounds, int(budget / (2 * est))))

    base_times: list[float] = []
    fa_times: list[float] = []
    for r in range(rounds):
        order = ((baseline, base_times), (fnaccel, fa_times))
        for fn, times in order if r % 2 == 0 else reversed(order):
            times.append(_block(fn, k, group))
    return {"k": k, "baseline": base_times, "fnaccel": fa_times}


# --- the driver -----------------------------------------------------------------


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:8.2f} ms"
    return f"{seconds:8.3f} s "


def _summarise(case: str, label: str, numel: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    k = per_rank[0]["k"]
    rounds = len(per_rank[0]["baseline"])
    row: dict[str, Any] = {"case": case, "size": label, "bytes": numel * 4, "k": k, "rounds": rounds}
    for name in ("baseline", "fnaccel"):
        # a block lasts until its slowest rank is done
        blocks = [max(times) for times in zip(*(r[name] for r in per_rank), strict=True)]
        per_call = [b / k for b in blocks]
        row[f"{name}_s"] = statistics.median(per_call)
        row[f"{name}_min_s"] = min(per_call)
        row[f"{name}_rounds_s"] = per_call
    row["ratio"] = row["fnaccel_s"] / row["baseline_s"]
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--rounds", type=int, default=21, help="alternating rounds (default 21)")
    parser.add_argument(
        "--min-block",
        type=float,
        default=0.2,
        help="seconds a timed block should last at least (default 0.2)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=10.0,
        help="timed seconds one (case, size) may take at most (default 10)",
    )
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES[:4]))
    args = parser.parse_args(argv)

    rows = []
    started = time.perf_counter()
    print(
        f"{NUM_PROCESSES} gloo processes, torch {torch.__version__}, "
        f"{platform.machine()}, OMP_NUM_THREADS=1 in the workers",
        flush=True,
    )
    header = f"{'case':<15} {'size':>5} {'k':>5} {'rounds':>6} {'baseline':>11} {'fnaccel':>11} {'ratio':>6}"
    print(header)
    print("-" * len(header), flush=True)
    with World(NUM_PROCESSES, timeout=300.0) as world:
        for case in args.cases:
            for label in args.sizes:
                numel = SIZES[label]
                per_rank = world.run(bench_worker, case, numel, args.rounds, args.min_block, args.budget)
                row = _summarise(case, label, numel, per_rank)
                rows.append(row)
                print(
                    f"{case:<15} {label:>5} {row['k']:>5} {row['rounds']:>6} "
                    f"{_fmt(row['baseline_s']):>11} "
                    f"{_fmt(row['fnaccel_s']):>11} {row['ratio']:6.3f}",
                    flush=True,
                )
    print(
        f"({time.perf_counter() - started:.1f} s in all; per call: median over rounds of "
        "block time / k, each block timed as the max over ranks)"
    )
    if args.json:
        meta = {
            "num_processes": NUM_PROCESSES,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "rounds": args.rounds,
            "min_block_s": args.min_block,
            "budget_s": args.budget,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
