"""Model weights as safetensors, in Accelerate's and transformers' layout.

`save_model` writes what ``Accelerator.save_model`` writes: ``model.safetensors``,
or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``. `load_checkpoint_in_model` reads that layout
back whoever wrote it (fnaccel, Accelerate, transformers,
``safetensors.torch.save_model``). Pickles (``.bin``, ``.pt``) are refused, never
unpickled.

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
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.files import fsync_dir, write_bytes
from fnaccel.checkpoint.tied import retie, untie
from fnaccel.ops.collectives import broadcast_object_list
from fnaccel.transforms.parallel import unwrap_model
from fnaccel.utils.constants import SAFE_MODEL_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "IncompatibleKeys",
    "consolidated_state_dict",
    "load_checkpoint_in_model",
    "save_model",
    "shard_checkpoint",
]

# (suffix, bytes) in match order: the binary units before the decimal ones they end like
_SIZE_UNITS = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
_PRIVATE = ".fnaccel-"  # staging and parked folders inside a save directory
_SHARD_NAME = re.compile(re.escape(SAFE_MODEL_NAME) + r"-\d{5}-of-\d{5}\.safetensors")  # as shard_checkpoint names them


class IncompatibleKeys(NamedTuple):
    """What `load_checkpoint_in_model` could not match (as ``nn.Module.load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights on the CPU, under the user's own names.

    Unwraps ``torch.compile`` and `DistributedDataParallel` (no ``_orig_mod.`` /
    ``module.`` prefixes). An FSDP2 model is gathered with
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
    if _is_sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = cast(dict[str, torch.Tensor], get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        ))
        if not full:
            return {}
        # each name is gathered on its own, so ties come from the module's own objects
        aliases = {alias: kept for alias, kept in _shared_names(module).items() if alias in full}
        kept = {name: tensor for name, tensor in full.items() if name not in aliases}
    else:
        kept, aliases = untie(module.state_dict())
        kept = {name: tensor.cpu() for name, tensor in kept.items()}
    return retie(kept, aliases)


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
            ``"5GiB"``: KB/MB/GB are decimal (10^3, 10^6, 10^9), KiB/MiB/GiB
            binary (2^10, 2^20, 2^30); as in transformers, a lowercase final
            ``b`` means bits (``"8Mb"`` is 10^6 bytes).
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
    shards = dict(zip(names, blocks))
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
    atomically (see the module docstring) and leaving other files alone. The
    main process writes; under FSDP2 every rank takes part in gathering the
    weights, so every rank must call this. In a larger world a failure on the
    main process is raised on every rank.

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
    gather = ctx.is_main_process or _is_sharded(unwrap_model(state.model))
    weights = consolidated_state_dict(state.model) if gather else {}
    error: Exception | None = None
    if ctx.is_main_process:
        try:
            _write_weights(weights, Path(path), limit)
        except Exception as exc:  # re-raised below, after the other ranks heard of it
            error = exc
    if ctx.num_processes > 1:
        [message] = broadcast_object_list(ctx, [None if error is None else f"{type(error).__name__}: {error}"])
        if message is not None and error is None:
            raise CheckpointError(f"fa.save_model: the main process failed to write {path}: {message}")
    if error is not None:
        raise error


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, int | str | torch.device] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Sequence[str] | None = None,
    strict: bool = False,
) -> IncompatibleKeys:
    """Load a safetensors checkpoint into ``model``'s own tensors, file by file.

    Every file's header is checked first (names, shapes), so a checkpoint
    that does not fit leaves the model untouched; then each file is read,
    copied into the model and dropped before the next, so the weights are
    never held twice. Copies are in place: the parameters stay
    the same objects (an optimizer built on them stays valid) and tied
    parameters stay tied; a tied name missing from the file is filled through
    its partner. ``torch.compile`` and DDP wrappers are looked through.

    Args:
        model: an unsharded model on real devices (load before ``fa.fsdp``
            shards it).
        checkpoint: a ``.safetensors`` file, an index ``.json``, or a
            directory holding ``model.safetensors`` or one ``*.index.json``.
        device_map: None (tensors stay on their devices), or module names
            mapped to ``"cpu"`` ("" for the whole model): the weights of every
            parameter load onto the CPU. Dispatching to other devices or to
            disk is not built yet.
        offload_folder, offload_state_dict, offload_buffers: disk offload, not
            built yet: only their defaults are accepted.
        dtype: cast floating-point weights to this dtype (a ``torch.dtype`` or
            its name, ``"float16"``); otherwise each keeps the model's dtype.
        keep_in_fp32_modules: with ``dtype``, modules (dotted names, matched
            at any depth) whose weights load in float32 instead.
        strict: raise when the checkpoint and the model name different
            tensors; otherwise warn and return them.

    Returns:
        The model tensors the checkpoint did not fill and the checkpoint
        tensors the model has no place for.

    Raises:
        CheckpointError: no checkpoint there, a pickle checkpoint, an unreadable
            file, a shape mismatch (always), missing or unexpected keys (strict).
        NotImplementedError: disk offload, a device other than the CPU in
            ``device_map``, or a model on the meta device or sharded.

    >>> import tempfile, safetensors.torch
    >>> with tempfile.TemporaryDirectory() as path:
    ...     safetensors.torch.save_file({"weight": torch.ones(1, 2), "bias": torch.ones(1)}, f"{path}/m.safetensors")
    ...     model = torch.nn.Linear(2, 1)
    ...     load_checkpoint_in_model(model, f"{path}/m.safetensors", strict=True)
    ...     model.weight.tolist()
    IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    [[1.0, 1.0]]
    """
    if offload_folder is not None or offload_state_dict or offload_buffers:
        raise NotImplementedError(_not_built("disk offload (offload_folder, offload_state_dict, offload_buffers)"))
    module = unwrap_model(model)
    targets = module.state_dict(keep_vars=True)
    if _is_sharded(module) or any(t.is_meta for t in targets.values()):
        raise NotImplementedError(
            "load_checkpoint_in_model loads into a materialised, unsharded model: load before "
            "fa.prepare(..., pipeline with fa.fsdp()) shards it (or use fa.load for a prepared run); "
            + _not_built("materialising a meta-device (init_empty_weights) model")
        )
    if device_map is not None:
        _check_device_map(device_map, targets)
    new_dtype = _as_dtype(dtype)
    keep_fp32 = tuple(name.split(".") for name in keep_in_fp32_modules or ())
    # every file's header first: a checkpoint that does not fit leaves the model untouched
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    aliases: dict[Path, dict[str, str]] = {}
    for file, listed in _checkpoint_files(Path(checkpoint)):
        file_shapes, aliases[file] = _read_header(file)
        absent = sorted(listed - file_shapes.keys()) if listed is not None else []
        if absent:
            raise CheckpointError(f"{file} lacks {absent}, which its index maps to it")
        shapes.update((name, (file, shape)) for name, shape in file_shapes.items())
    mismatched = [
        f"{name!r} is {shape} in {file.name} but {tuple(targets[name].shape)} in the model"
        for name, (file, shape) in shapes.items()
        if name in targets and shape != tuple(targets[name].shape)
    ]
    if mismatched:
        raise CheckpointError(f"load_checkpoint_in_model: {checkpoint} has other shapes: " + "; ".join(mismatched))
    unexpected = [name for name in shapes if name not in targets]
    filled = {id(targets[name]) for name in shapes if name in targets}
    missing = [name for name, target in targets.items() if id(target) not in filled]
    if missing or unexpected:
        message = (
            f"load_checkpoint_in_model: {checkpoint} does not fit {type(module).__name__}: "
            f"missing from the checkpoint: {missing}; unexpected in it: {unexpected}"
        )
        if strict:
            raise CheckpointError(message)
        warnings.warn(message + " (strict=True raises)", stacklevel=2)
    for file, file_aliases in aliases.items():  # one file in memory at a time
        for name, value in _read_tensors(file, file_aliases).items():
            target = targets.get(name)
            if target is None:
                continue
            want = target.dtype
            if new_dtype is not None and value.is_floating_point() and target.is_floating_point():
                want = torch.float32 if _in_modules(name, keep_fp32) else new_dtype
            _copy_into(target, value, target.device if device_map is None else torch.device("cpu"), want)
    return IncompatibleKeys(missing, unexpected)


