"""The sharded layout: a run whose model is split over the ranks, through `torch.distributed.checkpoint`.

An `fsdp()`, `tp()` or `pp()` run over several processes (those transforms
declare this layout, which `holds` a run whose model is split over its ranks)
has no whole model on any rank, and is saved pickle-free so. Every rank
writes the shards it holds; nothing is gathered onto one rank.
The model's and the optimizer's state come from DCP's own
``get_state_dict`` (keyed by parameter name, DTensor shards), the tensors
go through DCP's planner (``dcp.save``/``dcp.load``: deduplication of
replicated tensors, chunk offsets, resharding logic) and the non-tensor
values (the optimizer's param groups, any plain numbers) go to JSON::

    sharded/rank<r>.safetensors   the chunks rank r holds, one tensor per chunk
    sharded/metadata.json         DCP's Metadata: every key's global shape, dtype
                                  and chunks; which file and key holds each chunk (rank 0)
    sharded/state.json            the optimizer's class, param groups and other
                                  non-tensor values (rank 0)

DCP's stock `FileSystemWriter` is not used: it pickles its ``.metadata`` file
even with ``SerializationFormat.SAFETENSORS`` and stores non-tensor values
with ``torch.save``; `HuggingFaceStorageWriter` in distributed mode writes no
metadata at all, and its reader rediscovers it by listing the directory and
memory-mapping the files, past the manifest's checksums. Here a small
`StorageWriter`/`StorageReader` pair (`fnaccel.checkpoint.storage.dcpstore`) stores the same Metadata as JSON and
moves every byte through `fnaccel.checkpoint.storage.files` (fsynced writes,
checksum-verified reads), so a sharded checkpoint is as safe as a plain one.
A load checks the index first (`fnaccel.checkpoint.storage.shardindex.read_index`,
which needs no torch: chunks inside their tensors, files among the
manifest's, declared sizes within theirs) and the live model's keys, shapes
and dtypes against it before DCP writes a byte.

A `pp()` run takes the same path: each rank writes its stages' parameters
and optimizer state (plain tensors under the unsplit model's names, no two
ranks the same key) and loads the keys its stages hold. Its optimizer's
param groups differ per rank, so ``state.json`` holds one entry per rank
(``{"kind", "stages": [{"values", "param_groups"}, ...]}``); a load checks
this rank's entry against its optimizer, which refuses another stage layout.

The layout also loads across kinds of run: a sharded checkpoint into a
replicated model (DCP reads whole tensors), and a replicated checkpoint's
whole tensors (`fnaccel.checkpoint.storage.plain`) into a sharded run, each
rank keeping its chunks (`shard_into`). The run's save and load hooks never
see sharded weights, so such a run that has hooks is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir
from fnaccel.checkpoint.storage.files import (
    json_copy,
    read_json,
    write_json,
)
from fnaccel.checkpoint.storage.layout import CheckpointFiles
from fnaccel.checkpoint.storage.parts import (
    check_kind,
    check_layout,
    check_like,
    check_unsharded,
    kind_of,
    read_model,
    read_optimizer,
    restore_groups,
    unwrap_compiled,
    unwrap_model,
)
from fnaccel.checkpoint.storage.shardindex import METADATA, SHARDED_DIR, VALUES, is_stored_sharded

if TYPE_CHECKING:
    from fnaccel.dist import DistContext
    from fnaccel.state import RunState

__all__ = [
    "ShardedLayout",
    "ShardedRead",
    "ShardedSnapshot",
    "load_sharded",
    "shard_into",
    "snapshot_sharded",
    "write_sharded",
]


# -- the state dicts, split into tensors (DCP) and plain values (JSON) -----------------


def _split(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, values)``: the same nesting of dicts, tensors in one, the rest in the other."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            sub_tensors, sub_values = _split(value)
            if sub_tensors:
                tensors[key] = sub_tensors
            if sub_values:
                values[key] = sub_values
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            values[key] = value
    return tensors, values


def _merge(tensors: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(tensors)
    for key, value in values.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _state_dicts(state: RunState, *, for_load: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``({"model": ..., "optimizer": {"state": ...}}, param_groups)`` by parameter name
    (DTensor shards), the live tensors themselves: a load writes into them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = unwrap_compiled(state.model)
    tree: dict[str, Any] = {"model": get_model_state_dict(module)}
    groups: list[dict[str, Any]] = []
    optimizer = state.optimizer
    if optimizer is not None:
        had_state = bool(optimizer.state)
        # DCP allocates a stateless optimizer's state with one step at lr 0 (the targets a
        # load needs); a save before the first step must not keep that side effect
        optim_sd = get_optimizer_state_dict(module, optimizer)
        tree["optimizer"] = {"state": optim_sd["state"] if had_state or for_load else {}}
        saved_groups: Any = optim_sd["param_groups"]
        groups = [dict(g) for g in saved_groups]
        if not had_state and not for_load:
            optimizer.state.clear()
    return tree, groups


def _refuse_mid_accumulation(state: RunState, action: str, pipelined: bool) -> None:
    plan = state.plan
    if plan is not None and state.micro_step % plan.micro_steps != 0:
        why = (
            "a pp() run's checkpoint holds no gradients"
            if pipelined
            else "an fsdp() run between accumulation micro-steps holds its gradients in FSDP's private "
            "unsharded buffers, which torch.distributed.checkpoint cannot save"
        )
        raise CheckpointError(
            f"{action}: {why}; save after an optimizer step (when state.micro_step is a multiple "
            f"of {plan.micro_steps})"
        )


@dataclass
class ShardedSnapshot:
    """This rank's part of a sharded checkpoint, captured by `snapshot_sharded`."""

    tensors: dict[str, Any]  # {"model": {...}, "optimizer": {"state": {...}}}: DTensor shards
    values: dict[str, Any]  # the same nesting, non-tensor values (JSON)
    param_groups: list[dict[str, Any]]
    kind: str | None  # the optimizer's class (`kind_of`), None without one
    per_rank: bool  # a pp() run: values and param groups differ per rank (state.json's "stages")


