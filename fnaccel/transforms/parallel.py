"""Data parallelism: `ddp()` (replicated, DistributedDataParallel).

A no-op in a world of one, so the same pipeline runs everywhere. Gradient
communication is switched per micro-step by `set_sync` (``accumulate``'s
non-boundary micro-steps turn it off), eagerly, before the forward that needs
it: a hand-written forward runs with the right setting too.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fnaccel.dist import DistContext
from fnaccel.transforms.base import Transform, options
from fnaccel.utils.kwargs import DistributedDataParallelKwargs

__all__ = ["ddp", "unwrap_compiled", "unwrap_model"]

PARALLEL_PHASE = 130


def unwrap_compiled(model: Any) -> Any:
    """The module inside a `torch.compile` wrapper (the model itself otherwise)."""
    return getattr(model, "_orig_mod", model)


def unwrap_model(model: Any) -> nn.Module:
    """The user's module inside `torch.compile` and `DistributedDataParallel`
    wrappers (FSDP2 shards in place, so a sharded model is its own module)."""
    inner = unwrap_compiled(model)
    return inner.module if isinstance(inner, DistributedDataParallel) else inner


def ddp(*, find_unused: bool | None = None, **kwargs: Any) -> Transform:
    """Wrap the model in `DistributedDataParallel` (`DistributedDataParallelKwargs`' options).

    Args:
        find_unused: short for ``find_unused_parameters``.
        **kwargs: `DistributedDataParallelKwargs` fields (``bucket_cap_mb``,
            ``static_graph``, ``gradient_as_bucket_view``, ``comm_hook``, ...).

    >>> import fnaccel as fa
    >>> fa.ddp(find_unused=True)
    ddp(find_unused_parameters=True)
    """
    if find_unused is not None:
        if "find_unused_parameters" in kwargs:
            raise TypeError("ddp: give find_unused or find_unused_parameters, not both")
        kwargs["find_unused_parameters"] = find_unused
    handler = DistributedDataParallelKwargs(**kwargs)

    def prepare_model(ctx: DistContext, model: nn.Module, state: Any) -> nn.Module:
        if ctx.num_processes == 1:
            return model
        wrapped = DistributedDataParallel(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            process_group=ctx.process_group,
            **handler.to_kwargs(),
        )
        handler.register_comm_hook(wrapped)
        return wrapped

    def set_sync(model: Any, enabled: bool) -> None:
        inner = unwrap_compiled(model)
        if isinstance(inner, DistributedDataParallel):
            inner.require_backward_grad_sync = enabled

    shown = {**handler.to_kwargs()}
    for key in ("comm_hook", "comm_wrapper"):
        if getattr(handler, key) != "no":
            shown[key] = str(getattr(handler, key))
    return Transform(
        name="ddp",
        options=options(**shown),
        phase=PARALLEL_PHASE,
        conflicts=frozenset({"fsdp"}),
        prepare_model=prepare_model,
        set_sync=set_sync,
    )
