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
import subprocess
from pathlib import Path

__all__ = ["alive", "end_launch", "worker_pids"]


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
