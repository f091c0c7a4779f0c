"""The ZeRO layout: a DeepSpeed engine's optimizer partitions, per rank, in safetensors.

A pipeline whose engine steps the optimizer itself (`Capability.OWNS_OPTIMIZER_STEP`,
`fa.deepspeed`) over fp32 master partitions is saved so.

DeepSpeed's own ``save_checkpoint`` pickles (``torch.save``). Here each rank
writes the part of the optimizer it holds, next to its other files::

    rank<r>.zero.safetensors   this rank's fp32 master partitions ("master/<i>") and
                               the base optimizer's state over them ("partition<i>/<key>")
    rank<r>.zero.json          the optimizer's class, param groups and other state

and rank 0 writes ``model.safetensors`` with the consolidated weights (ZeRO-3's
gathered from every rank), which `fa.save_model` and people read. A load puts
the masters and the optimizer state back, then sets the model's parameters
from the masters as a DeepSpeed step does, so the run continues bit for bit.
A ZeRO-0 run in fp32 steps the model's own parameters and is saved like a
`ddp()` run (`fnaccel.checkpoint.layouts.plain`). A save falls on an update boundary: between micro-steps the
partial gradients sit in DeepSpeed's buffers, which it does not expose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.checks import check_tensors
from fnaccel.checkpoint.codec import optimizer_payload, optimizer_state
from fnaccel.checkpoint.files import read_json, read_tensors, verify_file
from fnaccel.checkpoint.hooks import saved_weights
from fnaccel.checkpoint.tied import untie
from fnaccel.transforms.deepspeed import (
    deepspeed_engine,
    gathered_parameters,
    master_partitions,
    optimizer_over_partitions,
    refresh_parameters,
)
from fnaccel.transforms.parallel import unwrap_compiled, unwrap_model

__all__ = ["ZeroLayout", "ZeroRead", "load_zero", "read_zero", "snapshot_zero", "zero_engine"]


def zero_engine(model: Any) -> Any:
    """The DeepSpeed engine of a run whose optimizer steps master partitions, or None."""
    engine = None if model is None else deepspeed_engine(unwrap_compiled(model))
    return engine if engine is not None and master_partitions(engine) is not None else None


def _names(masters: list[torch.Tensor]) -> dict[int, str]:
    return {id(m): f"partition{i}" for i, m in enumerate(masters)}


def snapshot_zero(state: Any, engine: Any) -> tuple[str, dict[str, torch.Tensor], str, dict[str, Any]]:
    """``(tensor file, tensors, json file, json)`` of this rank's ZeRO files."""
    if state.plan is not None and state.micro_step % state.plan.micro_steps != 0:
        raise CheckpointError(
            f"fa.save: micro-step {state.micro_step} falls inside an accumulation of "
            f"{state.plan.micro_steps}, and DeepSpeed keeps the partial gradients in buffers of its own; "
            "save after the update (when state.micro_step is a multiple of the accumulation)"
        )
    masters = master_partitions(engine)
    assert masters is not None, "zero_engine chose this engine"
    with optimizer_over_partitions(engine) as base:
        tensors, saved = optimizer_payload(base, _names(masters))
    tensors.update({f"master/{i}": m.detach() for i, m in enumerate(masters)})
    rank = state.dist.rank
    return f"rank{rank}.zero.safetensors", tensors, f"rank{rank}.zero.json", saved


def read_zero(state: Any, engine: Any, directory: Path, manifest: dict[str, Any]) -> tuple[Any, Any]:
    """This rank's ZeRO files, checked against the live engine: ``(masters, optimizer state_dict)``."""
    rank = state.dist.rank
    name = f"rank{rank}.zero.safetensors"
    tensors = read_tensors(directory, name, manifest)
    saved = read_json(directory, f"rank{rank}.zero.json", manifest)
    live = master_partitions(engine)
    assert live is not None, "zero_engine chose this engine"
    masters = {key: t for key, t in tensors.items() if key.startswith("master/")}
    check_tensors(
        masters,
        {f"master/{i}": m for i, m in enumerate(live)},
        str(directory / name),
        "this rank's master partitions (same model, stage and world size?)",
    )
    rest = {key: t for key, t in tensors.items() if not key.startswith("master/")}
    names = _names(live)
    with optimizer_over_partitions(engine) as base:
        state_dict = optimizer_state(
            base, {names[id(m)]: m for m in live}, rest, saved, str(directory / f"rank{rank}.zero.json")
        )
    return [masters[f"master/{i}"] for i in range(len(live))], state_dict


def load_zero(engine: Any, masters: list[torch.Tensor], state_dict: Any) -> None:
    """Restore what `read_zero` read, then the model's parameters from the masters."""
    live = master_partitions(engine)
    assert live is not None and len(live) == len(masters)
    with torch.no_grad():
        for now, saved in zip(live, masters, strict=False):
            now.copy_(saved)
    with optimizer_over_partitions(engine) as base:
        base.load_state_dict(state_dict)
    refresh_parameters(engine)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroRead:
    """What `ZeroLayout.read` checked, for `ZeroLayout.restore`."""

    engine: Any
    masters: list[torch.Tensor]
    optimizer: Any


class ZeroLayout:
    """Each rank's master partitions and optimizer state in ``rank<r>.zero.*``, the
    consolidated weights in ``model.safetensors`` (`fnaccel.protocols.CheckpointLayout`)."""

    def snapshot(self, state: Any, files: Any) -> None:
        tensor_file, tensors, json_file, values = snapshot_zero(state, zero_engine(state.model))
        files.add_tensors(tensor_file, tensors)
        files.add_json(json_file, values)
        module = unwrap_model(state.model)
        with gathered_parameters(module):  # ZeRO-3: a collective, every rank takes part
            weights, files.tied = untie(saved_weights(state, module))
            if files.writer:  # ZeRO-3's gathered data goes when the block ends: copied now
                files.add_tensors("model.safetensors", weights, transient=True)

    def write(self, captured: None, ctx: Any, directory: Path) -> dict[str, Any]:
        return {}  # every file is in the snapshot's own

    def read(
        self, state: Any, directory: Path, manifest: dict[str, Any], gradients: Mapping[str, torch.Tensor]
    ) -> ZeroRead:
        if gradients:
            raise CheckpointError(
                f"{directory}: holds gradients saved between accumulation micro-steps; a "
                "DeepSpeed ZeRO run keeps them in buffers of its own and cannot take them"
            )
        engine = zero_engine(state.model)
        verify_file(
            directory, "model.safetensors", manifest
        )  # the masters hold the weights: checked, not used
        masters, optimizer = read_zero(state, engine, directory, manifest)
        return ZeroRead(engine=engine, masters=masters, optimizer=optimizer)

    def restore(self, state: Any, read: ZeroRead) -> None:
        load_zero(read.engine, read.masters, read.optimizer)
