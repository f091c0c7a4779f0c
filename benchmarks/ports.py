"""A plain PyTorch DDP script and its fnaccel port, timed side by side (issue 37 point 5).

tests/ports/plain_train.py (launched with torchrun) and tests/ports/fnaccel_train.py (its port,
launched with `fnaccel launch`) each record rank 0's CPU time (`time.process_time`) from one
update to the next: the forward and backward of every micro-step, the clipping, the optimizer
step, the hand-set learning rate and the log line. Evaluation and checkpoints are left out
(one evaluation, at iteration 0, in the warm-up). Each figure is the median over the updates
after the warm-up of every round, rounds alternating plain and port; the ratio is port / plain.
CPU time, not wall time: it is what the port adds, and it reads the same on a loaded machine.

    python benchmarks/ports.py [--processes 1 2] [--iters 60] [--warmup 10] [--rounds 3] [--dim 32]
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


def launch(kind: str, num_processes: int, out: Path, args: argparse.Namespace) -> list[float]:
    """One run of ``kind`` ("plain" or "port"); rank 0's CPU seconds per update."""
    timings = out / "timings.json"
    script = [f"--out={out}", f"--max-iters={args.iters}", f"--dim={args.dim}",
              f"--eval-interval={10**9}", f"--timings={timings}"]
    if kind == "plain":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={num_processes}", str(PLAIN), *script]
    else:
        command = [sys.executable, "-m", "fnaccel", "launch", "-q", "--cpu", f"--num_processes={num_processes}",
                   "--num_cpu_threads_per_process=1", str(PORT), *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{kind} on {num_processes} processes failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(timings.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()
    if args.iters <= args.warmup:
        raise SystemExit("--iters must exceed --warmup")
    print(f"tests/ports scripts, dim {args.dim}, {args.iters} updates ({args.warmup} warm-up), "
          f"{args.rounds} rounds, one CPU thread per process; CPU ms per update, rank 0, median")
    with tempfile.TemporaryDirectory() as tmp:
        for num_processes in args.processes:
            warm: dict[str, list[float]] = {"plain": [], "port": []}
            for round_ in range(args.rounds):
                for kind in ("plain", "port"):
                    out = Path(tmp) / f"{kind}{num_processes}_{round_}"
                    warm[kind] += launch(kind, num_processes, out, args)[args.warmup:]
            plain, port = statistics.median(warm["plain"]), statistics.median(warm["port"])
            print(f"{num_processes} process{'es' if num_processes > 1 else ''}: plain {plain * 1e3:.2f} ms, "
                  f"port {port * 1e3:.2f} ms, ratio {port / plain:.3f}")


if __name__ == "__main__":
    main()