def _size_in_bytes(size: int | str) -> int:
    nbytes = 0
    if isinstance(size, int) and not isinstance(size, bool):
        nbytes = size
    elif isinstance(size, str):
        text = size.strip()
        unit = next((u for u in _SIZE_UNITS if text.upper().endswith(u[0])), None)
        if unit is not None:
            try:
                nbytes = int(float(text[: -len(unit[0])]) * unit[1])
            except (ValueError, OverflowError):
                nbytes = 0
            if text.endswith("b") and unit[0] in ("GB", "MB", "KB"):
                nbytes //= 8
    if nbytes <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '10GB', "
            f"'500MB' or '5GiB' (KB/MB/GB: powers of 10; KiB/MiB/GiB: powers of 2), got {size!r}"
        )
    return nbytes


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


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
        name: t if t.is_contiguous() and users[t.untyped_storage().data_ptr()] == 1
        else t.clone(memory_format=torch.contiguous_format)
        for name, t in tensors.items()
    }


def _write_weights(weights: Mapping[str, torch.Tensor], path: Path, limit: int) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"fa.save_model writes into a directory, but {path} is a file; pass a directory")
    kept, aliases = untie(weights)
    shards, index = shard_checkpoint(_storable(kept), limit)
    path.mkdir(parents=True, exist_ok=True)
    staging = path / f"{_PRIVATE}tmp-{uuid.uuid4().hex}"
    staging.mkdir()
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


