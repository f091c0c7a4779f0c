"""How a checkpoint is written: a snapshot, then files, manifest and commit, one save at a time.

`take_snapshot` captures, on the calling thread, everything a checkpoint holds
as tensors and JSON values (JSON parts are round-tripped through the encoder,
which both copies them and rejects what cannot be stored without pickle); the
run's checkpoint layout (`fnaccel.checkpoint.storage.layout`) adds the model and the
optimizer. `first_nonfinite` says whether what a save would write is finite:
`fa.save` refuses NaN or inf, because a checkpoint with non-finite parameters
is worse than none (`fa.latest_checkpoint` would hand it to the restarted
run, and rotation deletes the finite ones before it). Each rank checks the
tensors it holds (its shards under `fsdp` or `tp`), grouped by device and
dtype, one fused reduction per group (``torch._foreach_norm``: about 2 ms per
50 MB on one CPU core) and one host sync per group, never one per tensor; a
group found non-finite (or whose sum of squares overflowed, |x| above about
1e19 in float32) is checked again element by element, which names the tensor.

`write_snapshot` writes it and moves it into place. A blocking save runs both
on the caller's thread; an asynchronous one copies the snapshot's tensors to
the CPU first and writes on a background thread, coordinating the ranks over
a process group of its own so its collectives never meet training's. On one
process nothing is exchanged: no collective runs.

A run's saves go one at a time through its `SaveQueue` (registered with the
run's resources at its first save, as ``"saves"``): a save waits for the one
before it and re-raises its error, and `fa.shutdown` waits for the last one.
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
10: the clean exit waited for the save; its failure is not a clean exit)."""

from __future__ import annotations

import atexit
import dataclasses
import errno
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.checkpoint import extras as extras_codec
from fnaccel.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    RUN_FILE,
    SCHEMA_VERSION,
    describe_run,
    manifest_hash,
)
from fnaccel.checkpoint.storage.files import (
    SaveLock,
    commit,
    json_copy,
    make_temporary,
    remove_leftovers,
    remove_replaced,
    sibling_stem,
    temporary_sibling,
    write_bytes,
    write_json,
    write_tensors,
)
from fnaccel.checkpoint.storage.layout import CheckpointLayout
from fnaccel.checkpoint.storage.parts import rank_payload, scheduler_payload, unwrap_model
from fnaccel.dist import DistContext
from fnaccel.process import wait_for_everyone
from fnaccel.resources import GroupOwner

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "first_nonfinite",
    "saved_tensors",
    "SaveHandle",
    "SaveQueue",
    "Snapshot",
    "take_snapshot",
    "write_snapshot",
]


@dataclass(kw_only=True)
class Snapshot:
    """What one rank writes: its own files, the shared ones if it is a writer, and
    what its checkpoint layout writes itself."""

    rank: int
    node_rank: int
    writer: bool
    layout: CheckpointLayout
    per_node: bool = False
    staging: SaveQueue | None = None  # an asynchronous save's: tensors are copied into its buffers
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # file -> tensors
    json_files: dict[str, object] = field(default_factory=dict)  # file -> JSON value
    raw_files: dict[str, bytes] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> the stored weight's name (tied.py)
    captured: object = None  # the layout's snapshot, for its write (an fsdp() run's shards)
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def background(self) -> bool:
        """Whether the files are written on a background thread (tensors are copies)."""
        return self.staging is not None

    def add_tensors(self, file: str, tensors: Mapping[str, torch.Tensor], *, transient: bool = False) -> None:
        """Add ``tensors`` to ``file``'s: copied to the CPU now for an asynchronous save,
        and also for a blocking one when ``transient`` (valid only until the caller
        returns, as ZeRO-3's gathered parameters are)."""
        if self.staging is not None:
            held = {k: self.staging.staged(f"{file}/{k}", t) for k, t in tensors.items()}
        else:
            held = {k: t.detach().clone() if transient else t.detach() for k, t in tensors.items()}
        self.tensors.setdefault(file, {}).update(held)

    def add_json(self, file: str, value: object) -> None:
        """Add ``file`` holding ``value``, copied (refused when JSON cannot hold it)."""
        self.json_files[file] = json_copy(value, file)


