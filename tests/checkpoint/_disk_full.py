"""Save over a good checkpoint on a "full disk" (see test_targets.py).

    python _disk_full.py CKPT

Saves once, then caps the size of any file this process writes at 1 KiB
(RLIMIT_FSIZE, with SIGXFSZ ignored: a write past it fails with EFBIG, as one
on a full disk fails with ENOSPC) and saves again. Prints the second save's
error as one line ``<type>: <message>``.
"""

import resource
import signal
import sys

import fnaccel as fa
from tests.checkpoint.test_resume import fresh_run, train


def main(path: str) -> None:
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    state, _ = train(state, epochs=1, stop_after=2)
    fa.save(state, path)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
    try:
        fa.save(state.replace(epoch=1), path)
        print("saved")
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "))


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(sys.argv[1])
