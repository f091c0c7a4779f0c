"""How a checkpoint is written: a snapshot, then files, manifest and commit.

`take_snapshot` captures, on the calling thread, everything a checkpoint holds
as tensors and JSON values (JSON parts are round-tripped through the encoder,
which both copies them and rejects what cannot be stored without pickle); the
run's checkpoint layout (`fnaccel.checkpoint.storage.layout`) adds the model and the
optimizer.
`write_snapshot` writes it and moves it into place. A blocking save runs both
on the caller's thread; an asynchronous one copies the snapshot's tensors to
the CPU first (into the buffers the run's `SaveQueue` keeps from its last
asynchronous save) and writes on a background thread, coordinating the ranks over
a process group of its own so its collectives never meet training's.

A run's saves go one at a time through its `SaveQueue` (queue.py): a save
waits for the one before it and re-raises its error, and `fa.shutdown` waits
for the last one.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.checkpoint import extras as extras_codec
from fnaccel.checkpoint.manifest import FORMAT, MANIFEST, SCHEMA_VERSION, manifest_hash
from fnaccel.checkpoint.queue import SaveQueue
from fnaccel.checkpoint.runinfo import RUN_FILE, describe_run
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
from fnaccel.checkpoint.storage.parts import kind_of, rng_payload
from fnaccel.dist import DistContext
from fnaccel.process import wait_for_everyone

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["Snapshot", "take_snapshot", "write_snapshot"]


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
    json_files: dict[str, Any] = field(default_factory=dict)  # file -> JSON value
    raw_files: dict[str, bytes] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> the stored weight's name (tied.py)
    captured: Any = None  # the layout's snapshot, for its write (an fsdp() run's shards)
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

    def add_json(self, file: str, value: Any) -> None:
        """Add ``file`` holding ``value``, copied (refused when JSON cannot hold it)."""
        self.json_files[file] = json_copy(value, file)


def data_payload(state: RunState) -> dict[str, Any]:
    """The data position past the epoch (the manifest has the epoch), and the layout
    of the loader it belongs to (None without a loader)."""
    position = state.data_position
    return {
        "num_batches": position.num_batches,
        "loader_state": None if position.loader_state is None else dict(position.loader_state),
        "layout": None if state.loader is None else state.loader.layout.to_dict(),
    }


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
    rank_tensors, rng_json = rng_payload(state.rng)
    transforms = {
        name: value.state_dict()
        for name, value in state.transform_states.items()
        if callable(getattr(value, "state_dict", None))
    }
    snap.add_tensors(f"rank{ctx.rank}.safetensors", rank_tensors)
    snap.add_json(
        f"rank{ctx.rank}.json", {"rng": rng_json, "transforms": transforms, "data": data_payload(state)}
    )
    snap.captured = layout.snapshot(state, snap)
    if writer:
        if state.scheduler is not None:
            snap.add_json(
                "scheduler.json",
                {"kind": kind_of(state.scheduler), "state_dict": state.scheduler.state_dict()},
            )
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
    everyone = ops.gather_object(ctx, [(snap.node_rank, files, failure, prepared)])
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
