"""Hooks that run a module with its weights and inputs where they must be.

`AlignDevicesHook` is Accelerate's hook of that name: before the forward it
moves the inputs to the module's execution device and, for an offloaded
module, brings the module's weights in from a (lazy) weights map; after the
forward it puts the weights back on ``meta``, releasing them, and can move the
output back to where the input came from.

It is attached with PyTorch's own forward hooks, not by replacing
``forward``: a pre-hook, and a post-hook registered with ``always_call=True``
so that the weights are released even when the forward raises. What was
attached is recorded on the module itself (no registry anywhere), and
`remove_hook_from_module` / `remove_hook_from_submodules` undo it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fnaccel.modeling.sizes import named_module_tensors
from fnaccel.modeling.tensors import DeviceLike, as_device, set_module_tensor_to_device
from fnaccel.ops.tree import send_to_device, tree_leaves

__all__ = ["AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module", "remove_hook_from_submodules"]

_ATTRIBUTE = "_fnaccel_hooks"  # where a module keeps what add_hook_to_module attached


def _module_tensors(module: nn.Module, include_buffers: bool, recurse: bool) -> list[tuple[str, torch.Tensor]]:
    return list(named_module_tensors(module, include_buffers=include_buffers, recurse=recurse,
                                     remove_non_persistent=True))


class AlignDevicesHook:
    """Keep a module's inputs and weights on its execution device for each forward.

    Args:
        execution_device: where the inputs (and, when offloaded, the
            weights) go before the forward; None moves nothing.
        offload: keep the module's weights on ``meta`` between forwards,
            loading them from ``weights_map`` for each one.
        io_same_device: move the output back to the device of the input.
        weights_map: the offloaded weights, by name relative to the module
            (`PrefixedDataset` gives one module's view of a model's); by
            default, a CPU copy of the module's weights taken when attached.
        offload_buffers: offload the buffers too; otherwise they stay on the
            execution device.
        place_submodules: act on the tensors of the submodules too (all of
            them loaded at this module's forward), not only the module's own.
        skip_keys: keyword arguments (and output keys) left where they are.

    >>> hook = AlignDevicesHook(execution_device="cpu", offload=True)
    >>> layer = add_hook_to_module(torch.nn.Linear(2, 1), hook)
    >>> layer.weight.device.type, layer(torch.ones(1, 2)).shape, layer.weight.device.type
    ('meta', torch.Size([1, 1]), 'meta')
    """

    def __init__(
        self,
        execution_device: DeviceLike | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | Sequence[str] | None = None,
    ) -> None:
        self.execution_device = None if execution_device is None else as_device(execution_device)
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.offloaded: tuple[str, ...] = ()  # set when attached
        self.original_devices: dict[str, torch.device] = {}
        self.input_devices: list[torch.device | None] = []  # a stack: a module may run inside itself

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Put the module's tensors where the hook wants them between forwards."""
        tensors = _module_tensors(module, include_buffers=True, recurse=self.place_submodules)
        if not self.offload:
            if self.execution_device is not None:
                for name, _ in tensors:
                    set_module_tensor_to_device(module, name, self.execution_device)
            return module
        self.original_devices = {name: tensor.device for name, tensor in tensors}
        offloaded = _module_tensors(module, include_buffers=self.offload_buffers, recurse=self.place_submodules)
        self.offloaded = tuple(name for name, _ in offloaded)
        if self.weights_map is None:
            self.weights_map = {name: tensor.detach().to("cpu", copy=True) for name, tensor in offloaded}
        kept = [name for name, tensor in module.named_buffers(recurse=self.place_submodules) if name not in self.offloaded]
        for name in self.offloaded:
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is not None:
            for name in kept:
                set_module_tensor_to_device(module, name, self.execution_device)
        return module

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Load the offloaded weights and move the inputs to the execution device."""
        if self.io_same_device:
            leaves = tree_leaves([args, kwargs])
            self.input_devices.append(leaves[0].device if leaves else None)
        if self.offload:
            assert self.weights_map is not None  # init_hook made one
            device = self.execution_device or torch.device("cpu")
            for name in self.offloaded:
                set_module_tensor_to_device(module, name, device, value=self.weights_map[name])
        if self.execution_device is None:
            return args, kwargs
        return (tuple(send_to_device(args, self.execution_device)),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Release the offloaded weights (back to ``meta``) and move the output back."""
        for name in self.offloaded:
            set_module_tensor_to_device(module, name, "meta")
        if self.io_same_device and self.input_devices:
            input_device = self.input_devices.pop()
            if input_device is not None:
                return send_to_device(output, input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Put offloaded tensors back where they were before (those that were on ``meta`` stay there)."""
        assert self.weights_map is not None or not self.offloaded
        for name in self.offloaded:
            device = self.original_devices[name]
            if device.type != "meta" and self.weights_map is not None:
                set_module_tensor_to_device(module, name, device, value=self.weights_map[name].to(device, copy=True))
        self.offloaded = ()
        return module


@dataclass(frozen=True, slots=True)
class _Attached:
    """One hook on one module, with the two torch handles that run it."""

    hook: AlignDevicesHook
    pre: RemovableHandle
    post: RemovableHandle


def _pre(hook: AlignDevicesHook, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return hook.pre_forward(module, args, kwargs)


def _post(hook: AlignDevicesHook, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: AlignDevicesHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module`` (replacing its hooks, unless ``append``).

    The hook's `init_hook` runs now (an offloading hook moves the weights to
    ``meta``); its pre- and post-forward then run around every call.

    Returns:
        ``module``, changed in place.
    """
    if not append:
        remove_hook_from_module(module)
    hook.init_hook(module)
    attached = _Attached(
        hook,
        module.register_forward_pre_hook(partial(_pre, hook), with_kwargs=True),
        module.register_forward_hook(partial(_post, hook), always_call=True),
    )
    setattr(module, _ATTRIBUTE, (*getattr(module, _ATTRIBUTE, ()), attached))
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hooks `add_hook_to_module` attached to ``module`` (and its submodules with ``recurse``).

    Offloaded weights whose module held them in memory before are read back
    into memory; those that were on ``meta`` stay there.

    Returns:
        ``module``, changed in place.
    """
    for attached in reversed(getattr(module, _ATTRIBUTE, ())):
        attached.pre.remove()
        attached.post.remove()
        attached.hook.detach_hook(module)
    module.__dict__.pop(_ATTRIBUTE, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach every hook from ``module`` and all its submodules: undo `dispatch_model`.

    >>> from fnaccel.modeling.dispatch import dispatch_model
    >>> model = dispatch_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"0": "cpu"}, force_hooks=True)
    >>> remove_hook_from_submodules(model)
    >>> model._forward_pre_hooks
    OrderedDict()
    """
    remove_hook_from_module(module, recurse=True)
    module.__dict__.pop("hf_device_map", None)
