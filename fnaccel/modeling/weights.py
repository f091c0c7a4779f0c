"""Model weights as safetensors, in Accelerate's and transformers' layout.

`save_model` writes what ``Accelerator.save_model`` writes: ``model.safetensors``,
or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` shards plus
``model.safetensors.index.json`` (the files: `fnaccel.checkpoint.storage.weightfiles`).
`load_checkpoint_in_model` (`fnaccel.modeling.loading`) reads that layout back whoever
wrote it (fnaccel, Accelerate, transformers, ``safetensors.torch.save_model``).

Tied tensors are stored once, under their first name; each other name is
recorded in the file's metadata as ``{alias: kept name}``, the convention
``safetensors.torch.save_model`` uses. Loading copies into the model's own
tensors in place, so the ties the model has survive; an alias the model keeps
as a separate tensor gets its kept tensor's values.

Replacing an older save: the directory may hold other files (a config, a
tokenizer), so it is not swapped whole. The new files are written and fsynced
in a private ``.fnaccel-tmp-<id>/`` inside it, then renamed into place: shards
first, the file a loader opens (the index, or ``model.safetensors``) last; an
old ``model.safetensors``, which loaders prefer to an index, is deleted only
after the new index is in place. When a new shard would overwrite a shard the
live index still names, those old shards are first hard-linked (copied where
links fail) into ``.fnaccel-old-<id>/`` and the live index is pointed at them.
So after every single rename the directory loads as one complete set, old or
new; what a crash leaves behind (``.fnaccel-*`` folders, stale shards) the
next successful save removes. One save per directory at a time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir
from fnaccel.checkpoint.storage.files import retie, untie, write_bytes
from fnaccel.checkpoint.storage.weightfiles import fsync_file, size_in_bytes, staging_folder, write_weights
from fnaccel.modeling.placement import is_pipelined, is_sharded
from fnaccel.ops.collectives import broadcast_object_list
from fnaccel.transforms.deepspeed import gathered_parameters
from fnaccel.transforms.parallel import unwrap_model
from fnaccel.transforms.pipelining import PipelinedModel

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["consolidated_state_dict", "save_model", "write_configs"]


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights on the CPU, under the user's own names.

    Unwraps ``torch.compile``, `DistributedDataParallel` and DeepSpeed's engine (no
    ``_orig_mod.`` / ``module.`` prefixes); ZeRO-3's partitioned parameters are
    gathered (a collective: every rank calls this). An FSDP2 model is gathered with
    ``torch.distributed.checkpoint``'s full state dict: a collective, so every
    rank must call this, and only the main process receives the weights (the
    others get ``{}``: a full copy per rank would cost N times the memory).
    Tied names map to one tensor. Tensors already on the CPU are the model's
    own, detached, not copies.

    >>> model = torch.nn.Linear(2, 1)
    >>> sorted(consolidated_state_dict(torch.compile(model)))
    ['bias', 'weight']
    """
    module = unwrap_model(model)
    if is_pipelined(module):  # a pp() stage: every rank's stages, gathered on the first
        assert isinstance(module, PipelinedModel)  # unwrapped above: what is_pipelined found
        return _gathered_stages(module)
    if is_sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = cast(
            dict[str, torch.Tensor],
            get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        )
        if not full:
            return {}
        # each name is gathered on its own, so ties come from the module's own objects
        aliases = {alias: kept for alias, kept in _shared_names(module).items() if alias in full}
        kept = {name: tensor for name, tensor in full.items() if name not in aliases}
    else:
        with gathered_parameters(module):  # DeepSpeed ZeRO-3: every rank gathers, the copies are kept
            kept, aliases = untie(module.state_dict())
            zero3 = any(hasattr(p, "ds_id") for p in module.parameters())
            kept = {name: tensor.detach().to("cpu", copy=zero3) for name, tensor in kept.items()}
    return retie(kept, aliases)


