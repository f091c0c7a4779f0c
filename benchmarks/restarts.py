"""What a killed rank costs a run restarted by ``fnaccel launch --max_restarts 1``: two tiers against disk only.

    python benchmarks/restarts.py [--processes 2] [--width 1024] [--layers 4] [--kill_at 183]
                                  [--ram_every 5] [--disk_every 100] [--disk DIR]
                                  [--patterns disk,two-tier] [--patterns policy-continuous,policy-every]
    python benchmarks/restarts.py --cost [--cost_width 512] [--cost_steps 300] [--repeats 3]

Each row is one ``fnaccel launch --cpu --num_processes 2 --max_restarts 1
--monitor_interval 0.2`` of this file in worker mode: an MLP (``--layers``
square ``Linear`` layers of ``--width``, AdamW, the default pipeline:
``ddp()``) trains on random data; it saves asynchronously to disk every
``--disk_every`` steps (``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)`` under ``--disk``, a directory on the real disk) and, in the
two-tier row, also asynchronously to ``/dev/shm`` every ``--ram_every``
steps, over one path. The two ``policy-`` rows save through ``fa.autosave`` instead:
``fa.save_policy(every_steps=--ram_every, keep_last=1, directories=RAM) |
fa.save_policy(every_steps=--disk_every, keep_last=2, directories=DISK)``, and
with ``continuous=True`` in place of the RAM tier's interval (its next save
starts as soon as the last committed); they restart from
``fa.latest_checkpoint(*policy.directories)``. On the first attempt rank 1 kills itself with SIGKILL
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

``--cost``: what continuous saving costs the steps while nothing fails, on
one process (``torch.set_num_threads(1)``, so the step's compute is the main
thread's) and a small model (``--layers`` x ``Linear(--cost_width)`` + AdamW,
batch 64): ``--cost_steps`` steps with no saves, with ``every_steps=--ram_every``
to ``/dev/shm`` and with ``continuous=True`` to ``/dev/shm`` (both
``keep_last=1``), alternated ``--repeats`` times; per step the main thread's
CPU time (the loop's own cost: the step, `fa.autosave`, the snapshot copy),
the process's CPU time (adding the background writer's) and the wall time,
medians over the repeats, and how many saves each made.
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
from typing import Any


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
    policy = None
    if args.policy:  # the RAM tier's rule, and the disk tier's, as one fa.autosave policy
        assert ram is not None
        fast = (
            fa.save_policy(continuous=True, keep_last=1, directories=ram)
            if args.policy == "continuous"
            else fa.save_policy(every_steps=args.ram_every, keep_last=1, directories=ram)
        )
        policy = fast | fa.save_policy(every_steps=args.disk_every, keep_last=2, directories=disk / "policy")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    state = fa.init(
        seed=0,
        kwargs_handlers=[
            fa.ProjectConfiguration(project_dir=str(disk), automatic_checkpoint_naming=True, total_limit=2)
        ],
    )
    initialized = time.time()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4096, args.width, generator=generator)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    loader = DataLoader(TensorDataset(x, x), batch_size=16, shuffle=True)
    state = fa.prepare(
        state,
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        loader,
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
    prepared = time.time()
    tiers = [disk / "checkpoints"] if ram is None else [ram, disk / "checkpoints"]
    if policy is not None:
        tiers = list(policy.directories)
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always", fa.SkippedCheckpointWarning)
        found = fa.latest_checkpoint(*tiers)
    chosen = time.time()
    size = 0 if found is None else sum(f.stat().st_size for f in found.rglob("*") if f.is_file())
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
            record = {
                "first_step": time.time(),
                "started": started,
                "imported": imported,
                "initialized": initialized,
                "prepared": prepared,
                "chosen": chosen,
                "loaded": loaded,
                "resumed_from": resumed_from,
                "checkpoint": str(found),
                "bytes": size,
                "skipped": [str(w.message) for w in skipped],
            }
        if restarts == 1 and state.step >= args.kill_at and "back_at_kill" not in record and record:
            record["back_at_kill"] = time.time()
        if state.step == timed_from:
            since = time.time()
        if state.step == end:
            break
        if policy is not None:
            state = fa.autosave(state, policy)
        else:
            if ram is not None and state.step % args.ram_every == 0:
                fa.save(state, ram / "latest", blocking=False)
            if state.step % args.disk_every == 0:
                fa.save(state, blocking=False)
        if restarts == 0 and state.step == args.kill_at and state.dist.rank == 1:
            now = time.time()
            (out / "killed.json").write_text(
                json.dumps(
                    {
                        "time": now,
                        "step": state.step,
                        "step_seconds": (now - since) / (state.step - timed_from),
                    }
                )
            )
            os.kill(os.getpid(), signal.SIGKILL)
    if state.dist.is_main_process and restarts == 1:
        (out / "restart.json").write_text(json.dumps(record))
    fa.shutdown(state)


def one_row(args: argparse.Namespace, two_tier: bool, policy: str = "") -> dict[str, object]:
    """Launch one run (a fresh disk tier, and RAM tier for two tiers, saving by hand or through
    ``policy``); what it recorded."""
    out = Path(tempfile.mkdtemp(prefix="restarts-"))
    disk = Path(tempfile.mkdtemp(prefix="restarts-disk-", dir=args.disk))
    ram = Path(tempfile.mkdtemp(prefix="restarts-", dir="/dev/shm")) if two_tier else None
    try:
        command = [
            sys.executable,
            "-m",
            "fnaccel",
            "launch",
            "-q",
            "--cpu",
            "--num_processes",
            str(args.processes),
            "--max_restarts",
            "1",
            "--monitor_interval",
            "0.2",
            __file__,
            "--worker",
            str(out),
            "--disk",
            str(disk),
            "--ram",
            str(ram or ""),
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
            "--kill_at",
            str(args.kill_at),
            "--ram_every",
            str(args.ram_every),
            "--disk_every",
            str(args.disk_every),
            "--policy",
            policy,
        ]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if result.returncode != 0 or not (out / "restart.json").exists():
            raise SystemExit(f"the launch failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        killed = json.loads((out / "killed.json").read_text())
        restart = json.loads((out / "restart.json").read_text())
        return {
            "killed_at": killed["step"],
            "step_seconds": killed["step_seconds"],
            **restart,
            "to_first_step": restart["first_step"] - killed["time"],
            "to_killed_step": restart["back_at_kill"] - killed["time"],
        }
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
        return (
            f"fa.latest_checkpoint(ram, disk), {size / 1e6:.0f} MB checkpoints (1 in RAM, 3 on disk): "
            f"{sorted(seconds)[2]:.3f} s (median of 5)"
        )
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def cost_run(args: argparse.Namespace, policy: Any, steps: int) -> tuple[float, float, float, int]:
    """One run of ``steps`` steps autosaving with ``policy`` (None: no saves): per step the main
    thread's CPU, the process's CPU and the wall seconds, and the number of saves."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import fnaccel as fa

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64 * steps, args.cost_width, generator=generator)
    model = nn.Sequential(*[nn.Linear(args.cost_width, args.cost_width) for _ in range(args.layers)])
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        DataLoader(TensorDataset(x, x), batch_size=64),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
    saves = 0
    batches = iter(fa.batches(state, epochs=1))
    for _ in range(10):  # warm up: allocator, the first save's buffers and process group
        state, _ = fa.step(state, next(batches))
        if policy is not None:
            state = fa.autosave(state, policy)
    thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
    for batch in batches:
        state, _ = fa.step(state, batch)
        if policy is not None:
            before = state.resources.get("autosave")
            last = [p.last_saved for p in before._members.values()] if before else []
            state = fa.autosave(state, policy)
            saves += [p.last_saved for p in state.resources.get("autosave")._members.values()] != last
    thread, process, wall = (
        time.thread_time() - thread,
        time.process_time() - process,
        time.perf_counter() - wall,
    )
    fa.shutdown(state)  # waits for the last save: not counted
    timed = steps - 10
    return thread / timed, process / timed, wall / timed, saves


