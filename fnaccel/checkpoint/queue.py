"""The run's asynchronous saves: `SaveQueue` (registered with the run's resources at
its first save, as ``"saves"``) and `SaveHandle`.

Kept apart from the writer so that building a `RunState` imports no
checkpoint machinery: the writer loads with the first save.

What an asynchronous save blocks is its snapshot: every tensor copied to CPU
memory. Copying into fresh memory costs the kernel a page fault and a zeroed
page per 4 KiB (measured: 1.4 GB/s, where a copy into memory already touched
runs at several GB/s), so the queue keeps the snapshot's buffers
(`SaveQueue.staged`) and the next asynchronous save copies into them. They
are reused only after the save that wrote from them is done (a save first
waits for the one before it) and released by `close`.

A blocking save over an existing checkpoint returns once the new one is in
place; deleting the one it replaced (moved aside under a hidden marked name: a
quarter of a 600 MB save's time) runs on a thread while training goes on
(`SaveQueue.removing`), the save's handle's, so that it is waited for as an
asynchronous save is: by `SaveHandle.wait`, the next save (before it looks for
leftovers), `close` (`fa.shutdown`) and, a non-daemon thread, the interpreter's
exit. An asynchronous save deletes it on its own thread. Killed in between, the
run leaves the new checkpoint in place and a marked leftover the next save removes.

A failed asynchronous save is never lost. Its error is raised once: by
`SaveHandle.wait`, the run's next save, `fa.shutdown`, or the next step
(`SaveQueue.raise_failure`, which only looks, never waits). A process that
ends before any of these ran is ended at exit by `SaveHandle._exit_failed`:
one line naming the path and the cause on stderr, exit status 1 (principle
10: the clean exit waited for the save; its failure is not a clean exit).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fnaccel._errors import CheckpointError
from fnaccel.dist import DistContext
from fnaccel.resources import GroupOwner

__all__ = ["SaveHandle", "SaveQueue"]


class SaveHandle:
    """A save in progress (or done): `wait` blocks until it is on disk and re-raises its error."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the asynchronous save to {self.path} failed: {error}") from error
        return self.path

    def _exit_failed(self) -> None:
        """At interpreter exit (after the save's thread was joined): a failure nobody
        was given ends the process with status 1 and one line. ``os._exit``: an exit
        handler's exception cannot change the status, and an error path waits for
        nothing else (the run's group is left to the exit, as when a rank raises)."""
        if self._error is None:
            return
        error = str(self._error).replace("\n", " ")
        print(
            f"fnaccel: the asynchronous save to {self.path} failed and the script ended before it "
            f"was reported: {error}",
            file=sys.stderr,
        )
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)


class SaveQueue:
    """The run's saves, one at a time; a live object carried by the run's states."""

    __slots__ = ("_ctx", "_failed", "_owner", "_pending", "_staging")

    def __init__(self) -> None:
        self._pending: SaveHandle | None = None
        self._failed: SaveHandle | None = None  # set by a save's thread when it fails
        self._ctx: DistContext | None = None
        self._owner: Any = None
        self._staging: dict[str, torch.Tensor] = {}

    def staged(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``tensor`` for the snapshot, in the buffer kept under ``key``
        by the previous asynchronous save when it has the same shape and dtype
        (call only once the previous save is done: `wait`)."""
        buffer = self._staging.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._staging[key] = torch.empty(tensor.shape, dtype=tensor.dtype)
        return buffer.copy_(tensor.detach())

    def wait(self) -> None:
        """Wait for the save in flight; re-raise its error here, once."""
        pending, self._pending, self._failed = self._pending, None, None
        if pending is not None:
            pending.wait()

    def raise_failure(self) -> None:
        """Re-raise the error of an asynchronous save that has failed, once; a save still
        in flight is not waited for (called by each step: one attribute read)."""
        if self._failed is not None:
            self.wait()

    def background_ctx(self, ctx: DistContext) -> DistContext:
        """A context over a process group of the saves' own (made once, collectively)."""
        if ctx.num_processes == 1:
            return ctx
        if self._ctx is None:
            group = dist.new_group(backend="gloo")  # file writing is CPU work
            self._owner = GroupOwner(group, is_default=False)
            self._ctx = dataclasses.replace(ctx, _owner=self._owner)
        return self._ctx

    def start(self, path: Path, work: Any) -> SaveHandle:
        handle = SaveHandle(path)

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # surfaced by wait(), a step, or at exit: never lost
                handle._error = exc
                self._failed = handle
                atexit.register(handle._exit_failed)

        handle._thread = threading.Thread(target=run, name=f"fnaccel-save-{path.name}", daemon=False)
        self._pending = handle
        handle._thread.start()
        return handle

    def removing(self, path: Path, removals: list[Callable[[], None]]) -> SaveHandle:
        """The handle of a blocking save to ``path`` that is in place: done, or, when it
        replaced a checkpoint, running ``removals`` (its deletion: errors are not the
        save's) on the handle's thread, waited for as an asynchronous save is."""
        if not removals:
            return SaveHandle(path)

        def run() -> None:
            for remove in removals:
                remove()

        handle = SaveHandle(
            path, threading.Thread(target=run, name=f"fnaccel-remove-{path.name}", daemon=False)
        )
        self._pending = handle
        assert handle._thread is not None
        handle._thread.start()
        return handle

    def close(self) -> None:
        """Wait for the last save, release the saves' process group (from fa.shutdown), then
        raise the save's error, if any. The group is ended first, on the clean path (every
        rank is in fa.shutdown): raised before, it was left open, and the error's traceback
        held it until the garbage collector ran on one rank (see `fnaccel.resources`)."""
        failure: CheckpointError | None = None
        try:
            self.wait()
        except CheckpointError as exc:
            failure = exc
        self._staging.clear()
        if self._owner is not None:
            self._owner.close()
            self._owner = self._ctx = None
        if failure is not None:
            raise failure
