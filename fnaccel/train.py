"""`fa.prepare`, `fa.step`, and its two halves `fa.backward` and `fa.apply_gradients`.

A step is a fixed sequence; transforms contribute through named hooks
(`fnaccel.transforms.base`):

    forward:   loss_fn(model, batch) under the run's RNG (autocast already
               wraps model.forward; DDP/FSDP's sync switch is already set)
    backward:  loss / micro_steps -> scale_loss hooks -> .backward();
               then set_sync hooks for the *next* micro-step
    window:    zero_grad(set_to_none=True) at an accumulation window's first
               micro-step (gradients from another run never count)
    boundary:  before_update hooks (unscale, clip) -> optimizer_step hook or
               optimizer.step() -> scheduler.step() unless skipped ->
               after_step hooks
    position:  the data position moves past the batch `fa.batches` fetched last

A transform with a forward_backward hook (`pp`'s pipeline schedule) replaces
forward and backward with one call.

Metrics are detached tensors on the device: nothing here reads a tensor on
the host, so there is no host-device sync beyond what torch's GradScaler does
on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fnaccel.dist import data_parallel, mesh_dim
from fnaccel.state import RunState
from fnaccel.transforms.base import Collective, EngineRequest, Pipeline, Transform, compose
from fnaccel.transforms.parallel import ddp, unwrap_model
from fnaccel.transforms.precision import autocast, fp8, grad_scaler, precision_dtype
from fnaccel.constants import PrecisionType

__all__ = ["StepPlan", "apply_gradients", "backward", "prepare", "step"]

LossFn = Callable[[nn.Module, Any], Any]


def default_loss_fn(model: nn.Module, batch: Any) -> Any:
    """The model called on the batch (``model(**batch)`` for a mapping,
    ``model(*batch)`` for a tuple or list); its output if that is a scalar
    tensor, else its ``loss`` (attribute or key)."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor) and out.ndim == 0:
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError(
            f"fa.step: the model returned a {type(out).__name__} that is neither a scalar "
            "loss nor has a .loss; pass loss_fn=lambda model, batch: ... to fa.prepare"
        )
    return loss


def default_pipeline(state: RunState) -> Pipeline:
    """What `fa.prepare` uses without a pipeline: the launch's mixed precision
    (with its kwargs handlers, or the config's fp8_config), `ddp()` when the
    world is larger than one (or `fsdp()` from the config's FSDP section, or
    `deepspeed()` from its DeepSpeed section), and `compile()` when the config
    names a dynamo backend."""
    from fnaccel.plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
    from fnaccel.transforms.deepspeed_config import DeepSpeedPlugin
    from fnaccel.transforms.fp8 import recipe_from_config

    handlers = state.kwargs_handlers
    parts = []
    cast = handlers.get("AutocastKwargs")
    if state.mixed_precision in (PrecisionType.FP16, PrecisionType.BF16) and (cast is None or cast.enabled):
        parts.append(autocast(state.mixed_precision.value,
                              cache_enabled=None if cast is None else cast.cache_enabled))
    if state.mixed_precision == PrecisionType.FP8 and (cast is None or cast.enabled):
        # the script's FP8RecipeKwargs, else the launch's fp8_config (--fp8_* flags)
        recipe = handlers.get("FP8RecipeKwargs") or recipe_from_config(
            state.config.fp8_config, _section(state.config, "fp8_config"))
        parts.append(autocast(fp8, cache_enabled=None if cast is None else cast.cache_enabled, recipe=recipe))
    scaler = handlers.get("GradScalerKwargs")
    if scaler is not None and state.mixed_precision == PrecisionType.FP16:
        parts.append(grad_scaler(**scaler.to_kwargs()))
    config = state.config
    if config.distributed_type == "DEEPSPEED":
        parts.append(DeepSpeedPlugin.from_config(
            config.deepspeed_config, _section(config, "deepspeed_config")).transform())
    elif state.dist.num_processes > 1 and config.distributed_type == "FSDP":
        plugin = FullyShardedDataParallelPlugin.from_config(
            config.fsdp_config, _section(config, "fsdp_config"))
        checkpointing = plugin.checkpointing()
        parts.extend([plugin.transform()] if checkpointing is None else [checkpointing, plugin.transform()])
    elif state.dist.num_processes > 1:
        ddp_kwargs = handlers.get("DistributedDataParallelKwargs")
        fields = {} if ddp_kwargs is None else {
            f.name: getattr(ddp_kwargs, f.name) for f in dataclasses.fields(ddp_kwargs)
        }
        parts.append(ddp(**fields))
    dynamo = TorchDynamoPlugin.from_config(config.dynamo_config, _section(config, "dynamo_config"))
    compiled = dynamo.transform()
    if compiled is not None:
        parts.append(compiled)
    return compose(*parts)


