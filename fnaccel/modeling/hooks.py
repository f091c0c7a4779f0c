"""Hooks around a module's forward: Accelerate's `accelerate.hooks` API.

A `ModelHook` has four methods: `init_hook` when it is attached,
`pre_forward` (may change the arguments) and `post_forward` (may change the
output) around every call, `detach_hook` when it is removed. Users subclass it;
`SequentialHook` runs several in order. `add_hook_to_module` attaches one
(``append=True`` composes it after the hook already there);
`remove_hook_from_module` undoes it.

The hook attached to a module is ``module._hf_hook``, Accelerate's attribute,
so code that looks for it (``hasattr(module, "_hf_hook")``) finds it. It runs
through PyTorch's own forward hooks, not by replacing ``forward``: a pre-hook,
and a post-hook registered with ``always_call=True`` so that offloaded weights
are released even when the forward raises.

`AlignDevicesHook` moves the inputs to the module's execution device and, for
an offloaded module, loads its weights from a (lazy) weights map just before
the forward and puts them back on ``meta`` just after. `dispatch_model`,
`cpu_offload` and `disk_offload` are built on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import torch
from torch import nn

from fnaccel.modeling.sizes import named_module_tensors
from fnaccel.modeling.tensors import DeviceLike, as_device, set_module_tensor_to_device
from fnaccel.ops.tree import send_to_device, tree_leaves

__all__ = [
    "AlignDevicesHook",
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]

_HANDLES = "_fnaccel_hook_handles"  # the torch handles that run module._hf_hook


class ModelHook:
    """A hook run around a module's forward; subclass it and override what you need.

    ``no_grad = True`` runs the forward (between `pre_forward` and
    `post_forward`) without autograd.

    >>> class Double(ModelHook):
    ...     def post_forward(self, module, output):
    ...         return output * 2
    >>> layer = add_hook_to_module(torch.nn.Identity(), Double())
    >>> layer(torch.ones(2))
    tensor([2., 2.])
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached; returns the module."""
        return module

    def pre_forward(
        self, module: nn.Module, *args: object, **kwargs: object
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Called before the forward with its arguments; returns the ``(args, kwargs)`` to run it with."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:
        """Called after the forward with its output; returns the output the caller gets."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks as one: each `pre_forward` in order, each `post_forward` in order.

    >>> class Add(ModelHook):
    ...     def __init__(self, n): self.n = n
    ...     def post_forward(self, module, output): return output + self.n
    >>> class Times(ModelHook):
    ...     def post_forward(self, module, output): return output * 10
    >>> layer = add_hook_to_module(torch.nn.Identity(), SequentialHook(Add(1), Times()))
    >>> layer(torch.zeros(1))
    tensor([10.])
    """

    def __init__(self, *hooks: ModelHook) -> None:
        for hook in hooks:
            if not isinstance(hook, ModelHook):
                raise TypeError(
                    f"SequentialHook takes ModelHook instances, got {type(hook).__name__}: "
                    "subclass fnaccel.utils.ModelHook"
                )
        self.hooks = hooks

    def __repr__(self) -> str:
        return f"SequentialHook({', '.join(map(repr, self.hooks))})"

    @property
    def no_grad(self) -> bool:  # type: ignore[override]
        return any(hook.no_grad for hook in self.hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(
        self, module: nn.Module, *args: object, **kwargs: object
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in reversed(self.hooks):
            module = hook.detach_hook(module)
        return module


def _run_pre(
    hook: ModelHook,
    grad_modes: list[bool],
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> tuple[tuple[object, ...], dict[str, object]]:
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        grad_modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)
    return tuple(args), dict(kwargs)


def _run_post(
    hook: ModelHook, grad_modes: list[bool], module: nn.Module, args: tuple[object, ...], output: object
) -> object:
    if hook.no_grad and grad_modes:
        torch.set_grad_enabled(grad_modes.pop())
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its `init_hook` runs now, its pre/post-forward around every call.

    Args:
        module: the module, changed in place.
        hook: a `ModelHook` (a subclass of yours, or one of fnaccel's).
        append: keep the hook already attached and run ``hook`` after it
            (the two become a `SequentialHook`); otherwise the old hook is
            removed first (its `detach_hook` runs).

    Returns:
        ``module``; ``module._hf_hook`` is the hook that runs.

    Raises:
        TypeError: ``hook`` is not a `ModelHook`.
    """
    if not isinstance(hook, ModelHook):
        raise TypeError(
            f"add_hook_to_module takes a ModelHook, got {type(hook).__name__}: subclass "
            "fnaccel.utils.ModelHook and override pre_forward/post_forward"
        )
    old = getattr(module, "_hf_hook", None)
    if append and old is not None:
        module = hook.init_hook(module)
        _detach_handles(module)
        hook = SequentialHook(old, hook)
    else:
        remove_hook_from_module(module)
        module = hook.init_hook(module)
    grad_modes: list[bool] = []  # a stack: a module may run inside itself
    handles = (
        module.register_forward_pre_hook(partial(_run_pre, hook, grad_modes), with_kwargs=True),
        module.register_forward_hook(partial(_run_post, hook, grad_modes), always_call=True),
    )
    module.__dict__["_hf_hook"] = hook
    module.__dict__[_HANDLES] = handles
    return module


def _detach_handles(module: nn.Module) -> None:
    for handle in module.__dict__.pop(_HANDLES, ()):
        handle.remove()


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook `add_hook_to_module` attached (and, with ``recurse``, those of all submodules).

    The hook's `detach_hook` runs: offloaded weights whose module held them in
    memory before are read back; those that were on ``meta`` stay there.

    Returns:
        ``module``, changed in place.

    >>> layer = add_hook_to_module(torch.nn.Linear(2, 2), ModelHook())
    >>> remove_hook_from_module(layer) is layer, hasattr(layer, "_hf_hook")
    (True, False)
    """
    hook = module.__dict__.pop("_hf_hook", None)
    _detach_handles(module)
    if hook is not None:
        hook.detach_hook(module)
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


def _module_tensors(
    module: nn.Module, include_buffers: bool, recurse: bool
) -> list[tuple[str, torch.Tensor]]:
    return list(
        named_module_tensors(
            module, include_buffers=include_buffers, recurse=recurse, remove_non_persistent=True
        )
    )


class AlignDevicesHook(ModelHook):
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
        offloaded = _module_tensors(
            module, include_buffers=self.offload_buffers, recurse=self.place_submodules
        )
        self.offloaded = tuple(name for name, _ in offloaded)
        if self.weights_map is None:
            self.weights_map = {name: tensor.detach().to("cpu", copy=True) for name, tensor in offloaded}
        kept = [
            name
            for name, tensor in module.named_buffers(recurse=self.place_submodules)
            if name not in self.offloaded
        ]
        for name in self.offloaded:
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is not None:
            for name in kept:
                set_module_tensor_to_device(module, name, self.execution_device)
        return module

    def pre_forward(
        self, module: nn.Module, *args: object, **kwargs: object
    ) -> tuple[tuple[object, ...], dict[str, object]]:
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
        return (
            tuple(send_to_device(args, self.execution_device)),
            send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def post_forward(self, module: nn.Module, output: object) -> object:
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
                set_module_tensor_to_device(
                    module, name, device, value=self.weights_map[name].to(device, copy=True)
                )
        self.offloaded = ()
        return module
