"""Layerwise casting: weights stored in a low-precision dtype, cast up for each layer's forward.

`attach_layerwise_casting_hooks` (Accelerate's name) hooks every ``Linear``
and convolution of a model with a `LayerwiseCastingHook`: the layer's weights
are kept in ``storage_dtype`` (fp16, bf16, or an fp8 dtype: half the memory
or less) and cast to ``compute_dtype`` only while the layer runs. The result
equals running a model whose weights were rounded to ``storage_dtype`` by
hand and cast back to ``compute_dtype``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from fnaccel.modeling.hooks import ModelHook, add_hook_to_module

__all__ = ["LayerwiseCastingHook", "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING", "attach_layerwise_casting_hooks"]

# The layers whose weights are cast: those that only read their weights in forward (Accelerate's
# name and order).
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


def _check_dtype(dtype: object, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    return dtype


class LayerwiseCastingHook(ModelHook):
    """Store a module's weights in ``storage_dtype``; cast them to ``compute_dtype`` for its forward.

    Args:
        storage_dtype: the dtype the weights are kept in between forwards.
        compute_dtype: the dtype the forward runs in.
        non_blocking: cast asynchronously (on CUDA).

    >>> layer = add_hook_to_module(torch.nn.Linear(2, 2), LayerwiseCastingHook(torch.float16, torch.float32))
    >>> layer.weight.dtype, layer(torch.ones(1, 2)).dtype, layer.weight.dtype
    (torch.float16, torch.float32, torch.float16)
    """

    def __init__(
        self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool = False
    ) -> None:
        self.storage_dtype = _check_dtype(storage_dtype, "storage_dtype")
        self.compute_dtype = _check_dtype(compute_dtype, "compute_dtype")
        self.non_blocking = non_blocking

    def __repr__(self) -> str:
        return f"LayerwiseCastingHook(storage_dtype={self.storage_dtype}, compute_dtype={self.compute_dtype})"

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(
        self, module: nn.Module, *args: object, **kwargs: object
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | Sequence[str] | None = None,
    skip_modules_classes: Sequence[type[nn.Module]] | None = None,
    non_blocking: bool = False,
) -> None:
    """Hook every ``Linear`` and convolution (`SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING`) of ``module``
    with a `LayerwiseCastingHook`.

    Args:
        module: the model, changed in place.
        storage_dtype: the dtype the weights are kept in.
        compute_dtype: the dtype each layer runs in.
        skip_modules_pattern: regular expressions; a module whose name
            matches one (``re.search``) is left alone, with its submodules.
        skip_modules_classes: module classes left alone, with their submodules.
        non_blocking: cast asynchronously (on CUDA).

    Raises:
        TypeError: a dtype is not a floating-point ``torch.dtype``.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2), torch.nn.Linear(2, 1))
    >>> attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32, skip_modules_pattern=["^2$"])
    >>> [p.dtype for p in (model[0].weight, model[1].weight, model[2].weight)]
    [torch.bfloat16, torch.float32, torch.float32]
    """
    _check_dtype(storage_dtype, "storage_dtype")
    _check_dtype(compute_dtype, "compute_dtype")
    patterns = (
        [skip_modules_pattern] if isinstance(skip_modules_pattern, str) else list(skip_modules_pattern or ())
    )
    classes = tuple(skip_modules_classes or ())
    _attach(module, "", storage_dtype, compute_dtype, patterns, classes, non_blocking)


def _attach(
    module: nn.Module,
    name: str,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    patterns: list[str],
    classes: tuple[type[nn.Module], ...],
    non_blocking: bool,
) -> None:
    if isinstance(module, classes) or any(re.search(pattern, name) for pattern in patterns):
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        add_hook_to_module(
            module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True
        )
        return
    for child_name, child in module.named_children():
        _attach(
            child,
            f"{name}.{child_name}" if name else child_name,
            storage_dtype,
            compute_dtype,
            patterns,
            classes,
            non_blocking,
        )
