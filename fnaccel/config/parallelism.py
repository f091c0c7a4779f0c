"""`ParallelismConfig`: how the ranks are laid out on a named `DeviceMesh`.

Accelerate's ``ParallelismConfig`` fields (``dp_replicate_size``,
``dp_shard_size``, ``tp_size``, ``cp_size``, ``sp_size``) plus ``pp_size`` in
the same style. `fa.init(parallelism=...)`, the launch config's ``parallelism_config``
section (Accelerate's ``parallelism_config_*`` keys) and the
``--parallelism_config_*`` flags of ``fnaccel launch`` all end here.

The mesh's dimensions, outermost first, are `MESH_DIMS`: ``pp``,
``dp_replicate``, ``dp_shard``, ``cp``, ``sp``, ``tp``. A dimension of size 1 is left
out of the mesh (it would be a group of one), so the mesh of a plain
data-parallel run is 1-D. Rank ``r``'s coordinates are ``r`` unravelled over
the sizes in that order (tensor-parallel ranks are neighbours).

A leaf module: it imports nothing from fnaccel but the errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fnaccel._errors import ConfigError
from fnaccel.checks import is_int

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DATA_PARALLEL_DIMS", "MESH_DIMS", "ParallelismConfig", "TRANSFORM_FOR_DIM", "build_mesh"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
# The dimensions whose ranks read different data; fa.prepare asks for a transform that averages
# gradients over them. Every other dimension splits the model and needs a transform that consumes
# it (`Transform.mesh_dims`), or each of its ranks would silently train the whole model.
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
# What fa.prepare tells a user to add for a model-splitting dimension larger than one that no
# transform of the pipeline consumes; a dimension missing here gets a generic sentence.
TRANSFORM_FOR_DIM = MappingProxyType(
    {
        "pp": "fa.pp(loss_fn=lambda output, target: ..., num_microbatches=...)",
        "cp": "a context-parallel transform (none is built yet)",
        "sp": "fa.sp() (Ulysses sequence parallel over the sp dimension)",
        "tp": "fa.tp({'module.name': ColwiseParallel(), ...})",
    }
)
_KEY_PREFIX = "parallelism_config_"
_CP_STRATEGIES = ("allgather", "alltoall")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelismConfig:
    """The sizes of the run's mesh dimensions (Accelerate's ``ParallelismConfig``).

    Attributes:
        dp_replicate_size: data-parallel replicas (HSDP's replicate dimension).
        dp_shard_size: ranks a replica's parameters are sharded over (FSDP);
            None: whatever the world leaves once the other sizes are set.
        tp_size: tensor-parallel degree (`fa.tp`).
        cp_size: context-parallel degree (accepted; refused by `fa.init`,
            see docs/parallelism.md).
        sp_size: Ulysses sequence-parallel degree (`fa.sp`): the ranks of one
            sp group read one batch and split its sequence.
        pp_size: pipeline stages (`fa.pp`).
        cp_comm_strategy: Accelerate's context-parallel rotation, ``allgather``
            or ``alltoall`` (kept for a config's round trip).

    >>> ParallelismConfig(dp_replicate_size=2, tp_size=2).resolved(8)  # doctest: +NORMALIZE_WHITESPACE
    ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=1, sp_size=1, pp_size=1,
                      cp_comm_strategy='allgather')
    """

    dp_replicate_size: int = 1
    dp_shard_size: int | None = None
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1
    pp_size: int = 1
    cp_comm_strategy: str = "allgather"

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "pp_size"):
            value = getattr(self, name)
            if value is None and name == "dp_shard_size":
                continue
            if not is_int(value) or value < 1:
                raise ValueError(f"ParallelismConfig: {name} must be a positive int, got {value!r}")
        if self.cp_comm_strategy not in _CP_STRATEGIES:
            raise ValueError(
                f"ParallelismConfig: cp_comm_strategy must be one of "
                f"{', '.join(_CP_STRATEGIES)}, got {self.cp_comm_strategy!r}"
            )

    @classmethod
    def from_config(
        cls, section: Mapping[str, object], source: str = "parallelism_config"
    ) -> ParallelismConfig:
        """Read a config file's ``parallelism_config`` section (Accelerate's keys,
        ``parallelism_config_dp_replicate_size`` and so on; ``sp_size`` and ``pp_size`` too).

        >>> ParallelismConfig.from_config({"parallelism_config_dp_replicate_size": 2,
        ...                                "parallelism_config_dp_shard_size": 2}).dp_replicate_size
        2
        """
        values: dict[str, Any] = {}
        known = [
            f"{_KEY_PREFIX}{name}"
            for name in (
                "dp_replicate_size",
                "dp_shard_size",
                "tp_size",
                "cp_size",
                "sp_size",
                "pp_size",
                "cp_comm_strategy",
            )
        ]
        for key, raw in section.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key '{key}'; known keys are {', '.join(known)}")
            name = key.removeprefix(_KEY_PREFIX)
            if name == "cp_comm_strategy" or is_int(raw):
                values[name] = raw
            elif isinstance(raw, str) and raw.strip().isdigit():
                values[name] = int(raw)
            else:
                raise ConfigError(f"{source}: key '{key}' must be a positive integer, got {raw!r}")
        try:
            return cls(**values)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_config(self) -> dict[str, object]:
        """The config file's ``parallelism_config`` section (`from_config`'s inverse)."""
        return {
            f"{_KEY_PREFIX}{name}": getattr(self, name)
            for name in (
                "dp_replicate_size",
                "dp_shard_size",
                "tp_size",
                "cp_size",
                "sp_size",
                "pp_size",
                "cp_comm_strategy",
            )
            if getattr(self, name) is not None
        }

    @property
    def sizes(self) -> dict[str, int]:
        """Each of `MESH_DIMS` and its size (``dp_shard_size`` None counts as 1)."""
        return {
            "pp": self.pp_size,
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size or 1,
            "cp": self.cp_size,
            "sp": self.sp_size,
            "tp": self.tp_size,
        }

    def resolved(self, num_processes: int) -> ParallelismConfig:
        """This config with ``dp_shard_size`` filled in, checked against the world size.

        Raises:
            ValueError: the sizes do not multiply to ``num_processes``; the
                message names them and the fix.
        """
        others = self.pp_size * self.dp_replicate_size * self.cp_size * self.sp_size * self.tp_size
        shown = (
            f"pp_size={self.pp_size} x dp_replicate_size={self.dp_replicate_size} x "
            f"dp_shard_size={self.dp_shard_size} x cp_size={self.cp_size} x sp_size={self.sp_size} x "
            f"tp_size={self.tp_size}"
        )
        if self.dp_shard_size is None:
            if num_processes % others:
                raise ValueError(
                    f"ParallelismConfig: {shown.replace('dp_shard_size=None x ', '')} = {others} does not "
                    f"divide the {num_processes} processes; choose sizes whose product divides "
                    f"{num_processes} (dp_shard_size takes the rest)"
                )
            return replace(self, dp_shard_size=num_processes // others)
        if others * self.dp_shard_size != num_processes:
            raise ValueError(
                f"ParallelismConfig: {shown} = {others * self.dp_shard_size}, but the run has "
                f"{num_processes} processes; make the sizes multiply to {num_processes} (or leave "
                "dp_shard_size out to give it the rest), or launch with that many processes"
            )
        return self

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data: ``dp_replicate_size * dp_shard_size``."""
        return self.dp_replicate_size * (self.dp_shard_size or 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on each of `MESH_DIMS` (the mesh is ranks in row-major order).

        >>> ParallelismConfig(dp_shard_size=2, tp_size=2).coordinates(3)
        {'pp': 0, 'dp_replicate': 0, 'dp_shard': 1, 'cp': 0, 'sp': 0, 'tp': 1}
        """
        out: dict[str, int] = {}
        for name in reversed(MESH_DIMS):
            size = self.sizes[name]
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}


def build_mesh(config: ParallelismConfig, device_type: str, group: ProcessGroup) -> dict[str, DeviceMesh]:
    """The run's mesh and the sub-meshes fnaccel uses, keyed by name.

    ``"mesh"`` is the whole mesh over the dimensions of size > 1; each such
    dimension has its 1-D sub-mesh under its name; ``"dp"`` is the data-parallel
    ranks as one dimension (``dp_replicate`` and ``dp_shard`` flattened) when
    that is larger than one, and ``"dp_mesh"`` the data-parallel dimensions as
    they are (2-D under HSDP), for FSDP2. A mesh of only data-parallel ranks is
    built on ``group`` (the run's own group, no new group); any other mesh
    creates one group per dimension (collective: every rank calls it).
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    sizes = config.sizes
    assert config.dp_shard_size is not None, "resolve the config first (ParallelismConfig.resolved)"
    names = tuple(name for name in MESH_DIMS if sizes[name] > 1)
    if not names:
        return {}
    dp_names = tuple(name for name in ("dp_replicate", "dp_shard") if sizes[name] > 1)
    if len(names) == 1:
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
    else:
        mesh = init_device_mesh(device_type, tuple(sizes[name] for name in names), mesh_dim_names=names)
    meshes: dict[str, DeviceMesh] = {"mesh": mesh}
    for name in names:
        meshes[name] = mesh if len(names) == 1 else mesh[name]
    if dp_names:
        meshes["dp_mesh"] = mesh if dp_names == names else mesh[dp_names]
        # one dimension for the data-parallel ranks (torch's flatten, as torchtitan and Accelerate use it)
        meshes["dp"] = meshes[dp_names[0]] if len(dp_names) == 1 else meshes["dp_mesh"]._flatten("dp")
    return meshes
