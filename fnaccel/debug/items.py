"""A run, live or saved, as one flat table of named items: what `fa.diff` compares.

The same names come out of a `RunState` and of a checkpoint directory, plain
or sharded, so any two can be compared:

    step, micro_step, epoch, seed, num_processes, tied   the counters
    pipeline/<transform>/<option>, precision, micro_steps  how the run is set up
    config/<key>                                         the resolved launch config
    model/<parameter or buffer>                          tensors
    optimizer/<parameter>/<slot>, optimizer/param_groups/<i>/<key>
    scheduler/<field>
    rank<r>/rng/torch, rank<r>/rng/cuda/<i>, rank<r>/rng/python, rank<r>/rng/numpy
    rank<r>/data/num_batches, rank<r>/data/loader_state/...
    rank<r>/grad/<parameter>, rank<r>/transforms/<name>/<key>
    extras/<name>/...

A live state is read through `take_snapshot` (what `fa.save` would write) so
its names are a checkpoint's by construction. Tensors are *thunks*: nothing is
read (or, for a sharded live state, gathered) until `fa.diff` compares that
one tensor, so a comparison holds at most one tensor per side at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.headers import TensorFile
from fnaccel.checkpoint.manifest import RUN_FILE, read_manifest, saved_config
from fnaccel.checkpoint.storage.files import read_json, torch_dtype
from fnaccel.checkpoint.storage.plain import layout_for
from fnaccel.checkpoint.storage.sharded import ShardedSnapshot
from fnaccel.checkpoint.storage.shardindex import METADATA, VALUES
from fnaccel.checkpoint.writer import take_snapshot
from fnaccel.state import RunState

__all__ = ["TensorItem", "items_of_directory", "items_of_state"]

_RANK_FILE = re.compile(r"rank(\d+)\.(json|safetensors)")
_COUNTERS = ("step", "micro_step", "epoch", "seed", "num_processes", "tied")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorItem:
    """A tensor not yet read: its shape and dtype, and how to get it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    """Objects are walked key by key, lists of objects index by index; any other
    value (numbers, strings, lists of numbers such as a generator's words) is one item."""
    if isinstance(value, Mapping):  # an empty one holds no item: {} and absent compare equal
        for key, inner in value.items():
            _flatten(f"{prefix}/{key}", inner, out)
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for i, inner in enumerate(value):
            _flatten(f"{prefix}/{i}", inner, out)
    else:
        out[prefix] = value


def _json_file(name: str, value: object, out: dict[str, object]) -> None:
    """One JSON file of a checkpoint (or of a snapshot), under its items' names."""
    if name == RUN_FILE and isinstance(value, dict):
        for transform in value.get("pipeline") or []:
            _flatten(f"pipeline/{transform.get('name')}", transform.get("options") or "(no options)", out)
        for key in ("precision", "mixed_precision", "micro_steps"):
            out[key] = value.get(key)
        out["versions/fnaccel"], out["versions/torch"] = (
            value.get("fnaccel_version"),
            value.get("torch_version"),
        )
    elif name == "scheduler.json" and isinstance(value, dict):
        out["scheduler/kind"] = value.get("kind")
        _flatten("scheduler", value.get("state_dict"), out)
    elif name == VALUES and isinstance(value, dict):  # a sharded run's optimizer settings
        out["optimizer/kind"] = value.get("kind")
        _flatten("optimizer/param_groups", value.get("param_groups"), out)
        _flatten("optimizer/values", value.get("values"), out)
    elif name == "optimizer.json" and isinstance(value, dict):
        out["optimizer/kind"] = value.get("kind")
        _flatten("optimizer/param_groups", value.get("param_groups"), out)
        _flatten("optimizer/scalars", value.get("scalars"), out)
    else:
        _flatten(name.removesuffix(".json"), value, out)


def _tensor_prefix(name: str) -> str:
    return {
        "model.safetensors": "model",
        "optimizer.safetensors": "optimizer",
        "extras.safetensors": "extras",
    }.get(name, name.removesuffix(".safetensors"))


def _keep(name: str, ranks: set[int] | None) -> bool:
    match = _RANK_FILE.fullmatch(name)
    return match is None or ranks is None or int(match.group(1)) in ranks


def _thunk(tensor: torch.Tensor) -> TensorItem:
    full = getattr(tensor, "full_tensor", None)  # a DTensor shard: gathered (one tensor) when compared
    load = (lambda: full().detach().cpu()) if full is not None else (lambda: tensor.detach().cpu())
    return TensorItem(shape=tuple(tensor.shape), dtype=tensor.dtype, load=load)


