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

Rank 0 writes the shared files; every rank writes its own; rank 0 then writes
the manifest and moves the directory into place atomically (files.commit).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.codec import load_optimizer, optimizer_payload, rng_from, rng_payload
from fnaccel.checkpoint.files import (
    commit,
    read_json,
    read_tensors,
    read_verified,
    temporary_sibling,
    write_bytes,
    write_json,
    write_tensors,
)
from fnaccel.checkpoint.tied import retie, untie
from fnaccel.process import wait_for_everyone
from fnaccel.state import RunState
from fnaccel.transforms.parallel import unwrap_compiled, unwrap_model

__all__ = ["load", "save"]

MANIFEST = "fnaccel.json"
SCHEMA_VERSION = 1
FORMAT = "fnaccel-checkpoint"


def _module(state: RunState, action: str) -> torch.nn.Module | None:
    if state.model is None:
        return None
    from torch.distributed.fsdp import FSDPModule

    if isinstance(unwrap_compiled(state.model), FSDPModule):
        raise CheckpointError(
            f"{action}: an fsdp() run's sharded state goes through torch.distributed.checkpoint, "
            "which this build does not wire up yet; save the consolidated weights with "
            "fa.save_model, or train with ddp()"
        )
    return unwrap_model(state.model)


def _accumulating(state: RunState) -> bool:
    return state.plan is not None and state.micro_step % state.plan.micro_steps != 0


def _transform_payload(state: RunState) -> dict[str, Any]:
    out = {}
    for name, value in state.transform_states.items():
        state_dict = getattr(value, "state_dict", None)
        if callable(state_dict):
            out[name] = state_dict()
    return out


def _rank_files(state: RunState, directory: Path, module: torch.nn.Module | None) -> dict[str, Any]:
    rank = state.dist.rank
    tensors, rng_json = rng_payload(state.rng)
    if module is not None and _accumulating(state):
        for name, p in module.named_parameters():
            if p.grad is not None:
                tensors[f"grad/{name}"] = p.grad
    payload = {
        "rng": rng_json,
        "loader": None if state.loader is None else state.loader.state_dict(),
        "transforms": _transform_payload(state),
    }
    return {
        f"rank{rank}.safetensors": write_tensors(directory / f"rank{rank}.safetensors", tensors),
        f"rank{rank}.json": write_json(directory / f"rank{rank}.json", payload),
    }


def _shared_files(state: RunState, directory: Path, module: torch.nn.Module | None) -> tuple[dict[str, Any], dict[str, str]]:
    import yaml

    files: dict[str, Any] = {}
    tied: dict[str, str] = {}
    if module is not None:
        weights, tied = untie(module.state_dict())
        files["model.safetensors"] = write_tensors(directory / "model.safetensors", weights)
    if state.optimizer is not None:
        assert module is not None, "an optimizer without a model"
        names = {id(p): n for n, p in module.named_parameters()}
        tensors, json_part = optimizer_payload(state.optimizer, names)
        files["optimizer.safetensors"] = write_tensors(directory / "optimizer.safetensors", tensors)
        files["optimizer.json"] = write_json(directory / "optimizer.json", json_part)
    if state.scheduler is not None:
        files["scheduler.json"] = write_json(directory / "scheduler.json", state.scheduler.state_dict())
    config = yaml.safe_dump(state.config.to_dict(), sort_keys=True).encode()
    files["config.yaml"] = write_bytes(directory / "config.yaml", config)
    return files, tied


def save(state: RunState, path: str | Path) -> None:
    """Write a checkpoint of ``state`` to the directory ``path`` (the state is not consumed).

    Atomic: a crash, or ``kill -9``, leaves either the old checkpoint or the new
    one at ``path``, never a mix. Every rank calls it.

    Raises:
        StaleStateError: ``state`` was already consumed.
        CheckpointError: a value cannot be stored without pickle.
    """
    state.check_fresh("fa.save")
    final = Path(path).absolute()
    module = _module(state, "fa.save")
    token = ops.broadcast_object_list(state, [uuid.uuid4().hex if state.dist.is_main_process else None])[0]
    tmp = temporary_sibling(final, token)
    if state.dist.is_main_process:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    wait_for_everyone(state)
    files = _rank_files(state, tmp, module)
    tied: dict[str, str] = {}
    if state.dist.is_main_process:
        shared, tied = _shared_files(state, tmp, module)
        files.update(shared)
    everyone = ops.gather_object(state, [files])
    if state.dist.is_main_process:
        manifest = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "num_processes": state.dist.num_processes,
            "step": state.step,
            "micro_step": state.micro_step,
            "epoch": state.epoch,
            "seed": state.seed,
            "pipeline": repr(state.pipeline),
            "tied": tied,
            "files": {name: entry for part in everyone for name, entry in part.items()},
        }
        manifest["manifest_sha256"] = _manifest_hash(manifest)
        # whole or absent, even if killed while writing it
        write_json(tmp / f"{MANIFEST}.partial", manifest)
        (tmp / f"{MANIFEST}.partial").rename(tmp / MANIFEST)
        commit(tmp, final, MANIFEST)
    wait_for_everyone(state)


def _manifest_hash(manifest: dict[str, Any]) -> str:
    """The manifest's sha256 over its own content (so a flipped digit in a counter shows)."""
    import hashlib
    import json

    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _manifest(directory: Path, state: RunState) -> dict[str, Any]:
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
    if manifest.get("manifest_sha256") != _manifest_hash(manifest):
        raise CheckpointError(f"{path}: corrupt (its content does not match its own sha256)")
    saved, now = manifest["num_processes"], state.dist.num_processes
    if saved != now:
        raise CheckpointError(
            f"{directory}: saved by {saved} process(es), loaded by {now}; resume with the same "
            "world size (or consolidate the weights with fa.save_model and start a new run)"
        )
    return manifest


def _load_model(module: torch.nn.Module, directory: Path, manifest: dict[str, Any]) -> None:
    weights = retie(read_tensors(directory, "model.safetensors", manifest), manifest["tied"])
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
    if module is not None:
        _load_model(module, directory, manifest)
    if state.optimizer is not None:
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
    if module is not None:
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
    if new.plan is not None and new.model is not None:
        new.plan.set_sync_for(new.model, new.micro_step)
    return new
