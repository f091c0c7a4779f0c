"""One `fa.init` per model, many times in one process: launches that must all pass.

As a worker (under ``fnaccel launch``, which sets ``RANK``), each of ``--cycles``
cycles runs ``fa.init`` / ``fa.prepare`` / 3 ``fa.step`` / ``fa.shutdown`` on a
model built from the same seed, and appends one JSON line per cycle to
``OUT/rank<r>.jsonl``: a checksum of the trained weights (the same in every cycle
and on every rank when each new group works as the first did), the sum of
``rank + 1`` over the group, the TCP sockets the process still holds after the
shutdown, and the cycle's seconds. ``--fail-at K`` makes rank 1 raise in the
middle of cycle K (after its first step), to check that the launch still ends
at once.

Run directly, it launches itself ``--launches`` times in a row on 2 CPU
processes and reports how many launches passed::

    python benchmarks/reinit.py --launches 10 --cycles 20
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _tcp_sockets() -> int:
    """The TCP sockets this process holds listening or connected (not those still closing)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since listed
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table, encoding="ascii") as file:
            rows = [line.split() for line in file.read().splitlines()[1:]]
            count += sum(row[9] in inodes and row[3] in ("01", "0A") for row in rows)  # ESTABLISHED, LISTEN
    return count


# What runs beside each cycle's run, by cycle number: nothing; a second run alive at the same
# time, the first to start ending first, last, or between the second's steps; or, before
# the run, `fnaccel.testing.verify_resume` (its runs the only ones, the first holding the
# default group) with a chain ending on one process, then on two after one.
KINDS = ("alone", "oldest first", "newest first", "interleaved", "verify_resume")


def _prepared(seed: int) -> Any:
    """A fresh run (``fa.init``) of the same small model and data, prepared."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import fnaccel as fa

    state = fa.init(seed=0)
    torch.manual_seed(seed)  # the user's own model init: the same model every cycle
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(32, 4, generator=data), torch.randn(32, 1, generator=data))
    return fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(dataset, batch_size=8 // state.dist.num_processes),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )


def _end(state: Any) -> float:
    """Sum ``rank + 1`` over the run's group, then shut the run down."""
    import torch

    import fnaccel as fa

    total = fa.ops.reduce(state, torch.tensor(float(state.dist.rank + 1)), "sum").item()
    fa.shutdown(state)
    return float(total)


def _cycle(cycle: int, fail_at: int | None) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    import fnaccel as fa
    from fnaccel.testing import verify_resume

    start = time.perf_counter()
    kind = KINDS[cycle % len(KINDS)]
    if kind == "verify_resume":
        verify_resume(
            lambda: _prepared(1),
            steps=1,
            resumes=3 if cycle % 2 else 2,
            num_processes=(2, 1, 2) if cycle % 2 else (2, 1),
        )
    state = _prepared(0)
    other = None if kind in ("alone", "verify_resume") else _prepared(1)
    rank = state.dist.rank
    model = state.model
    for step, batch in enumerate(itertools.islice(fa.batches(state), 3)):
        state, _ = fa.step(state, batch)
        if other is not None:
            other, _ = fa.step(other, batch)
        if cycle == fail_at and rank == 1 and step == 0:
            raise RuntimeError(f"rank 1 fails in the middle of cycle {cycle}")
    total = fa.ops.reduce(state, torch.tensor(float(rank + 1)), "sum").item()
    checksum = float(sum(p.detach().double().abs().sum() for p in model.parameters()))
    other_total = total
    if kind == "newest first":
        other_total = _end(other)
        other = None
    fa.shutdown(state)
    if other is not None:  # the first run's end left the second's groups working
        if kind == "interleaved":
            other, _ = fa.step(other, batch)
        other_total = _end(other)
    initialized = dist.is_initialized()
    del state, other, model, batch
    gc.collect()
    return {
        "cycle": cycle,
        "kind": kind,
        "rank": rank,
        "checksum": checksum,
        "total": total,
        "other_total": other_total,
        "initialized_after_shutdown": initialized,
        "tcp_sockets": _tcp_sockets(),
        "seconds": round(time.perf_counter() - start, 3),
    }


