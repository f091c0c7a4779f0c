"""Ending what a launch test started, whatever the test's outcome.

A launch test's workers run in sessions of their own (torchrun's agent starts
them so), so ending the launcher does not end them: each worker leaves an empty
file ``OUT/pid.<pid>`` (``_crashing.py``, ``_lifetime.py``,
``_preemption_script.py``, benchmarks/reinit.py) and the test ends it by that pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["alive", "end_launch", "free_port", "start_launch", "start_two_machines", "worker_pids"]


def free_port() -> int:
    """A TCP port free on the loopback address now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_launch(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m fnaccel launch -q *argv``, its pipes captured, one intra-op thread a worker."""
    return subprocess.Popen(
        [sys.executable, "-m", "fnaccel", "launch", "-q", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def start_two_machines(*program: str) -> list[subprocess.Popen[str]]:
    """Two machines of one process each on the loopback address, both running ``program``
    (the script and its arguments): the launchers of machine 0 and machine 1."""
    machines = ("--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1")
    port = str(free_port())
    return [
        start_launch(*machines, "--main_process_port", port, "--machine_rank", str(rank), *program)
        for rank in (0, 1)
    ]


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie has exited: only its status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def worker_pids(out: Path) -> list[int]:
    """The pids of the workers that left ``OUT/pid.<pid>``."""
    return [int(path.name.split(".")[1]) for path in out.glob("pid.*")]


def end_launch(out: Path, *launchers: subprocess.Popen[str]) -> None:
    """Leave nothing behind: kill the ``launchers``, then each worker still alive by its
    ``OUT/pid.<pid>`` file, then read the launchers' pipes (they close once every worker
    is gone, so a worker left running would hang that read)."""
    for launcher in launchers:
        launcher.kill()
        launcher.wait()
    for pid in worker_pids(out):
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):  # it ended between the two lines
                os.kill(pid, signal.SIGKILL)
    for launcher in launchers:
        launcher.communicate(timeout=30)
