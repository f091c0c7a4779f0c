"""The worker side of ``fnaccel launch --dry_run``: one simulated rank of a large world.

A dry-run worker is the user's script started by the launcher with
``FNACCEL_DRY_RUN=1`` and the launch variables of the rank it plays (``RANK``,
``WORLD_SIZE``, ...). In it `fa.init` forms torch's fake process group (backend
``"fake"``: every collective returns at once and moves no data) instead of gloo or
nccl, on the CPU, so the mesh, the tp plan and FSDP2's sharding are built by the same
code as in the real run and refuse what it would refuse, with the same exception.

The first `fa.prepare` that holds a model and an optimizer ends the worker: it takes
one `fa.step` on the loader's first batch (when the state holds a loader), measures
this rank's parameter, gradient and optimizer bytes, computes them for every rank of
the world from the tensors' global shapes and placements (DTensor's own shard
arithmetic), writes them as JSON under ``FNACCEL_DRY_RUN_REPORT`` and exits with
status 0. The script's code after that `fa.prepare` does not run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fnaccel.config.parallelism import ParallelismConfig
from fnaccel.resources import GroupOwner
from fnaccel.state import RunState

__all__ = ["DRY_RUN_ENV", "REPORT_ENV", "active", "finish", "start_fake_group"]

DRY_RUN_ENV = "FNACCEL_DRY_RUN"
REPORT_ENV = "FNACCEL_DRY_RUN_REPORT"


def active() -> bool:
    """Whether this process is a dry-run worker (``FNACCEL_DRY_RUN=1``).

    >>> active()
    False
    """
    return os.environ.get(DRY_RUN_ENV) == "1"


def start_fake_group(rank: int, num_processes: int) -> tuple[Any, GroupOwner]:
    """The default group of a dry-run worker: torch's fake backend, as rank ``rank`` of ``num_processes``."""
    dist.init_process_group("fake", rank=rank, world_size=num_processes)  # torch gives it its FakeStore
    return dist.group.WORLD, GroupOwner(dist.group.WORLD, is_default=True)


def _coordinate(layout: ParallelismConfig, rank: int, dims: tuple[str, ...]) -> list[int]:
    """``rank``'s coordinate on a mesh of the dimensions ``dims`` (the run's mesh, a
    sub-mesh of it, or ``dp``: the data-parallel dimensions flattened)."""
    coords = layout.coordinates(rank)
    coords["dp"] = coords["dp_replicate"] * layout.sizes["dp_shard"] + coords["dp_shard"]
    return [coords[name] for name in dims]


def _bytes(tensors: Sequence[torch.Tensor], layout: ParallelismConfig, world: int) -> list[int]:
    """Bytes each rank of the world holds of ``tensors``: all of a plain tensor, a
    DTensor's shard at the rank's coordinate (a tensor on a sub-mesh lives on each
    rank's own copy of it)."""
    from torch.distributed.tensor import DTensor, _utils

    totals = [0] * world
    numels: dict[tuple[Any, ...], int] = {}  # a transformer's layers repeat the same shapes
    for t in tensors:
        if not isinstance(t, DTensor):
            totals = [total + t.numel() * t.element_size() for total in totals]
            continue
        dims, mesh_shape = t.device_mesh.mesh_dim_names or (), tuple(t.device_mesh.shape)
        full, placements, size = tuple(t.shape), tuple(t.placements), t.element_size()
        for rank in range(world):
            coordinate = _coordinate(layout, rank, dims)
            key = (full, mesh_shape, placements, tuple(coordinate))
            if key not in numels:
                shape, _ = _utils._compute_local_shape_and_global_offset(full, mesh_shape, coordinate, placements)
                numels[key] = torch.Size(shape).numel()
            totals[rank] += numels[key] * size
    return totals


def _held(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "to_local", None)
    held = local() if local is not None else tensor
    return held.numel() * held.element_size()


def _placements(tensor: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return "whole on every rank"
    names = tensor.device_mesh.mesh_dim_names or tuple(str(i) for i in range(tensor.device_mesh.ndim))
    return " ".join(f"{name}:{placement}" for name, placement in zip(names, tensor.placements, strict=True))


def figures(state: RunState) -> dict[str, Any]:
    """This rank's measured bytes and every rank's computed bytes, the tensors' layout."""
    model, optimizer = state.model, state.optimizer
    assert model is not None and optimizer is not None
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    # optimizer state tensors take their parameter's sharding (FSDP2 builds them from the DTensor)
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    world, layout = state.dist.num_processes, state.dist.parallelism
    assert layout is not None, "fa.init resolves the layout of every run"
    return {
        "rank": state.dist.rank,
        "measured": {"parameters": sum(map(_held, params)), "gradients": sum(map(_held, trainable)),
                     "optimizer": sum(map(_held, moments))},
        "ranks": [dict(zip(("parameters", "gradients", "optimizer"), figures, strict=True)) for figures in zip(
            _bytes(params, layout, world), _bytes(trainable, layout, world), _bytes(moments, layout, world),
            strict=True)],
        "layout": [{"name": name, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                    "placements": _placements(p)} for name, p in model.named_parameters()],
        "parallelism": layout.sizes,
    }


def finish(state: RunState) -> None:
    """End a dry-run worker after its `fa.prepare`: one step, the figures, exit 0."""
    from fnaccel.train import step

    stepped = "no loader in the state: no step taken, optimizer state not created"
    if state.loader is not None:
        state, _ = step(state, next(iter(state.loader)))
        stepped = "one fa.step taken on the loader's first batch"
    report = {**figures(state), "step": stepped}
    Path(os.environ[REPORT_ENV], f"rank{report['rank']}.json").write_text(json.dumps(report))
    raise SystemExit(0)
