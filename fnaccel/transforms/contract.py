"""The hooks a training transform may have (one Protocol each), what `fa.prepare` hands them, and their order.

This docstring is the one description of that order; the records that carry
the hooks (`fnaccel.transforms.kinds`), `fa.prepare` (fnaccel/preparation.py)
and the step (fnaccel/train.py) refer to it. Each hook sits on the kind of
transform that needs it: every `Transform` may have ``check``, ``init``,
``prepare_model`` and ``after_step``; a `StepTransform` adds the gradient
hooks; a `ParallelismTransform` those that decide where the model and the batch
live; an `EngineTransform` hands the model to an engine of its own.

At `fa.prepare`, once per call:

    check            each transform, in pipeline order, with a `PrepareRequest`
                     (the pipeline so far, the context, what this call passes);
                     raises ValueError with the fix, or returns the pipeline
                     completed with what it implies (fp16 adds a grad_scaler)
    init             each transform's state record, once per run
    prepare_model    in pipeline order, each on what the one before returned
                     (the earliest wraps innermost)
    prepare_engine   the engine's, after every prepare_model (`EngineRequest`)
    set_sync         gradient communication for the first micro-step

At each `fa.step` (`fa.backward` and `fa.apply_gradients` are its two halves):

    split_batch      this rank's part of the batch (fa.sp)
    forward          loss_fn(model, batch) under the run's generators; or one
                     forward_backward hook instead of forward and backward (fa.pp)
    backward         loss / micro_steps -> scale_loss hooks -> the engine's
                     backward, or torch's -> after_backward hooks (see the loss
                     and aux) -> set_sync for the *next* micro-step
    window           gradients zeroed at an accumulation window's first
                     micro-step (an engine with its own backward clears its own)
    boundary         before_update hooks (unscale, normalise, clip; skipped for
                     the capabilities an engine takes over) -> the first
                     optimizer_step hook -> the check_update hook (may hold
                     the update back) -> optimizer.step() unless a hook
                     stepped or held it -> scheduler.step() unless skipped
                     -> after_step hooks
    position         the data position moves past the batch consumed

A transform's own state record (what its ``init`` built) is the last
positional argument of each step hook, typed `Any` here because each
transform's is its own type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fnaccel.dist import DistContext

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fnaccel.state import DataPosition
    from fnaccel.transforms.declared import Capability

__all__ = [
    "EngineRequest",
    "PipelineView",
    "PrepareRequest",
    "AfterBackwardFn",
    "AfterStepFn",
    "BackwardFn",
    "BeforeUpdateFn",
    "ForwardBackwardFn",
    "OptimizerStepFn",
    "PrepareCheckFn",
    "PrepareEngineFn",
    "PrepareModelFn",
    "ScaleLossFn",
    "SetSyncFn",
    "SplitBatchFn",
    "TransformInitFn",
    "UpdateCheckFn",
]

S = TypeVar("S")


class PipelineView(Protocol):
    """What a check or an engine reads of the pipeline (`fnaccel.transforms.pipeline.Pipeline`
    is one: this Protocol keeps the hooks below the records that carry them)."""

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What its transforms do, together."""
        ...

    @property
    def forward_backward(self) -> object | None:
        """The transform that runs the forward and backward passes itself, or None."""
        ...

    def settings(self, kind: type[S]) -> S | None:
        """The settings record of type ``kind`` a transform declares, or None."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareRequest:
    """What `fa.prepare` hands each transform's ``check``: the pipeline and what this call passes.

    Attributes:
        pipeline: the pipeline as the checks before this one left it.
        ctx: the run's distributed context (its mesh, ranks and device).
        loss_fn_given: this call passes a loss function.
        loader_shards: the ways this call's loader is cut across the
            processes (1: every process reads every batch); None: no loader.
        optimizer_params: the parameters of this call's optimizer, group by
            group in order; None: no optimizer.
        model: the model this call passes, before any preparation, or None.
        prepared_model: the model an earlier `fa.prepare` of this run
            prepared, or None.
    """

    pipeline: PipelineView
    ctx: DistContext
    loss_fn_given: bool = False
    loader_shards: int | None = None
    optimizer_params: tuple[torch.Tensor, ...] | None = None
    model: nn.Module | None = None
    prepared_model: nn.Module | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """What `fa.prepare` gives an engine's ``prepare_engine`` hook.

    Attributes:
        ctx: the run's distributed context.
        pipeline: the whole training pipeline (the engine reads the settings
            other transforms state: accumulation, clipping, precision).
        model: the model, on the device, after every ``prepare_model`` hook.
        optimizer: the optimizer passed with it (None: none was; the engine
            says it needs one).
        micro_batch_size: the loader's batch size per process, when a loader
            was passed in the same call.
        state: the engine transform's own state.
    """

    ctx: DistContext
    pipeline: PipelineView
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    micro_batch_size: int | None
    state: object


class PrepareCheckFn(Protocol):
    """``Transform.check``: the transform's whole contract with what `fa.prepare` is given.

    Gets a `PrepareRequest` (the pipeline, the context, whether a loss
    function, a loader or an optimizer comes in this call); raises ValueError
    saying what to change, or returns the pipeline, completed with what the
    transform implies (``request.pipeline`` itself, or a `fa.compose` of it).
    """

    def __call__(self, request: PrepareRequest, /) -> PipelineView: ...


class TransformInitFn(Protocol):
    """``Transform.init``: builds the transform's state record for a run.

    `fa.prepare` calls it once per run (a state prepared in parts keeps the
    record it has); the record is stored under the transform's name in
    ``state.transform_states``, saved with checkpoints, and handed to each
    of the transform's hooks. A record with ``close()`` (a profiler run) is
    closed by `fa.shutdown`.
    """

    def __call__(self, ctx: DistContext, /) -> object: ...


class PrepareModelFn(Protocol):
    """``Transform.prepare_model``: wraps, shards or converts the model, once.

    Gets the model already on the run's device; the last result becomes
    ``state.model``. ``state`` is the transform's own.
    """

    def __call__(self, ctx: DistContext, model: nn.Module, state: Any, /) -> nn.Module: ...


class AfterStepFn(Protocol):
    """``Transform.after_step``: runs once the new state exists (the profiler steps, local SGD averages)."""

    def __call__(self, state: Any, /) -> None: ...


class ScaleLossFn(Protocol):
    """``StepTransform.scale_loss``: the loss backward runs on, from the loss before it.

    The fp16 scaler multiplies by its scale; `fa.skip_nonfinite` makes a
    non-finite loss's gradients non-finite on every rank.
    """

    def __call__(self, loss: torch.Tensor, state: Any, /) -> torch.Tensor: ...


class AfterBackwardFn(Protocol):
    """``StepTransform.after_backward``: sees each backward's loss and the loss function's ``aux``.

    ``loss`` is the loss function's, before any division or scaling. Metrics
    it returns replace `fa.step`'s of the same name, ``loss`` included
    (``accumulate(normalize="items")`` reports the window's loss per item);
    None adds nothing.
    """

    def __call__(self, loss: torch.Tensor, aux: object, state: Any, /) -> dict[str, torch.Tensor] | None: ...


class BeforeUpdateFn(Protocol):
    """``StepTransform.before_update``: works on the gradients before the optimizer steps.

    Returns metrics for `fa.step` (``grad_norm``), tensors left on the device.
    """

    def __call__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, /
    ) -> dict[str, torch.Tensor]: ...


class OptimizerStepFn(Protocol):
    """``StepTransform.optimizer_step``: replaces ``optimizer.step()``; the first one steps.

    Its metrics go into `fa.step`'s; a ``skipped`` bool tensor that is True
    holds back the scheduler step too.
    """

    def __call__(self, optimizer: torch.optim.Optimizer, state: Any, /) -> dict[str, torch.Tensor]: ...


class UpdateCheckFn(Protocol):
    """``StepTransform.check_update``: whether an update is held back (`fa.skip_nonfinite`).

    ``metrics`` holds the update's metrics so far (``grad_norm``,
    ``skipped``); it may add its own. True holds the update back: no
    optimizer step (unless an ``optimizer_step`` hook stepped already), no
    scheduler step, gradients cleared. ``step`` is the run's update count
    before this update; ``position`` the data position once the update's
    batches are consumed (for error messages).
    """

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        metrics: dict[str, torch.Tensor],
        state: Any,
        step: int,
        position: DataPosition,
        /,
    ) -> bool: ...


class SetSyncFn(Protocol):
    """``ParallelismTransform.set_sync``: gradient communication on or off for the next backward.

    ``enabled`` is True only when the next micro-step ends an accumulation
    window (or the pipeline's `Accumulation` syncs each batch): DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``.
    """

    def __call__(self, model: nn.Module, enabled: bool, /) -> None: ...


class SplitBatchFn(Protocol):
    """``ParallelismTransform.split_batch``: the part of the batch this rank computes on.

    `fa.sp` keeps this rank's slice of the sequence: the ranks of one
    sequence-parallel group read one batch and each computes on its part.
    """

    def __call__(self, batch: object, state: Any, /) -> object: ...


class ForwardBackwardFn(Protocol):
    """``ParallelismTransform.forward_backward``: the loss function and backward in one call.

    A pipeline schedule (`fa.pp`) runs both over its stages. Gradients are
    divided by ``divisor`` (the accumulation count). Returns the loss
    (`fa.step`'s ``loss`` metric) and an aux (None when there is none).
    """

    def __call__(
        self, model: nn.Module, batch: object, divisor: int | None, state: Any, /
    ) -> tuple[torch.Tensor, object]: ...


class PrepareEngineFn(Protocol):
    """``EngineTransform.prepare_engine``: builds the engine the model and optimizer are handed to.

    Gets an `EngineRequest`; the model and optimizer it returns are the state's.
    """

    def __call__(self, request: EngineRequest, /) -> tuple[nn.Module, torch.optim.Optimizer]: ...


class BackwardFn(Protocol):
    """``EngineTransform.backward``: replaces ``loss.backward()`` (the engine reduces gradients there).

    ``loss`` is already divided by the accumulation count and passed through
    every ``scale_loss`` hook. An engine with its own backward owns the
    gradients: `fa.step` does not clear them when an accumulation window
    starts, so the engine clears them after its update.
    """

    def __call__(self, loss: torch.Tensor, state: Any, /) -> None: ...
