"""How a checkpoint is written: a snapshot, then files, manifest and commit.

`take_snapshot` captures, on the calling thread, everything a checkpoint holds
as tensors and JSON values (JSON parts are round-tripped through the encoder,
which both copies them and rejects what cannot be stored without pickle).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.checkpoint import extras as extras_codec
from fnaccel.checkpoint.checks import kind_of
from fnaccel.checkpoint.codec import optimizer_payload, rng_payload
from fnaccel.checkpoint.hooks import check_unsharded, saved_weights
from fnaccel.checkpoint.files import (
    SaveLock,
    commit,
    json_copy,
    make_temporary,
    remove_leftovers,
    sibling_stem,
    temporary_sibling,
    write_bytes,
    write_json,
    write_tensors,
)
from fnaccel.checkpoint.runinfo import RUN_FILE, describe_run
from fnaccel.checkpoint.manifest import FORMAT, MANIFEST, SCHEMA_VERSION, manifest_hash
from fnaccel.checkpoint.queue import SaveQueue
from fnaccel.checkpoint.sharded import ShardedSnapshot, is_sharded, snapshot_sharded, write_sharded
from fnaccel.checkpoint.tied import untie
from fnaccel.checkpoint.zero import snapshot_zero, zero_engine
from fnaccel.dist import DistContext
from fnaccel.process import wait_for_everyone
from fnaccel.transforms.deepspeed import gathered_parameters

__all__ = ["Snapshot", "take_snapshot", "write_snapshot"]


@dataclass(kw_only=True)
class Snapshot:
    """What one rank writes: its own files, and the shared ones if it is a writer."""

    rank: int
    node_rank: int
    writer: bool
    per_node: bool = False
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # file -> tensors
    json_files: dict[str, Any] = field(default_factory=dict)  # file -> JSON value
    raw_files: dict[str, bytes] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    sharded: ShardedSnapshot | None = None  # an fsdp() run's model and optimizer (DCP)


def data_payload(state: Any) -> dict[str, Any]:
    """The data position past the epoch (the manifest has the epoch), and the layout
    of the loader it belongs to (None without a loader)."""
    position = state.data_position
    return {
        "num_batches": position.num_batches,
        "loader_state": None if position.loader_state is None else dict(position.loader_state),
        "layout": None if state.loader is None else state.loader.layout.to_dict(),
    }


def take_snapshot(
    state: Any, module: torch.nn.Module | None, writer: bool, per_node: bool, staging: SaveQueue | None
) -> Snapshot:
    """Everything ``state``'s checkpoint holds, captured now (with ``staging``: the
    tensors copied to the CPU, into the buffers that queue keeps)."""
    import yaml

    copy = staging is not None

    def owned(file: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if staging is None:
            return {k: t.detach() for k, t in tensors.items()}
        return {k: staging.staged(f"{file}/{k}", t) for k, t in tensors.items()}

    ctx: DistContext = state.dist
    snap = Snapshot(rank=ctx.rank, node_rank=ctx.node_rank, writer=writer, per_node=per_node)
    if is_sharded(state.model):  # every rank writes its own shards in write_sharded
        check_unsharded(state)
        snap.sharded = snapshot_sharded(state, copy=copy, per_node=per_node)
        module = None
    rank_tensors, rng_json = rng_payload(state.rng)
    accumulating = state.plan is not None and state.micro_step % state.plan.micro_steps != 0
    if module is not None and accumulating:
        for name, p in module.named_parameters():
            if p.grad is not None:
                rank_tensors[f"grad/{name}"] = p.grad
    transforms = {
        name: value.state_dict() for name, value in state.transform_states.items()
        if callable(getattr(value, "state_dict", None))
    }
    file = f"rank{ctx.rank}.safetensors"
    snap.tensors[file] = owned(file, rank_tensors)
    snap.json_files[f"rank{ctx.rank}.json"] = json_copy(
        {"rng": rng_json, "transforms": transforms, "data": data_payload(state)},
        f"rank{ctx.rank}.json",
    )
    tied: dict[str, str] = {}
    zero = zero_engine(state.model)
    if zero is not None:  # a DeepSpeed ZeRO run: each rank's optimizer partitions (zero.py)
        tensor_file, zero_tensors, json_file, zero_json = snapshot_zero(state, zero)
        snap.tensors[tensor_file] = owned(tensor_file, zero_tensors)
        snap.json_files[json_file] = json_copy(zero_json, json_file)
    if module is not None and (writer or zero is not None):
        with gathered_parameters(module):  # ZeRO-3: a collective, every rank takes part
            weights, tied = untie(saved_weights(state, module))
            if writer and zero is not None and staging is None:  # the gathered ZeRO-3 data goes at exit
                snap.tensors["model.safetensors"] = {k: v.detach().clone() for k, v in weights.items()}
            elif writer:
                snap.tensors["model.safetensors"] = owned("model.safetensors", weights)
    if writer:
        if state.optimizer is not None and snap.sharded is None and zero is None:
            assert module is not None, "an optimizer without a model"
            names = {id(p): n for n, p in module.named_parameters()}
            opt_tensors, opt_json = optimizer_payload(state.optimizer, names)
            snap.tensors["optimizer.safetensors"] = owned("optimizer.safetensors", opt_tensors)
            snap.json_files["optimizer.json"] = json_copy(opt_json, "optimizer.json")
        if state.scheduler is not None:
            snap.json_files["scheduler.json"] = json_copy(
                {"kind": kind_of(state.scheduler), "state_dict": state.scheduler.state_dict()}, "scheduler.json"
            )
        if state.extras:
            extra_tensors: dict[str, torch.Tensor] = {}
            trees = {
                name: extras_codec.split(obj.state_dict(), name, extra_tensors, copy)
                for name, obj in state.extras.items()
            }
            snap.tensors["extras.safetensors"] = extra_tensors
            snap.json_files["extras.json"] = json_copy(trees, "extras.json")
        snap.raw_files["config.yaml"] = yaml.safe_dump(state.config.to_dict(), sort_keys=True).encode()
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
        "tied": tied,
    }
    return snap


def write_snapshot(snap: Snapshot, ctx: DistContext, final: Path, token: str,
                   on_commit: Callable[[Path], None], lock: SaveLock | None) -> None:
    """Write ``snap`` into a temporary sibling of ``final`` and move it into place.

    Collective over ``ctx``: every rank calls it. Writers (rank 0, or each
    machine's first process with ``save_on_each_node``) first remove what
    crashed saves to ``final`` left (they hold its `SaveLock`, ``lock``: no live
    save to ``final`` is writing one), create the marked temporary directory,
    write the shared files and the manifest, commit, then call
    ``on_commit(final)`` (rotation).

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
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, not here
            failure = _cause(exc)
    wait_for_everyone(ctx)
    files: dict[str, Any] = {}
    if snap.sharded is not None:  # collective: every rank, over ctx's group, whatever failed before
        try:
            files.update(write_sharded(snap.sharded, ctx, tmp))
        except Exception as exc:  # noqa: BLE001 - DCP raised it on every rank
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
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            failure = _cause(exc)
    everyone = ops.gather_object(ctx, [(snap.node_rank, files, failure, prepared)])
    failed = [(rank, cause) for rank, (_, _, cause, _) in enumerate(everyone) if cause is not None]
    if failed:
        _abandon(snap, tmp)
        written = any(was_prepared for *_, was_prepared in everyone)
        rank, cause = failed[0]
        _raise(final, ctx, rank, cause, f"its partial directory {tmp} was removed" if written
               else "nothing was written")
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
            commit(tmp, final, MANIFEST)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            failure, after = _cause(exc), f"its partial directory {tmp} was removed"
            _abandon(snap, tmp)
        else:
            try:
                on_commit(final)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                failure, after = _cause(exc), f"{final} was saved, but older checkpoints were not all removed"
    if ctx.num_processes > 1:  # the closing barrier, carrying whether a writer's commit failed
        import torch.distributed as dist

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
