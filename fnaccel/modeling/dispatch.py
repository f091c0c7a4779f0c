"""Running a model spread over devices, the CPU and disk: `dispatch_model`.

A device map sends each module to a GPU, to ``"cpu"`` or to ``"disk"``. The
model runs on its main device (the first GPU in the map, else the CPU).
Modules mapped to a GPU, or to the CPU when the main device is the CPU, keep
their weights there and just run. The others are offloaded: their weights
stay on ``meta``, and an `AlignDevicesHook` on each module that owns weights
loads them onto the main device just before that module runs and releases
them just after: from the offload folder (memory-mapped files) for
``"disk"``, from a CPU state dict for ``"cpu"`` under a GPU main device. So
at any time the memory holds the resident layers plus one offloaded layer.
Every module named in the map moves its inputs to its execution device, and
the whole model returns its output on the device its input came from.

`load_checkpoint_and_dispatch` loads a checkpoint into a model built with
`init_empty_weights` (writing the ``"disk"`` part to the offload folder) and
dispatches it, with the device map given or inferred (``"auto"``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from fnaccel.modeling.device_map import check_device_map, resolve_device_map
from fnaccel.modeling.hooks import AlignDevicesHook, add_hook_to_module
from fnaccel.modeling.loading import load_checkpoint_in_model
from fnaccel.modeling.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    offload_state_dict,
    read_offload_index,
)
from fnaccel.modeling.sizes import named_module_tensors
from fnaccel.modeling.tensors import (
    DeviceMap,
    ModuleT,
    Placement,
    as_device,
    device_for,
    parse_device_map,
    set_module_tensor_to_device,
)
from fnaccel.modeling.tied import find_tied_parameters, retie_parameters

__all__ = ["dispatch_model", "load_checkpoint_and_dispatch"]


def _main_device(places: Sequence[Placement]) -> torch.device:
    return next(
        (p for p in places if isinstance(p, torch.device) and p.type not in ("cpu", "meta")),
        torch.device("cpu"),
    )


def dispatch_model(
    model: ModuleT,
    device_map: DeviceMap,
    main_device: int | str | torch.device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, Mapping[str, object]] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
) -> ModuleT:
    """Spread ``model`` over devices as ``device_map`` says, with hooks that make it run.

    Args:
        model: the model, its weights loaded (those mapped to ``"disk"`` may
            already be offloaded, on ``meta``, as `load_checkpoint_in_model` leaves them).
        device_map: module (or tensor) names to a GPU index or device,
            ``"cpu"`` or ``"disk"``; "" is the whole model.
        main_device: where the model runs; by default the first device in
            the map that is not ``"cpu"`` or ``"disk"``, else the CPU.
        state_dict: the CPU weights of the modules mapped to ``"cpu"`` when
            the main device is a GPU; by default taken from the model.
        offload_dir: the offload folder of the ``"disk"`` modules. Where it
            has no ``index.json`` yet, their weights are offloaded into it now.
        offload_index: entries to use instead of the folder's ``index.json``.
        offload_buffers: offload the buffers of offloaded modules too.
        skip_keys: keyword arguments (and output keys) never moved.
        preload_module_classes: class names of modules that load all their
            submodules' weights at the start of their own forward (for modules
            that use a submodule's weights without calling it).
        force_hooks: attach hooks even when the whole model is on one device.

    Returns:
        ``model``, changed in place; ``model.hf_device_map`` is the map.
        `remove_hook_from_submodules` undoes the hooks.

    Raises:
        ValueError: a bad or incomplete map, ``"disk"`` without an offload
            folder, weights missing from it or of other shapes, or weights on
            ``meta`` that the map keeps in memory.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     model = dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=folder)
    ...     model[1].weight.device.type, model(torch.ones(1, 2)).shape, model[1].weight.device.type
    ('meta', torch.Size([1, 1]), 'meta')
    """
    check_device_map(model, device_map)
    places = parse_device_map(device_map)
    if len(set(places.values())) == 1 and not force_hooks:
        (only,) = set(places.values())
        if only == "disk":
            raise ValueError(
                "device_map puts the whole model on 'disk': pass force_hooks=True and an offload_dir "
                "to run it from there one layer at a time"
            )
        on_meta = next((n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
        if on_meta is not None and torch.device(only).type != "meta":
            raise _still_on_meta(on_meta, only)
        model.to(only)
        setattr(model, "hf_device_map", dict(device_map))
        return model
    main = _main_device(list(places.values())) if main_device is None else as_device(main_device)
    offloaded_places = {"disk"} if main.type == "cpu" else {"disk", "cpu"}

    def offloaded(place: Placement) -> bool:
        return (place if place == "disk" else torch.device(place).type) in offloaded_places

    if main.type != "cpu" and state_dict is None:
        state_dict = extract_submodules_state_dict(
            model.state_dict(),
            [name for name, place in places.items() if offloaded(place) and place != "disk"],
        )
    disk = [name for name, place in places.items() if place == "disk"]
    if disk and offload_dir is None and offload_index is None:
        raise ValueError(f"device_map puts {disk} on 'disk': pass offload_dir=, the folder for their weights")
    if disk and offload_index is None and not read_offload_index(str(offload_dir)):
        offload_state_dict(
            str(offload_dir), _in_memory(extract_submodules_state_dict(model.state_dict(), disk))
        )
    weights = OffloadedWeightsLoader(
        state_dict=state_dict or {}, save_folder=offload_dir if disk else None, index=offload_index
    )
    resident_ties = [
        kept
        for group in find_tied_parameters(model)
        if len(kept := [n for n in group if not offloaded(device_for(n, places) or main)]) > 1
    ]
    _place_resident(model, places, main, offloaded, offload_buffers)
    _attach_hooks(
        model, places, main, offloaded, weights, offload_buffers, skip_keys, set(preload_module_classes or ())
    )
    retie_parameters(model, resident_ties)  # moving them one name at a time untied them
    setattr(model, "hf_device_map", dict(device_map))
    return model


def _attach_hooks(
    model: nn.Module,
    places: Mapping[str, Placement],
    main: torch.device,
    offloaded: Callable[[Placement], bool],
    weights: OffloadedWeightsLoader,
    offload_buffers: bool,
    skip_keys: str | Sequence[str] | None,
    preload: set[str],
) -> None:
    """One hook on the root, on each module the map names, and on each module
    owning offloaded tensors (or the subtree of a preload class)."""
    preloaded: list[str] = []  # modules whose hooks load their whole subtree
    for name, module in model.named_modules():
        if any(p == "" or name.startswith(p + ".") for p in preloaded):
            continue
        place = device_for(name, places)
        own = named_module_tensors(module, include_buffers=offload_buffers, remove_non_persistent=True)
        offload = any(offloaded(device_for(f"{name}.{n}" if name else n, places) or main) for n, _ in own)
        if type(module).__name__ in preload and place is not None and offloaded(place):
            offload = True
            preloaded.append(name)
        if not offload and name != "" and name not in places:
            continue
        execution = main if place is None or offloaded(place) else torch.device(place)
        prefix = f"{name}." if name else ""
        if offload:
            _check_offloaded(
                module, prefix, weights, recurse=name in preloaded, offload_buffers=offload_buffers
            )
        add_hook_to_module(
            module,
            AlignDevicesHook(
                execution_device=execution,
                offload=offload,
                io_same_device=name == "",
                weights_map=PrefixedDataset(weights, prefix) if offload else None,
                offload_buffers=offload_buffers,
                place_submodules=name in preloaded,
                skip_keys=skip_keys,
            ),
        )


def _in_memory(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    on_meta = [name for name, tensor in tensors.items() if tensor.is_meta]
    if on_meta:
        raise ValueError(
            f"the weights mapped to 'disk' ({on_meta[:3]}...) are on the meta device and the offload folder has no "
            "index.json: load them with load_checkpoint_in_model(..., offload_folder=) first"
        )
    return dict(tensors)


def _place_resident(
    model: nn.Module,
    places: Mapping[str, Placement],
    main: torch.device,
    offloaded: Callable[[Placement], bool],
    offload_buffers: bool,
) -> None:
    """Move the tensors that stay in memory to their devices (buffers of
    offloaded modules: the main device), refusing any still on ``meta``."""
    persistent = set(model.state_dict(keep_vars=True))
    tensors: list[tuple[str, torch.Tensor, bool]]
    tensors = [(name, tensor, False) for name, tensor in model.named_parameters(remove_duplicate=False)]
    tensors += [(name, tensor, True) for name, tensor in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_buffer in tensors:
        place = device_for(name, places) or main
        if offloaded(place):
            if not is_buffer or (offload_buffers and name in persistent):
                continue  # the hooks hold these
            place = main
        if tensor.is_meta:
            raise _still_on_meta(name, place)
        if tensor.device != place:
            set_module_tensor_to_device(model, name, place)


def _still_on_meta(name: str, place: Placement) -> ValueError:
    return ValueError(
        f"{name!r} is on the meta device, but the device_map keeps it in memory on {place}: load the "
        "weights first (load_checkpoint_in_model, or load_checkpoint_and_dispatch)"
    )


def _check_offloaded(
    module: nn.Module, prefix: str, weights: OffloadedWeightsLoader, recurse: bool, offload_buffers: bool
) -> None:
    """Every tensor a hook will load has an entry of its shape."""
    for name, tensor in named_module_tensors(
        module, include_buffers=offload_buffers, recurse=recurse, remove_non_persistent=True
    ):
        full = prefix + name
        if full in weights.state_dict:
            shape: object = list(weights.state_dict[full].shape)
        elif full in weights.index:  # a JSON value: anything but a list is a mismatch too
            saved = weights.index[full].get("shape", list(tensor.shape))
            shape = list(saved) if isinstance(saved, (list, tuple)) else saved
        else:
            where = weights.save_folder or "the offload index"
            raise ValueError(
                f"{full!r} is offloaded but {where} has no weights for it: offload them there "
                "(load_checkpoint_in_model with offload_folder=, or an empty folder)"
            )
        if shape != list(tensor.shape):
            raise ValueError(
                f"{full!r} has shape {shape} in {weights.save_folder} but {list(tensor.shape)} in "
                "the model: the folder holds another model's weights; use an empty one"
            )


def load_checkpoint_and_dispatch(
    model: ModuleT,
    checkpoint: str | os.PathLike[str],
    device_map: DeviceMap | str | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
) -> ModuleT:
    """Load a checkpoint into ``model`` (typically built with `init_empty_weights`) and dispatch it.

    Args:
        model: the model to fill.
        checkpoint: as for `load_checkpoint_in_model`.
        device_map: a map, or ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"``
            / ``"sequential"`` to infer one from ``max_memory``
            (`resolve_device_map`). None loads without dispatching.
        max_memory: device (GPU index, ``"cpu"``, ``"disk"``) to the most it
            may hold, in bytes or as ``"256MB"``; by default what is free.
        no_split_module_classes: class names of modules never split across devices.
        offload_folder: where the ``"disk"`` part is written; needed when there is one.
        offload_buffers: offload the buffers of offloaded modules too.
        dtype: cast floating-point weights to this dtype.
        offload_state_dict: park the CPU weights on disk while loading; by
            default, when the map uses ``"disk"``.
        skip_keys, preload_module_classes, force_hooks: as for `dispatch_model`.
        strict: raise when the checkpoint and the model name different tensors.

    Returns:
        ``model``, loaded and dispatched.

    >>> import tempfile, safetensors.torch
    >>> source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> with tempfile.TemporaryDirectory() as path:
    ...     safetensors.torch.save_file(source.state_dict(), f"{path}/model.safetensors")
    ...     model = load_checkpoint_and_dispatch(model, path, {"0": "cpu", "1": "disk"}, offload_folder=f"{path}/off")
    ...     torch.equal(model(torch.ones(1, 4)), source(torch.ones(1, 4)))
    True
    """
    if isinstance(device_map, str):
        device_map = resolve_device_map(
            model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers=offload_buffers
        )
    if offload_state_dict is None:
        offload_state_dict = device_map is not None and "disk" in device_map.values()
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=offload_state_dict,
        offload_buffers=offload_buffers,
        strict=strict,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )
