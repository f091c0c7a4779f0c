"""Gradient clipping at the update boundary, after the fp16 scaler unscaled.

The norm is global across every sharding: DTensor gradients (fsdp(), tp())
have their norms reduced over their meshes, grouped by mesh and placements,
then combined with the plain gradients' norm.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from fnaccel.transforms.declared import Capability, GradientClipping
from fnaccel.transforms.kinds import StepTransform, options
from fnaccel.transforms.phases import Phase
from fnaccel.transforms.pipelining import reduce_norm

if TYPE_CHECKING:
    from torch.distributed.tensor import DeviceMesh, DTensor, Placement

__all__ = ["clip_grad_norm", "clip_grad_value", "global_grad_norm"]


def _parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that have a gradient, in the model's order (then any
    the model does not hold): a floating-point sum depends on its order, and a hand
    loop clips ``model.parameters()``, whatever the optimizer's groups (decay/no-decay)."""
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    ordered = [p for p in model.parameters() if held.pop(id(p), None) is not None]
    ordered.extend(held.values())
    return [p for p in ordered if p.grad is not None]


def dtensor_class() -> type[DTensor] | tuple[()]:
    """DTensor, for isinstance, or () (no DTensor exists unless its module was loaded)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    found: type[DTensor] | tuple[()] = getattr(dtensor, "DTensor", ())
    return found


def global_grad_norm(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``grads`` together, as a plain tensor: each
    DTensor group's norm is reduced over its mesh (a collective), then the group
    norms and the plain tensors' norm are combined (a norm of norms is the norm).

    >>> global_grad_norm([torch.tensor([3.0]), torch.tensor([4.0])])
    tensor(5.)
    """
    kind = dtensor_class()
    plain = [g for g in grads if not isinstance(g, kind)]
    groups: dict[tuple[DeviceMesh, tuple[Placement, ...]], list[DTensor]] = {}
    for g in grads:
        if isinstance(g, kind):
            groups.setdefault((g.device_mesh, g.placements), []).append(g)
    if not groups:
        return torch.nn.utils.get_total_norm(plain, norm_type)
    norms: list[torch.Tensor] = [
        torch.nn.utils.get_total_norm(group, norm_type).full_tensor()  # type: ignore[attr-defined]
        for group in groups.values()
    ]
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain, norm_type))
    return torch.nn.utils.get_total_norm(norms, norm_type)


def _clip(model: nn.Module, params: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip in place; the norm before clipping. One sharding (plain tensors, or DTensors
    of one mesh as under fsdp()) goes through torch's norm and clipping, with the norm
    taken over every stage of a `pp` pipeline; a mix (tp(), fsdp() + tp()) scales each
    gradient's local part by the global norm."""
    kind = dtensor_class()
    meshes = {getattr(p.grad, "device_mesh", None) for p in params if isinstance(p.grad, kind)}
    if len(meshes) + any(not isinstance(p.grad, kind) for p in params) <= 1:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
        norm = reduce_norm(model, norm, norm_type)  # over every stage of a pipeline
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        return full() if full else norm
    norm = global_grad_norm([p.grad for p in params if p.grad is not None], norm_type)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            grad = p.grad
            assert grad is not None, "_parameters keeps those with a gradient"
            (grad.to_local() if isinstance(grad, kind) else grad).mul_(scale.to(grad.device))
    return norm


def clip_grad_norm(max_norm: float, norm_type: float = 2.0) -> StepTransform:
    """Clip the gradients' global norm to ``max_norm``; metrics gain ``grad_norm``
    (the norm before clipping, a tensor). Under `pp` the norm is over every
    stage's gradients.

    On one process and under `ddp` it equals
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)``
    bit for bit: the norm is summed in the model's parameter order, whatever the
    optimizer's parameter groups. Under `fsdp` and `tp` it is the unsplit
    model's global norm.

    >>> import fnaccel as fa
    >>> fa.clip_grad_norm(1.0)
    clip_grad_norm(max_norm=1.0)
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be positive, got {max_norm}")

    def before_update(
        model: nn.Module, optimizer: torch.optim.Optimizer, state: object
    ) -> dict[str, torch.Tensor]:
        return {"grad_norm": _clip(model, _parameters(model, optimizer), max_norm, norm_type).detach()}

    opts = options(max_norm=max_norm) + (options(norm_type=norm_type) if norm_type != 2.0 else ())
    return StepTransform(
        name="clip_grad_norm",
        options=opts,
        phase=Phase.CLIP,
        conflicts=frozenset({"clip_grad_value"}),
        before_update=before_update,
        capabilities=frozenset({Capability.CLIPS_GRADIENTS}),
        settings=GradientClipping(max_norm=max_norm, norm_type=norm_type),
    )


def clip_grad_value(value: float) -> StepTransform:
    """Clamp every gradient element to ``[-value, value]``, as
    ``torch.nn.utils.clip_grad_value_(model.parameters(), value)``.

    >>> import fnaccel as fa
    >>> fa.clip_grad_value(0.5)
    clip_grad_value(value=0.5)
    """
    if not value > 0:
        raise ValueError(f"clip_grad_value: value must be positive, got {value}")

    def before_update(
        model: nn.Module, optimizer: torch.optim.Optimizer, state: object
    ) -> dict[str, torch.Tensor]:
        torch.nn.utils.clip_grad_value_(_parameters(model, optimizer), value)
        return {}

    return StepTransform(
        name="clip_grad_value",
        options=options(value=value),
        phase=Phase.CLIP,
        conflicts=frozenset({"clip_grad_norm"}),
        before_update=before_update,
        capabilities=frozenset({Capability.CLIPS_GRADIENTS}),
    )