def _section(config: Any, key: str) -> str:
    return f"{config.source}: {key}" if config.source else key


def _training(pipeline: Pipeline) -> tuple[Transform, ...]:
    """A checked training pipeline's transforms (`_complete` refused collectives)."""
    return tuple(t for t in pipeline.transforms if isinstance(t, Transform))


def _complete(pipeline: Pipeline, state: RunState) -> Pipeline:
    """Check a training pipeline and add what it implies (the fp16 scaler)."""
    collectives = [t for t in pipeline.transforms if isinstance(t, Collective)]
    if collectives:
        raise ValueError(
            f"fa.prepare: {collectives[0]!r} is a collective; keep collectives in their own "
            "pipeline (collect = fa.compose(...); collect(state, tree))"
        )
    num_replicas = data_parallel(state.dist)[1]
    if num_replicas > 1 and not {"ddp", "fsdp", "pp", "deepspeed"} & set(pipeline.names):
        raise ValueError(
            f"fa.prepare: {pipeline!r} has no fa.ddp() or fa.fsdp() (nor fa.pp(...)) but this run has "
            f"{num_replicas} data-parallel processes; without one the replicas' gradients are "
            "never averaged. Add fa.ddp() (a no-op in a world of one)."
        )
    if "pp" in pipeline.names and num_replicas > 1 and mesh_dim(state.dist, "pp") is not None:
        raise ValueError(
            f"fa.prepare: fa.pp next to {num_replicas} data-parallel replicas is not built (each stage's "
            "gradients would need averaging over its replicas); use pp_size equal to the number of "
            "processes (dp_replicate_size=dp_shard_size=1)")
    layout = state.dist.parallelism
    if layout is not None and layout.tp_size > 1 and "tp" not in pipeline.names:
        raise ValueError(
            f"fa.prepare: the mesh has tp_size={layout.tp_size} but {pipeline!r} has no fa.tp(plan); "
            "add fa.tp({'module.name': ColwiseParallel(), ...}) to the pipeline, or set tp_size=1")
    cast = pipeline.get("autocast")
    if cast is not None and dict(cast.options)["dtype"] is torch.float16 and not pipeline.get("grad_scaler") \
            and not pipeline.get("deepspeed"):  # DeepSpeed scales fp16 losses itself
        # in its canonical place: after autocast, before ddp/fsdp and the rest
        pipeline = compose(*sorted([*pipeline.transforms, grad_scaler()], key=lambda t: t.phase))
    if pipeline.get("grad_scaler") and (cast is None or dict(cast.options)["dtype"] is not torch.float16):
        raise ValueError("fa.prepare: grad_scaler() only makes sense with autocast(fa.fp16)")
    return pipeline


