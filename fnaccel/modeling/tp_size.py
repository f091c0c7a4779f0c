"""`get_model_tp_size`: the tensor-parallel degree a model was split with (Accelerate's
``accelerate.utils.other.get_model_tp_size``, added in 1.15)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fnaccel.transforms.parallel import unwrap_model

__all__ = ["get_model_tp_size"]


def get_model_tp_size(model: nn.Module) -> int | None:
    """The tensor-parallel degree ``model`` was split with, or None when it was not.

    What transformers recorded (``model.tp_size`` before transformers 5,
    ``model.config.distributed_config`` since), else, for a model `fa.tp`
    prepared, the size of the ``tp`` mesh dimension its DTensor parameters
    live on. Wrappers (``fa.ddp``'s, ``fa.compile``'s) are looked through.

    >>> from torch import nn
    >>> get_model_tp_size(nn.Linear(2, 2)) is None
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_tp_size: model must be a torch.nn.Module, got {type(model).__name__}")
    inner = unwrap_model(model)
    recorded = getattr(inner, "tp_size", None)
    if recorded is not None:
        return int(recorded)
    distributed: object = getattr(getattr(inner, "config", None), "distributed_config", None)
    recorded = (
        distributed.get("tp_size") if isinstance(distributed, dict) else getattr(distributed, "tp_size", None)
    )
    if recorded is not None:
        return int(recorded)
    for parameter in inner.parameters():
        mesh: Any = getattr(parameter, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if "tp" in names:
            return int(mesh.size(names.index("tp")))
    return None
