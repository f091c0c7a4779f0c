"""Data parallelism: `ddp()` (replicated, DistributedDataParallel) and `fsdp()`
(sharded, FSDP2's `fully_shard`), over the mesh's data-parallel dimensions.

A no-op when the run has one data-parallel rank, so the same pipeline runs
everywhere. `fsdp()` shards over ``dp_shard`` and, when ``dp_replicate_size``
is larger than one, replicates over ``dp_replicate`` (HSDP: FSDP2 on the 2-D
mesh); after `fa.tp` it shards the tensor-parallel DTensors (FSDP + TP). Gradient
communication is switched per micro-step by `set_sync` (``accumulate``'s
non-boundary micro-steps turn it off), eagerly, before the forward that needs
it: a hand-written forward runs with the right setting too.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fnaccel.checkpoint.storage.parts import unwrap_compiled, unwrap_model
from fnaccel.checkpoint.storage.sharded import ShardedLayout
from fnaccel.dist import DistContext, data_parallel, data_parallel_context
from fnaccel.kwargs import DistributedDataParallelKwargs
from fnaccel.resources import GroupOwner
from fnaccel.transforms.contract import PipelineView, PrepareRequest
from fnaccel.transforms.declared import Capability
from fnaccel.transforms.kinds import ParallelismTransform, options
from fnaccel.transforms.phases import Phase

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "broadcast_from_first_rank",
    "check_optimizer_holds_model",
    "ddp",
    "fsdp",
    "unwrap_compiled",
    "unwrap_model",
]


def ddp(*, find_unused: bool | None = None, **kwargs: Any) -> ParallelismTransform:
    """Wrap the model in `DistributedDataParallel` (`DistributedDataParallelKwargs`' options).

    Args:
        find_unused: short for ``find_unused_parameters``.
        **kwargs: `DistributedDataParallelKwargs` fields (``bucket_cap_mb``,
            ``static_graph``, ``gradient_as_bucket_view``, ``comm_hook``, ...).

    >>> import fnaccel as fa
    >>> fa.ddp(find_unused=True)
    ddp(find_unused_parameters=True)
    """
    if find_unused is not None:
        if "find_unused_parameters" in kwargs:
            raise TypeError("ddp: give find_unused or find_unused_parameters, not both")
        kwargs["find_unused_parameters"] = find_unused
    handler = DistributedDataParallelKwargs(**kwargs)

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        _, size = data_parallel(ctx)
        if size == 1:
            return model
        wrapped = DistributedDataParallel(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            process_group=data_parallel_context(ctx).process_group,
            **handler.to_kwargs(),
        )
        handler.register_comm_hook(wrapped)
        if isinstance(ctx.group_owner, GroupOwner):  # not a World's borrowed group: the World ends it
            ctx.group_owner.release_before_destroy(partial(_release_reducer, weakref.ref(wrapped)))
        return wrapped

    def set_sync(model: nn.Module, enabled: bool) -> None:
        inner = unwrap_compiled(model)
        if isinstance(inner, DistributedDataParallel):
            inner.require_backward_grad_sync = enabled

    shown = {**handler.to_kwargs()}
    for key in ("comm_hook", "comm_wrapper"):
        if getattr(handler, key) != "no":
            shown[key] = str(getattr(handler, key))
    return ParallelismTransform(
        name="ddp",
        options=options(**shown),
        phase=Phase.DATA_PARALLEL,
        conflicts=frozenset({"fsdp"}),
        capabilities=frozenset({Capability.AVERAGES_GRADIENTS}),
        prepare_model=prepare_model,
        set_sync=set_sync,
    )


def _release_reducer(ref: weakref.ref[DistributedDataParallel]) -> None:
    """At `fa.shutdown`: drop the wrapper's ``Reducer`` (and the ``Logger`` holding it)
    while the run still holds the group, so that the reducer is never the group's last
    holder (see `fnaccel.resources.GroupOwner.release_before_destroy`). The wrapper
    then communicates no more (a forward with gradients enabled fails); its module,
    the user's model, is untouched and trains on alone, without the reducer's hooks."""
    wrapped = ref()
    if wrapped is not None:
        for name in ("logger", "reducer"):
            wrapped.__dict__.pop(name, None)


def _wrap_targets(
    model: nn.Module, class_names: frozenset[str], min_num_params: int | None
) -> list[nn.Module]:
    """Submodules to shard on their own, innermost first (FSDP2 wants children
    sharded before their parents); the root is sharded last by the caller."""
    targets = []
    for name, module in reversed(list(model.named_modules())):
        if not name:
            continue
        if type(module).__name__ in class_names or (
            min_num_params is not None
            and not any(m in targets for m in module.modules())
            and sum(p.numel() for p in module.parameters()) >= min_num_params
        ):
            targets.append(module)
    return targets


def broadcast_from_first_rank(model: nn.Module, group: Any) -> None:
    # fa.prepare has refused meta tensors on every rank before this point
    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            local = getattr(tensor, "to_local", None)  # a tp() DTensor: its own shard, the same over dp
            dist.broadcast(local() if local else tensor.data, src=first, group=group)


def _shard_mesh(ctx: DistContext) -> DeviceMesh:
    """The mesh FSDP2 shards over: the data-parallel dimensions (2-D under HSDP)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = ctx.mesh
    if mesh is None:  # a context built by hand over a group: its ranks are all data-parallel
        assert ctx.process_group is not None  # a world larger than one has a group
        return DeviceMesh.from_group(ctx.process_group, ctx.device.type)
    names = tuple(n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ()))
    if "dp_shard" not in names:
        raise ValueError(
            f"fa.prepare: fsdp() shards over dp_shard, and this run's mesh {mesh.mesh_dim_names} has "
            "dp_shard_size 1; use fa.ddp() for pure replication, or give ParallelismConfig a "
            "dp_shard_size > 1"
        )
    return mesh if names == mesh.mesh_dim_names else mesh[names]


