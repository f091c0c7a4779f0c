"""Whether what a save would write is finite: `fa.save` refuses NaN or inf.

A checkpoint with non-finite parameters is worse than none: `fa.latest_checkpoint`
would hand it to the restarted run, and rotation deletes the finite ones before
it. So `fa.save` asks `first_nonfinite` on every rank (each rank checks the
tensors it holds: its shards under `fsdp` or `tp`), and the ranks' answers
travel in the exchange every save already makes before anyone writes.

The check is kept off the save's critical path: the tensors are grouped by
device and dtype, each group gets one fused reduction (``torch._foreach_norm``: a
multi-tensor kernel on CUDA, about 2 ms per 50 MB on one CPU core), and the
groups' verdicts are read with one host sync each, never one per tensor. A NaN
or inf makes the norm NaN or inf; so may a sum of squares that overflows
(|x| above about 1e19 in float32), so a group found non-finite is checked again
element by element, which also names the first bad tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from fnaccel.checkpoint.storage.parts import unwrap_model

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["first_nonfinite", "saved_tensors"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it was loaded
    kind: Any = getattr(dtensor, "DTensor", ())
    return cast(torch.Tensor, tensor.to_local()) if isinstance(tensor, kind) else tensor


def saved_tensors(state: RunState) -> Iterator[tuple[str, torch.Tensor]]:
    """``(what, tensor)`` for each tensor of ``state`` that the updates compute and a save
    writes, as this rank holds it: the parameters and the optimizer's state (its moments).
    Not the gradients a save between accumulation micro-steps writes: a NaN there is
    `fa.skip_nonfinite`'s to skip after the resume, as it would have been without one."""
    if state.model is None:
        return
    module = unwrap_model(state.model)
    named = list(module.named_parameters())
    for name, param in named:
        yield f"parameter {name!r}", _local(param.detach())
    optimizer = state.optimizer
    if optimizer is None:
        return
    names = {id(param): name for name, param in named}
    for index, (moved, per_param) in enumerate(optimizer.state.items()):
        owner = names.get(id(moved), f"#{index}")
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {key!r} of {owner!r}", _local(value)


def first_nonfinite(state: RunState) -> str | None:
    """The first tensor of `saved_tensors` that holds a NaN or inf (named), or None.

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> state = fa.prepare(fa.init(cpu=True), model)
    >>> first_nonfinite(state) is None
    True
    >>> with torch.no_grad():
    ...     model.bias.fill_(float("nan"))
    Parameter containing:
    tensor([nan], requires_grad=True)
    >>> first_nonfinite(state)
    "parameter 'bias'"
    """
    found = [(what, t) for what, t in saved_tensors(state) if t.is_floating_point() and t.numel()]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, tensor in found:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        if all(
            bool(torch.stack(torch._foreach_norm(group, 2)).isfinite().all()) for group in groups.values()
        ):
            return None
        # rare: something is NaN or inf, or a norm overflowed; the exact check names it
        return next((what for what, tensor in found if not bool(torch.isfinite(tensor).all())), None)
