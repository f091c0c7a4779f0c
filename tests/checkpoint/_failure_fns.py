"""World functions for test_save_failures.py: a save whose write fails on one rank only."""

from __future__ import annotations

import contextlib
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fnaccel as fa
from tests.checkpoint.test_resume import fresh_run, train


@contextlib.contextmanager
def files_capped_on(rank: int, state: fa.RunState) -> Iterator[None]:
    """On ``rank`` only, no file this process writes may grow past 1 KiB (RLIMIT_FSIZE, SIGXFSZ
    ignored: a write past it fails with EFBIG, as one on a full disk fails with ENOSPC); the
    world's worker gets its limit back afterwards."""
    if state.dist.rank != rank:
        yield
        return
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)


def one_rank_fails(state: fa.RunState, directory: str, failing: int) -> dict[str, Any]:
    """Every rank saves; ``failing``'s file write fails. Then the run trains on and saves again
    (no rank is left behind in a collective), then an asynchronous save fails the same way
    and `fa.shutdown` reports it. Returns each error and how long it took to arrive."""
    run, model, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))
    run, _ = train(run, epochs=1, stop_after=2)
    out: dict[str, Any] = {}
    with files_capped_on(failing, run):
        start = time.monotonic()
        try:
            fa.save(run, Path(directory) / "blocking")
        except fa.CheckpointError as exc:
            out["blocking"] = str(exc)
        out["blocking_s"] = time.monotonic() - start
    run, _ = train(run, epochs=1, stop_after=4)  # caught, and training goes on: DDP's collectives line up
    fa.save(run, Path(directory) / "after")
    out["after_step"] = run.step
    out["params"] = [p.detach().clone() for p in model.parameters()]
    with files_capped_on(failing, run):
        fa.save(run, Path(directory) / "async", blocking=False)
        start = time.monotonic()
        try:
            fa.shutdown(run)
        except fa.CheckpointError as exc:
            out["shutdown"] = str(exc)
        out["shutdown_s"] = time.monotonic() - start
    out["left"] = sorted(p.name for p in Path(directory).iterdir())
    return out
