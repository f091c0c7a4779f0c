"""`fa.prepare`: a run's model, optimizer, loader, scheduler and loss function
made ready for `fa.step`, and `default_pipeline`, the pipeline a launch implies.

Preparing runs once per object: the pipeline is checked and completed (the
fp16 scaler), the model is moved, wrapped or sharded (DDP, FSDP2, an engine),
the optimizer is pointed at the prepared parameters, the loader is sharded,
and the pipeline's hooks are resolved into the `StepPlan` that the step runs
(`fnaccel.train`, which holds the plan because the step is the lower half: it
imports nothing from here).

Named `preparation`, not `prepare`: importing a submodule `fnaccel.prepare`
would bind the package attribute `fnaccel.prepare` to the module, hiding the
function `fa.prepare` behind it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from fnaccel import dryrun
from fnaccel.config.parallelism import DATA_PARALLEL_DIMS, TRANSFORM_FOR_DIM
from fnaccel.constants import PrecisionType
from fnaccel.dist import DistContext, data_parallel
from fnaccel.state import RunState
from fnaccel.train import SchedulerRuleWarning, StepPlan, scheduler_steps, training_transforms
from fnaccel.transforms.contract import EngineRequest, PrepareRequest
from fnaccel.transforms.declared import Capability, Precision
from fnaccel.transforms.fp8 import recipe_from_config
from fnaccel.transforms.kinds import ParallelismTransform, Transform
from fnaccel.transforms.mixed_precision import autocast, fp8, grad_scaler
from fnaccel.transforms.parallel import ddp, unwrap_model
from fnaccel.transforms.pipeline import Collective, Pipeline, compose
from fnaccel.transforms.plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from fnaccel.transforms.plugins.deepspeed import DeepSpeedPlugin

if TYPE_CHECKING:
    from fnaccel.config.launch import LaunchConfig
    from fnaccel.resources import Resource

__all__ = ["default_pipeline", "prepare"]

LossFn = Callable[[nn.Module, Any], Any]


def default_pipeline(state: RunState) -> Pipeline:
    """Reads ``state`` (not consumed): the pipeline `fa.prepare` builds when given none.

    The launch's mixed precision (with its kwargs handlers, or the config's
    fp8_config), `ddp()` when the world is larger than one (or `fsdp()` from
    the config's FSDP section, or `deepspeed()` from its DeepSpeed section), and
    `compile()` when the config names a dynamo backend. To add a transform and
    keep what the launch asked for, nest it: ``fa.compose(fa.default_pipeline(state),
    fa.accumulate(4))`` (`fa.compose` puts each transform in its place).

    Args:
        state: the run's state (from `fa.init`); its launch config, precision,
            kwargs handlers and world size decide the pipeline.

    Returns:
        The launch's `Pipeline` (empty for a plain one-process fp32 run).

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True, mixed_precision="bf16")
    >>> fa.default_pipeline(state)
    compose(autocast(dtype=torch.bfloat16))
    >>> fa.compose(fa.default_pipeline(state), fa.accumulate(4))
    compose(autocast(dtype=torch.bfloat16), accumulate(num_steps=4))
    """
    handlers = state.kwargs_handlers
    parts: list[Transform] = []
    cast = handlers.get("AutocastKwargs")
    if state.mixed_precision in (PrecisionType.FP16, PrecisionType.BF16) and (cast is None or cast.enabled):
        parts.append(
            autocast(state.mixed_precision.value, cache_enabled=None if cast is None else cast.cache_enabled)
        )
    if state.mixed_precision == PrecisionType.FP8 and (cast is None or cast.enabled):
        # the script's FP8RecipeKwargs, else the launch's fp8_config (--fp8_* flags)
        recipe = handlers.get("FP8RecipeKwargs") or recipe_from_config(
            state.config.fp8_config, _section(state.config, "fp8_config")
        )
        parts.append(autocast(fp8, cache_enabled=None if cast is None else cast.cache_enabled, recipe=recipe))
    scaler = handlers.get("GradScalerKwargs")
    if scaler is not None and state.mixed_precision == PrecisionType.FP16:
        parts.append(grad_scaler(**scaler.to_kwargs()))
    config = state.config
    if config.distributed_type == "DEEPSPEED":
        parts.append(
            DeepSpeedPlugin.from_config(
                config.deepspeed_config, _section(config, "deepspeed_config")
            ).transform()
        )
    elif state.dist.num_processes > 1 and config.distributed_type == "FSDP":
        plugin = FullyShardedDataParallelPlugin.from_config(
            config.fsdp_config, _section(config, "fsdp_config")
        )
        checkpointing = plugin.checkpointing()
        parts.extend([plugin.transform()] if checkpointing is None else [checkpointing, plugin.transform()])
    elif state.dist.num_processes > 1:
        ddp_kwargs = handlers.get("DistributedDataParallelKwargs")
        fields = (
            {}
            if ddp_kwargs is None
            else {f.name: getattr(ddp_kwargs, f.name) for f in dataclasses.fields(ddp_kwargs)}
        )
        parts.append(ddp(**fields))
    dynamo = TorchDynamoPlugin.from_config(config.dynamo_config, _section(config, "dynamo_config"))
    compiled = dynamo.transform()
    if compiled is not None:
        parts.append(compiled)
    return compose(*parts)


def _section(config: LaunchConfig, key: str) -> str:
    return f"{config.source}: {key}" if config.source else key


def _complete(pipeline: Pipeline, request: PrepareRequest, state: RunState) -> Pipeline:
    """Check a training pipeline against the run's world and mesh (what concerns every
    pipeline), then let each transform check its whole contract with what this call
    passes (`PrepareRequest`, whose pipeline is completed as it goes) and add what it
    implies (the fp16 scaler)."""
    collectives = [t for t in pipeline.transforms if isinstance(t, Collective)]
    if collectives:
        raise ValueError(
            f"fa.prepare: {collectives[0]!r} is a collective; keep collectives in their own "
            "pipeline (collect = fa.compose(...); collect(state, tree))"
        )
    num_replicas = data_parallel(state.dist)[1]
    capabilities = pipeline.capabilities
    # a split model's stages hold different layers: nothing to average over (pp checks its mesh itself)
    if num_replicas > 1 and not {Capability.AVERAGES_GRADIENTS, Capability.SPLITS_MODEL} & capabilities:
        raise ValueError(
            f"fa.prepare: {pipeline!r} has no fa.ddp() or fa.fsdp() (nor fa.pp(...)) but this run has "
            f"{num_replicas} data-parallel processes; without one the replicas' gradients are "
            "never averaged. Add fa.ddp() (a no-op in a world of one)."
        )
    layout = state.dist.parallelism
    sizes = {} if layout is None else layout.sizes
    for dim, size in sizes.items():
        # a dimension that splits the model, with nothing consuming it: its ranks would each train the
        # whole model on the same batches (the data is split over the data-parallel dimensions only)
        if size > 1 and dim not in DATA_PARALLEL_DIMS and dim not in pipeline.mesh_dims:
            fix = TRANSFORM_FOR_DIM.get(dim, f"a transform whose mesh_dims include {dim!r}")
            raise ValueError(
                f"fa.prepare: the mesh has {dim}_size={size} but {pipeline!r} has no transform over its "
                f"{dim} dimension; add {fix} to the pipeline, or set {dim}_size=1"
            )
    for t in training_transforms(pipeline):
        if t.check is not None:
            completed = t.check(dataclasses.replace(request, pipeline=pipeline))
            if not isinstance(completed, Pipeline):
                raise TypeError(
                    f"fa.prepare: {t!r}'s check returned {type(completed).__name__} {completed!r:.80}; a check "
                    "returns the pipeline it was given (request.pipeline), or fa.compose(request.pipeline, ...)"
                )
            pipeline = completed
    return pipeline


def _rebind_optimizer(optimizer: torch.optim.Optimizer, before: dict[int, str], model: nn.Module) -> None:
    """Point the optimizer at the prepared model's parameters (sharding replaces them);
    a model parameter the prepared model no longer holds (another pipeline stage's)
    leaves the optimizer. Parameters from outside the model stay."""
    after = dict(unwrap_model(model).named_parameters())
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            name = before.get(id(p))
            if name is None:
                kept.append(p)
            elif name in after:
                kept.append(after[name])
            else:
                optimizer.state.pop(p, None)
        group["params"] = kept


def _as_pipeline(pipeline: object) -> Pipeline | None:
    """A single transform is a pipeline of one; anything else but a pipeline (a list of
    transforms, a function, a name) is refused here rather than deep inside `prepare`."""
    if pipeline is None or isinstance(pipeline, Pipeline):
        return pipeline
    if isinstance(pipeline, (Transform, Collective)):
        return compose(pipeline)
    raise TypeError(
        f"fa.prepare: pipeline must be a transform or fa.compose(...) of transforms, got "
        f"{type(pipeline).__name__} {pipeline!r:.80}; write pipeline=fa.compose(fa.ddp(), fa.accumulate(4), ...)"
    )


def prepare(
    state: RunState,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loader: DataLoader[object] | None = None,
    scheduler: object = None,
    *,
    pipeline: Pipeline | Transform | None = None,
    loss_fn: LossFn | None = None,
) -> RunState:
    """Consumes ``state``: move the model to the device, apply the pipeline's
    preparation (DDP wrapping, FSDP2 sharding, compilation), prepare the loader.

    Args:
        state: the run's state.
        model, optimizer, loader, scheduler: live PyTorch objects; any may be
            left out and given to a later `prepare`.
        pipeline: composed training transforms (``fa.compose(...)``; a single
            transform is a pipeline of one); default: the launch config's
            (`fa.default_pipeline`).
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``; default:
            `default_loss_fn`.

    Returns:
        The prepared state. Under a dry run (``fnaccel launch --dry_run``, which sets
        ``FNACCEL_DRY_RUN=1``) the first call that leaves the state holding both a
        model and an optimizer does not return: it runs one step, prints this
        rank's figures and exits the process (``SystemExit(0)``).

    Raises:
        TypeError: ``pipeline`` is neither a transform nor ``fa.compose(...)``'s value.
        ValueError: the pipeline does not fit the run or what is passed (each
            transform's ``check`` says what to change).

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1),
    ...                    pipeline=fa.compose(fa.clip_grad_norm(1.0)))
    >>> state.pipeline
    compose(clip_grad_norm(max_norm=1.0))
    """
    by = "fa.prepare"
    state.check_fresh(by)
    ctx = state.dist
    pipeline = _as_pipeline(pipeline)
    if pipeline is None:
        held = state.pipeline
        assert held is None or isinstance(held, Pipeline), "a state's pipeline comes from fa.prepare"
        pipeline = held if held is not None else default_pipeline(state)
    elif state.pipeline is None:
        _warn_if_launch_ignored(pipeline, state)
    if state.pipeline is not None and state.model is not None and pipeline != state.pipeline:
        raise ValueError("fa.prepare: this state's model was prepared with another pipeline")
    config = state.kwargs_handlers.get("DataLoaderConfiguration")
    pipeline = _complete(
        pipeline,
        PrepareRequest(
            pipeline=pipeline,
            ctx=ctx,
            loss_fn_given=loss_fn is not None,
            # the loader shards over the data-parallel ranks (all of them without a mesh), unless told not to
            loader_shards=None
            if loader is None
            else (1 if config is not None and config.shard is False else data_parallel(ctx)[1]),
            optimizer_params=None
            if optimizer is None
            else tuple(p for group in optimizer.param_groups for p in group["params"]),
            model=model,
            prepared_model=state.model,
        ),
        state,
    )
    transform_states = pipeline.init(ctx, state.transform_states)
    for name, value in transform_states.items():
        if callable(getattr(value, "close", None)) and state.resources.get(f"transform:{name}") is None:
            # a profiler run: fa.shutdown closes it (the check above found its close())
            state.resources.register(f"transform:{name}", cast("Resource", value))

    changes: dict[str, Any] = {"pipeline": pipeline}
    engine = pipeline.engine  # fa.deepspeed
    if model is not None:
        if state.model is not None:
            raise ValueError("fa.prepare: this state already holds a prepared model")
        _refuse_meta(model, ctx)
        names = {id(p): name for name, p in model.named_parameters()}
        model = model.to(ctx.device)
        for t in training_transforms(pipeline):
            if t.prepare_model is not None:
                model = t.prepare_model(ctx, model, transform_states.get(t.name))
        if engine is not None:
            groups = [] if optimizer is None else list(optimizer.param_groups)
            model, optimizer = engine.prepare_engine(
                EngineRequest(
                    ctx=ctx,
                    pipeline=pipeline,
                    model=model,
                    optimizer=optimizer,
                    micro_batch_size=getattr(loader, "batch_size", None),
                    state=transform_states.get(engine.name),
                )
            )
            if optimizer is not None:
                _realign_scheduler(scheduler if scheduler is not None else state.scheduler, optimizer, groups)
        elif optimizer is not None:
            _rebind_optimizer(optimizer, names, model)
        changes["model"] = model
    elif optimizer is not None and engine is not None:
        raise ValueError(
            f"fa.prepare: {pipeline!r} builds an engine from the model and the optimizer "
            "together; pass both in the same fa.prepare call"
        )
    if optimizer is not None:
        changes["optimizer"] = optimizer
    if scheduler is not None:
        held_optimizer = changes.get("optimizer", state.optimizer)
        if held_optimizer is not None:
            _check_scheduler_groups(scheduler, held_optimizer)
        changes["scheduler"] = scheduler
    if loss_fn is not None:
        changes["loss_fn"] = loss_fn
    if loader is not None:
        from fnaccel.data.loader import prepare_loader  # the data path's own module

        changes["loader"] = prepare_loader(loader, ctx, seed=state.seed or 0, config=config)
    changes["transform_states"] = transform_states
    plan = StepPlan.of(
        pipeline,
        transform_states,
        scheduler_steps(ctx, changes.get("loader", state.loader), state.kwargs_handlers),
    )
    held = changes.get("optimizer", state.optimizer)
    if (
        held is not None
        and plan.backward is None
        # a parallelism whose gradients land on tensors of its own (FSDP2's unsharded copies) opts out
        and all(t.backward_inputs for t in pipeline.transforms if isinstance(t, ParallelismTransform))
    ):
        plan = dataclasses.replace(
            plan,
            backward_inputs=tuple(
                p for group in held.param_groups for p in group["params"] if p.requires_grad
            ),
        )
    changes["plan"] = plan
    if scheduler is not None and loader is None and state.loader is not None:
        _warn_scheduler_rule(state, plan.scheduler_steps)
    new = state.advance(by, **changes)
    if new.model is not None:
        plan.set_sync_for(new.model, new.micro_step)
    if dryrun.active() and new.model is not None and new.optimizer is not None:
        dryrun.finish(new)  # `fnaccel launch --dry_run`: one step, this rank's figures, exit
    return new


def _warn_scheduler_rule(state: RunState, steps: int) -> None:
    """A scheduler given after the loader was likely sized from ``len(state.loader)``, in
    updates: the rule that now advances it ``steps`` times per update (Accelerate's) would
    end it early. Said once per process (the warnings filter's default), by the main process,
    unless the run chose a rule (`SchedulerConfiguration`)."""
    if steps > 1 and state.dist.is_main_process and "SchedulerConfiguration" not in state.kwargs_handlers:
        warnings.warn(
            f"fa.prepare: the scheduler given after the loader advances {steps} steps per optimizer update "
            "(one per process the batches are cut across: Accelerate's rule since the 2026-11-27 release; "
            "it was one per update), so a schedule sized in updates, from len(state.loader), ends early: "
            "size it from the loader before fa.prepare (len(loader) * epochs), or keep one step per update with "
            "fa.init(kwargs_handlers=[fa.SchedulerConfiguration(step_per_process=False)])",
            SchedulerRuleWarning,
            stacklevel=3,
        )


def _warn_if_launch_ignored(pipeline: Pipeline, state: RunState) -> None:
    """An explicit pipeline wins over the launch (as explicit arguments do); say so
    when the launch asked for a precision or FSDP that the pipeline leaves out."""
    cast = pipeline.settings(Precision)
    wanted = (
        state.mixed_precision
        if state.mixed_precision in (fp8, PrecisionType.FP16, PrecisionType.BF16)
        else None
    )
    handler = state.kwargs_handlers.get("AutocastKwargs")
    if handler is not None and not handler.enabled:
        wanted = None  # the default pipeline would leave autocast out too
    if wanted is not None and (cast is None or cast.precision is not wanted):
        warnings.warn(
            f"fa.prepare: the launch asked for mixed_precision {state.mixed_precision.value} but the "
            f"pipeline passed in is {pipeline!r}; the pipeline wins. Leave pipeline out to follow the "
            "launch, or add fa.autocast to it",
            UserWarning,
            stacklevel=3,
        )
    capabilities = pipeline.capabilities
    # what the launch's engine (fa.deepspeed) and sharding (fa.fsdp) declare, as default_pipeline builds them
    if state.config.distributed_type == "DEEPSPEED" and pipeline.engine is None:
        warnings.warn(
            f"fa.prepare: the launch asked for DeepSpeed but the pipeline passed in is {pipeline!r}; the "
            "pipeline wins. Leave pipeline out to follow the launch, or add fa.deepspeed to it",
            UserWarning,
            stacklevel=3,
        )
    if (
        state.config.distributed_type == "FSDP"
        and state.dist.num_processes > 1
        and Capability.SHARDS_PARAMETERS not in capabilities
    ):
        warnings.warn(
            f"fa.prepare: the launch asked for FSDP but the pipeline passed in is {pipeline!r}; the "
            "pipeline wins. Leave pipeline out to follow the launch, or add fa.fsdp to it",
            UserWarning,
            stacklevel=3,
        )


# A torch scheduler's lists that hold one entry per parameter group: every scheduler's
# base and last rates, LambdaLR's and MultiplicativeLR's lambdas, CyclicLR's bounds,
# ReduceLROnPlateau's floors (torch.optim.lr_scheduler, torch 2.13)
_PER_GROUP_LISTS = (
    "base_lrs",
    "_last_lr",
    "lr_lambdas",
    "min_lrs",
    "max_lrs",
    "base_momentums",
    "max_momentums",
)


def _realign_scheduler(
    scheduler: object, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> None:
    """Keep a scheduler built before `fa.prepare` in step with an engine's optimizer.

    DeepSpeed drops the optimizer's empty parameter groups in place (a weight-decay
    split on a model without biases leaves one), while a scheduler built first
    still holds an entry per original group and fails at the first update (torch
    zips the two). The per-group lists of torch's own schedulers (and of those a
    SequentialLR or ChainedScheduler holds) keep the entries of the groups the
    engine kept; any other scheduler, or an engine that built groups of its own,
    is refused with the fix.

    Args:
        scheduler: the run's scheduler, or None.
        optimizer: the optimizer the engine returned.
        groups: the optimizer's parameter groups before the engine was built.

    Raises:
        ValueError: the groups changed and the scheduler cannot be realigned.
    """
    index = {id(group): i for i, group in enumerate(groups)}
    kept = [index.get(id(group), -1) for group in optimizer.param_groups]  # -1: a group the engine built
    if scheduler is None or (
        kept == list(range(len(groups))) and getattr(scheduler, "optimizer", None) is optimizer
    ):
        return
    parts = [scheduler, *getattr(scheduler, "_schedulers", ())]
    if (
        -1 in kept
        or kept != sorted(kept)
        or any(type(part).__module__ != torch.optim.lr_scheduler.__name__ for part in parts)
    ):
        raise ValueError(
            f"fa.prepare: the engine changed the optimizer's parameter groups ({len(groups)} -> "
            f"{len(optimizer.param_groups)}) and the scheduler {type(scheduler).__name__} was built on the old "
            "ones; build the scheduler after fa.prepare, from state.optimizer, and pass it to a second fa.prepare"
        )
    for part in parts:
        for name in _PER_GROUP_LISTS:
            values = getattr(part, name, None)
            if isinstance(values, list) and len(values) == len(groups):
                setattr(part, name, [values[i] for i in kept])
        part.optimizer = optimizer


def _check_scheduler_groups(scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler built on the optimizer's groups before an engine changed them (and
    passed to a later `fa.prepare`) would fail at the first update, inside torch."""
    rates = getattr(scheduler, "base_lrs", None)
    if isinstance(rates, list) and len(rates) != len(optimizer.param_groups):
        raise ValueError(
            f"fa.prepare: the scheduler has {len(rates)} learning rates but the optimizer has "
            f"{len(optimizer.param_groups)} parameter groups (fa.deepspeed drops empty groups when fa.prepare "
            "builds its engine); build the scheduler after fa.prepare, from state.optimizer"
        )


def _refuse_meta(model: nn.Module, ctx: DistContext) -> None:
    """A model with tensors on the meta device cannot be moved or trained. In a larger
    world the ranks agree first (one small all-reduce per prepare), so that every rank
    raises instead of one raising while the others wait in DDP's or FSDP2's first
    collective."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    on_meta = next((name for name, t in tensors if t.is_meta), None)
    anywhere = on_meta is not None
    if ctx.num_processes > 1:
        flag = torch.tensor([int(anywhere)], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.process_group)
        anywhere = bool(flag.item())
    if anywhere:
        where = f"'{on_meta}' is" if on_meta else "another rank's model has a tensor"
        raise ValueError(
            f"fa.prepare: {where} on the meta device (no data to train); load the weights first "
            "(fnaccel.utils.load_checkpoint_in_model), or, on ranks that receive rank 0's weights "
            "(fsdp(sync_module_states=True)), give the model real storage with "
            "model.to_empty(device=...)"
        )
