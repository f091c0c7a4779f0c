"""How many bytes a model and each of its modules hold, from shapes and dtypes alone.

Nothing here reads tensor data, so a model built under `init_empty_weights`
(every parameter on the ``meta`` device) is sized as cheaply as a real one.
A parameter shared under several names (tied weights) is counted once, under
the first name ``named_parameters`` gives it, as in Accelerate.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
>>> sizes = compute_module_sizes(model)
>>> sizes[""], sizes["0"], sizes["2.weight"]
(120, 80, 32)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

import torch
from torch import nn

__all__ = [
    "as_torch_dtype",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "dtype_byte_size",
    "get_max_layer_size",
    "largest_layer",
    "named_module_tensors",
]

# Accelerate's custom dtypes (``CustomDtype``): sizes torch has no dtype for.
_CUSTOM_DTYPE_BYTES = MappingProxyType({"int2": 0.25, "int4": 0.5, "fp8": 1.0})

DTypeLike = str | torch.dtype


def as_torch_dtype(dtype: object) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype``: itself, or the dtype its name names
    (``"float16"``, ``"torch.bfloat16"``); None when it names none.

    Every dtype argument and index entry of `fnaccel.modeling` is read through
    this; each caller raises its own error for None, naming what was wrong.

    >>> as_torch_dtype("torch.bfloat16"), as_torch_dtype(torch.int8), as_torch_dtype("float17")
    (torch.bfloat16, torch.int8, None)
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    return found if isinstance(found, torch.dtype) else None


def _proper_dtype(dtype: DTypeLike) -> torch.dtype | str:
    """``dtype`` as a torch dtype, or one of the custom names ("int4", "int2", "fp8")."""
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _CUSTOM_DTYPE_BYTES:
        return dtype.removeprefix("torch.")
    found = as_torch_dtype(dtype)
    if found is not None:
        return found
    raise ValueError(
        f"{dtype!r} is not a dtype: pass a torch.dtype, a name such as 'float16' or 'torch.bfloat16', "
        f"or one of {', '.join(repr(n) for n in _CUSTOM_DTYPE_BYTES)}"
    )


def dtype_byte_size(dtype: DTypeLike) -> float:
    """Bytes one element of ``dtype`` takes.

    ``torch.bool`` counts as 1/8 byte, and the custom names ``"int4"``,
    ``"int2"`` and ``"fp8"`` (Accelerate's ``CustomDtype``) as 1/2, 1/4 and 1.

    Args:
        dtype: a ``torch.dtype``, its name (``"float16"``, ``"torch.bfloat16"``)
            or a custom name.

    Raises:
        ValueError: ``dtype`` names no dtype.

    >>> dtype_byte_size(torch.float16), dtype_byte_size("float32"), dtype_byte_size("int4")
    (2, 4, 0.5)
    """
    proper = _proper_dtype(dtype)
    if isinstance(proper, str):
        return _CUSTOM_DTYPE_BYTES[proper]
    if proper == torch.bool:
        return 1 / 8
    return proper.itemsize


def _non_persistent_buffers(module: nn.Module, recurse: bool) -> set[str]:
    modules = module.named_modules() if recurse else [("", module)]
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in modules
        for name in sub._non_persistent_buffers_set
    }


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of ``module``, then its buffers, with their names.

    Args:
        module: the module to look into.
        include_buffers: also yield the buffers.
        recurse: also yield the tensors of the submodules (otherwise only the
            module's own).
        remove_non_persistent: leave out the buffers registered with
            ``persistent=False`` (those not in the state dict).

    >>> bn = nn.BatchNorm1d(3)
    >>> [name for name, _ in named_module_tensors(bn)]
    ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skipped = _non_persistent_buffers(module, recurse) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skipped:
                yield name, buffer


def compute_module_sizes(
    model: nn.Module,
    dtype: DTypeLike | None = None,
    special_dtypes: Mapping[str, DTypeLike] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes held by the model (name ``""``), each submodule and each tensor.

    Sizes come from shapes and dtypes, so meta-device models work. Each tensor
    counts once (tied parameters under their first name), rounded up to whole
    bytes. As in Accelerate the result is a ``defaultdict(int)``: a name that
    holds no tensor (an activation module) reads as 0.

    Args:
        model: the model to size.
        dtype: size floating-point tensors as if cast to this dtype (never
            larger than they are); integer and boolean tensors keep theirs.
        special_dtypes: dtypes for particular tensors, by full name; they win
            over ``dtype``.
        buffers_only: count only the buffers.

    >>> compute_module_sizes(nn.Linear(3, 2), dtype="float16")[""]
    16
    """
    default_size = None if dtype is None else dtype_byte_size(dtype)
    special_sizes = {name: dtype_byte_size(d) for name, d in (special_dtypes or {}).items()}
    sizes: defaultdict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        element_size = dtype_byte_size(tensor.dtype)
        if name in special_sizes:
            element_size = special_sizes[name]
        elif default_size is not None and (tensor.is_floating_point() or tensor.is_complex()):
            # integer and boolean tensors are never converted on load, so they keep their size
            element_size = min(element_size, default_size)
        size = math.ceil(tensor.numel() * element_size)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: DTypeLike | None = None,
    special_dtypes: Mapping[str, DTypeLike] | None = None,
) -> int:
    """Bytes held by all the buffers of ``model`` (see `compute_module_sizes`).

    >>> compute_module_total_buffer_size(nn.BatchNorm1d(3))  # two float32 stats of 3, one int64 counter
    32
    """
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True)
    return sizes.get("", 0)


