"""`tp(plan)`: tensor parallelism over the mesh's ``tp`` dimension (DTensor's
`parallelize_module`).

The plan says how each submodule's weights are split: a mapping from module
names (as ``model.named_modules()`` spells them; torch's ``*`` wildcards are
allowed) to torch `ParallelStyle`s (`ColwiseParallel`, `RowwiseParallel`,
`SequenceParallel`, `PrepareModuleInput`, ...), or a callable
``plan(model, tp_mesh) -> model`` that parallelizes the model itself. It runs
before `fsdp()` (which then shards the tensor-parallel DTensors over the
data-parallel dimensions: FSDP + TP) and is a no-op when ``tp_size`` is 1.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeAlias

from torch import nn

from fnaccel.checkpoint.storage.sharded import ShardedLayout
from fnaccel.dist import DistContext, mesh_dim
from fnaccel.transforms.kinds import ParallelismTransform, options
from fnaccel.transforms.phases import Phase

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["tp"]

# (torch's parallel styles load with the transform, not with fnaccel: the alias is a string)
Plan: TypeAlias = "Mapping[str, ParallelStyle] | Callable[[nn.Module, DeviceMesh], nn.Module]"


def _check_plan(plan: object) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if callable(plan) and not isinstance(plan, Mapping):
        return
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"tp: plan must be a non-empty dict of module name -> ParallelStyle (e.g. "
            f"{{'mlp.up': ColwiseParallel(), 'mlp.down': RowwiseParallel()}}) or a callable "
            f"(model, tp_mesh) -> model, got {plan!r}"
        )
    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise TypeError(
                f"tp: plan entry {name!r}: {style!r} is not a torch ParallelStyle; use ColwiseParallel(), "
                "RowwiseParallel(), SequenceParallel() ... from torch.distributed.tensor.parallel"
            )


def _check_names(model: nn.Module, plan: Mapping[str, object]) -> None:
    names = [name for name, _ in model.named_modules() if name]
    missing = [key for key in plan if not fnmatch.filter(names, key)]
    if missing:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ValueError(
            f"fa.prepare: tp plan names {missing[0]!r}, which is no submodule of the model; "
            f"its submodules are {shown}"
        )


def tp(plan: Plan) -> ParallelismTransform:
    """Split the model's weights over the mesh's ``tp`` dimension by ``plan``.

    Args:
        plan: module name -> torch `ParallelStyle`, or a callable
            ``plan(model, tp_mesh) -> model`` (for plans that also change the
            model, e.g. the number of attention heads per rank).

    Raises:
        TypeError: ``plan`` is neither (at once); ValueError at `fa.prepare`
            when a name matches no submodule.

    >>> import fnaccel as fa
    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    >>> fa.tp({"up": ColwiseParallel(), "down": RowwiseParallel()})
    tp(plan=['up', 'down'])
    """
    _check_plan(plan)

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        if isinstance(plan, Mapping):
            _check_names(model, plan)  # in a world of one too: the plan is wrong everywhere
        tp_mesh = mesh_dim(ctx, "tp")
        if tp_mesh is None:
            return model  # tp_size 1: every rank holds the whole model
        if isinstance(plan, Mapping):
            from torch.distributed.tensor.parallel import parallelize_module

            return parallelize_module(model, tp_mesh, dict(plan))
        out = plan(model, tp_mesh)
        if not isinstance(out, nn.Module):
            raise TypeError(
                f"fa.prepare: the tp plan {plan!r} returned {type(out).__name__}; "
                "return the (parallelized) model"
            )
        return out

    shown = list(plan) if isinstance(plan, Mapping) else getattr(plan, "__name__", repr(plan))
    return ParallelismTransform(
        name="tp",
        options=options(plan=shown),
        phase=Phase.TENSOR_PARALLEL,
        conflicts=frozenset({"ddp"}),
        prepare_model=prepare_model,
        layout=ShardedLayout(splits=_splits),
        mesh_dims=frozenset({"tp"}),
        conflict_fix="ddp() replicates whole parameters; use fa.fsdp() with fa.tp() (FSDP + TP)",
    )


def _splits(ctx: DistContext) -> bool:
    """Whether `tp` splits the model's weights in this run (as its prepare_model decides)."""
    return mesh_dim(ctx, "tp") is not None
