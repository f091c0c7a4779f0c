"""Accelerate's precision helpers: `get_grad_scaler` and `get_mixed_precision_context_manager`.

fnaccel's own way is the pipeline (`fa.autocast`, `fa.grad_scaler`); these are
for code that builds its own scaler or autocast region from a run's settings,
as Accelerate's utilities do.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from fnaccel.constants import DistributedType, PrecisionType
from fnaccel.kwargs import AutocastKwargs, GradScalerKwargs

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["get_grad_scaler", "get_mixed_precision_context_manager"]


def get_grad_scaler(distributed_type: DistributedType | str | None = None, **kwargs: Any) -> torch.amp.GradScaler:
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
) -> contextlib.AbstractContextManager[Any]:
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
