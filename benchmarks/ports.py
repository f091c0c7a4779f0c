"""A plain PyTorch DDP script and its fnaccel port, timed side by side (issue 37 point 5).

tests/ports/plain_train.py (launched with torchrun) and tests/ports/fnaccel_train.py (its port,
launched with `fnaccel launch`) each record rank 0's CPU time (`time.process_time`) from one
update to the next: the forward and backward of every micro-step, the clipping, the optimizer
step, the hand-set learning rate and the log line. Evaluation and checkpoints are left out
(one evaluation, at iteration 0, in the warm-up). In each round the two launches run at the
same time, so that both meet the same load from the rest of the machine; a round's figure is
the median over its updates after the warm-up, its ratio port / plain, and the result the median
round (with the spread of the rounds' ratios). CPU time, not wall time: it is what each script
spends, not how long it waited for a core.

    python benchmarks/ports.py [--processes 1 2] [--iters 60] [--warmup 10] [--rounds 5] [--dim 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN, PORT = ROOT / "tests" / "ports" / "plain_train.py", ROOT / "tests" / "ports" / "fnaccel_train.py"


def command(kind: str, num_processes: int, out: Path, args: argparse.Namespace) -> list[str]:
    """The launch of ``kind`` ("plain" or "port"), writing rank 0's CPU seconds per update."""
    script = [
        f"--out={out}",
        f"--max-iters={args.iters}",
        f"--dim={args.dim}",
        f"--eval-interval={10**9}",
        f"--timings={out / 'timings.json'}",
    ]
    if kind == "plain":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={num_processes}",
            str(PLAIN),
            *script,
        ]
    return [
        sys.executable,
        "-m",
        "fnaccel",
        "launch",
        "-q",
        "--cpu",
        f"--num_processes={num_processes}",
        "--num_cpu_threads_per_process=1",
        str(PORT),
        *script,
    ]


def one_round(num_processes: int, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    """Both launches side by side; each one's median CPU seconds per update after the warm-up."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = {kind: tmp / kind for kind in ("plain", "port")}
    running = {
        kind: subprocess.Popen(
            command(kind, num_processes, out, args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for kind, out in outs.items()
    }
    medians = {}
    for kind, process in running.items():
        output, _ = process.communicate(timeout=900)
        if process.returncode != 0:
            raise SystemExit(f"{kind} on {num_processes} processes failed:\n{output[-4000:]}")
        medians[kind] = statistics.median(
            json.loads((outs[kind] / "timings.json").read_text())[args.warmup :]
        )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()
    if args.iters <= args.warmup:
        raise SystemExit("--iters must exceed --warmup")
    print(
        f"tests/ports scripts, dim {args.dim}, {args.iters} updates ({args.warmup} warm-up), {args.rounds} rounds "
        "of the two launched side by side, one CPU thread per process; rank 0's CPU ms per update"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for num_processes in args.processes:
            rounds = [
                one_round(num_processes, Path(tmp) / f"{num_processes}_{i}", args) for i in range(args.rounds)
            ]
            ratios = sorted(r["port"] / r["plain"] for r in rounds)
            middle = sorted(rounds, key=lambda r: r["port"] / r["plain"])[len(rounds) // 2]
            print(
                f"{num_processes} process{'es' if num_processes > 1 else ''}: median round plain "
                f"{middle['plain'] * 1e3:.2f} ms, port {middle['port'] * 1e3:.2f} ms, "
                f"ratio {ratios[len(ratios) // 2]:.3f} "
                f"(rounds {ratios[0]:.3f}-{ratios[-1]:.3f})"
            )


if __name__ == "__main__":
    main()