_set = object.__setattr__  # writes a frozen slot (StepPlan.__post_init__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """A pipeline's hooks bound to their transform states, resolved once by
    `fa.prepare` so that a step runs tuples instead of searching the pipeline."""

    micro_steps: int = 1
    sync_each_batch: bool = False
    divide_loss: bool = True
    scale_loss: tuple[tuple[Callable[..., Any], Any], ...] = ()
    before_update: tuple[tuple[Callable[..., Any], Any], ...] = ()
    optimizer_step: tuple[Callable[..., Any], Any] | None = None
    after_backward: tuple[tuple[Callable[..., Any], Any], ...] = ()
    set_sync: tuple[Callable[..., Any], ...] = ()
    after_step: tuple[tuple[Callable[..., Any], Any], ...] = ()
    forward_backward: tuple[Callable[..., Any], Any] | None = None
    # The parameters this run's backward writes gradients to (its optimizer's), so that
    # a loss that flows through another run's model leaves nothing on it; None: all.
    backward_inputs: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    backward: tuple[Callable[..., Any], Any] | None = None
    # Derived from the fields above: which halves of a step are PyTorch's alone, so
    # that a step without hooks there runs them without looping over empty tuples.
    plain_backward: bool = field(init=False, repr=False, compare=False)
    plain_update: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _set(self, "plain_backward", (self.micro_steps == 1 or not self.divide_loss) and not self.scale_loss
             and self.backward is None and not self.after_backward)
        _set(self, "plain_update", not self.before_update and self.optimizer_step is None)

    @classmethod
    def of(cls, pipeline: Pipeline, transform_states: Mapping[str, Any]) -> StepPlan:
        ts = _training(pipeline)

        def bound(hook: str) -> tuple[tuple[Callable[..., Any], Any], ...]:
            return tuple(
                (getattr(t, hook), transform_states.get(t.name))
                for t in ts if getattr(t, hook) is not None
            )

        steppers = bound("optimizer_step")
        runners = bound("forward_backward")
        taken = frozenset().union(*(t.takes_over for t in ts))
        backward = bound("backward")
        return cls(
            micro_steps=next((t.micro_steps for t in ts if t.micro_steps > 1), 1),
            sync_each_batch=any(t.sync_each_batch for t in ts),
            divide_loss=not any(t.sums_items for t in ts),
            after_backward=bound("after_backward"),
            scale_loss=bound("scale_loss"),
            before_update=tuple((t.before_update, transform_states.get(t.name)) for t in ts
                                if t.before_update is not None and t.name not in taken),
            backward=backward[0] if backward else None,
            optimizer_step=steppers[0] if steppers else None,
            set_sync=tuple(t.set_sync for t in ts if t.set_sync is not None),
            after_step=bound("after_step"),
            forward_backward=runners[0] if runners else None,
        )

    def set_sync_for(self, model: Any, micro_step: int) -> None:
        """Gradient communication on for micro-step ``micro_step`` only if it ends
        an accumulation (or the pipeline syncs every batch)."""
        if self.set_sync:
            enabled = self.sync_each_batch or (micro_step + 1) % self.micro_steps == 0
            for set_sync in self.set_sync:
                set_sync(model, enabled)


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


def prepare(
    state: RunState,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loader: Any = None,
    scheduler: Any = None,
    *,
    pipeline: Pipeline | None = None,
    loss_fn: LossFn | None = None,
) -> RunState:
    """Consumes ``state``: move the model to the device, apply the pipeline's
    preparation (DDP wrapping, FSDP2 sharding, compilation), prepare the loader.

    Args:
        state: the run's state.
        model, optimizer, loader, scheduler: live PyTorch objects; any may be
            left out and given to a later `prepare`.
        pipeline: composed training transforms; default: the launch config's
            (`default_pipeline`).
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``; default:
            `default_loss_fn`.

    Returns:
        The prepared state.

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
    if pipeline is None:
        held = state.pipeline
        assert held is None or isinstance(held, Pipeline), "a state's pipeline comes from fa.prepare"
        pipeline = held if held is not None else default_pipeline(state)
    elif state.pipeline is None:
        _warn_if_launch_ignored(pipeline, state)
    if state.pipeline is not None and state.model is not None and pipeline != state.pipeline:
        raise ValueError("fa.prepare: this state's model was prepared with another pipeline")
    pipeline = _complete(pipeline, state)
    transform_states = pipeline.init(ctx, state.transform_states)
    for name, value in transform_states.items():
        if callable(getattr(value, "close", None)) and state.resources.get(f"transform:{name}") is None:
            state.resources.register(f"transform:{name}", value)  # a profiler run: fa.shutdown closes it

    changes: dict[str, Any] = {"pipeline": pipeline}
    engine = next((t for t in _training(pipeline) if t.prepare_engine is not None), None)  # fa.deepspeed
    if model is not None:
        if state.model is not None:
            raise ValueError("fa.prepare: this state already holds a prepared model")
        _refuse_meta(model, ctx)
        names = {id(p): name for name, p in model.named_parameters()}
        model = model.to(ctx.device)
        for t in _training(pipeline):
            if t.prepare_model is not None:
                model = t.prepare_model(ctx, model, transform_states.get(t.name))
        if engine is not None and engine.prepare_engine is not None:
            model, optimizer = engine.prepare_engine(EngineRequest(
                ctx=ctx, pipeline=pipeline, model=model, optimizer=optimizer,
                micro_batch_size=getattr(loader, "batch_size", None), state=transform_states.get(engine.name)))
        elif optimizer is not None:
            _rebind_optimizer(optimizer, names, model)
        changes["model"] = model
    elif optimizer is not None and engine is not None:
        raise ValueError(f"fa.prepare: {pipeline!r} builds an engine from the model and the optimizer "
                         "together; pass both in the same fa.prepare call")
    if optimizer is not None:
        if model is None and state.model is not None and {"fsdp", "pp"} & set(pipeline.names):
            _check_optimizer_params(optimizer, state.model)
        changes["optimizer"] = optimizer
    if scheduler is not None:
        changes["scheduler"] = scheduler
    if loss_fn is not None:
        if "pp" in pipeline.names:
            raise ValueError("fa.prepare: under fa.pp the loss is computed at the last stage by "
                             "fa.pp(loss_fn=lambda output, target: ...); drop fa.prepare's loss_fn")
        changes["loss_fn"] = loss_fn
    if loader is not None:
        from fnaccel.data.loader import prepare_loader  # the data path's own module

        config = state.kwargs_handlers.get("DataLoaderConfiguration")
        if ("pp" in pipeline.names and ctx.num_processes > 1 and mesh_dim(ctx, "pp") is None
                and (config is None or config.shard is not False)):
            raise ValueError(
                "fa.prepare: every stage of fa.pp must read the same batches, but the loader would be "
                "sharded over the processes; give fa.init(parallelism=fa.ParallelismConfig(pp_size=N)) "
                "(the data is then split over the data-parallel ranks only) or pass "
                "kwargs_handlers=[DataLoaderConfiguration(shard=False)] to fa.init")
        changes["loader"] = prepare_loader(loader, ctx, seed=state.seed or 0, config=config)
    changes["transform_states"] = transform_states
    plan = StepPlan.of(pipeline, transform_states)
    held = changes.get("optimizer", state.optimizer)
    if held is not None and "fsdp" not in pipeline.names and plan.backward is None:
        # FSDP2 computes gradients on unsharded copies of the parameters, not on these
        plan = dataclasses.replace(plan, backward_inputs=tuple(
            p for group in held.param_groups for p in group["params"] if p.requires_grad))
    changes["plan"] = plan
    new = state.advance(by, **changes)
    if new.model is not None:
        plan.set_sync_for(new.model, new.micro_step)
    return new