def _sharded_name(fqn: str) -> str:
    """DCP's flat key (``model.<fqn>``, ``optimizer.state.<fqn>.<slot>``) as an item name."""
    if fqn.startswith("optimizer.state."):
        param, _, slot = fqn.removeprefix("optimizer.state.").rpartition(".")
        return f"optimizer/{param}/{slot}"
    return fqn.replace(".", "/", 1)


def items_of_state(state: RunState) -> dict[str, object]:
    """Every item of a live ``state`` (this rank's own generators and data position).

    Reads the state; consumes nothing. A sharded (``fsdp()``) state's tensors
    are gathered one at a time when compared: every rank must compare.
    """
    state.check_fresh("fa.diff")  # a consumed state's model and optimizer have moved on: a lie about it
    snap = take_snapshot(state, layout_for(state), writer=True, per_node=False, staging=None)
    out: dict[str, object] = {key: snap.manifest[key] for key in _COUNTERS}
    for name, value in snap.json_files.items():
        _json_file(name, value, out)
    _flatten("config", yaml.safe_load(snap.raw_files["config.yaml"]), out)
    for name, tensors in snap.tensors.items():
        prefix = _tensor_prefix(name)
        out.update({f"{prefix}/{key}": _thunk(t) for key, t in tensors.items()})
    sharded = snap.captured
    if isinstance(sharded, ShardedSnapshot):  # the shards the sharded layout writes itself
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, _ = flatten_state_dict(dict(sharded.tensors))
        out.update({_sharded_name(key): _thunk(t) for key, t in flat.items()})
        _json_file(
            VALUES,
            {"kind": sharded.kind, "param_groups": sharded.param_groups, "values": sharded.values},
            out,
        )
    return out


def _chunked(
    directory: Path, manifest: dict[str, Any], fqn: str, item: Any, storage: Mapping[Any, tuple[str, str]]
) -> TensorItem:
    """A sharded tensor, assembled from its chunks (each read alone) when compared."""

    def load() -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        whole = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for chunk in item.chunks:
            file, key = storage[MetadataIndex(fqn, chunk.offsets)]
            with TensorFile(directory, file, manifest) as f:
                part = f.read(key)
            target = whole
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                target = target.narrow(dim, offset, size)
            if tuple(part.shape) != tuple(chunk.sizes) or part.dtype != whole.dtype:
                raise CheckpointError(
                    f"{directory / file}: key {key!r} does not hold the chunk of {fqn!r} "
                    f"that {METADATA} describes"
                )
            target.copy_(part)
        return whole

    return TensorItem(shape=tuple(item.size), dtype=item.properties.dtype, load=load)


def _file_tensors(directory: Path, name: str, manifest: dict[str, Any]) -> dict[str, TensorItem]:
    with TensorFile(directory, name, manifest) as f:
        specs = f.specs

    def loader(key: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            with TensorFile(directory, name, manifest, specs) as f:
                return f.read(key)

        return load

    prefix = _tensor_prefix(name)
    return {
        f"{prefix}/{key}": TensorItem(shape=spec.shape, dtype=torch_dtype(spec.dtype), load=loader(key))
        for key, spec in specs.items()
    }


def items_of_directory(directory: Path, ranks: set[int] | None = None) -> dict[str, object]:
    """Every item of the checkpoint at ``directory`` (only ``ranks``' own files, when given).

    JSON files are read verified (size and checksum); tensors are read one at
    a time, through their checked safetensors headers, when compared.
    """
    manifest = read_manifest(directory)
    files = manifest["files"]
    out: dict[str, object] = {key: manifest[key] for key in _COUNTERS}
    for name in files:
        if not _keep(name, ranks):
            continue
        if name.endswith(".json") and name != METADATA:
            _json_file(name, read_json(directory, name, manifest), out)
        elif name.endswith(".safetensors") and not name.startswith("sharded/"):
            out.update(_file_tensors(directory, name, manifest))
    if "config.yaml" in files:
        _flatten("config", saved_config(directory, manifest), out)
    if METADATA in files:
        from fnaccel.checkpoint.storage import (
            dcpstore,  # imports DCP: only a sharded checkpoint's items need it
        )

        metadata, storage = dcpstore.metadata_from(
            read_json(directory, METADATA, manifest), files, str(directory / METADATA)
        )
        for fqn, item in metadata.state_dict_metadata.items():
            out[_sharded_name(fqn)] = _chunked(directory, manifest, fqn, item, storage)
    return out