def take_snapshot(
    state: RunState, layout: CheckpointLayout, writer: bool, per_node: bool, staging: SaveQueue | None
) -> Snapshot:
    """Everything ``state``'s checkpoint holds, captured now, the model and optimizer
    by ``layout`` (with ``staging``: the tensors copied to the CPU, into the buffers
    that queue keeps). Every rank calls it (a layout's snapshot may be collective)."""
    import yaml

    ctx: DistContext = state.dist
    snap = Snapshot(
        rank=ctx.rank,
        node_rank=ctx.node_rank,
        writer=writer,
        layout=layout,
        per_node=per_node,
        staging=staging,
    )
    rank_tensors, rank_json = rank_payload(state)
    snap.add_tensors(f"rank{ctx.rank}.safetensors", rank_tensors)
    snap.add_json(f"rank{ctx.rank}.json", rank_json)
    snap.captured = layout.snapshot(state, snap)
    if writer:
        if state.scheduler is not None:
            snap.add_json("scheduler.json", scheduler_payload(state.scheduler))
        if state.extras:
            extra_tensors: dict[str, torch.Tensor] = {}
            trees = {
                name: extras_codec.split(obj.state_dict(), name, extra_tensors, staging is not None)
                for name, obj in state.extras.items()
            }
            snap.tensors["extras.safetensors"] = extra_tensors
            snap.add_json("extras.json", trees)
        # libyaml's dumper where PyYAML has it: the same text, 6x faster (0.13 ms, not 0.85, on a step's path)
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        snap.raw_files["config.yaml"] = yaml.dump(
            state.config.to_dict(), Dumper=dumper, sort_keys=True
        ).encode()
        snap.json_files[RUN_FILE] = describe_run(state)  # pipeline, precision, versions: drift on resume
    snap.manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "num_processes": ctx.num_processes,
        "step": state.step,
        "micro_step": state.micro_step,
        "epoch": state.epoch,
        "seed": state.seed,
        "pipeline": repr(state.pipeline),
        "tied": snap.tied,
    }
    return snap


def write_snapshot(
    snap: Snapshot,
    ctx: DistContext,
    final: Path,
    token: str,
    on_commit: Callable[[Path], None],
    lock: SaveLock | None,
    remove: Callable[[Callable[[], None]], None],
) -> None:
    """Write ``snap`` into a temporary sibling of ``final`` and move it into place.

    Collective over ``ctx``: every rank calls it. Writers (rank 0, or each
    machine's first process with ``save_on_each_node``) first remove what
    crashed saves to ``final`` left (they hold its `SaveLock`, ``lock``: no live
    save to ``final`` is writing one), create the marked temporary directory,
    write the shared files and the manifest, commit, hand the deletion of the
    checkpoint it replaced to ``remove`` (which runs it now or on a thread:
    `SaveQueue.removing`), then call ``on_commit(final)`` (rotation).

    The ranks agree on the outcome: a rank whose part fails (a full disk, a
    file it may not create) carries its error in the exchange of file entries
    that precedes the commit, and the writers carry the commit's outcome in the
    closing exchange, which was a barrier; so every rank raises the same
    error, and a save that succeeds pays no extra round trip.

    Raises:
        CheckpointError: on every rank, naming ``final``, the rank that failed
            first and its error; the writers removed the temporary directory.
    """
    tmp = temporary_sibling(final, token)
    failure: tuple[str, str] | None = None  # this rank's error and what to do, as every rank reports it
    prepared = False
    if snap.writer:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(final.parent, re.escape(sibling_stem(final.name)), holding=lock)
            make_temporary(final, token)
            prepared = True
        except Exception as exc:
            failure = _cause(exc)
    if ctx.num_processes > 1:  # the writers' leftovers are gone and the directory exists
        wait_for_everyone(ctx)
    files: dict[str, Any] = {}
    try:  # collective: every rank, over ctx's group, whatever failed before
        files.update(snap.layout.write(snap.captured, ctx, tmp))
    except Exception as exc:
        failure = failure or _cause(exc)
    if failure is None:
        try:
            for name, tensors in snap.tensors.items():
                if name.startswith("rank") or snap.writer:
                    files[name] = write_tensors(tmp / name, tensors)
            for name, value in snap.json_files.items():
                files[name] = write_json(tmp / name, value)
            for name, data in snap.raw_files.items():
                files[name] = write_bytes(tmp / name, data)
        except Exception as exc:
            failure = _cause(exc)
    mine = (snap.node_rank, files, failure, prepared)
    everyone = ops.gather_object(ctx, [mine]) if ctx.num_processes > 1 else [mine]
    failed = [(rank, cause) for rank, (_, _, cause, _) in enumerate(everyone) if cause is not None]
    if failed:
        _abandon(snap, tmp)
        written = any(was_prepared for *_, was_prepared in everyone)
        rank, cause = failed[0]
        _raise(
            final,
            ctx,
            rank,
            cause,
            f"its partial directory {tmp} was removed" if written else "nothing was written",
        )
    after = ""
    if snap.writer:
        try:
            manifest = dict(snap.manifest)
            # per node, a machine's directory holds its own ranks' files (and the shared ones)
            manifest["files"] = {
                name: entry
                for node, part, _, _ in everyone
                if not snap.per_node or node == snap.node_rank
                for name, entry in part.items()
            }
            manifest["manifest_sha256"] = manifest_hash(manifest)
            # whole or absent, even if killed while writing it
            write_json(tmp / f"{MANIFEST}.partial", manifest)
            (tmp / f"{MANIFEST}.partial").rename(tmp / MANIFEST)
            replaced = commit(tmp, final, MANIFEST)
        except Exception as exc:
            failure, after = _cause(exc), f"its partial directory {tmp} was removed"
            _abandon(snap, tmp)
        else:
            if replaced is not None:
                remove(lambda: remove_replaced(replaced, MANIFEST))
            try:
                on_commit(final)
            except Exception as exc:
                failure, after = _cause(exc), f"{final} was saved, but older checkpoints were not all removed"
    if ctx.num_processes > 1:  # the closing barrier, carrying whether a writer's commit failed
        flag = torch.tensor([0 if failure is None else ctx.rank + 1], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.process_group)
        if int(flag.item()):  # only now, only on failure: the writer's cause, to every rank
            rank = int(flag.item()) - 1
            failure, after = ops.broadcast_object_list(ctx, [(failure, after)], from_process=rank)[0]
            assert failure is not None, "the rank that flagged a failure sends it"
            _raise(final, ctx, rank, failure, after)
    elif failure is not None:
        _raise(final, ctx, ctx.rank, failure, after)