def _warn_if_launch_ignored(pipeline: Pipeline, state: RunState) -> None:
    """An explicit pipeline wins over the launch (as explicit arguments do); say so
    when the launch asked for a precision or FSDP that the pipeline leaves out."""
    import warnings

    cast = pipeline.get("autocast")
    dtype = dict(cast.options)["dtype"] if cast is not None else None
    low = state.mixed_precision in (PrecisionType.FP16, PrecisionType.BF16)
    wanted: Any = precision_dtype(state.mixed_precision) if low else None
    if state.mixed_precision == PrecisionType.FP8:
        wanted = str(fp8)  # what autocast(fa.fp8) records as its dtype
    handler = state.kwargs_handlers.get("AutocastKwargs")
    if handler is not None and not handler.enabled:
        wanted = None  # the default pipeline would leave autocast out too
    if wanted is not None and dtype != wanted:
        warnings.warn(
            f"fa.prepare: the launch asked for mixed_precision {state.mixed_precision.value} but the "
            f"pipeline passed in is {pipeline!r}; the pipeline wins. Leave pipeline out to follow the "
            "launch, or add fa.autocast to it", UserWarning, stacklevel=3)
    if state.config.distributed_type == "DEEPSPEED" and "deepspeed" not in pipeline.names:
        warnings.warn(
            f"fa.prepare: the launch asked for DeepSpeed but the pipeline passed in is {pipeline!r}; the "
            "pipeline wins. Leave pipeline out to follow the launch, or add fa.deepspeed to it",
            UserWarning, stacklevel=3)
    if state.config.distributed_type == "FSDP" and state.dist.num_processes > 1 \
            and "fsdp" not in pipeline.names:
        warnings.warn(
            f"fa.prepare: the launch asked for FSDP but the pipeline passed in is {pipeline!r}; the "
            "pipeline wins. Leave pipeline out to follow the launch, or add fa.fsdp to it",
            UserWarning, stacklevel=3)


