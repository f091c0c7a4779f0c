"""An asynchronous save that fails, and where its error surfaces (see test_save_failures.py).

    python _async_failure.py DIR [--checks]       (or under fnaccel launch)

Caps the size of any file this process writes at 1 KiB on the last rank only
(RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as one on a
full disk fails with ENOSPC). With ``--checks`` (one process) it first prints,
one line each, what the next step, the next save and `fa.shutdown` raise
after an asynchronous save failed. Then it starts one more failing
asynchronous save and ends without waiting for it: the process must end with
status 1 and one line on stderr.
"""

import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import fnaccel as fa
from tests.checkpoint.test_resume import fresh_run, train


def failed_save(state: fa.RunState, path: Path) -> Any:
    """A save that fails on this rank's file write; once it is known to have failed."""
    handle = fa.save(state, path, blocking=False)
    while not handle.done():
        time.sleep(0.01)
    return handle


def main(directory: str, checks: bool) -> None:
    out = Path(directory)
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))
    state, _ = train(state, epochs=1, stop_after=2)
    if state.dist.rank == state.dist.num_processes - 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    if checks:
        for where in ("step", "save", "shutdown"):
            failed_save(state, out / where)
            try:
                if where == "step":
                    batch = next(iter(fa.batches(state)))
                    state, _ = fa.step(state, batch)
                elif where == "save":
                    fa.save(state, out / "next")
                else:
                    fa.shutdown(state)
                print(f"{where}: nothing raised")
            except fa.CheckpointError as exc:
                print(f"{where}: {exc}".replace("\n", " "))
        state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))
    fa.save(state, out / "lost", blocking=False)
    print("script ended", flush=True)


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(sys.argv[1], "--checks" in sys.argv)