def get_max_layer_size(
    modules: Sequence[tuple[str, nn.Module | torch.Tensor]],
    module_sizes: Mapping[str, int],
    no_split_module_classes: Sequence[str],
) -> tuple[int, list[str]]:
    """The size of the largest layer among ``modules``, and the names of the layers of that size.

    A layer is a module with no children (it holds only parameters and
    buffers), a module whose class name is in ``no_split_module_classes``
    (kept whole, like a residual block), or a bare tensor. Modules with
    children are looked into.

    Args:
        modules: ``(name, module or tensor)`` pairs, names relative to the model.
        module_sizes: sizes by name, as `compute_module_sizes` returns them.
        no_split_module_classes: class names of the modules never split.

    Returns:
        ``(max_size, layer_names)``.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    >>> get_max_layer_size(list(model.named_children()), compute_module_sizes(model), [])
    (80, ['1.0'])
    >>> get_max_layer_size(list(model.named_children()), compute_module_sizes(model), ["Sequential"])
    (80, ['1'])
    """
    max_size = 0
    layer_names: list[str] = []
    to_treat = list(modules)
    while to_treat:
        name, module = to_treat.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes.get(name, 0)
            if size > max_size:
                max_size, layer_names = size, [name]
            elif size == max_size:
                layer_names.append(name)
        else:
            to_treat = [(f"{name}.{child}", sub) for child, sub in children] + to_treat
    return max_size, layer_names


def top_level_entries(model: nn.Module) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """The model's own parameters, its children, then its own buffers: the units a device map starts from."""
    return [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]


def largest_layer(model: nn.Module, module_sizes: Mapping[str, int]) -> tuple[int, list[str]]:
    """The largest layer of ``model`` as `get_max_layer_size` finds it: ``(size, layer_names)``,
    with the model's own ``_no_split_modules`` as the classes never split.

    Args:
        model: the model.
        module_sizes: its sizes, as `compute_module_sizes` returns them (in
            the dtypes to plan for).

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> largest_layer(model, compute_module_sizes(model, dtype="float16"))
    (40, ['0'])
    """
    # transformers models name the classes they never split; honour it as Accelerate does
    no_split = getattr(model, "_no_split_modules", None) or []
    return get_max_layer_size(top_level_entries(model), module_sizes, list(no_split))


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """The model's total size and its largest layer: ``(total, (layer_size, layer_names))``.

    Layers are as in `get_max_layer_size`, with the model's own
    ``_no_split_modules`` (set by transformers models) as the classes never split.

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> calculate_maximum_sizes(model)
    (120, (80, ['0']))
    """
    sizes = compute_module_sizes(model)
    return sizes[""], largest_layer(model, sizes)
