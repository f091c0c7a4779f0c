"""The plain layout: a replicated run's whole model and optimizer, written once.

A run on one process, under `ddp()` or any other replicated data parallelism
(every rank holds the same weights), or a DeepSpeed engine that steps the
model's own parameters (ZeRO-0 in fp32), is saved so::

    model.safetensors       the weights as the run's save hooks give them, tied tensors once (rank 0)
    optimizer.safetensors   optimizer state keyed "<param>/<key>"                          (rank 0)
    optimizer.json          its class, param groups, other state                            (rank 0)
    rank<r>.safetensors     also "grad/<param>": this rank's gradients, when the save falls
                            between accumulation micro-steps

It loads on any number of processes: into a replicated run here, or into a
sharded one (`fnaccel.checkpoint.storage.sharded`), which reads the same
whole tensors through `read_model` and `read_optimizer` and keeps its chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fnaccel.checkpoint.storage.files import untie
from fnaccel.checkpoint.storage.layout import CheckpointFiles, CheckpointLayout
from fnaccel.checkpoint.storage.parts import (
    check_tensors,
    optimizer_payload,
    read_model,
    read_optimizer,
    saved_weights,
    source_rank,
    unwrap_model,
)
from fnaccel.checkpoint.storage.sharded import ShardedLayout
from fnaccel.checkpoint.storage.shardindex import is_stored_sharded

if TYPE_CHECKING:
    from fnaccel.dist import DistContext
    from fnaccel.state import RunState

__all__ = ["PlainLayout", "layout_for"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlainRead:
    """What `PlainLayout.read` checked, for `PlainLayout.restore`."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    gradients: Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlainLayout:
    """The whole model and optimizer in ``model.safetensors`` and ``optimizer.*``
    (`CheckpointLayout`): a run whose parallelism declares no layout of its own."""

    def holds(self, state: RunState) -> bool:
        return True

    def snapshot(self, state: RunState, files: CheckpointFiles) -> None:
        if state.model is None:
            return
        module = unwrap_model(state.model)
        if state.plan is not None and state.micro_step % state.plan.micro_steps != 0:  # mid-accumulation
            files.add_tensors(
                f"rank{files.rank}.safetensors",
                {f"grad/{name}": p.grad for name, p in module.named_parameters() if p.grad is not None},
            )
        if files.writer:
            weights, files.tied = untie(saved_weights(state, module))
            files.add_tensors("model.safetensors", weights)
            if state.optimizer is not None:
                names = {id(p): n for n, p in module.named_parameters()}
                tensors, values = optimizer_payload(state.optimizer, names)
                files.add_tensors("optimizer.safetensors", tensors)
                files.add_json("optimizer.json", values)

    def write(self, captured: None, ctx: DistContext, directory: Path) -> dict[str, Any]:
        return {}  # every file is in the snapshot's own

    def read(
        self,
        state: RunState,
        directory: Path,
        manifest: dict[str, Any],
        gradients: Mapping[str, torch.Tensor],
    ) -> PlainRead | None:
        module = None if state.model is None else unwrap_model(state.model)
        read = (
            None
            if module is None
            else PlainRead(
                weights=read_model(state, module, directory, manifest),
                optimizer=read_optimizer(state, module, directory, manifest),
                gradients=gradients,
            )
        )
        params = {} if module is None else dict(module.named_parameters())
        check_tensors(
            gradients,
            {name: params[name] for name in gradients if name in params},
            str(directory / f"rank{source_rank(manifest, state.dist)}.safetensors"),
            "the model's parameters",
        )
        return read

    def restore(self, state: RunState, read: PlainRead | None) -> None:
        if read is None:
            return
        module = unwrap_model(state.model)
        module.load_state_dict(read.weights, strict=True)
        if read.optimizer is not None:
            assert state.optimizer is not None, "read_optimizer reads none without an optimizer"
            state.optimizer.load_state_dict(read.optimizer)
        for name, p in module.named_parameters():
            grad = read.gradients.get(name)
            p.grad = None if grad is None else grad.to(p.device, p.dtype)


def layout_for(state: RunState, manifest: dict[str, Any] | None = None) -> CheckpointLayout:
    """The layout that stores ``state``'s model and optimizer: the first one its pipeline's
    transforms declare that holds the run (`CheckpointLayout.holds`), else the plain one.
    The model is never asked. A load passes the checkpoint's ``manifest``: a sharded
    checkpoint goes into a run stored plainly through the sharded layout (DCP reads
    whole tensors).

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(1, 1)
    >>> type(layout_for(fa.prepare(fa.init(cpu=True), model, pipeline=fa.accumulate(2)))).__name__
    'PlainLayout'
    """
    declared = () if state.pipeline is None else state.pipeline.layouts
    for layout in declared:
        if not isinstance(layout, CheckpointLayout):
            raise TypeError(
                f"fa.save/fa.load: a transform's layout must implement CheckpointLayout (holds, snapshot, "
                f"write, read, restore), got {type(layout).__name__}"
            )
        if layout.holds(state):
            return layout
    if manifest is not None and state.model is not None and is_stored_sharded(manifest):
        return ShardedLayout()
    return PlainLayout()
