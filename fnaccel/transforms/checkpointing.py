"""`checkpoint_activations(...)`: recompute chosen blocks' activations in backward
instead of keeping them (`torch.utils.checkpoint`, non-reentrant).

Each chosen block's ``forward`` is replaced, on the instance, by one that runs
the original under `torch.utils.checkpoint.checkpoint`; the module tree and
its parameter names do not change, so checkpoints, `fa.tp` plans and FSDP
wrapping by class name see the same model. With ``offload=True`` the region
runs under `torch.autograd.graph.save_on_cpu`: what the checkpoint keeps for
its recomputation (the block's inputs) waits in host memory until backward. It runs after `fa.tp` and before
`fa.fsdp` (torchtitan's order), so FSDP2's hooks stay outside the recomputed
region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fnaccel.dist import DistContext
from fnaccel.transforms.kinds import Transform, options
from fnaccel.transforms.phases import Phase

__all__ = ["checkpoint_activations"]


class CheckpointedForward:
    """A module's own ``forward`` run under activation checkpointing."""

    __slots__ = ("inner", "offload")

    def __init__(self, inner: Callable[..., Any], offload: bool = False) -> None:
        self.inner = inner
        self.offload = offload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not self.offload:
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        # the non-reentrant checkpoint saves its inputs as autograd saved tensors, outside its own
        # hooks, so save_on_cpu around it moves exactly those; the block's inner activations are
        # recomputed and never saved. Pinned memory only where there is a GPU to copy from.
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _blocks(model: nn.Module, classes: tuple[str | type, ...]) -> list[nn.Module]:
    if classes:
        names = {c for c in classes if isinstance(c, str)}
        types = tuple(c for c in classes if isinstance(c, type))
        chosen = [m for m in model.modules() if type(m).__name__ in names or isinstance(m, types)]
        if not chosen:
            raise ValueError(
                f"fa.prepare: checkpoint_activations: the model has no module of class "
                f"{', '.join(sorted(map(_name, classes)))}; name the class of its blocks"
            )
    else:
        chosen = [block for m in model.modules() if isinstance(m, nn.ModuleList) for block in m]
        if not chosen:
            raise ValueError(
                "fa.prepare: checkpoint_activations() checkpoints every block of the model's "
                "nn.ModuleLists, and it has none; name the blocks' class: "
                "checkpoint_activations('Block')"
            )
    # a block inside a chosen block is recomputed with it already
    inside = {id(sub) for block in chosen for sub in block.modules() if sub is not block}
    return [block for block in chosen if id(block) not in inside]


def _name(c: str | type) -> str:
    return c if isinstance(c, str) else c.__name__


def checkpoint_activations(*classes: str | type, offload: bool = False) -> Transform:
    """Recompute the activations of the model's blocks in backward instead of storing them.

    Args:
        *classes: the blocks to checkpoint, by class or class name; none: every
            module held in one of the model's ``nn.ModuleList``s (its repeated
            blocks).
        offload: also keep each block's input (what the checkpoint saves to
            recompute from) in host memory until backward, copied back to the
            device then (`torch.autograd.graph.save_on_cpu`, pinned on CUDA).
            Results are unchanged; it lowers the accelerator's peak at the
            cost of two copies per block. On the CPU it changes nothing.

    Raises:
        TypeError: a class that is neither a type nor a name, or an
            ``offload`` that is not a bool.

    This is what the FSDP config key ``fsdp_activation_checkpointing: true``
    builds (for the ``fsdp_transformer_layer_cls_to_wrap`` classes), with
    ``offload=True`` under ``fsdp_activation_checkpointing_offload: true``.

    >>> import fnaccel as fa
    >>> fa.checkpoint_activations("Block")
    checkpoint_activations(classes=('Block',))
    """
    bad = [c for c in classes if not isinstance(c, (str, type))]
    if bad:
        raise TypeError(f"checkpoint_activations: takes module classes or class names, got {bad[0]!r}")
    if not isinstance(offload, bool):
        raise TypeError(f"checkpoint_activations: offload must be True or False, got {offload!r}")

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        for block in _blocks(model, classes):
            if not isinstance(block.__dict__.get("forward"), CheckpointedForward):
                block.forward = CheckpointedForward(block.forward, offload)
        return model

    given = {"classes": tuple(map(_name, classes)) if classes else None, "offload": offload or None}
    opts = options(**{key: value for key, value in given.items() if value is not None})
    return Transform(
        name="checkpoint_activations",
        options=opts,
        phase=Phase.CHECKPOINT_ACTIVATIONS,
        prepare_model=prepare_model,
    )
