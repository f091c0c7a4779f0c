"""`fa.save` and `fa.load`: everything a run needs to continue bit for bit.

Layout (all tensors in safetensors, everything else JSON or YAML; no pickle)::

    fnaccel.json            manifest: schema, world size, counters, tied aliases,
                            sha256 and size of every other file (written last)
    model.safetensors       the weights, tied tensors once        (rank 0)
    optimizer.safetensors   optimizer state keyed "<param>/<key>" (rank 0)
    optimizer.json          param groups and non-tensor state      (rank 0)
    scheduler.json          the scheduler's state_dict             (rank 0)
    config.yaml             the resolved launch config             (rank 0)
    rank<r>.safetensors     this rank's generators, gradients accumulated so
                            far when the save falls between micro-steps
    rank<r>.json            this rank's Python/NumPy generators, data position,
                            transform states

    extras.safetensors/.json  objects registered for checkpointing (rank 0)

An fsdp() run has no model.safetensors, optimizer.* or gradients; its model
and optimizer go through torch.distributed.checkpoint instead (sharded.py),
each rank writing the shards it holds:

    sharded/rank<r>.safetensors  rank r's chunks of parameters and optimizer state
    sharded/metadata.json        DCP's index: shapes, dtypes, chunks, their files (rank 0)
    sharded/state.json           param groups, non-tensor optimizer state (rank 0)

Rank 0 writes the shared files; every rank writes its own; rank 0 then writes
the manifest and moves the directory into place atomically (writer.py,
files.commit). With ProjectConfiguration(save_on_each_node=True) every
machine's first process does rank 0's part on that machine's disk.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.checkpoint import extras as extras_codec
from fnaccel.checkpoint.codec import load_optimizer, rng_from
from fnaccel.checkpoint.hooks import check_unsharded, loaded_weights
from fnaccel.checkpoint.files import read_json, read_tensors, read_verified
from fnaccel.checkpoint.project import next_checkpoint, project_of, rotate
from fnaccel.checkpoint.sharded import is_sharded, load_sharded
from fnaccel.checkpoint.tied import retie
from fnaccel.checkpoint.writer import (
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    SaveHandle,
    manifest_hash,
    take_snapshot,
    write_snapshot,
)
from fnaccel.state import RunState
from fnaccel.transforms.parallel import unwrap_model

__all__ = ["load", "save"]



def _module(state: RunState, action: str) -> torch.nn.Module | None:
    if state.model is None:
        return None
    return unwrap_model(state.model)


def save(state: RunState, path: str | Path | None = None, *, blocking: bool = True) -> SaveHandle:
    """Write a checkpoint of ``state`` (the state is not consumed); every rank calls it.

    Atomic: a crash, or ``kill -9``, leaves either the old checkpoint or the
    new one at ``path``, never a mix. A save first waits for the run's
    previous one (and re-raises its error).

    Args:
        state: the run's state.
        path: the checkpoint directory; None with
            ``ProjectConfiguration(automatic_checkpoint_naming=True)`` picks
            ``<project_dir>/checkpoints/checkpoint_<n>``.
        blocking: False snapshots the state to the CPU now and writes it on a
            background thread while training goes on; ``handle.wait()`` (or
            the next save, or `fa.shutdown`) waits for it and raises its error.

    Returns:
        A `SaveHandle` (already done when ``blocking``).

    Raises:
        StaleStateError: ``state`` was already consumed.
        CheckpointError: a value cannot be stored without pickle.
    """
    state.check_fresh("fa.save")
    state.saves.wait()
    project, project_dir = project_of(state)
    if path is None:
        if not (project.automatic_checkpoint_naming and project_dir is not None):
            raise ValueError(
                "fa.save: give a path, or use ProjectConfiguration(project_dir=..., "
                "automatic_checkpoint_naming=True) in fa.init's kwargs_handlers"
            )
        path = next_checkpoint(project_dir)
    final = Path(path).absolute()
    module = _module(state, "fa.save")
    ctx = state.dist
    writer = ctx.is_main_process or (project.save_on_each_node and ctx.is_local_main_process)
    token = ops.broadcast_object_list(state, [uuid.uuid4().hex if ctx.is_main_process else None])[0]
    snap = take_snapshot(state, module, writer, project.save_on_each_node, copy=not blocking)

    def on_commit(committed: Path) -> None:
        automatic = project_dir is not None and committed.parent == project_dir / "checkpoints"
        if project.total_limit is not None and automatic:
            assert project_dir is not None
            rotate(project_dir, project.total_limit, committed)

    if blocking:
        write_snapshot(snap, ctx, final, token, on_commit)
        return SaveHandle(final)
    background = state.saves.background_ctx(ctx)
    return state.saves.start(final, lambda: write_snapshot(snap, background, final, token, on_commit))


def read_manifest(directory: Path) -> dict[str, Any]:
    """A checkpoint's ``fnaccel.json``, checked: present, JSON, fnaccel's format,
    a known schema version, and its own sha256.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    import json

    path = directory / MANIFEST
    if not path.is_file():
        hint = " (it is not a directory)" if path.parent.exists() and not path.parent.is_dir() else ""
        raise CheckpointError(f"{directory}: not a complete fnaccel checkpoint: {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError:
        raise CheckpointError(f"{path}: corrupt (not valid JSON)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an fnaccel checkpoint manifest")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(
            f"{path}: schema version {manifest.get('schema_version')!r} is unknown to this "
            f"fnaccel (it reads version {SCHEMA_VERSION}); load it with the fnaccel that wrote it"
        )
    if manifest.get("manifest_sha256") != manifest_hash(manifest):
        raise CheckpointError(f"{path}: corrupt (its content does not match its own sha256)")
    return manifest


def _manifest(directory: Path, state: RunState) -> dict[str, Any]:
    manifest = read_manifest(directory)
    saved, now = manifest["num_processes"], state.dist.num_processes
    if saved != now:
        raise CheckpointError(
            f"{directory}: saved by {saved} process(es), loaded by {now}; resume with the same "
            "world size (or consolidate the weights with fa.save_model and start a new run)"
        )
    return manifest


def _load_model(state: RunState, module: torch.nn.Module, directory: Path, manifest: dict[str, Any]) -> None:
    weights = loaded_weights(state, module, retie(read_tensors(directory, "model.safetensors", manifest),
                                                  manifest["tied"]))
    expected = module.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory / 'model.safetensors'}: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}; the model is not the one this checkpoint was saved from"
        )
    mismatched = [
        f"{key!r} has shape {tuple(weights[key].shape)} in the checkpoint but "
        f"{tuple(value.shape)} in the model"
        for key, value in expected.items() if weights[key].shape != value.shape
    ]
    if mismatched:
        raise CheckpointError(f"{directory / 'model.safetensors'}: {'; '.join(mismatched)}")
    module.load_state_dict(weights, strict=True)


