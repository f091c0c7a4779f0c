"""Make one file of a checkpoint hostile, then time fa.load on it (see test_hostile.py).

    python _hostile_load.py CKPT NAME KIND    # KIND: zero, fifo, outside, sparse

Runs with its address space capped at 3 GiB above what it holds before the
load, so a regression that reads /dev/zero or a sparse file whole dies of a
MemoryError here instead of exhausting the machine. Prints one JSON line:
the error's type and message, the seconds fa.load took, and how many MB the
process's peak resident memory grew.
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import fnaccel as fa
from tests.checkpoint.test_resume import fresh_run


def _vm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(checkpoint: Path, name: str, kind: str) -> None:
    target = checkpoint / name
    if kind == "zero":
        target.unlink()
        target.symlink_to("/dev/zero")
    elif kind == "fifo":
        target.unlink()
        os.mkfifo(target)
    elif kind == "outside":  # the very same bytes, but in a file outside the checkpoint
        outside = checkpoint.parent / f"outside-{name}"
        target.rename(outside)
        target.symlink_to(outside)
    elif kind == "sparse":
        with open(target, "r+b") as handle:
            handle.truncate(8 * 2**30)
    state = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))[0]
    limit = _vm_bytes() + 3 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        fa.load(state, checkpoint)
        error, message = None, ""
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    seconds = time.perf_counter() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({"error": error, "message": message, "seconds": seconds, "grown_mb": grown}))


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
