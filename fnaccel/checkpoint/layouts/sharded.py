"""The sharded layout: a run whose model is split over the ranks, through `torch.distributed.checkpoint`.

An `fsdp()`, `tp()` or `pp()` run over several processes (a pipeline that
declares `Capability.SHARDS_PARAMETERS`, `TENSOR_PARALLEL` or `SPLITS_MODEL`)
has no whole model on any rank: every rank writes the shards it holds under
``sharded/`` (`fnaccel.checkpoint.sharded`: DCP's planner, pickle-free
storage, the checks before DCP writes a byte), and reads its chunks of the
loading run's layout, on any number of processes.

The layout also loads across kinds of run: a sharded checkpoint into a
replicated model (DCP reads whole tensors), and a replicated checkpoint's
whole tensors (`fnaccel.checkpoint.layouts.plain`) into a sharded run, each
rank keeping its chunks (`shard_into`). The run's save and load hooks never
see sharded weights, so such a run that has hooks is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.hooks import check_unsharded
from fnaccel.checkpoint.layouts.plain import read_model, read_optimizer
from fnaccel.checkpoint.shardindex import SHARDED_DIR
from fnaccel.checkpoint.sharded import ShardedSnapshot, load_sharded, snapshot_sharded, write_sharded
from fnaccel.transforms.parallel import unwrap_compiled, unwrap_model

if TYPE_CHECKING:
    from fnaccel.dist import DistContext
    from fnaccel.state import RunState

__all__ = ["ShardedLayout", "ShardedRead", "is_stored_sharded", "shard_into"]


def is_stored_sharded(manifest: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's model and optimizer are under ``sharded/`` (a sharded run saved it).

    >>> is_stored_sharded({"files": {"sharded/metadata.json": {}, "rank0.json": {}}})
    True
    """
    return any(name.startswith(f"{SHARDED_DIR}/") for name in manifest["files"])


def shard_into(state: RunState, weights: Mapping[str, torch.Tensor], optimizer_sd: Mapping[str, Any] | None) -> None:
    """Restore a replicated checkpoint's whole tensors into a sharded run, in place.

    ``weights``: the model's tensors by name, checked against the model's global
    shapes; ``optimizer_sd``: the optimizer's ``state_dict`` as `codec.optimizer_state`
    builds it (parameters by index), checked the same way. Every rank keeps its own
    chunk of each tensor (torch's ``set_*_state_dict`` with ``full_state_dict``).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = unwrap_compiled(state.model)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, dict(weights), options=options)
    if optimizer_sd is None:
        return
    optimizer = state.optimizer
    assert optimizer is not None, "read_optimizer reads none without an optimizer"
    names = {id(p): name for name, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name: dict[str, Any] = {
        "state": {order[i]: fields for i, fields in optimizer_sd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optimizer_sd["param_groups"]],
    }
    set_optimizer_state_dict(module, optimizer, by_name, options=options)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedRead:
    """What `ShardedLayout.read` checked, for `ShardedLayout.restore`."""

    directory: Path
    manifest: dict[str, Any]
    # a replicated checkpoint's whole tensors, to shard; None: the checkpoint's own shards, which
    # DCP checks and reads in restore (they are the last thing read)
    weights: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None


class ShardedLayout:
    """The model's and optimizer's shards under ``sharded/``, through DCP
    (`fnaccel.protocols.CheckpointLayout`)."""

    def snapshot(self, state: RunState, files: Any) -> ShardedSnapshot:
        check_unsharded(state)
        return snapshot_sharded(state, copy=files.staging is not None, per_node=files.per_node)

    def write(self, captured: ShardedSnapshot, ctx: DistContext, directory: Path) -> dict[str, dict[str, Any]]:
        return write_sharded(captured, ctx, directory)

    def read(self, state: RunState, directory: Path, manifest: dict[str, Any],
             gradients: Mapping[str, torch.Tensor]) -> ShardedRead:
        check_unsharded(state)  # save/load hooks never see sharded weights: refused, not skipped
        if gradients:
            raise CheckpointError(f"{directory}: saved between accumulation micro-steps by a replicated run; a "
                                  "sharded run cannot take those gradients: save after an optimizer step")
        if is_stored_sharded(manifest):
            return ShardedRead(directory=directory, manifest=manifest)
        module = unwrap_model(state.model)
        return ShardedRead(directory=directory, manifest=manifest,
                           weights=read_model(state, module, directory, manifest),
                           optimizer=read_optimizer(state, module, directory, manifest))

    def restore(self, state: RunState, read: ShardedRead) -> None:
        if read.weights is None:
            load_sharded(state, read.directory, read.manifest)
        else:
            shard_into(state, read.weights, read.optimizer)
