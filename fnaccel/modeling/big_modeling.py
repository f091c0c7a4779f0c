"""Offloading a whole model: Accelerate's `accelerate.big_modeling` offload functions.

- `cpu_offload` / `disk_offload`: the weights live in CPU memory / in an
  offload folder; each module brings its own onto the execution device for its
  forward and releases them after. The lowest memory, the most transfers.
- `cpu_offload_with_hook`: the pipeline-of-models pattern (a text encoder, a
  denoiser, a decoder run one after the other). The whole model moves to the
  execution device when it runs and stays there until the next model of the
  chain starts (or the user calls `UserCpuOffloadHook.offload`).
- `has_offloaded_params` / `align_module_device`: reach an offloaded
  module's real weights outside its forward; `get_state_dict_offloaded_model`
  all of them at once, on the CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from fnaccel.modeling.attach import attach_align_device_hook
from fnaccel.modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
)
from fnaccel.modeling.memory import clear_device_cache
from fnaccel.modeling.offload import OffloadedWeightsLoader, offload_state_dict, read_offload_index
from fnaccel.modeling.tensors import DeviceLike, ModuleT, as_device, set_module_tensor_to_device
from fnaccel.ops.tree import send_to_device

__all__ = [
    "CpuOffload",
    "UserCpuOffloadHook",
    "align_module_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "default_execution_device",
    "disk_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
]

_LOG = logging.getLogger(__name__)


def default_execution_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU (Accelerate's default device).

    >>> default_execution_device().type in ("cpu", "cuda")
    True
    """
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