def fsdp(
    *,
    transformer_cls_names_to_wrap: tuple[str, ...] | list[str] = (),
    min_num_params: int | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    sync_module_states: bool = False,
) -> ParallelismTransform:
    """Shard the model over the data-parallel ranks with FSDP2's `fully_shard`
    (HSDP when the mesh has ``dp_replicate_size > 1``).

    Args:
        transformer_cls_names_to_wrap: shard every submodule of these class
            names on its own (auto-wrap by class, e.g. ``("Block",)``).
        min_num_params: also shard on its own every submodule holding at least
            this many parameters not already in a sharded submodule.
        reshard_after_forward: free the gathered parameters after forward.
        cpu_offload: keep the sharded parameters, gradients and optimizer
            state on the CPU (`CPUOffloadPolicy`).
        sync_module_states: before sharding, give every rank rank 0's
            parameters and buffers (so weights need loading on rank 0 only).

    Under ``autocast``, the precision becomes FSDP2's `MixedPrecisionPolicy`
    (parameters in that dtype for compute, gradients reduced in fp32, outputs
    in fp32) instead of a ``torch.autocast`` around forward.

    >>> import fnaccel as fa
    >>> fa.fsdp(transformer_cls_names_to_wrap=["Block"])
    fsdp(transformer_cls_names_to_wrap=('Block',))
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    class_names = frozenset(transformer_cls_names_to_wrap)
    if min_num_params is not None and min_num_params < 1:
        raise ValueError(f"fsdp: min_num_params must be positive, got {min_num_params}")

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        from fnaccel.transforms.mixed_precision import AutocastForward

        if data_parallel(ctx)[1] == 1:
            return model
        if cpu_offload and ctx.device.type == "cpu":
            raise ValueError(
                "fsdp(cpu_offload=True) moves the shards off an accelerator to the CPU, but this "
                "run computes on the CPU already; drop cpu_offload (or run on CUDA)"
            )
        inner_policy = root_policy = MixedPrecisionPolicy()
        forward = model.__dict__.get("forward")
        if isinstance(forward, AutocastForward):  # autocast folds into FSDP2's policy
            del model.forward
            inner_policy = MixedPrecisionPolicy(param_dtype=forward.dtype, reduce_dtype=torch.float32)
            # only the model's own outputs come back in fp32, as autocast's would
            root_policy = MixedPrecisionPolicy(
                param_dtype=forward.dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        mesh = _shard_mesh(ctx)
        if sync_module_states:
            broadcast_from_first_rank(model, data_parallel_context(ctx).process_group)
        offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()  # fully_shard's default: none
        for module in _wrap_targets(model, class_names, min_num_params):
            fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=inner_policy,
                offload_policy=offload,
            )
        fully_shard(
            model,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=root_policy,
            offload_policy=offload,
        )
        return model

    def set_sync(model: nn.Module, enabled: bool) -> None:
        inner = unwrap_compiled(model)
        if isinstance(inner, FSDPModule):
            inner.set_requires_gradient_sync(enabled)

    opts = (
        (options(transformer_cls_names_to_wrap=tuple(sorted(class_names))) if class_names else ())
        + (options(min_num_params=min_num_params) if min_num_params is not None else ())
        + (options(reshard_after_forward=False) if not reshard_after_forward else ())
        + (options(cpu_offload=True) if cpu_offload else ())
        + (options(sync_module_states=True) if sync_module_states else ())
    )
    return ParallelismTransform(
        name="fsdp",
        options=opts,
        phase=Phase.DATA_PARALLEL,
        conflicts=frozenset({"ddp"}),
        capabilities=frozenset({Capability.AVERAGES_GRADIENTS, Capability.SHARDS_PARAMETERS}),
        layout=ShardedLayout(splits=_shards),
        backward_inputs=False,  # FSDP2 computes gradients on unsharded copies, not on the shards
        check=check_optimizer_holds_model,
        prepare_model=prepare_model,
        set_sync=set_sync,
    )


def check_optimizer_holds_model(request: PrepareRequest) -> PipelineView:
    """`fa.fsdp`'s and `fa.pp`'s check: an optimizer passed after its model was prepared
    must hold the prepared model's parameters: FSDP2 replaced the ones it may have been
    built on, and pp() keeps this rank's stages only. (An optimizer that also holds
    parameters of its own, outside the model, is fine when passed together with the model.)"""
    held, params = request.prepared_model, request.optimizer_params
    if request.model is None and held is not None and params is not None:
        current = {id(p) for p in held.parameters()}
        if any(id(p) not in current for p in params):
            raise ValueError(
                "fa.prepare: the optimizer holds parameters that are not the prepared model's: fa.fsdp "
                "replaced the model's parameters with sharded ones (fa.pp keeps this rank's stages "
                "only); pass the optimizer in the same fa.prepare call as the model, or build it from "
                "state.model.parameters()"
            )
    return request.pipeline


def _shards(ctx: DistContext) -> bool:
    """Whether `fsdp` shards the model in this run (as its prepare_model decides)."""
    return data_parallel(ctx)[1] > 1
