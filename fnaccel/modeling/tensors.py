"""Putting one tensor of a module on a device: `set_module_tensor_to_device`.

``param.to(device)`` makes a new tensor that the module does not see, and a
parameter on the ``meta`` device has no data to move at all. This sets the
module's own entry (``_parameters`` or ``_buffers``) to the tensor on its new
device, keeping a parameter a parameter of the same class with the same
``requires_grad``. Loading into a model built with `init_empty_weights`,
disk offload and dispatching over devices all go through it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, TypeVar

import torch
from torch import nn

from fnaccel.checks import is_int

__all__ = ["set_module_tensor_to_device"]

DeviceLike = int | str | torch.device
DeviceMap = Mapping[str, DeviceLike]
Placement = torch.device | str  # a device, or "disk"
TiedParamsMap = MutableMapping[int, MutableMapping[torch.device, torch.Tensor]]
# a function that hooks, offloads or loads into the model it was given returns it as typed
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def as_device(device: DeviceLike, what: str = "device") -> torch.device:
    """``device`` as a `torch.device`; an int is a CUDA index, as in Accelerate's device maps.

    Raises:
        ValueError: ``"disk"`` or a name torch does not know.
    """
    if isinstance(device, torch.device):
        return device
    if is_int(device):
        return torch.device("cuda", device)
    if isinstance(device, str) and device != "disk":
        try:
            return torch.device(device)
        except RuntimeError:
            pass
    raise ValueError(
        f"{what} {device!r} is not a device: use 'cpu', 'meta', 'cuda:0' or a GPU index"
        + (" ('disk' is only a device_map value: weights offloaded to a folder)" if device == "disk" else "")
    )


def parse_device_map(device_map: DeviceMap) -> dict[str, Placement]:
    """``device_map`` with every value a `torch.device` or ``"disk"``.

    Raises:
        ValueError: a value that is no device, or a CUDA device without CUDA.
    """
    parsed: dict[str, Placement] = {}
    for name, value in device_map.items():
        device = "disk" if value == "disk" else as_device(value, what=f"device_map[{name!r}]")
        if isinstance(device, torch.device) and device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device_map puts {name!r} on {device}, but CUDA is not available: use 'cpu' or 'disk'"
            )
        parsed[name] = device
    return parsed


def device_for(name: str, device_map: Mapping[str, Placement]) -> Placement | None:
    """Where ``device_map`` puts the tensor or module ``name``: at its longest listed prefix."""
    while name not in device_map:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return device_map[name]


def owner_of(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``tensor_name`` (dotted), and the tensor's name there.

    Raises:
        ValueError: no such submodule, parameter or buffer.
    """
    prefix, _, leaf = tensor_name.rpartition(".")
    try:
        owner = module.get_submodule(prefix)
    except AttributeError:
        raise ValueError(
            f"{type(module).__name__} has no submodule {prefix!r} (for {tensor_name!r})"
        ) from None
    if owner._parameters.get(leaf) is None and owner._buffers.get(leaf) is None:
        raise ValueError(
            f"{type(owner).__name__} {prefix or '(the model)'!s} has no parameter or buffer {leaf!r}; "
            "pass a name as model.state_dict() lists it"
        )
    return owner, leaf


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _tied(
    tied_params_map: TiedParamsMap | None, tensor: torch.Tensor | None, device: torch.device
) -> int | None:
    """The key of ``tensor`` in ``tied_params_map`` (meta tensors have no data pointer to key on)."""
    if tied_params_map is None or tensor is None or tensor.is_meta:
        return None
    pointer = tensor.data_ptr()
    return pointer if pointer in tied_params_map else None


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: DeviceLike,
    value: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Set the parameter or buffer ``tensor_name`` of ``module`` on ``device``, in place.

    The module's entry is replaced: a parameter becomes a new parameter of the
    same class, with the same ``requires_grad``, holding the moved data (other
    modules that shared the old object keep it: `retie_parameters` re-shares).

    Args:
        module: the module holding the tensor, at any depth.
        tensor_name: its dotted name, as ``module.state_dict()`` lists it.
        device: where to put it (an int is a CUDA index; ``"meta"`` drops the data).
        value: the data to put there instead of the current tensor's; needed
            when the tensor is on ``meta``. Its shape must match.
        dtype: cast floating-point data to this dtype (integer and bool
            tensors keep theirs). Without it, ``value`` is cast to the
            current tensor's dtype, as ``nn.Module.load_state_dict`` does.
        fp16_statistics: 8-bit quantization statistics, set as the new
            parameter's ``SCB`` on ``device`` (bitsandbytes' serialization).
        tied_params_map: ``{data_ptr: {device: tensor}}`` for tied weights:
            when the current tensor's or ``value``'s data pointer is a key and
            ``device`` already has a tensor for it, that one is reused instead of
            a new copy; otherwise the new tensor is recorded there.

    Raises:
        ValueError: no such tensor, a ``meta`` tensor without ``value``, a
            shape mismatch, ``fp16_statistics`` for a buffer, or a bad device.

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(2, 1))
    >>> set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(1, 2, dtype=torch.float64))
    >>> model[0].weight
    Parameter containing:
    tensor([[1., 1.]], requires_grad=True)
    """
    owner, leaf = owner_of(module, tensor_name)
    target = as_device(device)
    is_buffer = owner._parameters.get(leaf) is None
    slots: MutableMapping[str, Any] = owner._buffers if is_buffer else owner._parameters
    old = slots[leaf]
    for key in (_tied(tied_params_map, value, target), _tied(tied_params_map, old, target)):
        if key is not None and tied_params_map is not None and target in tied_params_map[key]:
            slots[leaf] = tied_params_map[key][target]
            return
    if old.is_meta and target.type != "meta" and value is None:
        raise ValueError(
            f"{tensor_name!r} is on the meta device and holds no data: pass value= (its weights) to put it on {target}"
        )
    if fp16_statistics is not None and is_buffer:
        raise ValueError(f"fp16_statistics apply to 8-bit parameters, and {tensor_name!r} is a buffer")
    source = old if value is None else value
    if value is not None and tuple(value.shape) != tuple(old.shape):
        raise ValueError(
            f"value for {tensor_name!r} has shape {tuple(value.shape)} but the module's tensor has "
            f"{tuple(old.shape)}: the weights do not belong to this model"
        )
    if dtype is None:
        new_dtype = old.dtype if value is not None else source.dtype
    else:
        new_dtype = source.dtype if _is_integer(source.dtype) else dtype
    with torch.no_grad():
        new = source.to(device=target, dtype=new_dtype)
    if is_buffer:
        stored: torch.Tensor = new
    elif new is old and fp16_statistics is None:
        stored = old  # already there: the same parameter stays
    else:
        param_class: Any = type(old)
        stored = param_class(new, requires_grad=old.requires_grad)
        if fp16_statistics is not None:
            stored.SCB = fp16_statistics.to(target)  # type: ignore[attr-defined]
    slots[leaf] = stored
    for tensor in (old, value):
        key = _tied(tied_params_map, tensor, target)
        if key is not None and tied_params_map is not None:
            tied_params_map[key].setdefault(target, stored)
            break