def _copied(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with every tensor copied to the CPU (a DTensor stays a DTensor: its shard is copied)."""
    return {
        key: _copied(value) if isinstance(value, Mapping) else value.detach().to("cpu", copy=True)
        for key, value in tree.items()
    }


def snapshot_sharded(state: RunState, *, copy: bool, per_node: bool, pipelined: bool) -> ShardedSnapshot:
    """Capture the model's and optimizer's shards now, for `write_sharded`.

    ``copy``: shards cloned to the CPU (an asynchronous save writes them while
    training goes on); otherwise the live tensors, for a save that writes at once.
    ``pipelined``: a pp() run's stages, whose optimizer's groups differ per rank.
    Not collective. Fails here, before anything is written, when the state
    cannot be saved.

    Raises:
        CheckpointError: between accumulation micro-steps; ``per_node``
            (``save_on_each_node``) over several machines; a non-tensor value
            that JSON cannot hold.
    """
    _refuse_mid_accumulation(state, "fa.save", pipelined)
    if per_node and state.dist.num_nodes > 1:
        raise CheckpointError(
            "fa.save: save_on_each_node with fsdp(): a sharded checkpoint is one directory that "
            "every rank reads from (each reads chunks other ranks wrote); save to a filesystem "
            "all machines share, without save_on_each_node"
        )
    tree, groups = _state_dicts(state, for_load=False)
    tensors, values = _split(tree)
    payload = json_copy({"values": values, "param_groups": groups}, VALUES)
    return ShardedSnapshot(
        tensors=_copied(tensors) if copy else tensors,
        values=payload["values"],
        param_groups=payload["param_groups"],
        kind=None if state.optimizer is None else kind_of(state.optimizer),
        per_rank=pipelined,
    )


def write_sharded(snap: ShardedSnapshot, ctx: DistContext, directory: Path) -> dict[str, dict[str, Any]]:
    """Write ``snap`` under ``directory / "sharded"`` through `torch.distributed.checkpoint`.

    Collective over ``ctx``'s process group (every rank calls it; an
    asynchronous save passes its own group). Every file is fsynced, and the
    directory. Returns the manifest entries of the files this rank wrote.
    """
    from fnaccel.checkpoint.storage import dcpstore  # imports DCP: only a sharded save pays for it

    root = Path(directory)
    (root / SHARDED_DIR).mkdir(exist_ok=True)
    entries = dict(dcpstore.save(snap.tensors, root, ctx.rank, ctx.process_group))
    own = {"values": snap.values, "param_groups": snap.param_groups}
    record = (
        {"kind": snap.kind, "stages": ops.gather_object(ctx, [own])}
        if snap.per_rank
        else {"kind": snap.kind, **own}
    )
    if ctx.is_main_process:
        entries[VALUES] = write_json(root / VALUES, record)
        fsync_dir(root / SHARDED_DIR)
    return entries


def _targets(
    tensors: Mapping[str, Any], metadata: Any, source: str, own_keys_only: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flat ``{DCP key: live tensor}`` to load and each key's path in the nested dicts.

    Model keys must match the checkpoint's exactly (``own_keys_only``: the
    checkpoint holds every stage's, this rank loads its own). Optimizer state the
    checkpoint lacks (a parameter that had no gradient yet) is left out;
    optimizer state the live optimizer lacks is an error. Named, before DCP
    plans anything (so every rank raises the same error, none hangs).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, paths = flatten_state_dict(dict(tensors))
    saved = metadata.state_dict_metadata
    wanted = {k: v for k, v in flat.items() if k in saved or paths[k][0] == "model"}
    if own_keys_only:
        saved = {k: m for k, m in saved.items() if k in wanted}
    check_layout(
        {
            k: (tuple(m.size), m.properties.dtype) if hasattr(m, "size") else ((), None)  # not a tensor
            for k, m in saved.items()
        },
        {k: (tuple(v.shape), v.dtype) for k, v in wanted.items()},
        source,
        "the model or optimizer",
    )
    return wanted, {k: paths[k] for k in wanted}


def _nest(flat: Mapping[str, Any], paths: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = paths[key]
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _own_stage(
    saved: object, live: dict[str, object], rank: int, num_processes: int, source: str
) -> dict[str, Any]:
    """A pp() run's ``state.json`` as this rank's ``{"kind", "values", "param_groups"}``,
    checked against the record this run would save (``live``, one stage per rank)."""
    own = {key: value for key, value in live.items() if key != "kind"}
    try:
        check_like(saved, {"kind": live["kind"], "stages": [own] * num_processes}, source, depth=2)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc}; this run is split by fa.pp (one stage per rank): resume with the pipeline that saved it"
        ) from None
    assert isinstance(saved, dict), "check_like held it to the live record, an object"
    return {"kind": saved["kind"], **saved["stages"][rank]}


def load_sharded(state: RunState, directory: Path, manifest: dict[str, Any], *, pipelined: bool) -> None:
    """Read the shards `write_sharded` wrote back into ``state.model`` and ``state.optimizer``, in place
    (``pipelined``: into a pp() run's stages, each rank its own keys and param groups).

    Collective: every rank calls it. The run may have another number of
    processes than the one that saved (DCP reads each rank's chunks of the new
    layout), and its model may be replicated instead of sharded (every rank
    reads whole tensors). Every file is checked against the
    manifest's size and checksum before it is used, and the index and the
    plain values against the live model and optimizer before DCP writes into
    them; nothing is unpickled.

    Raises:
        CheckpointError: a missing or corrupt file (named), a malformed index,
            missing or unexpected keys, mismatched shapes, dtypes or parameter
            groups, an optimizer of another class.
    """
    from fnaccel.checkpoint.storage import dcpstore  # imports DCP: only a sharded load pays for it

    root = Path(directory)
    metadata, storage = dcpstore.metadata_from(
        read_json(root, METADATA, manifest), manifest["files"], str(root / METADATA)
    )
    saved = read_json(root, VALUES, manifest)
    source = str(root / VALUES)
    tree, groups = _state_dicts(state, for_load=True)
    tensors, values = _split(tree)
    # the record this run would save (`write_sharded`): the file must be shaped so
    live: dict[str, object] = {
        "kind": None if state.optimizer is None else kind_of(state.optimizer),
        "values": values,
        "param_groups": groups,
    }
    if pipelined:
        saved = _own_stage(saved, live, state.dist.rank, state.dist.num_processes, source)
    check_like(saved, live, source, depth=1)
    flat, paths = _targets(tensors, metadata, str(root / METADATA), own_keys_only=pipelined)
    param_groups = None
    if state.optimizer is not None:
        check_kind(saved, state.optimizer, source)
        param_groups = restore_groups(saved["param_groups"], groups, source, state.optimizer)
    # group None: one process loads the whole tensors
    dcpstore.load(
        flat, dcpstore.ShardReader(root, manifest, metadata, storage), state.dist.process_group, "fa.load"
    )
    restored = _merge(_nest(flat, paths), saved["values"])
    module = unwrap_compiled(state.model)
    dcpstore.set_model_state_dict(module, restored.get("model", {}))
    if state.optimizer is not None:
        optim_sd = {"state": restored.get("optimizer", {}).get("state", {}), "param_groups": param_groups}
        dcpstore.set_optimizer_state_dict(module, state.optimizer, optim_sd)


def shard_into(
    state: RunState, weights: Mapping[str, torch.Tensor], optimizer_sd: Mapping[str, Any] | None
) -> None:
    """Restore a replicated checkpoint's whole tensors into a sharded run, in place.

    ``weights``: the model's tensors by name, checked against the model's global
    shapes; ``optimizer_sd``: the optimizer's ``state_dict`` as `parts.optimizer_state`
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
        "param_groups": [
            {**g, "params": [order[i] for i in g["params"]]} for g in optimizer_sd["param_groups"]
        ],
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


def _always(ctx: DistContext) -> bool:
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedLayout:
    """The model's and optimizer's shards under ``sharded/``, through DCP
    (`CheckpointLayout`), as `fa.fsdp`, `fa.tp` and `fa.pp` declare it.

    Attributes:
        splits: whether the declaring transform splits the model in a run with
            this context (`fa.fsdp`: more than one data-parallel rank); a run it
            leaves whole is stored plainly.
        pipelined: the model is split into `fa.pp` stages, whose optimizers'
            param groups differ per rank.
    """

    splits: Callable[[DistContext], bool] = field(default=_always, compare=False)
    pipelined: bool = False

    def holds(self, state: RunState) -> bool:
        return self.splits(state.dist)

    def snapshot(self, state: RunState, files: CheckpointFiles) -> ShardedSnapshot:
        check_unsharded(state)
        return snapshot_sharded(
            state, copy=files.background, per_node=files.per_node, pipelined=self.pipelined
        )

    def write(
        self, captured: ShardedSnapshot, ctx: DistContext, directory: Path
    ) -> dict[str, dict[str, Any]]:
        return write_sharded(captured, ctx, directory)

    def read(
        self,
        state: RunState,
        directory: Path,
        manifest: dict[str, Any],
        gradients: Mapping[str, torch.Tensor],
    ) -> ShardedRead:
        check_unsharded(state)  # save/load hooks never see sharded weights: refused, not skipped
        if gradients:
            raise CheckpointError(
                f"{directory}: saved between accumulation micro-steps by a replicated run; an "
                "fsdp() run cannot take those gradients: save after an optimizer step"
            )
        if is_stored_sharded(manifest):
            return ShardedRead(directory=directory, manifest=manifest)
        module = unwrap_model(state.model)
        return ShardedRead(
            directory=directory,
            manifest=manifest,
            weights=read_model(state, module, directory, manifest),
            optimizer=read_optimizer(state, module, directory, manifest),
        )

    def restore(self, state: RunState, read: ShardedRead) -> None:
        if read.weights is None:
            load_sharded(state, read.directory, read.manifest, pipelined=self.pipelined)
        else:
            shard_into(state, read.weights, read.optimizer)
