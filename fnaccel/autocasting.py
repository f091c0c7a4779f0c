"""`autocast_context(state)`: the run's mixed precision for code outside the model's forward.

`fa.autocast` wraps the model's ``forward`` at `fa.prepare`; a loss computed
outside it, a second model called by hand, or an evaluation helper runs in
full precision unless it enters this context (Accelerate's
``accelerator.autocast()``). The precision is the pipeline's `autocast`
transform's (its `Precision` settings) when it has one, else the run's
``mixed_precision``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from fnaccel.state import RunState
from fnaccel.transforms.base import Pipeline, Precision
from fnaccel.transforms.precision import precision_dtype
from fnaccel.constants import PrecisionType
from fnaccel.kwargs import AutocastKwargs

__all__ = ["autocast_context"]


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
    >>> from fnaccel.autocasting import autocast_context
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
    with torch.autocast(state.dist.device.type, dtype=dtype if enabled else None, enabled=enabled,
                        cache_enabled=cache_enabled):
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