def load(state: RunState, path: str | Path) -> RunState:
    """Consumes ``state``: restore the checkpoint at ``path`` into its live objects.

    ``state`` must be prepared like the run that saved (same model, optimizer,
    scheduler, loader and pipeline, same number of processes); the rest of the
    run then continues bit for bit as if it had never stopped.

    Raises:
        CheckpointError: a missing, truncated or corrupt file (named), an
            unknown schema version, another world size, missing or
            unexpected model keys, mismatched shapes.
    """
    by = "fa.load"
    state.check_fresh(by)
    directory = Path(path).absolute()
    manifest = _manifest(directory, state)
    module = _module(state, by)
    rank = state.dist.rank
    sharded = is_sharded(state.model)
    if sharded:  # model and optimizer from sharded/ (torch.distributed.checkpoint)
        check_unsharded(state)
        load_sharded(state, directory, manifest)
    elif module is not None:
        _load_model(state, module, directory, manifest)
    if state.optimizer is not None and not sharded:
        assert module is not None, "an optimizer without a model"
        names = {id(p): n for n, p in module.named_parameters()}
        load_optimizer(
            state.optimizer, names,
            read_tensors(directory, "optimizer.safetensors", manifest),
            read_json(directory, "optimizer.json", manifest),
            str(directory / "optimizer.json"),
        )
    if state.scheduler is not None:
        state.scheduler.load_state_dict(read_json(directory, "scheduler.json", manifest))
    read_verified(directory, "config.yaml", manifest)  # recorded for people; checked all the same
    tensors = read_tensors(directory, f"rank{rank}.safetensors", manifest)
    own = read_json(directory, f"rank{rank}.json", manifest)
    if state.loader is not None and own["loader"] is not None:
        state.loader.load_state_dict(own["loader"])
    for name, saved in own["transforms"].items():
        value = state.transform_states.get(name)
        if value is None or not callable(getattr(value, "load_state_dict", None)):
            raise CheckpointError(f"{directory / f'rank{rank}.json'}: state for transform {name!r}, "
                                  "which this run's pipeline lacks")
        value.load_state_dict(saved)
    if module is not None and not sharded:
        for name, p in module.named_parameters():
            grad = tensors.get(f"grad/{name}")
            p.grad = None if grad is None else grad.to(p.device, p.dtype)
    new = state.advance(
        by,
        rng=rng_from(tensors, own["rng"]),
        step=manifest["step"],
        micro_step=manifest["micro_step"],
        epoch=manifest["epoch"],
        seed=manifest["seed"],
    )
    if state.extras:
        trees = read_json(directory, "extras.json", manifest)
        extra_tensors = read_tensors(directory, "extras.safetensors", manifest)
        for name, obj in state.extras.items():
            if name not in trees:
                raise CheckpointError(f"{directory / 'extras.json'}: nothing saved for registered object {name!r}")
            obj.load_state_dict(extras_codec.join(trees[name], extra_tensors))
    if new.plan is not None and new.model is not None:
        new.plan.set_sync_for(new.model, new.micro_step)
    return new
