"""Make one file of a checkpoint hostile, then time fa.load on it (see test_hostile.py).

    python _hostile_load.py CKPT NAME KIND    # KIND: zero, fifo, outside, sparse
    python _hostile_load.py serve             # one such load per line ["CKPT", "NAME", "KIND"] on stdin

``serve`` runs each load in a child forked from it once it has imported torch and
fnaccel and prepared a run (what a new interpreter per load spent seconds on): each
load is still a process of its own, with its own address-space cap and peak
memory, and prints its own line.

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
import traceback
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


def serve() -> None:
    fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))  # every import a load needs, once
    while line := sys.stdin.readline():
        checkpoint, name, kind = json.loads(line)
        child = os.fork()  # one thread here (OMP_NUM_THREADS=1, no group): safe to fork
        if child == 0:  # the load, then out: never back into this loop, nor this process's exit handlers
            try:
                main(Path(checkpoint), name, kind)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            sys.stdout.flush()
            os._exit(0)
        _, status = os.waitpid(child, 0)
        if status != 0:
            print(json.dumps({"error": f"the load's process ended with wait status {status}"}), flush=True)


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