def _check_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Under fsdp() or pp(), an optimizer passed after its model was prepared must hold
    the prepared model's parameters: FSDP2 replaced the ones it may have been built on,
    and pp() keeps this rank's stages only. (An optimizer that also holds parameters
    of its own, outside the model, is fine when passed together with the model.)"""
    current = {id(p) for p in model.parameters()}
    if any(id(p) not in current for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "fa.prepare: the optimizer holds parameters that are not the prepared model's: fa.fsdp "
            "replaced the model's parameters with sharded ones (fa.pp keeps this rank's stages "
            "only); pass the optimizer in the same fa.prepare call as the model, or build it from "
            "state.model.parameters()"
        )


def _refuse_meta(model: nn.Module, ctx: Any) -> None:
    """A model with tensors on the meta device cannot be moved or trained. In a larger
    world the ranks agree first (one small all-reduce per prepare), so that every rank
    raises instead of one raising while the others wait in DDP's or FSDP2's first
    collective."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    on_meta = next((name for name, t in tensors if t.is_meta), None)
    anywhere = on_meta is not None
    if ctx.num_processes > 1:
        import torch.distributed as dist

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


def _require(state: RunState, action: str) -> tuple[nn.Module, torch.optim.Optimizer, StepPlan]:
    state.check_fresh(action)
    if state.model is None or state.optimizer is None or state.plan is None:
        raise ValueError(f"{action}: prepare a model and an optimizer first (fa.prepare)")
    plan = state.plan
    assert isinstance(plan, StepPlan), "a state's plan comes from fa.prepare"
    return state.model, state.optimizer, plan


def _backward(plan: StepPlan, loss: torch.Tensor, aux: Any) -> None:
    if plan.plain_backward:  # nothing to divide, scale or call after: PyTorch's backward alone
        loss.backward(inputs=plan.backward_inputs)
        return
    scaled = loss / plan.micro_steps if plan.micro_steps > 1 and plan.divide_loss else loss
    for scale_loss, transform_state in plan.scale_loss:
        scaled = scale_loss(scaled, transform_state)
    if plan.backward is None:
        scaled.backward(inputs=plan.backward_inputs)
    else:  # an engine's own backward (fa.deepspeed)
        engine_backward, transform_state = plan.backward
        engine_backward(scaled, transform_state)
    for after_backward, transform_state in plan.after_backward:
        after_backward(aux, transform_state)


def _update(state: RunState, model: nn.Module, optimizer: torch.optim.Optimizer,
            plan: StepPlan) -> dict[str, Any]:
    if plan.plain_update:  # no hook can skip the update or add metrics
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]  # the rate this update used
        if state.scheduler is not None:
            state.scheduler.step()
        return {"lr": lr}
    metrics: dict[str, Any] = {}
    for before_update, transform_state in plan.before_update:
        metrics.update(before_update(model, optimizer, transform_state))
    if plan.optimizer_step is None:
        optimizer.step()
    else:
        optimizer_step, transform_state = plan.optimizer_step
        metrics.update(optimizer_step(optimizer, transform_state))
    metrics["lr"] = optimizer.param_groups[0]["lr"]  # the rate this update used
    skipped = metrics.get("skipped")
    if state.scheduler is not None and (skipped is None or not bool(skipped)):
        state.scheduler.step()
    return metrics


