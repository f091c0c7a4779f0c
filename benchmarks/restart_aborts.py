"""How often a restarted run that finished aborts at exit, under ``fnaccel launch --max_restarts``.

    python benchmarks/restart_aborts.py [--runs 50] [--processes 2]

Each run is one ``fnaccel launch --cpu --num_processes 2 --max_restarts 1``
of this file in worker mode: a small MLP (dropout, AdamW, a shuffling loader,
the default pipeline: ``ddp()``) trains two epochs, saves a checkpoint after
step 6, and rank 1 of the first attempt kills itself with SIGKILL right
after it; torchrun restarts the worker group, which resumes from the
checkpoint, finishes, writes its weights and ends with ``fa.shutdown``. The
restarted group has finished its work, so any non-zero exit is an abort at
exit (``terminate called without an active exception``, code -6, is the
one seen once in 23 such runs, issue 26). Prints one line per run and
``aborts N/RUNS``; exits 1 if any run aborted or did not restart.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECKPOINT_STEP = 6


def worker(out: Path) -> None:
    """One attempt of the run (see the module's docstring)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import fnaccel as fa

    state = fa.init(seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 2, generator=generator)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    state = fa.prepare(
        state,
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        loader,
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
    checkpoint = out / "ckpt"
    resumed = (checkpoint / "fnaccel.json").exists()
    if resumed:
        state = fa.load(state, checkpoint)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
        if state.step == CHECKPOINT_STEP and not resumed:
            fa.save(state, checkpoint)
            if restarts == 0 and state.dist.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    fa.save_model(state, out / "final")
    print(f"rank {state.dist.rank}: attempt {restarts} finished at step {state.step}", flush=True)
    fa.shutdown(state)


def one_run(processes: int) -> tuple[int, str]:
    """(the launch's exit status, a short account of it)."""
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "fnaccel",
                "launch",
                "-q",
                "--cpu",
                "--num_processes",
                str(processes),
                "--max_restarts",
                "1",
                "--monitor_interval",
                "0.2",
                __file__,
                "--worker",
                out,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finished = len(re.findall(r"attempt 1 finished", result.stdout))
    codes = re.findall(r"exitcode: (-?\d+)", result.stderr)
    aborted = "terminate called" in result.stderr
    return result.returncode, (
        f"exit {result.returncode}, {finished}/{processes} ranks of the restarted "
        f"group finished, agent saw exit codes {codes}" + (", terminate called" if aborted else "")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return 0
    aborts = 0
    start = time.monotonic()
    for run in range(1, args.runs + 1):
        status, account = one_run(args.processes)
        aborts += status != 0
        print(f"run {run}/{args.runs}: {account}", flush=True)
    print(f"aborts {aborts}/{args.runs} ({time.monotonic() - start:.0f} s)")
    return 1 if aborts else 0


if __name__ == "__main__":
    sys.exit(main())
