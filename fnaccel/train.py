"""`fa.step`, and its two halves `fa.backward` and `fa.apply_gradients`; the
`StepPlan` they run, which `fa.prepare` (fnaccel/preparation.py) resolves once.

This module is the per-iteration path; preparing a run (moving, wrapping and
sharding the model, the default pipeline, the checks on what is passed in)
happens once and lives in fnaccel/preparation.py, which imports the plan from here.

A step is a fixed sequence; transforms contribute through named hooks, whose
order is described once, in `fnaccel.transforms.contract`.

Metrics are detached tensors on the device: nothing here reads a tensor on
the host, so there is no host-device sync beyond what torch's GradScaler does
on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fnaccel.calls import failure_of
from fnaccel.dist import DistContext, data_parallel
from fnaccel.kwargs.mixin import KwargsHandler
from fnaccel.rng import put_back, swap_in, swap_out
from fnaccel.state import DataPosition, RunState
from fnaccel.transforms.contract import (
    AfterBackwardFn,
    AfterStepFn,
    BackwardFn,
    BeforeUpdateFn,
    ForwardBackwardFn,
    OptimizerStepFn,
    ScaleLossFn,
    SetSyncFn,
    SplitBatchFn,
    UpdateCheckFn,
)
from fnaccel.transforms.declared import Accumulation
from fnaccel.transforms.kinds import Transform
from fnaccel.transforms.pipeline import Pipeline

__all__ = [
    "SchedulerConfiguration",
    "SchedulerRuleWarning",
    "StepPlan",
    "apply_gradients",
    "backward",
    "scheduler_steps",
    "step",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfiguration(KwargsHandler):
    """How far `fa.step` advances the scheduler passed to `fa.prepare` at each optimizer update.

    Pass it to ``fa.init(kwargs_handlers=[SchedulerConfiguration(...)])``.

    Args:
        step_per_process: advance the scheduler once per process the loader's
            batches are cut across (Accelerate's rule: ``num_processes`` steps
            per update, one when ``split_batches``), so that a schedule sized
            from the loader before `fa.prepare` (``len(loader) * epochs``)
            ends with the run on any number of processes. False: one step per
            update, for a schedule sized in updates
            (``len(state.loader) * epochs // accumulation``).

    >>> SchedulerConfiguration(step_per_process=False).to_kwargs()
    {'step_per_process': False}
    """

    step_per_process: bool = True


class SchedulerRuleWarning(UserWarning):
    """A scheduler given to a later `fa.prepare` than the loader, on several processes:
    `fa.step` advances it once per process at each update (Accelerate's rule since the
    2026-11-27 release; it stepped once per update before), so a schedule sized in
    updates would end early. Sized from the loader, or with ``SchedulerConfiguration``
    given, it is not shown."""


def scheduler_steps(ctx: DistContext, loader: object, kwargs_handlers: Mapping[str, Any]) -> int:
    """The scheduler steps one optimizer update takes (`SchedulerConfiguration`).

    With a prepared loader, the ranks each global batch is cut across (its layout's
    ``num_shards``): the factor by which the loader's own length overstates the
    updates of an epoch, which is Accelerate's ``num_processes`` under data
    parallelism; 1 when batches are split, or the loader is not sharded by fnaccel
    (its length is already this rank's). Without one, the data-parallel processes,
    1 under ``DataLoaderConfiguration(split_batches=True)``.

    >>> scheduler_steps(DistContext(num_processes=2, rank=0), None, {})
    2
    >>> scheduler_steps(DistContext(num_processes=2, rank=0), None,
    ...                 {"SchedulerConfiguration": SchedulerConfiguration(step_per_process=False)})
    1
    """
    config = kwargs_handlers.get("SchedulerConfiguration")
    if config is not None and not config.step_per_process:
        return 1
    layout = getattr(loader, "layout", None)
    if layout is not None:
        return 1 if layout.split_batches else int(layout.num_shards)
    data_config = kwargs_handlers.get("DataLoaderConfiguration")
    return 1 if data_config is not None and data_config.split_batches else data_parallel(ctx)[1]


def default_loss_fn(model: nn.Module, batch: object) -> torch.Tensor:
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
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"fa.step: the model returned a {type(out).__name__} that is neither a scalar "
            "loss nor has a .loss tensor; pass loss_fn=lambda model, batch: ... to fa.prepare"
        )
    return loss


def training_transforms(pipeline: Pipeline) -> tuple[Transform, ...]:
    """A checked training pipeline's transforms (`_complete` in fnaccel/preparation.py
    refused collectives)."""
    return tuple(t for t in pipeline.transforms if isinstance(t, Transform))


_set = object.__setattr__  # writes a frozen slot (StepPlan.__post_init__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """A pipeline's hooks bound to their transform states, resolved once by
    `fa.prepare` so that a step runs tuples instead of searching the pipeline."""

    micro_steps: int = 1
    scheduler_steps: int = 1  # per optimizer update (`scheduler_steps`)
    sync_each_batch: bool = False
    divide_loss: bool = True
    # Each hook with its transform's state (`fnaccel.transforms.contract` documents the hooks).
    scale_loss: tuple[tuple[ScaleLossFn, object], ...] = ()
    before_update: tuple[tuple[BeforeUpdateFn, object], ...] = ()
    optimizer_step: tuple[OptimizerStepFn, object] | None = None
    check_update: tuple[UpdateCheckFn, object] | None = None
    after_backward: tuple[tuple[AfterBackwardFn, object], ...] = ()
    set_sync: tuple[SetSyncFn, ...] = ()
    after_step: tuple[tuple[AfterStepFn, object], ...] = ()
    forward_backward: tuple[ForwardBackwardFn, object] | None = None
    split_batch: tuple[tuple[SplitBatchFn, object], ...] = ()
    # The parameters this run's backward writes gradients to (its optimizer's), so that
    # a loss that flows through another run's model leaves nothing on it; None: all.
    backward_inputs: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    backward: tuple[BackwardFn, object] | None = None
    # Derived from the fields above: which halves of a step are PyTorch's alone, so
    # that a step without hooks there runs them without looping over empty tuples.
    plain_backward: bool = field(init=False, repr=False, compare=False)
    plain_update: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _set(
            self,
            "plain_backward",
            (self.micro_steps == 1 or not self.divide_loss)
            and not self.scale_loss
            and self.backward is None
            and not self.after_backward,
        )
        _set(
            self,
            "plain_update",
            not self.before_update and self.optimizer_step is None and self.check_update is None,
        )

    @classmethod
    def of(
        cls, pipeline: Pipeline, transform_states: Mapping[str, object], scheduler_steps: int = 1
    ) -> StepPlan:
        ts = training_transforms(pipeline)

        def bound(hook: str) -> tuple[tuple[Callable[..., Any], object], ...]:
            # a hook lives on the kinds of transform that have it (`fnaccel.transforms.kinds`)
            return tuple(
                (fn, transform_states.get(t.name)) for t in ts if (fn := getattr(t, hook, None)) is not None
            )

        steppers = bound("optimizer_step")
        checkers = bound("check_update")
        runners = bound("forward_backward")
        engine = pipeline.engine
        taken = engine.takes_over if engine is not None else frozenset()
        accumulation = pipeline.settings(Accumulation)
        if accumulation is None:  # every batch updates, unless an engine's own configuration accumulates
            accumulation = Accumulation(micro_steps=engine.micro_steps if engine is not None else 1)
        return cls(
            micro_steps=accumulation.micro_steps,
            scheduler_steps=scheduler_steps,
            sync_each_batch=accumulation.sync_each_batch,
            divide_loss=not accumulation.sums_items,
            after_backward=bound("after_backward"),
            scale_loss=bound("scale_loss"),
            before_update=tuple(
                (fn, transform_states.get(t.name))
                for t in ts
                if (fn := getattr(t, "before_update", None)) is not None and not t.capabilities & taken
            ),
            backward=None
            if engine is None or engine.backward is None
            else (engine.backward, transform_states.get(engine.name)),
            optimizer_step=steppers[0] if steppers else None,
            check_update=checkers[0] if checkers else None,
            set_sync=tuple(fn for t in ts if (fn := getattr(t, "set_sync", None)) is not None),
            after_step=bound("after_step"),
            forward_backward=runners[0] if runners else None,
            split_batch=bound("split_batch"),
        )

    def set_sync_for(self, model: nn.Module, micro_step: int) -> None:
        """Gradient communication on for micro-step ``micro_step`` only if it ends
        an accumulation (or the pipeline syncs every batch)."""
        if self.set_sync:
            enabled = self.sync_each_batch or (micro_step + 1) % self.micro_steps == 0
            for set_sync in self.set_sync:
                set_sync(model, enabled)


def _require(state: RunState, action: str) -> tuple[nn.Module, torch.optim.Optimizer, StepPlan]:
    state.check_fresh(action)
    if state.model is None or state.optimizer is None or state.plan is None:
        raise ValueError(f"{action}: prepare a model and an optimizer first (fa.prepare)")
    saves = state.resources.get("saves")
    if saves is not None:  # an asynchronous save that failed is raised here (fnaccel/checkpoint/writer.py)
        saves.raise_failure()
    plan = state.plan
    assert isinstance(plan, StepPlan), "a state's plan comes from fa.prepare"
    return state.model, state.optimizer, plan


def _backward(plan: StepPlan, loss: torch.Tensor, aux: object) -> dict[str, torch.Tensor] | None:
    """Backward as the plan says; the metrics an after_backward hook reports, if any."""
    if plan.plain_backward:  # nothing to divide, scale or call after: PyTorch's backward alone
        loss.backward(inputs=plan.backward_inputs)
        return None
    scaled = loss / plan.micro_steps if plan.micro_steps > 1 and plan.divide_loss else loss
    for scale_loss, transform_state in plan.scale_loss:
        scaled = scale_loss(scaled, transform_state)
    if plan.backward is None:
        scaled.backward(inputs=plan.backward_inputs)
    else:  # an engine's own backward (fa.deepspeed)
        engine_backward, transform_state = plan.backward
        engine_backward(scaled, transform_state)
    reported = None
    for after_backward, transform_state in plan.after_backward:
        reported = after_backward(loss, aux, transform_state) or reported
    return reported


def _update(
    state: RunState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: StepPlan,
    position: DataPosition,
) -> dict[str, torch.Tensor | float]:
    if plan.plain_update:  # no hook can skip the update or add metrics
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]  # the rate this update used
        if state.scheduler is not None:
            _step_scheduler(state.scheduler, plan.scheduler_steps)
        return {"lr": lr}
    metrics: dict[str, torch.Tensor] = {}
    for before_update, transform_state in plan.before_update:
        metrics.update(before_update(model, optimizer, transform_state))
    if plan.optimizer_step is not None:  # it skips a non-finite update itself (the fp16 scaler)
        optimizer_step, transform_state = plan.optimizer_step
        metrics.update(optimizer_step(optimizer, transform_state))
    if plan.check_update is not None:  # it decides, from the metrics so far (fa.skip_nonfinite)
        check_update, transform_state = plan.check_update
        skip = check_update(model, optimizer, metrics, transform_state, state.step, position)
        if skip:
            _clear_grads(optimizer)
    else:
        skipped = metrics.get("skipped")
        skip = skipped is not None and bool(skipped)
    if plan.optimizer_step is None and not skip:
        optimizer.step()
    lr = optimizer.param_groups[0]["lr"]  # the rate this update used
    if state.scheduler is not None and not skip:
        _step_scheduler(state.scheduler, plan.scheduler_steps)
    return {**metrics, "lr": lr}


def _step_scheduler(scheduler: _Scheduler, steps: int) -> None:
    if steps == 1:
        scheduler.step()
        return
    # Several steps per update: the last update of a run whose ranks pad the last batch
    # can overshoot a schedule sized from the loader by part of an update; a
    # scheduler that refuses to step past its end (OneCycleLR's total_steps) stays
    # there, as under Accelerate.
    total = getattr(scheduler, "total_steps", None)
    for _ in range(steps):
        if total is not None and scheduler.last_epoch >= total:
            return
        scheduler.step()


class _Scheduler(Protocol):
    """What a step asks of the run's scheduler (torch's `LRScheduler`, or one like it)."""

    last_epoch: int

    def step(self) -> object: ...


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


def _consumed(state: RunState) -> DataPosition:
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
    kinds = state.step_rng_types
    rng = state.rng
    _start_window(state, optimizer, plan)
    # what this rank is doing, for a rank that waits for it in a collective call (fnaccel.calls)
    owner = state.dist.group_owner
    calls = None if owner is None else owner.calls
    if calls is not None:
        calls.call = calls.last = by
        calls.micro_step, calls.step = micro_step, state.step
    # The run's generators in, the step, their new values out, and the process's own
    # back, also when the step raises (inline: a context manager costs more than the swap).
    consumed = _consumed(state)
    held = swap_in(rng, kinds)
    try:
        for split_batch, transform_state in plan.split_batch:  # fa.sp: this rank's part of the sequence
            batch = split_batch(batch, transform_state)
        if plan.forward_backward is None:
            out = (state.loss_fn or default_loss_fn)(model, batch)
            loss, aux = out if isinstance(out, tuple) else (out, None)
            reported = _backward(plan, loss, aux)
        else:
            run, transform_state = plan.forward_backward
            loss, aux = run(model, batch, plan.micro_steps if plan.divide_loss else None, transform_state)
            reported = None
        metrics = _update(state, model, optimizer, plan, consumed) if boundary else {}
    except BaseException as error:
        put_back(kinds, held)
        failure = failure_of(owner, error)  # the gradients' all-reduce broke: a rank named why
        if failure is not None:
            raise failure from None  # the cause, named; gloo's "Connection closed" is its symptom
        raise
    rng = swap_out(rng, kinds, held)
    metrics["loss"] = loss.detach()
    if reported:  # accumulate(normalize="items"): the window's loss per item, its sum and count
        metrics.update(reported)
    if aux is not None:
        metrics["aux"] = aux
    new = state.advance(
        by, rng=rng, micro_step=micro_step + 1, step=state.step + boundary, data_position=consumed
    )
    if calls is not None:
        calls.call, calls.micro_step, calls.step = None, new.micro_step, new.step
    if plan.set_sync:
        plan.set_sync_for(model, new.micro_step)
    if plan.after_step:
        _after(plan)
    return new, metrics


def backward(state: RunState, loss: torch.Tensor, aux: object = None) -> RunState:
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
        raise ValueError(
            f"{by}: a pipeline schedule (fa.pp) runs forward and backward together "
            "in fa.step; call fa.step(state, batch) instead"
        )
    _start_window(state, optimizer, plan)
    owner = state.dist.group_owner
    calls = None if owner is None else owner.calls
    if calls is not None:
        calls.call = calls.last = by
        calls.micro_step, calls.step = state.micro_step, state.step
    try:
        _backward(plan, loss, aux)
    except RuntimeError as error:
        failure = failure_of(owner, error)  # the gradients' all-reduce broke: a rank named why
        if failure is not None:
            raise failure from None  # the cause, named; gloo's "Connection closed" is its symptom
        raise
    new = state.advance(by, micro_step=state.micro_step + 1, data_position=_consumed(state))
    if calls is not None:
        calls.call, calls.micro_step = None, new.micro_step
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
    kinds, rng = state.step_rng_types, state.rng
    held = swap_in(rng, kinds)
    try:
        metrics = _update(state, model, optimizer, plan, state.data_position)
    except BaseException:
        put_back(kinds, held)
        raise
    rng = swap_out(rng, kinds, held)
    new = state.advance(by, rng=rng, step=state.step + 1)
    _after(plan)
    return new, metrics
