"""Where a prepared model's parameters are: sharded over the ranks, or split into pipeline stages.

`fa.save_model` and `load_checkpoint_in_model` gather or place whole weights, so
they ask the model itself; `fa.save` and `fa.load` never do (the parallelism
declares its checkpoint layout).
"""

from __future__ import annotations

import sys

from torch import nn

from fnaccel.checkpoint.storage.parts import unwrap_model
from fnaccel.transforms.pipelining import PipelinedModel

__all__ = ["is_pipelined", "is_sharded"]


def is_sharded(model: object) -> bool:
    """True for a model whose parameters are sharded over the ranks (DTensors, as `fsdp()`
    leaves them, or pipeline stages, as `pp()` does), compiled or wrapped or not.

    >>> import torch
    >>> is_sharded(torch.nn.Linear(2, 2)), is_sharded(None)
    (False, False)
    """
    if is_pipelined(model):
        return True
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor exists
    if not isinstance(model, nn.Module) or dtensor is None:
        return False
    return any(isinstance(p, dtensor.DTensor) for p in unwrap_model(model).parameters())


def is_pipelined(model: object) -> bool:
    """True for a model split into pipeline stages over several processes by `pp()`
    (this rank's stages only; in a world of one it holds the whole model).

    >>> import torch
    >>> is_pipelined(torch.nn.Linear(2, 2))
    False
    """
    inner = unwrap_model(model) if isinstance(model, nn.Module) else None
    return isinstance(inner, PipelinedModel) and inner.group is not None
