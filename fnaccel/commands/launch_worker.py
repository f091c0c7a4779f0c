"""What every worker of ``fnaccel launch`` runs first: it ties the worker's life to
the launcher's, then replaces itself with the worker's own program.

    python -u -m fnaccel.commands.launch_worker LAUNCHER_PID PROGRAM [ARGS...]

torchrun's agent starts each worker in a session of its own, so a launcher
killed outright (SIGKILL, a scheduler's last resort) signals nobody, and its
workers were left running forever. Here the worker asks Linux to send it
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``; the setting
survives ``execve``), then executes ``PROGRAM`` in this same process (same
pid, the one torchrun watches). The program runs exactly as torchrun would
have run it: ``python -u script.py ...`` is a fresh interpreter, so
``sys.argv``, ``__main__``, ``sys.path[0]``, tracebacks and exit codes are
the plain ones.

The parent-death signal fires when the *thread* that started the child ends;
torchrun's agent starts its workers from the launcher's main thread, which
lives as long as the launcher. Not Linux: no parent-death signal, the program
just runs. First, the worker records its global rank in the launcher's
directory (`LAUNCH_DIR_ENV`), so that the machines of a multi-machine launch
can name the ranks of one that vanishes. Processes the program itself starts (DataLoader workers, ...)
are not covered; torch's DataLoader workers end when their parent goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence

from fnaccel.constants import LAUNCH_DIR_ENV, RANK_MARK

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(launcher: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != launcher:  # the launcher died before the line above: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str]) -> None:
    """Tie this process to the launcher ``argv[0]`` (a pid), then execute ``argv[1:]``."""
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit(
            "usage: python -m fnaccel.commands.launch_worker LAUNCHER_PID PROGRAM [ARGS...] "
            "(fnaccel launch runs this; run your script with fnaccel launch)"
        )
    if sys.platform.startswith("linux"):
        _die_with_parent(int(argv[0]))
    launch_dir, rank = os.environ.get(LAUNCH_DIR_ENV), os.environ.get("RANK", "")
    if launch_dir and rank.isdigit():
        with contextlib.suppress(OSError):  # only a name in a report depends on it
            open(os.path.join(launch_dir, f"{RANK_MARK}.{rank}"), "w").close()
    try:
        os.execvp(argv[1], list(argv[1:]))
    except OSError as exc:  # as a shell says it: 127 not found, 126 found but not runnable
        print(f"fnaccel launch: cannot run {argv[1]}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(127 if isinstance(exc, FileNotFoundError) else 126) from None


if __name__ == "__main__":
    main(sys.argv[1:])
