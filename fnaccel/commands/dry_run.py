"""``fnaccel launch --dry_run``: a large launch's set-up checked on one machine.

The launcher starts the script twice, as the world's first and last rank, with the
launch environment those ranks would get and ``FNACCEL_DRY_RUN=1`` (see
`fnaccel.dryrun`): `fa.init` forms torch's fake process group of the whole world on
the CPU, `fa.prepare` builds the mesh and applies the pipeline's plans, one
`fa.step` runs, and each worker reports its bytes. Rank 0's worker also computes
every other rank's bytes from the tensors' global shapes and placements, so the
table covers the whole world without starting a process per rank; the last rank's
own measurement checks that computation. A rank that raises ends the dry run with
its traceback, as the real launch would show it. The workers live as the real
launch's do: started through its worker entry, they die with the launcher even by
SIGKILL, and its signals end them (each in a session of its own) and the launch,
with one line (docs/cli.md, "Dry runs").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fnaccel.commands.estimate import box_table, human_size
from fnaccel.commands.main import CommandError
from fnaccel.config.launch import LaunchConfig
from fnaccel.dryrun import DRY_RUN_ENV, REPORT_ENV

__all__ = ["dry_run"]

# A worker builds the model, prepares it and takes one step on the CPU: seconds for a
# small model; this bound only ends a script that hangs before its fa.prepare.
WORKER_TIMEOUT_S = 600.0
_KINDS = ("parameters", "gradients", "optimizer")


def _spans(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _worker_env(
    config: LaunchConfig, base: Mapping[str, str], rank: int, world: int, report_dir: str
) -> dict[str, str]:
    local = world // config.num_machines
    return {
        **os.environ,
        **base,
        DRY_RUN_ENV: "1",
        REPORT_ENV: report_dir,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_RANK": str(rank // local),
        "GROUP_WORLD_SIZE": str(config.num_machines),
        # the fake group connects to nothing; fa.init still asks for a rendezvous address
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": "1",
    }


def _run_workers(program: list[str], envs: Mapping[int, dict[str, str]], logs: Path) -> dict[int, int]:
    """Start one worker per rank, all at once; their exit statuses (each killed at the timeout).

    Each runs in a session of its own, ended whole (the script and what it started) when
    this function ends by an exception: an error, the timeout, or a signal the launcher
    turned into one."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for rank, env in envs.items():
            with open(logs / f"rank{rank}.log", "wb") as log:
                procs[rank] = subprocess.Popen(
                    program, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        status = {}
        for rank, proc in procs.items():
            try:
                status[rank] = proc.wait(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise CommandError(
                    f"--dry_run: rank {rank} did not reach its fa.prepare and step within "
                    f"{WORKER_TIMEOUT_S:.0f} s; its output: {logs / f'rank{rank}.log'}"
                ) from None
        return status
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the script and what it started
                proc.wait()


def _print_report(reports: Mapping[int, dict[str, Any]], world: int, machines: int) -> None:
    first = reports[0]
    sizes = {name: size for name, size in first["parallelism"].items() if size > 1}
    shown = " x ".join(f"{name}={size}" for name, size in sizes.items()) or "none (one process)"
    print(
        f"fnaccel launch --dry_run: {world} processes on {machines} machine(s), simulated on this "
        f"machine with torch's fake process group on the CPU; ranks {_spans(sorted(reports))} ran the "
        "script up to its fa.prepare and one step"
    )
    print(f"mesh: {shown} (rank r's coordinates are r unravelled over these sizes, the last fastest)")
    print(f"step: {first['step']}")
    print(
        f"bytes: computed by rank 0 for all {world} ranks, once per class of alike ranks "
        f"({first['num_classes']} classes: the same shard of every tensor)"
    )
    by_figures: dict[tuple[int, ...], list[int]] = {}
    for rank, figures in enumerate(first["ranks"]):
        by_figures.setdefault(tuple(figures[k] for k in _KINDS), []).append(rank)
    rows = [
        (_spans(ranks), *(human_size(b) for b in key), human_size(sum(key)))
        for key, ranks in by_figures.items()
    ]
    print(box_table(("ranks", "parameters", "gradients", "optimizer", "total"), rows, "Bytes held per rank"))
    for rank, report in sorted(reports.items()):
        computed = first["ranks"][rank]
        shown = ", ".join(f"{report['measured'][k]} B" for k in _KINDS)
        verdict = (
            "as computed"
            if report["measured"] == computed
            else "but rank 0 computed " + ", ".join(f"{computed[k]} B" for k in _KINDS)
        )
        print(f"rank {rank} measured {shown} (parameters, gradients, optimizer) {verdict}")
    sharded = any(entry["placements"] != "whole on every rank" for entry in first["layout"])
    print(
        "checkpoint (fa.save) layout: "
        + (
            f"sharded/rank<r>.safetensors for r in 0-{world - 1} (each rank's shards of the parameters and "
            "optimizer state, the sizes above), sharded/metadata.json, sharded/state.json, "
            if sharded
            else "model.safetensors, optimizer.safetensors and optimizer.json (rank 0), "
        )
        + f"rank<r>.json and rank<r>.safetensors for r in 0-{world - 1}, config.yaml, run.json, "
        "fnaccel.json; the tensors:"
    )
    rows = [(e["name"], "x".join(map(str, e["shape"])), e["dtype"], e["placements"]) for e in first["layout"]]
    print(
        box_table(
            ("tensor", "full shape", "dtype", "held as (mesh dimension: placement)"), rows, "Model tensors"
        )
    )


def dry_run(
    config: LaunchConfig,
    world: int,
    script: str,
    program: list[str],
    base: Mapping[str, str],
    *,
    json_path: str | None = None,
) -> int:
    """Run ``program`` (the launch's worker command line for ``script``) as the first and last rank of a
    world of ``world`` processes, each with the launch's variables ``base``, under the
    fake process group, and print the mesh, the bytes per rank and the checkpoint layout
    (and write them as JSON to ``json_path`` when given); a rank that raises ends it with
    that rank's output and exit status. ``program`` starts through the launch's worker
    entry, so the ranks die with the launcher (SIGKILL included); an exception here (the
    launcher's signals become one) ends them."""
    if world % config.num_machines:
        raise CommandError(
            f"--num_processes {world} is the total over all machines and "
            f"must divide evenly over --num_machines {config.num_machines}"
        )
    with tempfile.TemporaryDirectory(prefix="fnaccel-dry-run-") as tmp:
        logs = Path(tmp)
        envs = {rank: _worker_env(config, base, rank, world, tmp) for rank in sorted({0, world - 1})}
        status = _run_workers(program, envs, logs)
        for rank, code in status.items():
            if code != 0:
                sys.stderr.write((logs / f"rank{rank}.log").read_text(errors="replace"))
                print(
                    f"fnaccel launch --dry_run: {script} failed as rank {rank} of {world} "
                    f"(exit code {code}); the real launch would fail the same way",
                    file=sys.stderr,
                )
                return code if code > 0 else 1
        reports = {
            rank: json.loads(path.read_text())
            for rank in status
            if (path := logs / f"rank{rank}.json").is_file()
        }
        if len(reports) != len(status):
            print(
                f"fnaccel launch --dry_run: {script} ended without an fa.prepare holding a "
                "model and an optimizer: only its fa.init was checked (the dry run reports at that "
                "fa.prepare)",
                file=sys.stderr,
            )
            return 1
    _print_report(reports, world, config.num_machines)
    if json_path is not None:
        first = reports[0]
        Path(json_path).write_text(
            json.dumps(
                {
                    "num_processes": world,
                    "num_machines": config.num_machines,
                    "parallelism": first["parallelism"],
                    "step": first["step"],
                    "ranks": first["ranks"],
                    "num_classes": first["num_classes"],
                    "measured": {str(rank): report["measured"] for rank, report in sorted(reports.items())},
                    "layout": first["layout"],
                },
                indent=1,
            )
        )
    return 0