class CpuOffload(ModelHook):
    """Keep a model on the CPU and move all of it to ``execution_device`` when it runs.

    Args:
        execution_device: where the model runs; by default `default_execution_device`.
        prev_module_hook: the `UserCpuOffloadHook` of the model that runs
            before this one: it is sent back to the CPU when this one starts.

    >>> layer = add_hook_to_module(torch.nn.Linear(2, 1), CpuOffload("cpu"))
    >>> layer(torch.ones(1, 2)).shape
    torch.Size([1, 1])
    """

    def __init__(
        self, execution_device: DeviceLike | None = None, prev_module_hook: UserCpuOffloadHook | None = None
    ) -> None:
        if prev_module_hook is not None and not isinstance(prev_module_hook, UserCpuOffloadHook):
            raise TypeError(
                f"prev_module_hook must be the UserCpuOffloadHook that cpu_offload_with_hook returned, "
                f"got {type(prev_module_hook).__name__}"
            )
        self.execution_device = (
            default_execution_device() if execution_device is None else as_device(execution_device)
        )
        self.prev_module_hook = prev_module_hook

    def __repr__(self) -> str:
        return f"CpuOffload(execution_device={self.execution_device})"

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(
        self, module: nn.Module, *args: object, **kwargs: object
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
            clear_device_cache()
        module.to(self.execution_device)
        return tuple(send_to_device(args, self.execution_device)), send_to_device(
            kwargs, self.execution_device
        )


class UserCpuOffloadHook:
    """What `cpu_offload_with_hook` returns: send the model back to the CPU, or remove the hook.

    Args:
        model: the hooked model.
        hook: its `CpuOffload` hook.
    """

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU (the next forward brings it over again)."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Detach the hook; the model stays where it is."""
        remove_hook_from_module(self.model)


def cpu_offload_with_hook(
    model: ModuleT,
    execution_device: DeviceLike | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[ModuleT, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU until it runs; it stays on the device until the next model of a chain starts.

    Chain models that run in turn by passing each one the previous one's hook:
    when model k runs, model k-1 goes back to the CPU. Call the last hook's
    `~UserCpuOffloadHook.offload` when the chain is done.

    Args:
        model: the model, changed in place (moved to the CPU now).
        execution_device: where it runs; by default `default_execution_device`.
        prev_module_hook: the hook of the model that runs before this one.

    Returns:
        ``(model, hook)``.

    >>> encoder, _ = torch.nn.Linear(2, 2), None
    >>> encoder, first = cpu_offload_with_hook(encoder, "cpu")
    >>> decoder, second = cpu_offload_with_hook(torch.nn.Linear(2, 1), "cpu", prev_module_hook=first)
    >>> decoder(encoder(torch.ones(1, 2))).shape
    torch.Size([1, 1])
    >>> second.offload()
    """
    hook = CpuOffload(execution_device, prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def _io_hook(model: nn.Module) -> None:
    """The root returns its output where its input came from."""
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)


def cpu_offload(
    model: ModuleT,
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> ModuleT:
    """Keep every weight of ``model`` in CPU memory; each module loads its own onto the device for its forward.

    Args:
        model: the model, changed in place: its weights go to ``meta``.
        execution_device: where it runs; by default `default_execution_device`.
        offload_buffers: offload the buffers too (else they stay on the device).
        state_dict: the CPU weights to serve; by default a copy of the model's.
        preload_module_classes: class names of modules that load all their
            submodules' weights at the start of their own forward.

    Returns:
        ``model``.

    >>> model = cpu_offload(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)), "cpu")
    >>> model[0].weight.device.type, model(torch.ones(1, 2)).shape
    ('meta', torch.Size([1, 1]))
    """
    device = default_execution_device() if execution_device is None else as_device(execution_device)
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    _refuse_meta_weights(state_dict, "cpu_offload")
    attach_align_device_hook(
        model,
        device,
        offload=True,
        weights_map=state_dict,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )
    _io_hook(model)
    return model


def disk_offload(
    model: ModuleT,
    offload_dir: str | os.PathLike[str],
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] | None = None,
) -> ModuleT:
    """Keep every weight of ``model`` in ``offload_dir`` (memory-mapped); each module reads its own for its forward.

    Where ``offload_dir`` has no ``index.json`` yet, the model's weights are
    written there first; otherwise the folder's weights are used as they are.

    Args:
        model: the model, changed in place: its weights go to ``meta``.
        offload_dir: the offload folder.
        execution_device, offload_buffers, preload_module_classes: as for `cpu_offload`.

    Returns:
        ``model``.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     model = disk_offload(torch.nn.Sequential(torch.nn.Linear(2, 1)), folder, "cpu")
    ...     model[0].weight.device.type, model(torch.ones(1, 2)).shape
    ('meta', torch.Size([1, 1]))
    """
    device = default_execution_device() if execution_device is None else as_device(execution_device)
    if not read_offload_index(offload_dir):
        state_dict = model.state_dict()
        _refuse_meta_weights(state_dict, "disk_offload")
        offload_state_dict(offload_dir, state_dict)
    weights = OffloadedWeightsLoader(save_folder=offload_dir)
    attach_align_device_hook(
        model,
        device,
        offload=True,
        weights_map=weights,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )
    _io_hook(model)
    return model


def _refuse_meta_weights(state_dict: Mapping[str, torch.Tensor], caller: str) -> None:
    on_meta = [name for name, tensor in state_dict.items() if tensor.is_meta]
    if on_meta:
        raise ValueError(
            f"{caller}: {on_meta[:3]} are on the meta device, so there is nothing to offload: load the "
            "weights first (load_checkpoint_in_model) or pass them as state_dict="
        )


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has an `AlignDevicesHook` that offloads its weights.

    >>> layer = torch.nn.Linear(2, 2)
    >>> has_offloaded_params(layer), has_offloaded_params(cpu_offload(layer, "cpu"))
    (False, True)
    """
    return any(
        isinstance(h, AlignDevicesHook) and h.offload for h in _flat(getattr(module, "_hf_hook", None))
    )


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``model``, offloaded weights included, every tensor on the CPU.

    Each module whose weights are offloaded (`cpu_offload`, `disk_offload`,
    `dispatch_model` with ``"cpu"`` / ``"disk"``) loads them onto the CPU in turn,
    as for a forward, so the CPU must hold the whole model. A tensor that is still
    on the meta device (never loaded, and offloaded nowhere) is left out, with a
    warning on the logger ``fnaccel.modeling.big_modeling``, as Accelerate does.
    The keys are ``model.state_dict()``'s, root tensors included (Accelerate's
    leaves out those of the model's own module).

    >>> model = cpu_offload(torch.nn.Sequential(torch.nn.Linear(2, 1)), "cpu")
    >>> {name: t.device.type for name, t in get_state_dict_offloaded_model(model).items()}
    {'0.weight': 'cpu', '0.bias': 'cpu'}
    """
    state = model.state_dict()
    for name, module in model.named_modules():
        if not has_offloaded_params(module) or not any(state[key].is_meta for key in _keys(module, name)):
            continue
        with align_module_device(module, "cpu"):
            for key, tensor in module.state_dict(prefix=f"{name}." if name else "").items():
                if state[key].is_meta:
                    state[key] = tensor
    on_meta = [key for key, tensor in state.items() if tensor.is_meta]
    if on_meta:
        _LOG.warning(
            "get_state_dict_offloaded_model: %s are still on the meta device (their weights were "
            "never loaded nor offloaded), so they are left out",
            on_meta,
        )
    return {key: tensor.detach().to("cpu") for key, tensor in state.items() if not tensor.is_meta}


def _keys(module: nn.Module, name: str) -> Iterator[str]:
    prefix = f"{name}." if name else ""
    return (prefix + key for key in module.state_dict(keep_vars=True))


@contextmanager
def align_module_device(module: nn.Module, execution_device: DeviceLike | None = None) -> Iterator[None]:
    """Inside the block, ``module``'s own weights are real tensors on ``execution_device``.

    An offloaded module's weights are loaded as for a forward and released
    at the end; another module's own parameters are moved there, and its
    original parameters are put back at the end.
    Without ``execution_device``, an offloaded module loads onto its hook's
    execution device and any other module is left alone.

    >>> layer = cpu_offload(torch.nn.Linear(2, 2), "cpu")
    >>> with align_module_device(layer):
    ...     layer.weight.device.type
    'cpu'
    >>> layer.weight.device.type
    'meta'
    """
    offloading = [
        h for h in _flat(getattr(module, "_hf_hook", None)) if isinstance(h, AlignDevicesHook) and h.offload
    ]
    if offloading:
        align = offloading[0]
        original = align.execution_device
        if execution_device is not None:
            align.execution_device = as_device(execution_device)
        try:
            align.pre_forward(module)
            yield
        finally:
            align.post_forward(module, None)
            align.execution_device = original
        return
    if execution_device is None:
        yield
        return
    device = as_device(execution_device)
    originals = dict(module.named_parameters(recurse=False))
    try:
        for name in originals:
            set_module_tensor_to_device(module, name, device)
        yield
    finally:
        for name, param in originals.items():  # the very objects: optimizers still hold them
            module.register_parameter(name, param)


def _flat(hook: ModelHook | None) -> list[ModelHook]:
    """The hooks a (possibly nested) `SequentialHook` runs."""
    if hook is None:
        return []
    if isinstance(hook, SequentialHook):
        return [inner for h in hook.hooks for inner in _flat(h)]
    return [hook]