def cost(args: argparse.Namespace) -> None:
    """The ``--cost`` table (see the module's docstring)."""
    import statistics

    import torch

    import fnaccel as fa

    torch.set_num_threads(1)
    ram = Path(tempfile.mkdtemp(prefix="restarts-cost-", dir="/dev/shm"))
    try:
        patterns = {
            "no saves": None,
            f"every_steps={args.ram_every}": fa.save_policy(
                every_steps=args.ram_every, keep_last=1, directories=ram / "every"
            ),
            "continuous": fa.save_policy(continuous=True, keep_last=1, directories=ram / "continuous"),
        }
        rows: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in patterns}
        for _ in range(args.repeats):
            for name, policy in patterns.items():
                rows[name].append(cost_run(args, policy, args.cost_steps))
        size = sum(f.stat().st_size for f in next((ram / "continuous").glob("step_*")).iterdir())
        print(
            f"1 process, {args.layers} x Linear({args.cost_width}, {args.cost_width}) + AdamW, batch 64, "
            f"{args.cost_steps - 10} timed steps, a {size / 1e6:.1f} MB checkpoint to /dev/shm; medians of "
            f"{args.repeats} alternated runs"
        )
        print(
            f"{'pattern':<18}{'main CPU ms/step':>18}{'process CPU ms/step':>21}{'wall ms/step':>14}{'saves':>7}"
        )
        base = statistics.median(r[0] for r in rows["no saves"])
        for name, runs in rows.items():
            main_cpu, process_cpu, wall = (statistics.median(r[i] for r in runs) for i in range(3))
            saves = statistics.median(r[3] for r in runs)
            print(
                f"{name:<18}{main_cpu * 1e3:>12.3f} ({main_cpu / base - 1:+.1%}){process_cpu * 1e3:>13.3f}"
                f"{' ' * 8}{wall * 1e3:>14.3f}{saves:>7.0f}",
                flush=True,
            )
    finally:
        shutil.rmtree(ram, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kill_at", type=int, default=183)
    parser.add_argument("--ram_every", type=int, default=5)
    parser.add_argument("--disk_every", type=int, default=100)
    parser.add_argument("--disk", default=".", help="where the disk tier goes (a real disk, not tmpfs)")
    parser.add_argument(
        "--patterns",
        default="disk,two-tier",
        help="the rows to launch, comma-separated, of disk, two-tier, policy-every, policy-continuous",
    )
    parser.add_argument("--cost", action="store_true", help="measure continuous saving's step cost instead")
    parser.add_argument("--cost_width", type=int, default=512)
    parser.add_argument("--cost_steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ram", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.cost:
        cost(args)
        return
    print(choice_cost(args.disk), flush=True)
    print(
        f"{args.processes} processes, {args.layers} x Linear({args.width}, {args.width}) + AdamW, killed "
        f"(rank 1, SIGKILL) after step {args.kill_at}; RAM every {args.ram_every} steps, disk every "
        f"{args.disk_every}, both asynchronous"
    )
    print(
        f"{'pattern':<26}{'s/step':>7}{'killed':>8}{'resumed':>9}{'lost':>6}{'kill->1st step':>16}"
        f"{'kill->back':>12}{'ckpt MB':>9}"
    )
    rows = {
        "disk": ("disk only", False, ""),
        "two-tier": ("two tiers (/dev/shm+disk)", True, ""),
        "policy-every": (f"policy: every {args.ram_every}+disk", True, "every"),
        "policy-continuous": ("policy: continuous+disk", True, "continuous"),
    }
    for pattern in args.patterns.split(","):
        name, two_tier, policy = rows[pattern]
        row = one_row(args, two_tier, policy)
        lost = int(row["killed_at"]) - int(row["resumed_from"])  # type: ignore[call-overload]
        print(
            f"{name:<26}{row['step_seconds']:>7.3f}{row['killed_at']:>8}{row['resumed_from']:>9}{lost:>6}"
            f"{row['to_first_step']:>14.2f} s{row['to_killed_step']:>10.2f} s{float(str(row['bytes'])) / 1e6:>9.0f}",
            flush=True,
        )
        at = {
            key: float(row[key]) - float(row["first_step"]) + float(row["to_first_step"])  # type: ignore[arg-type]
            for key in ("started", "imported", "initialized", "prepared", "chosen", "loaded")
        }
        print(
            f"    after the kill: new rank 0 running {at['started']:.2f} s; "
            f"then imports {at['imported'] - at['started']:.2f} s, "
            f"fa.init {at['initialized'] - at['imported']:.2f} s, prepare {at['prepared'] - at['initialized']:.2f} s, "
            f"latest_checkpoint {at['chosen'] - at['prepared']:.2f} s, load {at['loaded'] - at['chosen']:.2f} s, "
            f"first step {float(row['to_first_step']) - at['loaded']:.2f} s"
        )  # type: ignore[arg-type]
        for message in row["skipped"]:  # type: ignore[attr-defined]
            print(f"    {message}")


if __name__ == "__main__":
    main()
