"""`DistContext`: where this process stands in the run, and on its device mesh.

Collectives and process helpers take a context first; `as_dist` lets them
accept either a `RunState` or its `dist` field.

The run's layout (`fnaccel.config.parallelism.ParallelismConfig`) and its named
`DeviceMesh` live here too; every other module asks through the accessors
`data_parallel` (this rank's data-parallel rank and size: what the data path
shards by), `mesh_dim` (a named dimension's sub-mesh, e.g. ``"tp"``, ``"pp"``,
``"dp"``) and `data_parallel_context` (a context whose ranks are the
data-parallel ones, for gathering metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fnaccel.constants import DistributedType

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from fnaccel.config.parallelism import ParallelismConfig

__all__ = [
    "DistContext",
    "DistLike",
    "HasDist",
    "as_dist",
    "data_parallel",
    "data_parallel_context",
    "mesh_dim",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DistContext:
    """Where this process stands in the run: ranks, device, backend, process group.

    Attributes:
        num_processes: processes in the run, over all machines (world size).
        rank: this process's global rank.
        local_rank: its rank on this machine.
        num_local_processes: processes on this machine.
        node_rank: this machine's rank.
        num_nodes: machines in the run.
        device: the device this process computes on.
        backend: the `torch.distributed` backend, or None in a world of one.
        distributed_type: Accelerate's name for the kind of run.
        debug: ``FNACCEL_DEBUG_MODE``: the launcher shows full tracebacks (collectives check
            every rank's tree in every mode).
        parallelism: the run's layout, its sizes resolved against the world
            (None: every rank is a data-parallel rank).
    """

    num_processes: int = 1
    rank: int = 0
    local_rank: int = 0
    num_local_processes: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    distributed_type: DistributedType = DistributedType.NO
    debug: bool = False
    parallelism: ParallelismConfig | None = None
    _owner: Any = field(default=None, repr=False, compare=False)

    @property
    def process_group(self) -> ProcessGroup | None:
        """The group collectives use; None in a world of one or after `fa.shutdown`."""
        return None if self._owner is None else self._owner.group

    @property
    def mesh(self) -> DeviceMesh | None:
        """The run's named `DeviceMesh` over its dimensions of size > 1 (outermost
        first: pp, dp_replicate, dp_shard, cp, tp); None in a world of one, without a
        `ParallelismConfig`, or after `fa.shutdown`."""
        return None if self._owner is None else self._owner.mesh("mesh")

    @property
    def group_owner(self) -> Any:
        """The `GroupOwner` of the group (None in a world of one): where collectives
        keep the group's record of its last agreed call."""
        return self._owner

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on rank 0 of each machine."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.rank == self.num_processes - 1


class HasDist(Protocol):
    """What carries a run's `DistContext`: a `RunState` (named here by what is read of it)."""

    @property
    def dist(self) -> DistContext: ...


#: What the collectives, `progress` and the like take first: a `RunState` or its `DistContext`.
DistLike = DistContext | HasDist


def as_dist(ctx: object) -> DistContext:
    """The `DistContext` of ``ctx``: a `RunState` or a `DistContext` itself (anything
    else is refused at run time, for callers without a type checker)."""
    if isinstance(ctx, DistContext):
        return ctx
    dist = getattr(ctx, "dist", None)
    if isinstance(dist, DistContext):
        return dist
    raise TypeError(
        f"expected a RunState or a DistContext as the first argument, got {type(ctx).__name__}; "
        "pass the state from fa.init (or state.dist)"
    )


def data_parallel(dist: DistContext) -> tuple[int, int]:
    """``(rank, size)`` of this process among the data-parallel ranks: the ranks that
    read different batches. Ranks of one tensor-, context- or pipeline-parallel group
    share a data-parallel rank (they read the same batch).

    >>> data_parallel(DistContext(num_processes=4, rank=3))
    (3, 4)
    """
    config = dist.parallelism
    if config is None:
        return dist.rank, dist.num_processes
    where = config.coordinates(dist.rank)
    return where["dp_replicate"] * config.sizes["dp_shard"] + where["dp_shard"], config.data_parallel_size


def mesh_dim(dist: DistContext, name: str) -> DeviceMesh | None:
    """The 1-D sub-mesh of the mesh dimension ``name`` that holds this rank.

    ``name`` is one of ``"pp"``, ``"dp_replicate"``, ``"dp_shard"``, ``"cp"``,
    ``"sp"``, ``"tp"``, or ``"dp"`` (the data-parallel ranks as one dimension); its
    process group is ``mesh_dim(dist, name).get_group()``. None when that
    dimension has size 1 (or the run has no mesh).

    >>> mesh_dim(DistContext(), "tp") is None
    True
    """
    from fnaccel.config.parallelism import MESH_DIMS

    if name not in (*MESH_DIMS, "dp"):
        raise ValueError(f"mesh_dim: unknown dimension {name!r}; use one of {', '.join((*MESH_DIMS, 'dp'))}")
    return None if dist._owner is None else dist._owner.mesh(name)


class _DataParallelGroup:
    """The data-parallel sub-mesh's group, read through the run's owner (never held).
    ``agreed`` (the collectives' record of the last call all ranks agreed on) starts
    empty for each view, so a call over it always checks in full."""

    __slots__ = ("_owner", "agreed")

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self.agreed: Any = None

    @property
    def group(self) -> Any:
        mesh = self._owner.mesh("dp")
        return None if mesh is None else mesh.get_group()

    def mesh(self, name: str) -> Any:
        return None

    @property
    def calls(self) -> Any:
        """The process's record of its current fnaccel call (`fnaccel.calls`), whatever the group."""
        return self._owner.calls


def data_parallel_context(dist: DistContext) -> DistContext:
    """``dist`` seen by the data-parallel ranks only: `data_parallel`'s rank and size,
    the data-parallel group. Gathering metrics over it counts each batch once even
    when tensor-parallel ranks computed it together. ``dist`` itself when every rank
    is a data-parallel rank.

    >>> ctx = DistContext(num_processes=2, rank=1)
    >>> data_parallel_context(ctx) is ctx
    True
    """
    rank, size = data_parallel(dist)
    if size == dist.num_processes:
        return dist
    owner = None if size == 1 or dist._owner is None else _DataParallelGroup(dist._owner)
    return replace(dist, num_processes=size, rank=rank, parallelism=None, _owner=owner)
