"""The run's mixed precision for code outside the pipeline: `autocast_context`, and Accelerate's helpers.

`fa.autocast` (`fnaccel.transforms.mixed_precision`) wraps the model's ``forward`` at
`fa.prepare`; a loss computed outside it, a second model called by hand, or an
evaluation helper runs in full precision unless it enters `autocast_context`
(Accelerate's ``accelerator.autocast()``). The precision is the pipeline's
`autocast` transform's (its `Precision` settings) when it has one, else the
run's ``mixed_precision``. `get_grad_scaler` and
`get_mixed_precision_context_manager` are Accelerate's utilities of those names,
for code that builds its own scaler or autocast region from a run's settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from fnaccel.constants import DistributedType, PrecisionType
from fnaccel.kwargs import AutocastKwargs, GradScalerKwargs
from fnaccel.state import RunState
from fnaccel.transforms.declared import Precision
from fnaccel.transforms.mixed_precision import precision_dtype
from fnaccel.transforms.pipeline import Pipeline

__all__ = ["autocast_context", "get_grad_scaler", "get_mixed_precision_context_manager"]


def autocast_context(
    state: RunState, autocast_handler: AutocastKwargs | None = None
) -> AbstractContextManager[None]:
    """A context running its body under the run's autocast; consumes nothing.

    Args:
        state: the run's state.
        autocast_handler: `AutocastKwargs` for this region (``enabled=False``
            turns autocasting off inside it, as torch's nested autocast does);
            default: the one given to `fa.init`, if any.

    Returns:
        A context manager; outputs made inside keep the low-precision dtype
        (unlike the prepared model's forward, which casts them back to fp32).

    Raises:
        TypeError: ``autocast_handler`` is not an `AutocastKwargs`.

    >>> import torch, fnaccel as fa
    >>> from fnaccel.precision import autocast_context
    >>> state = fa.init(cpu=True, mixed_precision="bf16")
    >>> with autocast_context(state):
    ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    >>> y.dtype
    torch.bfloat16
    """
    if autocast_handler is None:
        autocast_handler = state.kwargs_handlers.get("AutocastKwargs")
    if autocast_handler is not None and not isinstance(autocast_handler, AutocastKwargs):
        raise TypeError(
            f"autocast_context: autocast_handler must be an AutocastKwargs, got "
            f"{type(autocast_handler).__name__}"
        )
    return _autocast(state, autocast_handler or AutocastKwargs())


@contextmanager
def _autocast(state: RunState, handler: AutocastKwargs) -> Iterator[None]:
    dtype, cache_enabled = _run_precision(state)
    if handler.cache_enabled is not None:
        cache_enabled = handler.cache_enabled
    enabled = handler.enabled and dtype is not torch.float32
    with torch.autocast(
        state.dist.device.type, dtype=dtype if enabled else None, enabled=enabled, cache_enabled=cache_enabled
    ):
        yield


def _run_precision(state: RunState) -> tuple[torch.dtype, bool | None]:
    """The prepared pipeline's autocast dtype and cache option, else the run's precision.

    fp8 runs compute their non-fp8 operations in bf16, as Accelerate's do.
    """
    pipeline = state.pipeline
    cast = pipeline.settings(Precision) if isinstance(pipeline, Pipeline) else None
    if cast is not None:
        return cast.dtype, cast.cache_enabled
    if state.mixed_precision is PrecisionType.FP8:
        return torch.bfloat16, None
    return precision_dtype(state.mixed_precision), None


def get_grad_scaler(
    distributed_type: DistributedType | str | None = None, **kwargs: Any
) -> torch.amp.GradScaler:
    """A gradient scaler for fp16 training on this machine: Accelerate's helper of that name.

    CUDA's when CUDA is available, else the CPU's (Accelerate returns a
    disabled CUDA scaler there); under ``DistributedType.FSDP``, torch's
    ``ShardedGradScaler``, which unscales sharded gradients.

    Args:
        distributed_type: the run's `DistributedType` (``state.dist.distributed_type``).
        **kwargs: `GradScalerKwargs` fields (``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``, ``enabled``).

    Raises:
        TypeError: a keyword that is not a `GradScalerKwargs` field.
        ValueError: a bad value for one, or an unknown distributed type.

    >>> scaler = get_grad_scaler(init_scale=1024.0)
    >>> scaler.get_scale() if scaler.is_enabled() else 1024.0
    1024.0
    """
    options = GradScalerKwargs(**kwargs).to_kwargs()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if distributed_type is not None and DistributedType(distributed_type) is DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, **options)
    return torch.amp.GradScaler(device, **options)


def get_mixed_precision_context_manager(
    state: RunState, native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> AbstractContextManager[object]:
    """Reads the state's mixed precision and returns the autocast region for it (Accelerate's helper).

    Args:
        state: the run: its ``mixed_precision`` and device are read.
        native_amp: whether mixed precision is on; without it, a context
            that does nothing.
        autocast_kwargs: `AutocastKwargs` for ``torch.autocast``.

    Returns:
        ``torch.autocast`` on the run's device in fp16 for ``"fp16"``, bf16
        for ``"bf16"`` (and ``"fp8"``, as Accelerate), the device's default
        autocast dtype for ``"no"``; or ``contextlib.nullcontext()``.

    Raises:
        TypeError: ``autocast_kwargs`` is not an `AutocastKwargs`.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True, mixed_precision="bf16")
    >>> with get_mixed_precision_context_manager(state, native_amp=True):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    """
    if autocast_kwargs is not None and not isinstance(autocast_kwargs, AutocastKwargs):
        raise TypeError(f"autocast_kwargs must be an AutocastKwargs, got {type(autocast_kwargs).__name__}")
    if not native_amp:
        return contextlib.nullcontext()
    options = {} if autocast_kwargs is None else autocast_kwargs.to_kwargs()
    device_type = state.dist.device.type
    precision = PrecisionType(state.mixed_precision)
    if precision is PrecisionType.FP16:
        return torch.autocast(device_type, dtype=torch.float16, **options)
    if precision in (PrecisionType.BF16, PrecisionType.FP8):
        return torch.autocast(device_type, dtype=torch.bfloat16, **options)
    return torch.autocast(device_type, **options)