def worker(cycles: int, out: Path, fail_at: int | None, stacks_after: float) -> None:
    import faulthandler

    # a hung worker shows where it hangs before the launch is killed
    faulthandler.dump_traceback_later(stacks_after, exit=True)
    rank = int(os.environ["RANK"])
    (out / f"pid.{os.getpid()}").touch()  # for a test to end any worker left behind
    with open(out / f"rank{rank}.jsonl", "a", encoding="utf-8") as log:
        for cycle in range(cycles):
            log.write(json.dumps(_cycle(cycle, fail_at)) + "\n")
            log.flush()


def check(out: Path, cycles: int, num_processes: int = 2) -> list[str]:
    """What is wrong with a launch's records (empty when every cycle did what the first did)."""
    problems = []
    records = []
    for rank in range(num_processes):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records += [json.loads(line) for line in lines]
        if len(lines) != cycles:
            problems.append(f"rank {rank} finished {len(lines)} of {cycles} cycles")
    if not records:
        return problems
    first = records[0]["checksum"]
    problems += [
        f"rank {r['rank']} cycle {r['cycle']}: weights {r['checksum']!r} != {first!r}"
        for r in records
        if r["checksum"] != first
    ]
    expected = num_processes * (num_processes + 1) / 2
    problems += [
        f"rank {r['rank']} cycle {r['cycle']} ({r['kind']}): sum {r[key]} != {expected}"
        for r in records
        for key in ("total", "other_total")
        if r[key] != expected
    ]
    problems += [
        f"rank {r['rank']} cycle {r['cycle']}: a process group is still initialized"
        for r in records
        if r["initialized_after_shutdown"]
    ]
    for rank in range(num_processes):
        # torch's DistributedDataParallel keeps the first group it was built on alive for
        # the process's life (three sockets); nothing else may stay after a shutdown. A leak
        # accumulates over the cycles; one socket still being closed (seen once in 30 launches,
        # back the next cycle: docs/state.md) is not one, so the later half's median is judged
        held = [r["tcp_sockets"] for r in records if r["rank"] == rank]
        later = sorted(held[len(held) // 2 :])
        if held and later[len(later) // 2] > held[0]:
            problems.append(f"rank {rank}: TCP sockets held after each shutdown grow: {held}")
    return problems


def launch(cycles: int, out: Path, timeout: float, fail_at: int | None = None) -> tuple[int, str, float]:
    """One ``fnaccel launch --cpu --num_processes 2`` of this file; (exit code, output, seconds).
    A launch past ``timeout`` is killed (its workers end with it) and reported as -9."""
    argv = [
        sys.executable,
        "-m",
        "fnaccel",
        "launch",
        "-q",
        "--cpu",
        "--num_processes",
        "2",
        __file__,
        "--cycles",
        str(cycles),
        "--out",
        str(out),
        "--stacks-after",
        str(timeout - 15),
    ]
    if fail_at is not None:
        argv += ["--fail-at", str(fail_at)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += f"\n[killed after {timeout} s]"
    return proc.returncode, output, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument("--out", type=Path, help="(worker) where the records go")
    parser.add_argument("--fail-at", type=int, help="(worker) rank 1 raises in this cycle")
    parser.add_argument(
        "--stacks-after",
        type=float,
        default=285.0,
        help="(worker) print every thread's stack and exit after this many seconds",
    )
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.cycles, args.out, args.fail_at, args.stacks_after)
        return
    passed = 0
    for number in range(1, args.launches + 1):
        with tempfile.TemporaryDirectory(prefix="fnaccel-reinit-") as out:
            code, output, seconds = launch(args.cycles, Path(out), args.timeout)
            problems = check(Path(out), args.cycles)
        ok = code == 0 and not problems
        passed += ok
        print(f"launch {number}: {'pass' if ok else 'FAIL'} (exit {code}, {seconds:.1f} s)", flush=True)
        if not ok:
            print("\n".join([*problems, output[-6000:]]), flush=True)
    print(f"{passed} of {args.launches} launches of {args.cycles} cycles passed")
    sys.exit(0 if passed == args.launches else 1)


if __name__ == "__main__":
    main()
