"""Attaching `AlignDevicesHook`s over a model: Accelerate's ``attach_*`` functions.

`attach_execution_device_hook` moves inputs only; `attach_align_device_hook`
puts a hook on every module that owns tensors (offloading them when asked);
`attach_align_device_hook_on_blocks` does either per block, from maps of
module names to execution devices and to whether the block is offloaded.
`cpu_offload` and `disk_offload` (in `fnaccel.modeling.big_modeling`) and
`dispatch_model` are built on these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fnaccel.modeling.hooks import AlignDevicesHook, add_hook_to_module
from fnaccel.modeling.offload import PrefixedDataset
from fnaccel.modeling.sizes import named_module_tensors
from fnaccel.modeling.tensors import DeviceLike

__all__ = ["attach_align_device_hook", "attach_align_device_hook_on_blocks", "attach_execution_device_hook"]


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in named_module_tensors(module, include_buffers=True, recurse=False))


def _child_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: DeviceLike,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> None:
    """Hook every module owning tensors (that has no hook yet) to move its inputs to ``execution_device``.

    Args:
        module: the model, changed in place.
        execution_device: where each hooked module's inputs go.
        skip_keys: keyword arguments left where they are.
        preload_module_classes: class names whose submodules are not hooked
            (their hook already handles the whole subtree).

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> attach_execution_device_hook(model, "cpu")
    >>> hasattr(model[0], "_hf_hook"), hasattr(model[1], "_hf_hook")
    (True, False)
    """
    if not hasattr(module, "_hf_hook") and _owns_tensors(module):
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys))
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: DeviceLike | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> None:
    """Put an `AlignDevicesHook` on every module of ``module`` that owns tensors.

    Args:
        module: the model, changed in place.
        execution_device: where inputs and (offloaded) weights go for each forward.
        offload: keep the weights on ``meta`` between forwards.
        weights_map: the whole model's offloaded weights by full name (each
            hook sees its module's part); by default each hook keeps a CPU copy.
        offload_buffers: offload the buffers too.
        module_name: ``module``'s name in ``weights_map``.
        skip_keys: keyword arguments left where they are.
        preload_module_classes: class names of modules that load all their
            submodules' weights at the start of their own forward.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> attach_align_device_hook(model, "cpu", offload=True)
    >>> model[0].weight.device.type, model(torch.ones(1, 2)).shape
    ('meta', torch.Size([1, 1]))
    """
    preload = (
        offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    )
    if _owns_tensors(module) or preload:
        prefixed = (
            None
            if weights_map is None
            else PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
        )
        add_hook_to_module(
            module,
            AlignDevicesHook(
                execution_device=execution_device,
                offload=offload,
                weights_map=prefixed,
                offload_buffers=offload_buffers,
                place_submodules=preload,
                skip_keys=skip_keys,
            ),
            append=True,
        )
    if preload:
        return
    for name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            _child_name(module_name, name),
            skip_keys,
            preload_module_classes,
        )


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: DeviceLike | Mapping[str, DeviceLike] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> None:
    """Hook each block named in ``execution_device`` / ``offload``: in memory, or offloaded.

    A block kept in memory gets one hook that moves its whole subtree to its
    execution device; an offloaded block gets `attach_align_device_hook`'s
    hooks. The root always returns its output where its input came from.

    Args:
        module: the model, changed in place.
        execution_device: one device for every block, or block names (""
            is the root) to devices.
        offload: one flag for every block, or block names to flags.
        weights_map, offload_buffers, module_name, skip_keys, preload_module_classes:
            as for `attach_align_device_hook`.

    Raises:
        ValueError: the two maps name different blocks.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> attach_align_device_hook_on_blocks(model, {"0": "cpu", "1": "cpu"}, {"0": False, "1": True})
    >>> model[0].weight.device.type, model[1].weight.device.type, model(torch.ones(1, 2)).shape
    ('cpu', 'meta', torch.Size([1, 1]))
    """
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attach_align_device_hook(
                module,
                execution_device,
                True,
                weights_map,
                offload_buffers,
                module_name,
                skip_keys,
                preload_module_classes,
            )
        else:
            add_hook_to_module(
                module,
                AlignDevicesHook(
                    execution_device, io_same_device=True, skip_keys=skip_keys, place_submodules=True
                ),
            )
        return
    devices: Mapping[str, DeviceLike | None]
    if isinstance(execution_device, Mapping):
        devices = execution_device
    else:
        assert isinstance(offload, Mapping)  # one of the two is a map, or we returned above
        devices = dict.fromkeys(offload, execution_device)
    flags = offload if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    if set(devices) != set(flags):
        raise ValueError(
            f"attach_align_device_hook_on_blocks: execution_device names {sorted(devices)} but offload "
            f"names {sorted(flags)}: give both for the same blocks"
        )
    _on_blocks(
        module, devices, flags, weights_map, offload_buffers, module_name, skip_keys, preload_module_classes
    )


def _on_blocks(
    module: nn.Module,
    devices: Mapping[str, DeviceLike | None],
    flags: Mapping[str, bool],
    weights_map: Mapping[str, torch.Tensor] | None,
    offload_buffers: bool,
    module_name: str,
    skip_keys: str | Sequence[str] | None,
    preload_module_classes: Sequence[str] | None,
) -> None:
    is_root = module_name == ""
    if module_name in devices and not flags[module_name]:
        add_hook_to_module(
            module,
            AlignDevicesHook(
                devices[module_name],
                io_same_device=is_root,
                offload_buffers=offload_buffers,
                place_submodules=True,
                skip_keys=skip_keys,
            ),
        )
        return  # the hook moved the whole block; its submodules run where it put them
    if module_name in devices:
        attach_align_device_hook(
            module,
            devices[module_name],
            True,
            weights_map,
            offload_buffers,
            module_name,
            skip_keys,
            preload_module_classes,
        )
        if not hasattr(module, "_hf_hook") or is_root:
            add_hook_to_module(
                module,
                AlignDevicesHook(devices[module_name], io_same_device=is_root, skip_keys=skip_keys),
                append=True,
            )
        return
    if is_root:
        add_hook_to_module(
            module, AlignDevicesHook(devices.get(""), io_same_device=True, skip_keys=skip_keys)
        )
    for name, child in module.named_children():
        _on_blocks(
            child,
            devices,
            flags,
            weights_map,
            offload_buffers,
            _child_name(module_name, name),
            skip_keys,
            preload_module_classes,
        )
