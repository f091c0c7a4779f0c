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
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fnaccel.config.parallelism import DATA_PARALLEL_DIMS, ParallelismConfig
from fnaccel.resources import GroupOwner
from fnaccel.state import RunState

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = [
    "DRY_RUN_ENV",
    "REPORT_ENV",
    "Held",
    "WorldBytes",
    "active",
    "figures",
    "finish",
    "start_fake_group",
    "world_bytes",
]

DRY_RUN_ENV = "FNACCEL_DRY_RUN"
REPORT_ENV = "FNACCEL_DRY_RUN_REPORT"


def active() -> bool:
    """Whether this process is a dry-run worker (``FNACCEL_DRY_RUN=1``).

    >>> active()
    False
    """
    return os.environ.get(DRY_RUN_ENV) == "1"


def start_fake_group(rank: int, num_processes: int) -> tuple[dist.ProcessGroup | None, GroupOwner]:
    """The default group of a dry-run worker: torch's fake backend, as rank ``rank`` of ``num_processes``."""
    dist.init_process_group("fake", rank=rank, world_size=num_processes)  # torch gives it its FakeStore
    return dist.group.WORLD, GroupOwner(dist.group.WORLD, is_default=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Held:
    """How one tensor lies over the world: what a rank's bytes are computed from.

    Attributes:
        shape: the tensor's full (global) shape.
        element_size: bytes per element.
        mesh_dims: the names of the dimensions of the mesh it lives on (a DTensor's
            ``device_mesh.mesh_dim_names``: the run's `MESH_DIMS`, or ``dp``, the
            data-parallel dimensions flattened); empty: whole on every rank.
        mesh_shape: that mesh's sizes.
        placements: its DTensor placements, one per mesh dimension.
    """

    shape: tuple[int, ...]
    element_size: int
    mesh_dims: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    placements: tuple[Placement, ...] = ()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Held:
        """A live tensor's record (a DTensor's global shape and placements)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(tensor, DTensor):
            return cls(shape=tuple(tensor.shape), element_size=tensor.element_size())
        names = tensor.device_mesh.mesh_dim_names
        assert names is not None, "fnaccel's meshes name their dimensions"
        return cls(
            shape=tuple(tensor.shape),
            element_size=tensor.element_size(),
            mesh_dims=tuple(names),
            mesh_shape=tuple(tensor.device_mesh.shape),
            placements=tuple(tensor.placements),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldBytes:
    """Bytes every rank of a world holds, computed once per class of alike ranks.

    Attributes:
        ranks: for each rank, its bytes of each kind (``{"parameters": ..., ...}``).
        num_classes: how many classes of alike ranks there were, each computed once.
    """

    ranks: tuple[dict[str, int], ...]
    num_classes: int


def _shard_sizes(length: int, num_chunks: int, split_factor: int | None) -> list[int]:
    """Each chunk's length when ``length`` is sharded over ``num_chunks`` ranks as DTensor
    does: ``torch.chunk``'s split, or, for a strided shard, that split of each of
    ``split_factor`` pieces, the pieces' chunks added up."""

    def chunk(n: int) -> list[int]:
        size = -(-n // num_chunks)
        return [max(0, min(size, n - c * size)) for c in range(num_chunks)]

    if split_factor is None:
        return chunk(length)
    piece = -(-length // split_factor)
    sizes = [0] * num_chunks
    for j in range(split_factor):
        for c, n in enumerate(chunk(max(0, min(piece * (j + 1), length) - min(piece * j, length)))):
            sizes[c] += n
    return sizes


class _Axes:
    """The independent coordinates ranks are classified by: the run's mesh dimensions larger
    than one, except that ``dp_replicate`` and ``dp_shard`` count as one (``dp``) when a
    tensor lives on the flattened data-parallel dimension (its shard depends on both)."""

    def __init__(self, layout: ParallelismConfig, names: set[str]) -> None:
        self.layout = layout
        sizes = {name: size for name, size in layout.sizes.items() if size > 1}
        self.merged = "dp" in names
        if self.merged:
            sizes = {"dp" if name in DATA_PARALLEL_DIMS else name: size for name, size in sizes.items()}
            sizes["dp"] = layout.data_parallel_size
        self.sizes = sizes

    def of_rank(self, rank: int) -> dict[str, int]:
        coords = self.layout.coordinates(rank)
        if self.merged:
            coords["dp"] = coords["dp_replicate"] * self.layout.sizes["dp_shard"] + coords["dp_shard"]
        return coords

    def locate(self, name: str) -> tuple[str, Callable[[int], int]]:
        """The axis a tensor's mesh dimension ``name`` reads, and its coordinate as a function of the axis'."""
        if name in self.sizes:
            return name, lambda c: c
        shard = self.layout.sizes["dp_shard"]
        return "dp", (lambda c: c // shard) if name == "dp_replicate" else (lambda c: c % shard)

    def tensor_coordinate(self, coords: Mapping[str, int], names: Sequence[str]) -> list[int]:
        """A rank's coordinate on a tensor's mesh, from the rank's ``coords`` (`of_rank`)."""
        shard = self.layout.sizes["dp_shard"]
        return [
            coords["dp_replicate"] * shard + coords["dp_shard"] if name == "dp" else coords[name]
            for name in names
        ]


def _classes(axes: _Axes, sharded: Sequence[Held]) -> dict[str, list[int]]:
    """For each axis, each coordinate's class: coordinates in one class give every tensor the
    same shard, whatever the other axes' coordinates (exact: a shard's length along one tensor
    dimension is computed mesh dimension after mesh dimension, so each step is classified for
    every length the steps before it can hand on)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    rows: dict[str, list[list[int]]] = {axis: [[] for _ in range(size)] for axis, size in axes.sizes.items()}
    done: set[tuple[str, int, int | None, int]] = set()
    for held in sharded:
        steps: dict[int, list[tuple[str, int, int | None]]] = {}
        for name, size, placement in zip(held.mesh_dims, held.mesh_shape, held.placements, strict=True):
            if isinstance(placement, (Shard, _StridedShard)):  # a strided shard is no Shard in torch 2.13
                split = int(placement.split_factor) if isinstance(placement, _StridedShard) else None
                steps.setdefault(placement.dim, []).append((name, size, split))
        for dim, chain in steps.items():
            lengths = {held.shape[dim]}
            for name, size, split in chain:
                handed: set[int] = set()
                for length in sorted(lengths):
                    sizes = _shard_sizes(length, size, split)
                    handed.update(sizes)
                    if (name, size, split, length) in done:
                        continue
                    done.add((name, size, split, length))
                    axis, coordinate = axes.locate(name)
                    for c, row in enumerate(rows[axis]):
                        row.append(sizes[coordinate(c)])
                lengths = handed
    classes = {}
    for axis, axis_rows in rows.items():
        ids: dict[tuple[int, ...], int] = {}
        classes[axis] = [ids.setdefault(tuple(row), len(ids)) for row in axis_rows]
    return classes


def world_bytes(kinds: Mapping[str, Sequence[Held]], layout: ParallelismConfig) -> WorldBytes:
    """Bytes each rank of ``layout``'s world holds of each kind of tensors.

    Ranks are grouped into classes of alike ranks first (the same shard of every
    tensor), in time linear in the ranks; each class's bytes are then computed
    once, at one of its ranks, with DTensor's own shard arithmetic.

    Args:
        kinds: the tensors of each kind (``parameters``, ``gradients``, ...).
        layout: the run's resolved layout.

    Returns:
        Every rank's bytes and the number of classes computed.

    >>> from fnaccel.config.parallelism import DATA_PARALLEL_DIMS, ParallelismConfig
    >>> layout = ParallelismConfig(tp_size=2).resolved(4)
    >>> world_bytes({"parameters": [Held(shape=(3,), element_size=4)]}, layout).ranks[3]
    {'parameters': 12}
    """
    from torch.distributed.tensor import _utils

    assert layout.dp_shard_size is not None, "resolve the layout first"
    every = [held for group in kinds.values() for held in group]
    sharded = [held for held in every if held.mesh_dims]
    axes = _Axes(layout, {name for held in sharded for name in held.mesh_dims})
    classes = _classes(axes, sharded)
    members: dict[tuple[int, ...], list[int]] = {}
    for rank in range(
        layout.data_parallel_size * layout.pp_size * layout.cp_size * layout.sp_size * layout.tp_size
    ):
        coords = axes.of_rank(rank)
        members.setdefault(tuple(classes[axis][coords[axis]] for axis in axes.sizes), []).append(rank)
    ranks: list[dict[str, int]] = [{}] * sum(map(len, members.values()))
    for alike in members.values():
        coords = axes.of_rank(alike[0])
        numels: dict[Held, int] = {}  # a transformer's layers repeat the same tensors
        for held in every:
            if held not in numels:
                shape = (
                    held.shape
                    if not held.mesh_dims
                    else _utils._compute_local_shape_and_global_offset(
                        held.shape,
                        held.mesh_shape,
                        axes.tensor_coordinate(coords, held.mesh_dims),
                        held.placements,
                        skip_offset=True,
                    )[0]
                )
                numels[held] = math.prod(shape)
        figures = {
            kind: sum(numels[held] * held.element_size for held in group) for kind, group in kinds.items()
        }
        for rank in alike:
            ranks[rank] = figures
    return WorldBytes(ranks=tuple(ranks), num_classes=len(members))


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
    """This rank's measured bytes, the tensors' layout, and on rank 0 every rank's computed bytes."""
    model, optimizer = state.model, state.optimizer
    assert model is not None and optimizer is not None
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    # optimizer state tensors take their parameter's sharding (FSDP2 builds them from the DTensor)
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    layout = state.dist.parallelism
    assert layout is not None, "fa.init resolves the layout of every run"
    report: dict[str, Any] = {
        "rank": state.dist.rank,
        "measured": {
            "parameters": sum(map(_held, params)),
            "gradients": sum(map(_held, trainable)),
            "optimizer": sum(map(_held, moments)),
        },
        "layout": [
            {
                "name": name,
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "placements": _placements(p),
            }
            for name, p in model.named_parameters()
        ],
        "parallelism": layout.sizes,
    }
    if state.dist.rank == 0:  # the launcher prints rank 0's table; the last rank's measurement checks it
        computed = world_bytes(
            {
                kind: [Held.of(t) for t in tensors]
                for kind, tensors in (
                    ("parameters", params),
                    ("gradients", trainable),
                    ("optimizer", moments),
                )
            },
            layout,
        )
        report.update(ranks=list(computed.ranks), num_classes=computed.num_classes)
    return report


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
