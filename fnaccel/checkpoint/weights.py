"""Model weights as safetensors, in Accelerate's and transformers' layout.

`save_model` writes what ``Accelerator.save_model`` writes: ``model.safetensors``,
or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``. `load_checkpoint_in_model` (in
`fnaccel.modeling.loading`, re-exported here) reads that layout back whoever
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

import json
import os
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir
from fnaccel.checkpoint.files import write_bytes
from fnaccel.checkpoint.layouts.sharded import is_pipelined, is_sharded
from fnaccel.checkpoint.tied import retie, untie
from fnaccel.constants import SAFE_MODEL_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from fnaccel.ops.collectives import broadcast_object_list
from fnaccel.transforms.deepspeed import gathered_parameters
from fnaccel.transforms.parallel import unwrap_model

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "consolidated_state_dict",
    "save_model",
    "shard_checkpoint",
    "write_configs",
    "write_weights",
]

_PRIVATE = ".fnaccel-"  # staging and parked folders inside a save directory
_SHARD_NAME = re.compile(
    re.escape(SAFE_MODEL_NAME) + r"-\d{5}-of-\d{5}\.safetensors"
)  # as shard_checkpoint names them


def __getattr__(name: str) -> Any:
    # the loading half lives in fnaccel.modeling.loading, imported on first use
    if name in ("IncompatibleKeys", "load_checkpoint_in_model"):
        from fnaccel.modeling import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'fnaccel.checkpoint.weights' has no attribute {name!r}")


def _read_index(index: Path) -> dict[str, Any]:
    from fnaccel.modeling.checkpoint_files import read_index

    return read_index(index)


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


def _gathered_stages(module: Any) -> dict[str, torch.Tensor]:
    """The weights of every stage of a `pp()` model on its group's first rank ({} on the
    others); tied weights cannot span stages (`pp` refuses them), so none are untied."""
    own = {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
    group = module.group
    first = dist.get_global_rank(group, 0)
    parts: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(own, parts, dst=first, group=group)  # in memory, between this run's processes
    if parts is None:
        return {}
    return {name: tensor for part in parts for name, tensor in part.items()}


def shard_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    max_shard_size: int | str = "10GB",
    weights_name: str = SAFE_WEIGHTS_NAME,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any] | None]:
    """Split ``state_dict`` into shards of at most ``max_shard_size`` bytes each.

    Greedy in key order (no bin packing), as in Accelerate and transformers: a
    tensor that would tip the current shard over the limit starts the next
    one, and a tensor larger than the limit gets a shard of its own.

    Args:
        state_dict: tensor names to tensors (tied names once: see `untie`).
        max_shard_size: bytes, or a size such as ``"10GB"``, ``"500MB"``,
            ``"5GiB"``, read as `convert_file_size_to_int` reads ``max_memory``:
            KB/MB/GB/TB are decimal (10^3 ... 10^12), KiB/MiB/GiB/TiB binary
            (2^10 ... 2^40); as in transformers, a lowercase final ``b`` of a
            decimal unit means bits (``"8Mb"`` is 10^6 bytes).
        weights_name: the file name of an unsharded checkpoint.

    Returns:
        ``(shards, index)``: shards maps file names to their tensors. One shard
        is ``{weights_name: ...}`` with index None; several are named
        ``model-00001-of-00003.safetensors`` and so on, and the index is
        ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.

    Raises:
        ValueError: ``max_shard_size`` is not a positive size.

    >>> weights = {"a": torch.zeros(100, dtype=torch.uint8), "b": torch.zeros(100, dtype=torch.uint8)}
    >>> shards, index = shard_checkpoint(weights, max_shard_size=150)
    >>> index["weight_map"]
    {'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}
    """
    limit = _size_in_bytes(max_shard_size)
    blocks: list[dict[str, torch.Tensor]] = [{}]
    block_size = total_size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if blocks[-1] and block_size + nbytes > limit:
            blocks.append({})
            block_size = 0
        blocks[-1][name] = tensor
        block_size += nbytes
        total_size += nbytes
    if len(blocks) == 1:
        return {weights_name: blocks[0]}, None
    stem, suffix = os.path.splitext(weights_name)
    names = [f"{stem}-{i:05d}-of-{len(blocks):05d}{suffix}" for i in range(1, len(blocks) + 1)]
    shards = dict(zip(names, blocks, strict=False))
    weight_map = {key: file for file, block in shards.items() for key in block}
    return shards, {"metadata": {"total_size": total_size}, "weight_map": weight_map}


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
    limit = _size_in_bytes(max_shard_size)  # on every rank, before the gather
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
    staging = _staging_folder(path)
    try:
        for config, name in configs:
            if callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(staging)
            else:
                write_bytes(staging / name, config.to_json_string().encode())
        written = sorted(entry.name for entry in staging.iterdir() if entry.is_file())
        for name in written:
            _fsync_file(staging / name)
            os.replace(staging / name, path / name)
        fsync_dir(path)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_config(value: Any) -> bool:
    return value is not None and any(
        callable(getattr(value, method, None)) for method in ("save_pretrained", "to_json_string")
    )


def _size_in_bytes(size: int | str) -> int:
    # sizes read as max_memory's; imported here: `import fnaccel` never loads fnaccel.modeling
    from fnaccel.modeling.memory_budget import convert_file_size_to_int

    try:
        nbytes = convert_file_size_to_int(size)
    except ValueError:
        nbytes = 0
    if nbytes <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '10GB', "
            f"'500MB' or '5GiB' (KB/MB/GB/TB: powers of 10; KiB/MiB/GiB/TiB: powers of 2), got {size!r}"
        )
    return nbytes


def _shared_names(module: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for the state-dict names of one tensor object."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        kept = first.setdefault(id(tensor), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def _storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors takes contiguous tensors that own their storage: copy the
    others (views into one storage, transposed parameters), and only those."""
    users = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    return {
        name: t
        if t.is_contiguous() and users[t.untyped_storage().data_ptr()] == 1
        else t.clone(memory_format=torch.contiguous_format)
        for name, t in tensors.items()
    }


def write_weights(weights: Mapping[str, torch.Tensor], path: Path, limit: int) -> None:
    """Write ``weights`` into the directory ``path`` as `save_model` does (shards past
    ``limit`` bytes, tied tensors once), replacing an older save file by file."""
    kept, aliases = untie(weights)
    shards, index = shard_checkpoint(_storable(kept), limit)
    staging = _staging_folder(path)
    try:
        for file, tensors in shards.items():
            metadata = {"format": "pt", **{a: k for a, k in aliases.items() if k in tensors}}
            save_file(tensors, staging / file, metadata=metadata)
            _fsync_file(staging / file)
        if index is not None:
            _write_index(staging / SAFE_WEIGHTS_INDEX_NAME, index)
        fsync_dir(staging)
        _commit(path, staging, list(shards), sharded=index is not None)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_folder(path: Path) -> Path:
    """A new private folder inside the save directory ``path`` (created if missing)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"fa.save_model writes into a directory, but {path} is a file; pass a directory")
    path.mkdir(parents=True, exist_ok=True)
    staging = path / f"{_PRIVATE}tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    return staging


def _fsync_file(file: Path) -> None:
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())


def _write_index(file: Path, index: Mapping[str, Any]) -> None:
    write_bytes(file, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())


def _commit(path: Path, staging: Path, files: list[str], sharded: bool) -> None:
    """Rename the staged files into ``path``, keeping it loadable throughout."""
    live_index = path / SAFE_WEIGHTS_INDEX_NAME
    try:
        old_index = _read_index(live_index) if live_index.is_file() else None
    except CheckpointError:  # an unreadable old index loads nothing: nothing to keep loadable
        old_index = None
    old_files = set(old_index["weight_map"].values()) if old_index else set()
    if sharded and old_index and old_files & set(files):
        _park(path, staging, old_index, old_files & set(files))
    for file in files:
        os.replace(staging / file, path / file)
    if sharded:
        os.replace(staging / SAFE_WEIGHTS_INDEX_NAME, live_index)
    fsync_dir(path)
    # the new set is live (model.safetensors shadows an index, so a single file
    # took over at its rename; an old single file goes now): clear the old one
    current = {*files, SAFE_WEIGHTS_INDEX_NAME} if sharded else set(files)
    stale = {SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, *old_files}
    stale.update(name for name in os.listdir(path) if _SHARD_NAME.fullmatch(name))
    for name in stale - current:
        if Path(name).name == name and (path / name).is_file():
            (path / name).unlink()
    for entry in path.iterdir():
        if entry.name.startswith(_PRIVATE) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(path)


def _park(path: Path, staging: Path, old_index: Mapping[str, Any], files: set[str]) -> None:
    """Hard-link the old shards the new ones will overwrite into a private
    folder, and point the live index at the links (copies where the
    filesystem has no hard links)."""
    parked = path / f"{_PRIVATE}old-{uuid.uuid4().hex}"
    parked.mkdir()
    for file in files:
        try:
            os.link(path / file, parked / file)
        except OSError:
            shutil.copyfile(path / file, parked / file)
            _fsync_file(parked / file)
    fsync_dir(parked)
    weight_map = {
        name: f"{parked.name}/{file}" if file in files else file
        for name, file in old_index["weight_map"].items()
    }
    _write_index(staging / "parked.index.json", {**old_index, "weight_map": weight_map})
    os.replace(staging / "parked.index.json", path / SAFE_WEIGHTS_INDEX_NAME)
    fsync_dir(path)
