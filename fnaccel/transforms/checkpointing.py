"""`checkpoint_activations(...)`: recompute chosen blocks' activations in backward
instead of keeping them (`torch.utils.checkpoint`, non-reentrant).

Each chosen block's ``forward`` is replaced, on the instance, by one that runs
the original under `torch.utils.checkpoint.checkpoint`; the module tree and
its parameter names do not change, so checkpoints, `fa.tp` plans and FSDP
wrapping by class name see the same model. It runs after `fa.tp` and before
`fa.fsdp` (torchtitan's order), so FSDP2's hooks stay outside the recomputed
region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fnaccel.dist import DistContext
from fnaccel.transforms.base import Transform, options
from fnaccel.transforms.phases import Phase

__all__ = ["checkpoint_activations"]


class CheckpointedForward:
    """A module's own ``forward`` run under activation checkpointing."""

    __slots__ = ("inner",)

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _blocks(model: nn.Module, classes: tuple[str | type, ...]) -> list[nn.Module]:
    if classes:
        names = {c for c in classes if isinstance(c, str)}
        types = tuple(c for c in classes if isinstance(c, type))
        chosen = [m for m in model.modules() if type(m).__name__ in names or isinstance(m, types)]
        if not chosen:
            raise ValueError(f"fa.prepare: checkpoint_activations: the model has no module of class "
                             f"{', '.join(sorted(map(_name, classes)))}; name the class of its blocks")
    else:
        chosen = [block for m in model.modules() if isinstance(m, nn.ModuleList) for block in m]
        if not chosen:
            raise ValueError("fa.prepare: checkpoint_activations() checkpoints every block of the model's "
                             "nn.ModuleLists, and it has none; name the blocks' class: "
                             "checkpoint_activations('Block')")
    # a block inside a chosen block is recomputed with it already
    inside = {id(sub) for block in chosen for sub in block.modules() if sub is not block}
    return [block for block in chosen if id(block) not in inside]


def _name(c: str | type) -> str:
    return c if isinstance(c, str) else c.__name__


def checkpoint_activations(*classes: str | type) -> Transform:
    """Recompute the activations of the model's blocks in backward instead of storing them.

    Args:
        *classes: the blocks to checkpoint, by class or class name; none: every
            module held in one of the model's ``nn.ModuleList``s (its repeated
            blocks).

    This is what the FSDP config key ``fsdp_activation_checkpointing: true``
    builds (for the ``fsdp_transformer_layer_cls_to_wrap`` classes).

    >>> import fnaccel as fa
    >>> fa.checkpoint_activations("Block")
    checkpoint_activations(classes=('Block',))
    """
    bad = [c for c in classes if not isinstance(c, (str, type))]
    if bad:
        raise TypeError(f"checkpoint_activations: takes module classes or class names, got {bad[0]!r}")

    def prepare_model(ctx: DistContext, model: nn.Module, state: Any) -> nn.Module:
        for block in _blocks(model, classes):
            if not isinstance(block.__dict__.get("forward"), CheckpointedForward):
                block.forward = CheckpointedForward(block.forward)
        return model

    opts = options(classes=tuple(map(_name, classes))) if classes else ()
    return Transform(name="checkpoint_activations", options=opts, phase=Phase.CHECKPOINT_ACTIVATIONS,
                     prepare_model=prepare_model)
