"""Gradient accumulation: `accumulate(num_steps)`.

The optimizer steps once every ``num_steps`` batches. On non-boundary
micro-steps gradient communication is off (DDP's and FSDP2's sync switches),
unless ``sync_each_batch=True`` (which trades communication for memory).

Loss normalisation is explicit:

``normalize="mean"`` (default)
    each micro-batch's loss is divided by ``num_steps`` before backward, so
    the gradient is the mean over the micro-batches: ``accumulate(k)`` with
    batch ``b`` equals one batch of ``k * b`` for a loss that averages over its
    batch.
``normalize="items"``
    for losses over a varying number of items (tokens): ``loss_fn`` returns
    the *sum* of the per-item losses and ``{"num_items": n}`` as its aux. At
    the boundary the item counts of all micro-steps and all ranks are summed
    (one all-reduce of a scalar, no host sync) and the gradients are scaled so
    that the update is the mean over every item of the global batch, however
    the items fall across micro-steps and ranks. `fa.step`'s metrics then
    describe the window so far on this rank, as a token-normalised hand loop
    prints it: ``loss`` is its loss per item (``loss_sum / num_items``; at the
    boundary, the whole window's), ``loss_sum`` the summed loss and
    ``num_items`` the items (float64, as counted; device tensors: no host sync). Sum ``loss_sum``
    and ``num_items`` over the ranks (`fa.ops.reduce`) for the global mean.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from fnaccel.checks import is_int, is_number
from fnaccel.dist import DistContext, data_parallel_context
from fnaccel.transforms.declared import Accumulation
from fnaccel.transforms.kinds import StepTransform, options
from fnaccel.transforms.phases import Phase

__all__ = ["ItemCount", "accumulate"]


class ItemCount:
    """``normalize="items"``'s state: the items counted, and the summed loss, since the
    last update (this rank's; float64 on the device)."""

    __slots__ = ("ctx", "loss_sum", "total")

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = data_parallel_context(ctx)  # a tp/pp group's ranks count the same items once
        self.total: torch.Tensor | None = None
        self.loss_sum: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, aux: object) -> dict[str, torch.Tensor]:
        """Count a micro-step's items and loss; the window's metrics so far."""
        count = aux.get("num_items") if isinstance(aux, dict) else None
        if count is None:
            raise ValueError(
                "accumulate(normalize='items'): loss_fn must return (loss_sum, "
                "{'num_items': n}) with the number of items the summed loss covers"
            )
        count = torch.as_tensor(count, dtype=torch.float64, device=self.ctx.device)
        summed = loss.detach().to(torch.float64)
        self.total = count if self.total is None else self.total + count
        self.loss_sum = summed if self.loss_sum is None else self.loss_sum + summed
        # new tensors: the boundary all-reduces self.total in place
        return {
            "loss": (self.loss_sum / self.total).to(loss.dtype),
            "loss_sum": self.loss_sum.to(loss.dtype),
            "num_items": self.total.clone(),
        }

    def state_dict(self) -> dict[str, float | None]:
        """For checkpoints saved between micro-steps (reads the counts on the host)."""
        return {
            "total": None if self.total is None else float(self.total),
            "loss_sum": None if self.loss_sum is None else float(self.loss_sum),
        }

    def load_state_dict(self, saved: dict[str, float | None]) -> None:
        for key in ("total", "loss_sum"):  # a checkpoint's JSON: checked before use
            value = saved[key]
            if value is not None and (not is_number(value) or not math.isfinite(value)):
                raise ValueError(
                    f"accumulate(normalize='items'): the saved {key} must be a finite number "
                    f"or null, got {value!r}"[:300]
                )
        self.total, self.loss_sum = (
            None
            if saved[key] is None
            else torch.tensor(saved[key], dtype=torch.float64, device=self.ctx.device)
            for key in ("total", "loss_sum")
        )

    def scale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.total is not None, "an update boundary without a counted micro-step"
        total, self.total, self.loss_sum = self.total, None, None
        if self.ctx.num_processes > 1:
            dist.all_reduce(total, group=self.ctx.process_group)
        # DDP and FSDP2 average gradients over the ranks: undo that, then divide by all items
        scale = self.ctx.num_processes / total
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        if any(hasattr(g, "full_tensor") for g in grads):  # FSDP2's DTensors take a float
            for grad in grads:
                grad.mul_(scale.item())
        else:
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))


def accumulate(
    num_steps: int, sync_each_batch: bool = False, normalize: Literal["mean", "items"] = "mean"
) -> StepTransform:
    """Step the optimizer once every ``num_steps`` batches (see the module docstring).

    >>> import fnaccel as fa
    >>> fa.accumulate(4)
    accumulate(num_steps=4)
    """
    if not is_int(num_steps) or num_steps < 1:
        raise ValueError(
            f"accumulate: num_steps must be a positive int, got {num_steps!r}; "
            "accumulate(1) steps every batch"
        )
    if normalize not in ("mean", "items"):
        raise ValueError(f"accumulate: normalize must be 'mean' or 'items', got {normalize!r}")
    opts = (
        options(num_steps=num_steps)
        + (options(sync_each_batch=True) if sync_each_batch else ())
        + (options(normalize=normalize) if normalize != "mean" else ())
    )
    if normalize == "mean":
        return StepTransform(
            name="accumulate",
            options=opts,
            phase=Phase.ACCUMULATE,
            settings=Accumulation(micro_steps=num_steps, sync_each_batch=sync_each_batch),
        )

    def count(loss: torch.Tensor, aux: object, state: ItemCount) -> dict[str, torch.Tensor]:
        return state.add(loss, aux)

    def before_update(
        model: nn.Module, optimizer: torch.optim.Optimizer, state: ItemCount
    ) -> dict[str, torch.Tensor]:
        state.scale_gradients(optimizer)
        return {}

    return StepTransform(
        name="accumulate",
        options=opts,
        phase=Phase.ACCUMULATE,
        settings=Accumulation(micro_steps=num_steps, sync_each_batch=sync_each_batch, sums_items=True),
        init=ItemCount,
        after_backward=count,
        before_update=before_update,
    )
