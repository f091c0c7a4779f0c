"""Reading safetensors weights into a model: `load_state_dict` and `load_checkpoint_in_model`.

`load_checkpoint_in_model` reads the layout `fa.save_model` writes (and
Accelerate, transformers and ``safetensors.torch.save_model`` write):
``model.safetensors``, or shards and ``model.safetensors.index.json``. Pickles
(``.bin``, ``.pt``) are refused, never unpickled. Finding the files and
reading their headers is `fnaccel.checkpoint.storage.weightfiles`.

Memory: a file is never read whole. Its tensors are memory-mapped a few at a
time (a new mapping every ``64 MiB``, the previous one released) and each is
copied to its place in the model and dropped, so loading a model built on
the ``meta`` device (`init_empty_weights`) peaks at about the model's own
size, never twice it, whether or not the checkpoint is sharded. Tensors that
``device_map`` sends to ``"disk"`` go to ``offload_folder`` instead
(`fnaccel.modeling.offload`), leaving the model's tensor on ``meta``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import retie
from fnaccel.checkpoint.storage.weightfiles import (
    PICKLE_SUFFIXES,
    checkpoint_files,
    read_header,
    refuse_pickle,
    unreadable,
)
from fnaccel.modeling.device_map import check_device_map
from fnaccel.modeling.offload import (
    OffloadIndex,
    index_tied_names,
    load_offloaded_weights,
    offload_weight,
    save_offload_index,
)
from fnaccel.modeling.placement import is_sharded
from fnaccel.modeling.sizes import as_torch_dtype
from fnaccel.modeling.tensors import DeviceMap, device_for, parse_device_map, set_module_tensor_to_device
from fnaccel.modeling.tied import find_tied_parameters, retie_parameters
from fnaccel.transforms.parallel import unwrap_model

_LOG = logging.getLogger(__name__)

__all__ = ["IncompatibleKeys", "load_checkpoint_in_model", "load_state_dict"]

_MAPPED_BYTES = 64 * 2**20  # how much of a file is mapped before the mapping is renewed


class IncompatibleKeys(NamedTuple):
    """What `load_checkpoint_in_model` could not match (as ``nn.Module.load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_state_dict(
    checkpoint_file: str | os.PathLike[str], device_map: DeviceMap | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, each straight on its device.

    Tensors loaded onto the CPU are memory-mapped (read when used), as with
    ``safetensors.torch.load_file``; those for a GPU are read onto it directly.
    Names the file records as tied to another (`fa.save_model` stores a tied
    tensor once) come back as that tensor.

    Args:
        checkpoint_file: a ``.safetensors`` file.
        device_map: module names to devices: each tensor goes to the device
            of its longest listed prefix; tensors mapped to ``"disk"`` or not
            mapped at all come back on the CPU (mapped, not read), as in
            Accelerate, for the caller to offload.

    Raises:
        CheckpointError: a pickle file, or an unreadable or non-PyTorch file.

    >>> import tempfile, safetensors.torch
    >>> with tempfile.TemporaryDirectory() as path:
    ...     tensors = {"a.weight": torch.ones(2), "b.weight": torch.zeros(1)}
    ...     safetensors.torch.save_file(tensors, f"{path}/m.safetensors")
    ...     {k: v.device.type for k, v in load_state_dict(f"{path}/m.safetensors", {"a": "cpu", "b": "disk"}).items()}
    {'a.weight': 'cpu', 'b.weight': 'cpu'}
    """
    path = Path(checkpoint_file)
    if path.suffix in PICKLE_SUFFIXES:
        raise refuse_pickle(path)
    shapes, aliases = read_header(path)
    parsed = None if device_map is None else parse_device_map(device_map)
    by_device: dict[str, list[str]] = {}
    for name in shapes:
        if name in aliases:
            continue
        place = None if parsed is None else device_for(name, parsed)
        by_device.setdefault("cpu" if place in (None, "disk") else str(place), []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for device, names in by_device.items():
        try:
            with safe_open(path, framework="pt", device=device) as handle:
                tensors.update((name, handle.get_tensor(name)) for name in names)
        except (SafetensorError, OSError) as exc:
            raise unreadable(path, exc) from None
    return retie({name: tensors[name] for name in shapes if name not in aliases}, aliases)


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: DeviceMap | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Sequence[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
) -> IncompatibleKeys:
    """Load a safetensors checkpoint into ``model``, tensor by tensor.

    Every file's header is checked first (names, shapes), so a checkpoint
    that does not fit leaves the model untouched. Then each tensor is read and
    put in place: copied into the model's own tensor where that holds data
    (the parameters stay the same objects, so an optimizer built on them stays
    valid), or set as a new tensor where the model is on ``meta``
    (`init_empty_weights`), with tied parameters tied again. Files are
    memory-mapped a slice at a time, so the weights are never held twice.
    ``torch.compile`` and DDP wrappers are looked through. To run a model
    spread over devices or disk, `dispatch_model` it afterwards (or use
    `load_checkpoint_and_dispatch`).

    Args:
        model: an unsharded model (load before ``fa.fsdp`` shards it).
        checkpoint: a ``.safetensors`` file, an index ``.json``, or a
            directory holding ``model.safetensors`` or one ``*.index.json``.
        device_map: module names (or tensor names; "" for the whole model)
            to a device, or to ``"disk"``. Without it, tensors stay on their
            devices, and those on ``meta`` load onto the CPU.
        offload_folder: where the weights mapped to ``"disk"`` are written
            (`offload_weight`, with an ``index.json``); needed when there are.
        dtype: cast floating-point weights to this dtype (a ``torch.dtype`` or
            its name, ``"float16"``); otherwise each keeps the model's dtype.
        offload_state_dict: with a device map, park the weights bound for the
            CPU in a temporary folder while loading, and read them back at the
            end.
        offload_buffers: also offload the buffers of modules mapped to
            ``"disk"``; otherwise those load onto the CPU.
        keep_in_fp32_modules: with ``dtype``, modules (dotted names, matched
            at any depth) whose weights load in float32 instead.
        offload_8bit_bnb: offload bitsandbytes 8-bit modules; not supported.
        strict: raise when the checkpoint and the model name different
            tensors; otherwise log a warning (logger
            ``fnaccel.modeling.loading``, as Accelerate logs it) and return them.

    Returns:
        The model tensors the checkpoint did not fill and the checkpoint
        tensors the model has no place for.

    Raises:
        CheckpointError: no checkpoint there, a pickle checkpoint, an unreadable
            file, a shape mismatch (always), missing or unexpected keys (strict).
        ValueError: a bad ``device_map`` or ``dtype``, or ``"disk"`` without
            ``offload_folder``.
        NotImplementedError: a sharded (FSDP) model, or ``offload_8bit_bnb``.

    >>> import tempfile, safetensors.torch
    >>> with tempfile.TemporaryDirectory() as path:
    ...     safetensors.torch.save_file({"weight": torch.ones(1, 2), "bias": torch.ones(1)}, f"{path}/m.safetensors")
    ...     with torch.device("meta"):
    ...         model = torch.nn.Linear(2, 1)
    ...     load_checkpoint_in_model(model, f"{path}/m.safetensors", strict=True)
    ...     model.weight.tolist()
    IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    [[1.0, 1.0]]
    """
    if offload_8bit_bnb:
        raise NotImplementedError(
            "offload_8bit_bnb: fnaccel does not offload bitsandbytes 8-bit modules; load in 16 or 32 bits "
            "(dtype=) and quantize afterwards"
        )
    module = unwrap_model(model)
    if is_sharded(module):
        raise NotImplementedError(
            "load_checkpoint_in_model loads into an unsharded model: load before "
            "fa.prepare(..., pipeline with fa.fsdp()) shards it (or use fa.load for a prepared run)"
        )
    targets = module.state_dict(keep_vars=True)
    places = None
    if device_map is not None:
        check_device_map(module, device_map)
        parsed = parse_device_map(device_map)
        places = {
            name: device_for(name, parsed) or "cpu" for name in targets
        }  # check_device_map: all covered
    if places is not None and not offload_buffers:  # the buffers of modules on disk stay in memory
        buffers = {name for name, _ in module.named_buffers()}
        places = {
            name: torch.device("cpu") if p == "disk" and name in buffers else p for name, p in places.items()
        }
    to_disk = {name for name, place in (places or {}).items() if place == "disk"}
    if to_disk and offload_folder is None:
        raise ValueError(
            f"device_map sends {sorted(to_disk)[:3]} and others to 'disk': pass offload_folder=, "
            "the folder to write their weights to"
        )
    new_dtype = None if dtype is None else as_torch_dtype(dtype)
    if dtype is not None and new_dtype is None:
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float16' or torch.bfloat16")
    keep_fp32 = tuple(name.split(".") for name in keep_in_fp32_modules or ())
    files, result = _check_fit(module, targets, Path(checkpoint), strict)
    tied = find_tied_parameters(module)
    folders: dict[str, tuple[Path, OffloadIndex]] = {}  # "disk" and, when parking, "cpu"
    if to_disk:
        folders["disk"] = (Path(str(offload_folder)), {})
    with ExitStack() as stack:
        if offload_state_dict and places is not None:
            folders["cpu"] = (
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fnaccel-state-"))),
                {},
            )
        done: set[tuple[int, str]] = set()  # (id(tensor), place): tied names are read and written once
        for file, names, aliases in files:
            for name, value in _file_tensors(file, [n for n in names if n in targets], aliases):
                target = targets[name]
                want = target.dtype
                if new_dtype is not None and value.is_floating_point() and target.is_floating_point():
                    want = torch.float32 if _in_modules(name, keep_fp32) else new_dtype
                place = (
                    places[name]
                    if places is not None
                    else torch.device("cpu")
                    if target.is_meta
                    else target.device
                )
                parking = folders.get("disk" if place == "disk" else torch.device(place).type)
                first = (id(target), str(place)) not in done
                done.add((id(target), str(place)))
                if parking is not None:
                    if first:
                        offload_weight(value.to(want), name, parking[0], index=parking[1])
                    set_module_tensor_to_device(module, name, "meta", dtype=want)
                elif not first:
                    pass  # a tied name: retie_parameters shares what its partner loaded
                elif target.is_meta:
                    loaded = value.to(
                        device=place, dtype=want, copy=True
                    )  # the model's own copy, not file pages
                    set_module_tensor_to_device(module, name, place, value=loaded, dtype=want)
                else:
                    _copy_into(target, value, torch.device(place), want)
                del value  # the file's pages go with the next mapping
        if "cpu" in folders:
            load_offloaded_weights(module, folders["cpu"][1], folders["cpu"][0])
    if "disk" in folders:
        folder, index = folders["disk"]
        index_tied_names(module, tied, to_disk, folder, index)
        save_offload_index(index, folder)
    retie_parameters(module, tied)
    return result


def _check_fit(
    module: nn.Module, targets: Mapping[str, torch.Tensor], checkpoint: Path, strict: bool
) -> tuple[list[tuple[Path, list[str], dict[str, str]]], IncompatibleKeys]:
    """Each file with its tensor names and aliases, and what does not match,
    after checking from the headers alone that the checkpoint fits the model."""
    files = []
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file, listed in checkpoint_files(checkpoint):
        file_shapes, aliases = read_header(file)
        absent = sorted(listed - file_shapes.keys()) if listed is not None else []
        if absent:
            raise CheckpointError(f"{file} lacks {absent}, which its index maps to it")
        shapes.update((name, (file, shape)) for name, shape in file_shapes.items())
        files.append((file, list(file_shapes), aliases))
    mismatched = [
        f"{name!r} is {shape} in {file.name} but {tuple(targets[name].shape)} in the model"
        for name, (file, shape) in shapes.items()
        if name in targets and shape != tuple(targets[name].shape)
    ]
    if mismatched:
        raise CheckpointError(
            f"load_checkpoint_in_model: {checkpoint} has other shapes: " + "; ".join(mismatched)
        )
    unexpected = [name for name in shapes if name not in targets]
    filled = {id(targets[name]) for name in shapes if name in targets}
    missing = [name for name, target in targets.items() if id(target) not in filled]
    if missing or unexpected:
        cls_name = type(module).__name__
        # Accelerate's words for unexpected weights, which a ported test or log filter may look for
        parts = [f"missing from the checkpoint: {missing}"] if missing else []
        parts += (
            [
                f"unexpected in it, so some weights of the model checkpoint were not used when "
                f"initializing {cls_name}: {unexpected}"
            ]
            if unexpected
            else []
        )
        message = f"load_checkpoint_in_model: {checkpoint} does not fit {cls_name}: " + "; ".join(parts)
        if strict:
            raise CheckpointError(message)
        _LOG.warning("%s (strict=True raises)", message)
    return files, IncompatibleKeys(missing, unexpected)


def _file_tensors(
    file: Path, names: Sequence[str], aliases: Mapping[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``names`` from ``file``, memory-mapped, a stored tensor read once for
    all its names; the mapping is renewed every `_MAPPED_BYTES`, so only the
    pages of the latest slice stay resident."""
    by_stored: dict[str, list[str]] = {}
    for name in names:
        by_stored.setdefault(aliases.get(name, name), []).append(name)
    stack = ExitStack()
    handle: safe_open | None = None
    mapped = 0
    try:
        for stored, stored_as in by_stored.items():
            if handle is None or mapped >= _MAPPED_BYTES:
                stack.close()
                handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                mapped = 0
            tensor: torch.Tensor = handle.get_tensor(stored)
            mapped += tensor.numel() * tensor.element_size()
            for name in stored_as:
                yield name, tensor
            del tensor
    except (SafetensorError, OSError) as exc:
        raise unreadable(file, exc) from None
    finally:
        stack.close()


def _in_modules(name: str, modules: Sequence[list[str]]) -> bool:
    """Whether ``name``'s dotted parts contain one of ``modules``' parts, in a row."""
    parts = name.split(".")
    return any(parts[i : i + len(m)] == m for m in modules for i in range(len(parts) - len(m) + 1))


def _copy_into(target: torch.Tensor, value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    with torch.no_grad():
        if target.device == device and target.dtype == dtype:
            target.copy_(value)
        else:  # same object, new data: parameters stay registered, tied and optimised
            target.data = value.to(device=device, dtype=dtype, copy=True)