def _gathered_stages(module: PipelinedModel) -> dict[str, torch.Tensor]:
    """The weights of every stage of a `pp()` model on its group's first rank ({} on the
    others); tied weights cannot span stages (`pp` refuses them), so none are untied."""
    own = {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
    group = module.group
    assert group is not None, "is_pipelined: a model split over processes"
    first = dist.get_global_rank(group, 0)
    parts: list[dict[str, torch.Tensor] | None] | None = (
        [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    )
    dist.gather_object(own, parts, dst=first, group=group)  # in memory, between this run's processes
    if parts is None:
        return {}
    return {name: tensor for part in parts if part is not None for name, tensor in part.items()}


def save_model(
    state: RunState,
    path: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> None:
    """Write the state's model weights into the directory ``path``; the state
    is read, not consumed (but must be fresh: an old state's model has moved on).

    Writes ``model.safetensors``, or shards and ``model.safetensors.index.json``
    past ``max_shard_size`` (`shard_checkpoint`), replacing an older save there
    atomically (see the module docstring) and leaving other files alone. A
    model carrying a transformers-style config (``model.config``, and
    ``model.generation_config`` where it has one) gets ``config.json`` (and
    ``generation_config.json``) beside the weights, so that
    ``from_pretrained(path)`` loads it (`write_configs`). The main process
    writes; under FSDP2 every rank takes part in gathering the weights, so
    every rank must call this. In a larger world a failure on the main process
    is raised on every rank.

    Args:
        state: the run's state, with a prepared model.
        path: the directory to write into; created if missing.
        max_shard_size: the largest shard, in bytes or as ``"10GB"``.
        safe_serialization: must be True: fnaccel never writes pickles.

    Raises:
        StaleStateError: ``state`` was already advanced.
        ValueError: no model, a bad ``max_shard_size``, ``safe_serialization=False``,
            or ``path`` is a file.
        CheckpointError: on other ranks, when the main process failed.

    >>> import fnaccel as fa, tempfile, os
    >>> state = fa.prepare(fa.init(cpu=True), torch.nn.Linear(2, 1))
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_model(state, path)
    ...     os.listdir(path)
    ['model.safetensors']
    """
    state.check_fresh("fa.save_model")
    if not safe_serialization:
        raise ValueError(
            "fa.save_model: safe_serialization=False would write a pickle, which fnaccel never "
            "does (loading one runs arbitrary code); drop the argument to write safetensors"
        )
    if state.model is None:
        raise ValueError("fa.save_model: this state has no model; fa.prepare(state, model) first")
    limit = size_in_bytes(max_shard_size)  # on every rank, before the gather
    ctx = state.dist
    module = unwrap_model(state.model)
    gather = (
        ctx.is_main_process or is_sharded(module) or any(hasattr(p, "ds_id") for p in module.parameters())
    )
    weights = consolidated_state_dict(state.model) if gather else {}
    error: Exception | None = None
    if ctx.is_main_process:
        try:
            write_configs(module, Path(path))
            write_weights(weights, Path(path), limit)
        except Exception as exc:  # re-raised below, after the other ranks heard of it
            error = exc
    if ctx.num_processes > 1:
        [message] = broadcast_object_list(
            ctx, [None if error is None else f"{type(error).__name__}: {error}"]
        )
        if message is not None and error is None:
            raise CheckpointError(f"fa.save_model: the main process failed to write {path}: {message}")
    if error is not None:
        raise error


def write_configs(module: nn.Module, path: Path) -> list[str]:
    """Write the transformers-style configs of ``module`` (already unwrapped) into the
    directory ``path``, as ``PreTrainedModel.save_pretrained`` does; return the names written.

    A config is duck-typed, so transformers is never imported here: ``module.config``
    and ``module.generation_config``, each when it has ``save_pretrained(directory)``
    (used, so that the file is what transformers itself writes) or else
    ``to_json_string()`` (written as ``config.json`` / ``generation_config.json``).
    As ``save_pretrained`` does, ``config.architectures`` is set to the model's class
    name (which a server such as vLLM reads to pick the model). The files are
    written in a private folder inside ``path`` and renamed into place, each one
    whole; other files are left alone.

    >>> import json, tempfile, torch
    >>> class Config:
    ...     architectures = None
    ...     def to_json_string(self):
    ...         return json.dumps({"architectures": self.architectures})
    >>> model = torch.nn.Linear(2, 1)
    >>> model.config = Config()
    >>> with tempfile.TemporaryDirectory() as path:
    ...     write_configs(model, Path(path)), (Path(path) / "config.json").read_text()
    (['config.json'], '{"architectures": ["Linear"]}')
    """
    configs: list[tuple[Any, str]] = []
    for attribute, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
        config = getattr(module, attribute, None)
        if _is_config(config):
            configs.append((config, name))
    if not configs:
        return []
    if configs[0][1] == "config.json" and hasattr(configs[0][0], "architectures"):
        # FSDP2 shards in place under a class named "FSDP<name>"; the checkpoint names the user's class
        cls_name = type(module).__name__
        configs[0][0].architectures = [cls_name.removeprefix("FSDP") if is_sharded(module) else cls_name]
    staging = staging_folder(path)
    try:
        for config, name in configs:
            if callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(staging)
            else:
                write_bytes(staging / name, config.to_json_string().encode())
        written = sorted(entry.name for entry in staging.iterdir() if entry.is_file())
        for name in written:
            fsync_file(staging / name)
            os.replace(staging / name, path / name)
        fsync_dir(path)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_config(value: object) -> bool:
    return value is not None and any(
        callable(getattr(value, method, None)) for method in ("save_pretrained", "to_json_string")
    )


def _shared_names(module: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for the state-dict names of one tensor object."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        kept = first.setdefault(id(tensor), name)
        if kept != name:
            aliases[name] = kept
    return aliases
