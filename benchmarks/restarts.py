"""What a killed rank costs a run restarted by ``fnaccel launch --max_restarts 1``: two tiers against disk only.

    python benchmarks/restarts.py [--processes 2] [--width 1024] [--layers 4] [--kill_at 183]
                                  [--ram_every 5] [--disk_every 100] [--disk DIR]

Each row is one ``fnaccel launch --cpu --num_processes 2 --max_restarts 1
--monitor_interval 0.2`` of this file in worker mode: an MLP (``--layers``
square ``Linear`` layers of ``--width``, AdamW, the default pipeline:
``ddp()``) trains on random data; it saves asynchronously to disk every
``--disk_every`` steps (``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)`` under ``--disk``, a directory on the real disk) and, in the
two-tier row, also asynchronously to ``/dev/shm`` every ``--ram_every``
steps, over one path. On the first attempt rank 1 kills itself with SIGKILL
right after step ``--kill_at``; torchrun stops the group and starts it again;
every rank of the new group loads ``fa.latest_checkpoint(ram, disk)`` and
trains on to ``--kill_at + 20``.

First line: what `fa.latest_checkpoint` itself costs over a RAM tier
holding one 151 MB checkpoint and a disk tier holding three.

Per row: the seconds a step took in the 60 steps before the kill (saves
included: what the pattern costs while nothing fails), the step the run was
killed at, the step it resumed from, the steps lost, the seconds from the kill to the first step after the restart (the
launcher noticing, new processes importing torch, the process group, the
choice and verification of the checkpoint, the load, one step), the seconds
from the kill until the run is back at the step it was killed at, and the
checkpoint's size; below it, where the seconds to the first step went on
rank 0. The kill time is the killed rank's clock, the rest rank
0's, on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    """One attempt of the run (see the module's docstring)."""
    started = time.time()
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import fnaccel as fa

    imported = time.time()
    out, disk = Path(args.worker), Path(args.disk)
    ram = Path(args.ram) if args.ram else None
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    state = fa.init(seed=0, kwargs_handlers=[fa.ProjectConfiguration(
        project_dir=str(disk), automatic_checkpoint_naming=True, total_limit=2)])
    initialized = time.time()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4096, args.width, generator=generator)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    loader = DataLoader(TensorDataset(x, x), batch_size=16, shuffle=True)
    state = fa.prepare(state, model, torch.optim.AdamW(model.parameters(), lr=1e-4), loader,
                       loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    prepared = time.time()
    tiers = [disk / "checkpoints"] if ram is None else [ram, disk / "checkpoints"]
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always", fa.SkippedCheckpointWarning)
        found = fa.latest_checkpoint(*tiers)
    chosen = time.time()
    if found is not None:
        state = fa.load(state, found)
    loaded = time.time()
    resumed_from = state.step
    end = args.kill_at + 20
    record: dict[str, object] = {}
    timed_from = max(resumed_from, args.kill_at - 60)  # the step time while nothing fails, RAM saves included
    since = time.time()
    for batch in fa.batches(state, epochs=1000):
        state, _ = fa.step(state, batch)
        if restarts == 1 and not record and state.dist.is_main_process:
            record = {"first_step": time.time(), "started": started, "imported": imported,
                      "initialized": initialized, "prepared": prepared, "chosen": chosen,
                      "loaded": loaded, "resumed_from": resumed_from, "checkpoint": str(found),
                      "skipped": [str(w.message) for w in skipped]}
        if restarts == 1 and state.step >= args.kill_at and "back_at_kill" not in record and record:
            record["back_at_kill"] = time.time()
        if state.step == timed_from:
            since = time.time()
        if state.step == end:
            break
        if ram is not None and state.step % args.ram_every == 0:
            fa.save(state, ram / "latest", blocking=False)
        if state.step % args.disk_every == 0:
            fa.save(state, blocking=False)
        if restarts == 0 and state.step == args.kill_at and state.dist.rank == 1:
            now = time.time()
            (out / "killed.json").write_text(json.dumps({"time": now, "step": state.step,
                                                         "step_seconds": (now - since) / (state.step - timed_from)}))
            os.kill(os.getpid(), signal.SIGKILL)
    if state.dist.is_main_process and restarts == 1:
        (out / "restart.json").write_text(json.dumps(record))
    fa.shutdown(state)


def one_row(args: argparse.Namespace, two_tier: bool) -> dict[str, object]:
    """Launch one run (a fresh disk tier, and RAM tier for two tiers); what it recorded."""
    out = Path(tempfile.mkdtemp(prefix="restarts-"))
    disk = Path(tempfile.mkdtemp(prefix="restarts-disk-", dir=args.disk))
    ram = Path(tempfile.mkdtemp(prefix="restarts-", dir="/dev/shm")) if two_tier else None
    try:
        command = [sys.executable, "-m", "fnaccel", "launch", "-q", "--cpu",
                   "--num_processes", str(args.processes), "--max_restarts", "1", "--monitor_interval", "0.2",
                   __file__, "--worker", str(out), "--disk", str(disk), "--ram", str(ram or ""),
                   "--width", str(args.width), "--layers", str(args.layers), "--kill_at", str(args.kill_at),
                   "--ram_every", str(args.ram_every), "--disk_every", str(args.disk_every)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0 or not (out / "restart.json").exists():
            raise SystemExit(f"the launch failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        killed = json.loads((out / "killed.json").read_text())
        restart = json.loads((out / "restart.json").read_text())
        checkpoint = Path(restart["checkpoint"])
        size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) if checkpoint.is_dir() else 0
        return {"killed_at": killed["step"], "step_seconds": killed["step_seconds"], **restart, "to_first_step": restart["first_step"] - killed["time"],
                "to_killed_step": restart["back_at_kill"] - killed["time"], "bytes": size}
    finally:
        for path in (out, disk, ram):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)


def choice_cost(disk: str) -> str:
    """Seconds `fa.latest_checkpoint` takes over a RAM tier holding one 151 MB checkpoint and a
    disk tier holding three (12 x Linear(1024, 1024) + AdamW): it verifies the newest only."""
    import torch

    import fnaccel as fa

    ram = Path(tempfile.mkdtemp(prefix="restarts-", dir="/dev/shm"))
    root = Path(tempfile.mkdtemp(prefix="restarts-disk-", dir=disk))
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 1024)).sum().backward()
        optimizer.step()
        state = fa.prepare(fa.init(cpu=True), model, optimizer)
        for i in range(3):
            fa.save(state, root / f"checkpoint_{i}")
        fa.save(state, ram / "latest")
        fa.shutdown(state)
        size = sum(f.stat().st_size for f in (ram / "latest").iterdir())
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            assert fa.latest_checkpoint(ram, root) == ram / "latest"
            seconds.append(time.perf_counter() - start)
        return (f"fa.latest_checkpoint(ram, disk), {size / 1e6:.0f} MB checkpoints (1 in RAM, 3 on disk): "
                f"{sorted(seconds)[2]:.3f} s (median of 5)")
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kill_at", type=int, default=183)
    parser.add_argument("--ram_every", type=int, default=5)
    parser.add_argument("--disk_every", type=int, default=100)
    parser.add_argument("--disk", default=".", help="where the disk tier goes (a real disk, not tmpfs)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ram", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(choice_cost(args.disk), flush=True)
    print(f"{args.processes} processes, {args.layers} x Linear({args.width}, {args.width}) + AdamW, killed "
          f"(rank 1, SIGKILL) after step {args.kill_at}; RAM every {args.ram_every} steps, disk every "
          f"{args.disk_every}, both asynchronous")
    print(f"{'pattern':<26}{'s/step':>7}{'killed':>8}{'resumed':>9}{'lost':>6}{'kill->1st step':>16}"
          f"{'kill->back':>12}{'ckpt MB':>9}")
    for name, two_tier in (("disk only", False), ("two tiers (/dev/shm+disk)", True)):
        row = one_row(args, two_tier)
        lost = int(row["killed_at"]) - int(row["resumed_from"])  # type: ignore[call-overload]
        print(f"{name:<26}{row['step_seconds']:>7.3f}{row['killed_at']:>8}{row['resumed_from']:>9}{lost:>6}"
              f"{row['to_first_step']:>14.2f} s{row['to_killed_step']:>10.2f} s{int(row['bytes']) / 1e6:>9.0f}",
              flush=True)
        at = {key: float(row[key]) - float(row["first_step"]) + float(row["to_first_step"])  # type: ignore[arg-type]
              for key in ("started", "imported", "initialized", "prepared", "chosen", "loaded")}
        print(f"    after the kill: new rank 0 running {at['started']:.2f} s; then imports {at['imported'] - at['started']:.2f} s, "
              f"fa.init {at['initialized'] - at['imported']:.2f} s, prepare {at['prepared'] - at['initialized']:.2f} s, "
              f"latest_checkpoint {at['chosen'] - at['prepared']:.2f} s, load {at['loaded'] - at['chosen']:.2f} s, "
              f"first step {float(row['to_first_step']) - at['loaded']:.2f} s")  # type: ignore[arg-type]
        for message in row["skipped"]:  # type: ignore[attr-defined]
            print(f"    {message}")


if __name__ == "__main__":
    main()