def _not_built(what: str) -> str:
    return (
        f"{what} comes with the big-model work (dispatching a model over devices with "
        "CPU/disk offload) and is not built yet"
    )


def _check_device_map(device_map: Mapping[str, int | str | torch.device], targets: Mapping[str, Any]) -> None:
    """Accept a map that puts every tensor of the model on the CPU."""
    for module_name, device in device_map.items():
        try:
            on_cpu = torch.device(device).type == "cpu"
        except RuntimeError:  # "disk", or no device at all
            on_cpu = False
        if not on_cpu:
            raise NotImplementedError(
                f"device_map puts {module_name!r} on {device!r}: only 'cpu' is supported; "
                + _not_built("loading onto other devices or disk")
            )
    for name in targets:
        if not any(m == "" or name == m or name.startswith(m + ".") for m in device_map):
            raise ValueError(
                f"device_map sets no device for {name!r}: add its module, or '' for the whole model"
            )


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float16' or torch.bfloat16")
    return found


def _in_modules(name: str, modules: Sequence[list[str]]) -> bool:
    """Whether ``name``'s dotted parts contain one of ``modules``' parts, in a row."""
    parts = name.split(".")
    return any(
        parts[i : i + len(m)] == m for m in modules for i in range(len(parts) - len(m) + 1)
    )


def _copy_into(target: torch.Tensor, value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    with torch.no_grad():
        if target.device == device and target.dtype == dtype:
            target.copy_(value)
        else:  # same object, new data: parameters stay registered, tied and optimised
            target.data = value.to(device=device, dtype=dtype)


def _refuse_pickle(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is a pickle checkpoint; fnaccel never unpickles (that can run arbitrary code). "
        "Convert it once where you trust it: load it with torch.load(..., weights_only=True) "
        "into the model and write it with fa.save_model (or safetensors.torch.save_model)"
    )


def _checkpoint_files(path: Path) -> list[tuple[Path, frozenset[str] | None]]:
    """The safetensors files of a checkpoint, each with the names its index maps to it."""
    if path.is_dir():
        if (path / SAFE_WEIGHTS_NAME).is_file():
            return [(path / SAFE_WEIGHTS_NAME, None)]
        indexes = sorted(path.glob("*.index.json"))
        if len(indexes) == 1:
            return _index_files(indexes[0])
        pickles = sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if not indexes and pickles:
            raise _refuse_pickle(pickles[0])
        raise CheckpointError(
            f"{path} holds no {SAFE_WEIGHTS_NAME} and "
            + (f"several indexes {[p.name for p in indexes]}" if indexes else f"no {SAFE_WEIGHTS_INDEX_NAME}")
            + "; pass the file or index to load"
        )
    if path.is_file():
        if path.name.endswith(".json"):
            return _index_files(path)
        if path.suffix in _PICKLE_SUFFIXES:
            raise _refuse_pickle(path)
        return [(path, None)]
    raise CheckpointError(f"no checkpoint at {path}")


def _read_index(index: Path) -> dict[str, Any]:
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index} is not a readable JSON index: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index} has no 'weight_map' from tensor names to file names")
    return data


def _index_files(index: Path) -> list[tuple[Path, frozenset[str] | None]]:
    by_file: dict[str, set[str]] = {}
    for name, file in _read_index(index)["weight_map"].items():
        by_file.setdefault(file, set()).add(name)
    for file in by_file:
        if Path(file).suffix in _PICKLE_SUFFIXES:
            raise _refuse_pickle(index)
        if not (index.parent / file).is_file():
            raise CheckpointError(f"{index} maps tensors to {file}, which is missing from {index.parent}")
    return [(index.parent / file, frozenset(names)) for file, names in by_file.items()]


def _read_header(file: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A safetensors file's tensor shapes by name (aliases included) and its
    aliases, from the header alone."""
    try:
        with safe_open(file, framework="pt", device="cpu") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise _unreadable(file, exc) from None
    aliases = {alias: kept for alias, kept in metadata.items() if kept in shapes and alias not in shapes}
    return {**shapes, **{alias: shapes[kept] for alias, kept in aliases.items()}}, aliases


def _read_tensors(file: Path, aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as exc:
        raise _unreadable(file, exc) from None
    return retie(tensors, aliases)


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}")