def _cause(exc: BaseException) -> tuple[str, str]:
    """An error as the save reports it: its type and message, and what to do about a
    directory this process may not write in."""
    hint = ""
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == errno.EROFS:
        hint = "; save to a directory this process may write in"
    return f"{type(exc).__name__}: {exc}", hint


def _abandon(snap: Snapshot, tmp: Path) -> None:
    """A writer removes the save's temporary directory (nothing there is anyone else's)."""
    if snap.writer:
        shutil.rmtree(tmp, ignore_errors=True)


def _raise(final: Path, ctx: DistContext, rank: int, failure: tuple[str, str], after: str) -> None:
    where = f" on rank {rank}" if ctx.num_processes > 1 else ""
    cause, hint = failure
    raise CheckpointError(f"{final}: the save failed{where} ({cause}); {after}{hint}")


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
        self._owner: GroupOwner | None = None
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

    def start(self, path: Path, work: Callable[[], None]) -> SaveHandle:
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it was loaded
    kind: Any = getattr(dtensor, "DTensor", ())
    return cast(torch.Tensor, tensor.to_local()) if isinstance(tensor, kind) else tensor


def saved_tensors(state: RunState) -> Iterator[tuple[str, torch.Tensor]]:
    """``(what, tensor)`` for each tensor of ``state`` that the updates compute and a save
    writes, as this rank holds it: the parameters and the optimizer's state (its moments).
    Not the gradients a save between accumulation micro-steps writes: a NaN there is
    `fa.skip_nonfinite`'s to skip after the resume, as it would have been without one."""
    if state.model is None:
        return
    module = unwrap_model(state.model)
    named = list(module.named_parameters())
    for name, param in named:
        yield f"parameter {name!r}", _local(param.detach())
    optimizer = state.optimizer
    if optimizer is None:
        return
    names = {id(param): name for name, param in named}
    for index, (moved, per_param) in enumerate(optimizer.state.items()):
        owner = names.get(id(moved), f"#{index}")
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {key!r} of {owner!r}", _local(value)


def first_nonfinite(state: RunState) -> str | None:
    """The first tensor of `saved_tensors` that holds a NaN or inf (named), or None.

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> state = fa.prepare(fa.init(cpu=True), model)
    >>> first_nonfinite(state) is None
    True
    >>> with torch.no_grad():
    ...     model.bias.fill_(float("nan"))
    Parameter containing:
    tensor([nan], requires_grad=True)
    >>> first_nonfinite(state)
    "parameter 'bias'"
    """
    found = [(what, t) for what, t in saved_tensors(state) if t.is_floating_point() and t.numel()]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, tensor in found:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        if all(
            bool(torch.stack(torch._foreach_norm(group, 2)).isfinite().all()) for group in groups.values()
        ):
            return None
        # rare: something is NaN or inf, or a norm overflowed; the exact check names it
        return next((what for what, tensor in found if not bool(torch.isfinite(tensor).all())), None)