def _start_window(state: RunState, optimizer: torch.optim.Optimizer, plan: StepPlan) -> None:
    """Gradients start from nothing at an accumulation window's first micro-step, so
    that what other code's backward left on these parameters never reaches this
    run's update. (Another fnaccel run's backward writes only its own parameters:
    `StepPlan.backward_inputs`, so nothing leaks inside a window either.) An engine with
    its own backward (DeepSpeed) owns the gradients: it zeroes them after each update,
    and its optimizer's parameters keep buffers of its own in ``.grad``."""
    if state.micro_step % plan.micro_steps == 0 and plan.backward is None:
        _clear_grads(optimizer)


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``: for an optimizer that keeps torch's
    zero_grad, what it does (every parameter's ``.grad`` set to None) without the
    profiler record around it, which costs more than the loop (about 10 us of a
    200 us step); an optimizer with its own zero_grad gets it called."""
    if type(optimizer).zero_grad is not _TORCH_ZERO_GRAD:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def _after(plan: StepPlan) -> None:
    for after_step, transform_state in plan.after_step:
        after_step(transform_state)


def _consumed(state: RunState) -> Any:
    """The data position once this step has consumed the batch `fa.batches` fetched last."""
    loader = state.loader
    return state.data_position if loader is None else loader.consumed(state.data_position)


def step(state: RunState, batch: Any) -> tuple[RunState, dict[str, Any]]:
    """Consumes ``state``: one training step on ``batch``.

    At an accumulation window's first micro-step, ``zero_grad(set_to_none=True)``
    (so gradients another run's backward left here never count); then the loss
    function under the run's RNG, backward, and at an accumulation boundary:
    unscale, clip, optimizer step, scheduler step (not when the fp16 scaler
    skipped). When ``batch`` came from `fa.batches`, the state's data position
    moves past it.

    Returns:
        ``(new_state, metrics)``: ``loss`` (detached), ``aux`` when the loss
        function returned one, and at a boundary ``lr``, ``grad_norm`` when
        clipping by norm, ``scale`` and ``skipped`` under fp16 scaling.

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1),
    ...                    loss_fn=lambda m, b: m(b).pow(2).mean())
    >>> state, metrics = fa.step(state, torch.ones(4, 2))
    >>> state.step, sorted(metrics)
    (1, ['loss', 'lr'])
    """
    by = "fa.step"
    model, optimizer, plan = _require(state, by)
    micro_step = state.micro_step
    boundary = (micro_step + 1) % plan.micro_steps == 0
    # The run's generators in, the step, then their new values out: no restore
    # of the process's values (every step installs its own), no context manager.
    kinds = state.step_rng_types
    rng = state.rng
    _start_window(state, optimizer, plan)
    rng.install(kinds)
    if plan.forward_backward is None:
        out = (state.loss_fn or default_loss_fn)(model, batch)
        loss, aux = out if isinstance(out, tuple) else (out, None)
        _backward(plan, loss, aux)
    else:
        run, transform_state = plan.forward_backward
        loss, aux = run(model, batch, plan.micro_steps if plan.divide_loss else None, transform_state)
    metrics = _update(state, model, optimizer, plan) if boundary else {}
    rng = rng.recapture(kinds)
    metrics["loss"] = loss.detach()
    if aux is not None:
        metrics["aux"] = aux
    new = state.advance(by, rng=rng, micro_step=micro_step + 1, step=state.step + boundary,
                        data_position=_consumed(state))
    if plan.set_sync:
        plan.set_sync_for(model, new.micro_step)
    if plan.after_step:
        _after(plan)
    return new, metrics


def backward(state: RunState, loss: torch.Tensor, aux: Any = None) -> RunState:
    """Consumes ``state``: backward of ``loss`` as `fa.step` does it (accumulation
    scaling, fp16 loss scaling), counted as one micro-step. ``aux`` is what
    the loss function returned beside the loss (``{"num_items": n}`` under
    ``accumulate(normalize="items")``).

    For hand-written steps: run the forward under the run's RNG with
    `fa.with_rng`, then ``state = fa.backward(state, loss)`` and
    ``state, metrics = fa.apply_gradients(state)``.
    """
    by = "fa.backward"
    model, optimizer, plan = _require(state, by)
    if plan.forward_backward is not None:
        raise ValueError(f"{by}: a pipeline schedule (fa.pp) runs forward and backward together "
                         "in fa.step; call fa.step(state, batch) instead")
    _start_window(state, optimizer, plan)
    _backward(plan, loss, aux)
    new = state.advance(by, micro_step=state.micro_step + 1, data_position=_consumed(state))
    plan.set_sync_for(model, new.micro_step)
    return new


def apply_gradients(state: RunState) -> tuple[RunState, dict[str, Any]]:
    """Consumes ``state``: the update half of `fa.step` (unscale, clip, optimizer
    and scheduler step, zero_grad) when the micro-steps since the last update
    complete an accumulation; otherwise a no-op returning empty metrics."""
    by = "fa.apply_gradients"
    model, optimizer, plan = _require(state, by)
    if state.micro_step // plan.micro_steps <= state.step:
        return state.advance(by), {}
    state.rng.install(state.step_rng_types)
    metrics = _update(state, model, optimizer, plan)
    new = state.advance(by, rng=state.rng.recapture(state.step_rng_types), step=state.step + 1)
    _after(plan)
    return new, metrics
