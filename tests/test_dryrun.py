"""`fnaccel.dryrun.world_bytes`: every rank's bytes of a large world, computed once per class of alike ranks.

Checked against DTensor's own shard arithmetic at every rank of small worlds
(random layouts: plain, strided and nested shards, replicas, partial sums, the
flattened data-parallel dimension), and counted at 16,384 ranks: the per-class
computation runs once per class and tensor, not once per rank. The launch
around it (`fnaccel launch --dry_run`) is tested in tests/commands/test_dry_run.py.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard, _utils
from torch.distributed.tensor.placement_types import _StridedShard

from fnaccel.config.parallelism import ParallelismConfig
from fnaccel.dryrun import Held, world_bytes


def by_dtensor(kinds: dict[str, list[Held]], layout: ParallelismConfig, rank: int) -> dict[str, int]:
    """``rank``'s bytes, from DTensor's own arithmetic at that rank's coordinate."""
    coords = layout.coordinates(rank)
    coords["dp"] = coords["dp_replicate"] * layout.sizes["dp_shard"] + coords["dp_shard"]
    numels = {
        held: math.prod(
            held.shape
            if not held.mesh_dims
            else _utils._compute_local_shape_and_global_offset(
                held.shape, held.mesh_shape, [coords[n] for n in held.mesh_dims], held.placements
            )[0]
        )
        for group in kinds.values()
        for held in set(group)
    }
    return {kind: sum(numels[held] * held.element_size for held in group) for kind, group in kinds.items()}


def random_held(rng: random.Random, layout: ParallelismConfig) -> Held:
    shape = (rng.randint(1, 40), rng.randint(1, 9))
    dims = [name for name, size in layout.sizes.items() if size > 1]
    if not dims or rng.random() < 0.2:
        return Held(shape=shape, element_size=4)
    names = tuple(name for name in dims if rng.random() < 0.7) or (dims[0],)
    if {"dp_replicate", "dp_shard"} <= set(names) and rng.random() < 0.4:  # the flattened dimension
        names = (*(name for name in names if name not in ("dp_replicate", "dp_shard")), "dp")
    placements: list[Any] = []
    for _ in names:
        pick = rng.random()
        placements.append(
            Replicate()
            if pick < 0.2
            else Partial()
            if pick < 0.3
            else Shard(rng.randint(0, 1))
            if pick < 0.6
            else _StridedShard(rng.randint(0, 1), split_factor=rng.choice([2, 3, 4]))
        )
    return Held(
        shape=shape,
        element_size=rng.choice([2, 4]),
        mesh_dims=names,
        placements=tuple(placements),
        mesh_shape=tuple(layout.data_parallel_size if n == "dp" else layout.sizes[n] for n in names),
    )


@pytest.mark.parametrize("seed", range(2))
def test_every_ranks_bytes_equal_dtensors_own_arithmetic(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(8):
        layout = ParallelismConfig(
            pp_size=rng.choice([1, 2]),
            dp_replicate_size=rng.choice([1, 2, 3]),
            dp_shard_size=rng.choice([1, 2, 3, 5, 8]),
            tp_size=rng.choice([1, 2, 4]),
        )
        world = math.prod(layout.sizes.values())
        layout = layout.resolved(world)
        helds = [random_held(rng, layout) for _ in range(6)]
        kinds = {"parameters": helds[:4], "optimizer": helds[2:]}
        computed = world_bytes(kinds, layout)
        assert list(computed.ranks) == [by_dtensor(kinds, layout, rank) for rank in range(world)], (
            layout,
            helds,
        )
        assert computed.num_classes <= world


def fsdp_x_tp(dp_shard: int) -> list[Held]:
    """tests/commands/_dry_run_script.py's tensors as fa.tp + fa.fsdp lay them (its dry run prints them)."""
    mesh = {"mesh_dims": ("dp_shard", "tp"), "mesh_shape": (dp_shard, 8)}
    rows = {"mesh_dims": ("dp_shard",), "mesh_shape": (dp_shard,), "placements": (Shard(0),)}
    colwise = (_StridedShard(0, split_factor=8), Shard(0))
    block = [Held(shape=(128,), element_size=4, **rows)] * 4 + [
        *[
            Held(shape=shape, element_size=4, placements=colwise, **mesh)
            for shape in [(128, 128), (128,)] * 3 + [(512, 128), (512,)]
        ],
        *[
            Held(shape=(128, width), element_size=4, placements=(Shard(0), Shard(1)), **mesh)
            for width in (128, 512)
        ],
        *[Held(shape=(128,), element_size=4, placements=(Shard(0), Replicate()), **mesh)] * 2,
    ]
    return [
        Held(shape=(250, 128), element_size=4, **rows),
        *block,
        *block,
        Held(shape=(250, 128), element_size=4, **rows),
        Held(shape=(250,), element_size=4, **rows),
    ]


def test_alike_ranks_are_computed_once_at_16384_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run of 16,384 ranks spent minutes computing each rank's shards one by one."""
    layout = ParallelismConfig(tp_size=8).resolved(16384)
    tensors = fsdp_x_tp(2048)
    kinds = {"parameters": tensors, "gradients": tensors, "optimizer": tensors + tensors}
    calls = []
    shard_of = _utils._compute_local_shape_and_global_offset

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2])
        return shard_of(*args, **kwargs)

    monkeypatch.setattr(_utils, "_compute_local_shape_and_global_offset", counted)
    computed = world_bytes(kinds, layout)
    # dp_shard coordinates 0-15 hold rows of every strided tensor, 16-124 of the 128-long, 125-127 ...:
    # a handful of classes, each computed once per distinct tensor
    assert 2 <= computed.num_classes <= 8
    assert len(calls) == computed.num_classes * len({held for held in tensors if held.mesh_dims})
    monkeypatch.undo()
    for rank in (0, 127, 128, 511, 512, 1023, 1024, 1999, 2000, 16383):  # each side of every boundary
        assert computed.ranks[rank] == by_dtensor(kinds, layout, rank), rank
