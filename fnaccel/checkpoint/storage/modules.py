"""The user's module inside the wrappers a run put around it.

Here, below the transforms, because a layout stores the user's own module
(its names carry no ``module.`` or ``_orig_mod.`` prefix) and the transforms
that wrap it (`fa.ddp`, `fa.compile`, `fa.deepspeed`) import the same answer.
"""

from __future__ import annotations

import sys
from typing import Any, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["unwrap_compiled", "unwrap_model"]


def unwrap_compiled(model: Any) -> Any:
    """The module inside a `torch.compile` wrapper (the model itself otherwise)."""
    return getattr(model, "_orig_mod", model)


def unwrap_model(model: Any) -> nn.Module:
    """The user's module inside `torch.compile`, `DistributedDataParallel` and DeepSpeed
    engine wrappers (FSDP2 shards in place, so a sharded model is its own module).

    >>> import torch
    >>> layer = torch.nn.Linear(1, 1)
    >>> unwrap_model(torch.compile(layer)) is layer
    True
    """
    inner = unwrap_compiled(model)
    if isinstance(inner, DistributedDataParallel):
        return cast(nn.Module, inner.module)
    ds = sys.modules.get("deepspeed")  # only a run that built an engine has imported it
    return cast(
        nn.Module, inner.module if ds is not None and isinstance(inner, ds.DeepSpeedEngine) else inner
    )
