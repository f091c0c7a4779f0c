"""The two transform records, `Transform` and `Collective`, and `compose`.

Both are small named records built by lowercase factories, in the spirit of
optax's ``GradientTransformation``: a `Transform` (``autocast(fa.bf16)``,
``accumulate(4)``) holds training hooks that `fa.prepare` and `fa.step` call;
a `Collective` (``gather()``, ``pad_across_processes(dim=1)``) holds one hook,
``apply(ctx, tree, call) -> (tree, call)``, run on a tree when the pipeline is
called. `compose` turns either kind (never both) into a `Pipeline`: a value
that prints as the code that built it, compares equal to an identical
pipeline, and keys each transform's state by the transform's name (optax's
``named_chain``), so saved states survive reordering.

A `Collective`'s ``call`` is the `CallInfo` passed along the chain (what
earlier steps learnt). A `Transform`'s hooks are optional fields, each typed
by a Protocol that says when it runs and what it gets (`PrepareModelFn`,
`ScaleLossFn`, `BeforeUpdateFn`, ...; fnaccel/train.py lists the step's fixed
sequence). What only an engine needs (``prepare_engine``, its own
``backward``, the capabilities whose hooks it runs itself) lives on the
subtype `EngineTransform` (`fa.deepspeed`).

A transform declares what it is, so that nothing outside it asks its name:
``capabilities`` (`Capability`: averages gradients, shards parameters, scales
the loss, ...), ``settings`` (a typed record other code reads: `Precision`,
`GradientClipping`, `Accumulation`; found with `Pipeline.settings`), and
``check_pipeline(pipeline, ctx) -> pipeline``, run by `fa.prepare`, which
checks the transform's combination with the rest of the pipeline and the
run's mesh (raising ValueError with the fix) or completes the pipeline with
what the transform implies (``autocast(fa.fp16)`` adds a ``grad_scaler()``).

Every transform has a ``phase`` (`fnaccel.transforms.phases.Phase`, the one
table of the order); a pipeline lists phases in non-decreasing order, and
``conflicts`` names the transforms it cannot be combined with
(``conflict_fix`` says why and what to do instead).
`compose` enforces both, and rejects duplicates, with a message that names
the transforms and the fix.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fnaccel.constants import PrecisionType
from fnaccel.dist import DistContext, as_dist
from fnaccel.protocols import CheckpointLayout

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fnaccel.ops.collectives import ShapeTable
    from fnaccel.state import DataPosition, RunState

__all__ = [
    "Accumulation",
    "CallInfo",
    "Capability",
    "Collective",
    "EngineRequest",
    "EngineTransform",
    "GradientClipping",
    "Pipeline",
    "PipelineCheckFn",
    "Precision",
    "Transform",
    "compose",
    # the hooks' signatures, one Protocol each
    "AfterBackwardFn",
    "AfterStepFn",
    "BackwardFn",
    "BeforeUpdateFn",
    "ForwardBackwardFn",
    "OptimizerStepFn",
    "PrepareEngineFn",
    "PrepareModelFn",
    "ScaleLossFn",
    "SetSyncFn",
    "SplitBatchFn",
    "TransformApplyFn",
    "TransformInitFn",
    "UpdateCheckFn",
]

S = TypeVar("S")


@dataclass(frozen=True, slots=True, kw_only=True)
class CallInfo:
    """What one call of a pipeline carries from step to step.

    Attributes:
        num_valid: leading real samples of this rank's batch (for
            `gather_for_metrics`), or None when all are real.
        shapes: every rank's shapes, once a step has exchanged them (padding
            does); a following gather uses them instead of checking again.
    """

    num_valid: int | None = None
    shapes: ShapeTable | None = None


class TransformInitFn(Protocol):
    """``Transform.init``: builds the transform's state record for a run.

    `fa.prepare` calls it once per run (a state prepared in parts keeps the
    record it has); the record is stored under the transform's name in
    ``state.transform_states``, saved with checkpoints, and handed to each
    of the transform's hooks as ``state``. A record with ``close()`` (a
    profiler run) is closed by `fa.shutdown`.
    """

    def __call__(self, ctx: DistContext, /) -> Any: ...


class PrepareModelFn(Protocol):
    """``Transform.prepare_model``: wraps, shards or converts the model, once, at `fa.prepare`.

    Called in pipeline order on the model already on the run's device, each
    on what the one before returned (so the earliest wraps innermost); the
    last result becomes ``state.model``. ``state`` is the transform's own.
    """

    def __call__(self, ctx: DistContext, model: nn.Module, state: Any, /) -> nn.Module: ...


class SetSyncFn(Protocol):
    """``Transform.set_sync``: switches gradient communication on or off for the next backward.

    `fa.prepare`, `fa.load` and every micro-step call it with ``enabled`` True only
    when the next micro-step ends an accumulation window (or the pipeline's
    `Accumulation` syncs each batch): DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``.
    """

    def __call__(self, model: nn.Module, enabled: bool, /) -> None: ...


class SplitBatchFn(Protocol):
    """``Transform.split_batch``: the part of the batch this rank computes on, before `fa.step`'s loss function.

    `fa.sp` keeps this rank's slice of the sequence: the ranks of one
    sequence-parallel group read one batch and each computes on its part.
    """

    def __call__(self, batch: Any, state: Any, /) -> Any: ...


class ScaleLossFn(Protocol):
    """``Transform.scale_loss``: the loss backward runs on, from the loss before it.

    Runs on every backward, after the division by the accumulation count
    (the fp16 scaler multiplies by its scale; `fa.skip_nonfinite` makes a
    non-finite loss's gradients non-finite on every rank).
    """

    def __call__(self, loss: torch.Tensor, state: Any, /) -> torch.Tensor: ...


class BeforeUpdateFn(Protocol):
    """``Transform.before_update``: works on the gradients at an update boundary, before the optimizer steps.

    In pipeline order (the scaler unscales, accumulation normalises by the
    items, clipping clips); returns metrics for `fa.step` (``grad_norm``),
    tensors left on the device. An engine that takes over a capability the
    transform declares (`EngineTransform.takes_over`) skips it.
    """

    def __call__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, /
    ) -> dict[str, torch.Tensor]: ...


class OptimizerStepFn(Protocol):
    """``Transform.optimizer_step``: replaces ``optimizer.step()`` at an update boundary.

    The first transform with one steps (the fp16 scaler, an engine). Its
    metrics go into `fa.step`'s; a ``skipped`` bool tensor that is True
    holds back the scheduler step too.
    """

    def __call__(self, optimizer: torch.optim.Optimizer, state: Any, /) -> dict[str, torch.Tensor]: ...


class UpdateCheckFn(Protocol):
    """``Transform.check_update``: whether an update is held back (`fa.skip_nonfinite`).

    At an update boundary, after every ``before_update`` and any
    ``optimizer_step`` hook, whose metrics ``metrics`` holds (``grad_norm``,
    ``skipped``); it may add its own to it. True holds the update back: no
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


class AfterBackwardFn(Protocol):
    """``Transform.after_backward``: sees each backward's loss and the loss function's ``aux``.

    ``loss`` is the loss function's, before any division or scaling. Metrics
    it returns replace `fa.step`'s of the same name, ``loss`` included
    (``accumulate(normalize="items")`` reports the window's loss per item);
    None adds nothing.
    """

    def __call__(self, loss: torch.Tensor, aux: Any, state: Any, /) -> dict[str, torch.Tensor] | None: ...


class AfterStepFn(Protocol):
    """``Transform.after_step``: runs after every `fa.step`, and after an `fa.apply_gradients` that
    updated, once the new state exists (the profiler steps, local SGD averages)."""

    def __call__(self, state: Any, /) -> None: ...


class ForwardBackwardFn(Protocol):
    """``Transform.forward_backward``: replaces `fa.step`'s loss function and backward with one call.

    A pipeline schedule (`fa.pp`) runs both over its stages. Gradients are
    divided by ``divisor`` (the accumulation count), or not at all when it is
    None (a loss summed over items, normalised at the update). Returns the
    loss (`fa.step`'s ``loss`` metric) and an aux (None when there is none).
    """

    def __call__(
        self, model: nn.Module, batch: Any, divisor: int | None, state: Any, /
    ) -> tuple[torch.Tensor, Any]: ...


class PrepareEngineFn(Protocol):
    """``EngineTransform.prepare_engine``: builds the engine the model and optimizer are handed to.

    `fa.prepare` calls it once, after every ``prepare_model`` hook, with an
    `EngineRequest`; the model and optimizer it returns are the state's.
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


class TransformApplyFn(Protocol):
    """Applies a collective step to a tree."""

    def __call__(self, ctx: DistContext, tree: Any, call: CallInfo) -> tuple[Any, CallInfo]: ...


class Capability(Enum):
    """What a training transform does, declared on it (`Transform.capabilities`).

    `fa.prepare`, `fa.step` and the checkpoint layer ask a pipeline for these,
    never for a transform's name, so a transform written outside fnaccel (a
    data-parallel wrapper of one's own) takes part as fnaccel's own do.
    """

    # Who declares each, and who asks:
    # ddp, fsdp, deepspeed; fa.prepare needs one (or SPLITS_MODEL) on several data-parallel ranks,
    # and fa.load ignores one present on one side only when the number of processes changed
    AVERAGES_GRADIENTS = "averages the data-parallel replicas' gradients"
    # fsdp; the sharded checkpoint layout, a backward without an inputs list (FSDP2 computes
    # gradients on unsharded copies), the launch's FSDP is what the pipeline has
    SHARDS_PARAMETERS = "holds the model's parameters as shards (DTensor) across ranks"
    # pp; the sharded checkpoint layout (as TENSOR_PARALLEL), and an optimizer passed after
    # its model must hold the prepared model's parameters (as SHARDS_PARAMETERS)
    SPLITS_MODEL = "keeps only part of the model on each rank (pipeline stages)"
    # pp; fa.prepare refuses a loss_fn of its own
    RUNS_FORWARD_BACKWARD = "runs the forward and backward passes itself"
    # pp; fa.prepare refuses a loader sharded over the ranks that must read alike
    SAME_BATCH_ACROSS_RANKS = "needs every rank of its group to read the same batches"
    # tp; the sharded checkpoint layout (fa.prepare asks Transform.mesh_dims for the tp dimension)
    TENSOR_PARALLEL = "splits layers over the mesh's tensor-parallel dimension"
    # grad_scaler, deepspeed; autocast(fa.fp16) adds a grad_scaler() only when none is there
    SCALES_LOSS = "scales the loss before backward (fp16)"
    # deepspeed; the ZeRO checkpoint layout, and the launch's DeepSpeed is what the pipeline has
    OWNS_OPTIMIZER_STEP = "runs the optimizer step itself (an engine)"
    # clip_grad_norm, clip_grad_value; an engine that takes it over skips their before_update
    CLIPS_GRADIENTS = "clips the gradients before the optimizer step"


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """The precision a transform makes the model compute in (`fa.autocast`'s settings).

    Attributes:
        precision: fp16, bf16, fp8, or ``PrecisionType.NO`` (fp32, no autocast).
        dtype: the dtype autocast computes in (bf16 for what fp8's float8
            layers leave).
        cache_enabled: ``torch.autocast``'s weight-cast cache (None: torch's default).
    """

    precision: PrecisionType
    dtype: torch.dtype
    cache_enabled: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientClipping:
    """How a transform clips the gradients' global norm (`fa.clip_grad_norm`'s settings)."""

    max_norm: float
    norm_type: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Accumulation:
    """How a transform accumulates gradients over batches (`fa.accumulate`'s settings).

    Attributes:
        micro_steps: batches per optimizer update.
        sync_each_batch: gradients are communicated on every batch anyway.
        sums_items: the loss is a sum over items, normalised at the update.
    """

    micro_steps: int
    sync_each_batch: bool = False
    sums_items: bool = False


class PipelineCheckFn(Protocol):
    """Checks a transform's combination with its pipeline and the run's mesh (`Transform.check_pipeline`).

    Called by `fa.prepare` with the whole pipeline; raises ValueError saying
    what to change, or returns the pipeline, completed with what the
    transform implies (``autocast(fa.fp16)`` adds the ``grad_scaler()`` it
    needs when nothing else scales the loss).
    """

    def __call__(self, pipeline: Pipeline, ctx: DistContext) -> Pipeline: ...


def _describe(name: str, options: tuple[tuple[str, Any], ...]) -> str:
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in options)})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """A named collective step on a tree; see the module docstring.

    Attributes:
        name: a stable key (the factory's name).
        options: the factory's non-default arguments, for printing and equality.
        phase: its canonical position in a pipeline (padding before gathering).
        conflicts: names of collectives it cannot be composed with.
        apply: the step: ``apply(ctx, tree, call) -> (tree, call)``.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    phase: int = 0
    conflicts: frozenset[str] = frozenset()
    apply: TransformApplyFn = field(compare=False)

    def __repr__(self) -> str:
        return _describe(self.name, self.options)

    def __call__(self, ctx: RunState | DistContext, tree: Any, *, num_valid: int | None = None) -> Any:
        """Apply this one collective: ``fa.gather()(state, tree)``."""
        return compose(self)(ctx, tree, num_valid=num_valid)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transform:
    """A named record of training hooks; see the module docstring.

    The hooks, every one optional, are listed last in the order a run meets
    them; each one's Protocol says when it runs and what it gets.

    Attributes:
        name: a stable key (the factory's name); the transform's state is
            stored under it.
        options: the factory's non-default arguments, for printing and equality.
        phase: its canonical position in a pipeline (a `Phase`).
        conflicts: names of transforms it cannot be composed with.
        conflict_fix: what `compose` tells the user when a conflict is found
            (the generic advice when empty).
        capabilities: what it does (`Capability`), asked instead of its name.
        mesh_dims: the mesh dimensions (`fnaccel.config.MESH_DIMS`) it lays the
            model over (``fa.tp``: ``tp``; ``fa.pp``: ``pp``); `fa.prepare`
            refuses a run whose mesh has such a dimension larger than one that
            no transform of the pipeline consumes.
        settings: a typed record of the settings other code reads
            (`Precision`, `GradientClipping`, `Accumulation`), or None;
            ``options`` is for printing, equality and the saved record only.
        check_pipeline: checks its combination with the pipeline and the mesh
            at `fa.prepare` (`PipelineCheckFn`), or None.
        init: builds its state record (`TransformInitFn`); None: it has none.
        prepare_model: wraps or shards the model at `fa.prepare` (`PrepareModelFn`).
        set_sync: switches gradient communication for the next backward (`SetSyncFn`).
        split_batch: the part of the batch this rank computes on (`SplitBatchFn`).
        forward_backward: replaces the loss function and backward (`ForwardBackwardFn`).
        scale_loss: the loss backward runs on (`ScaleLossFn`).
        after_backward: sees each backward's loss and aux (`AfterBackwardFn`).
        before_update: works on the gradients at an update boundary (`BeforeUpdateFn`).
        optimizer_step: replaces ``optimizer.step()`` (`OptimizerStepFn`).
        check_update: may hold the update back (`UpdateCheckFn`).
        after_step: runs after each step (`AfterStepFn`).
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    phase: int = 0
    conflicts: frozenset[str] = frozenset()
    conflict_fix: str = field(default="", compare=False)
    capabilities: frozenset[Capability] = frozenset()
    mesh_dims: frozenset[str] = frozenset()
    settings: object = None
    check_pipeline: PipelineCheckFn | None = field(default=None, compare=False)
    # How `fa.save` / `fa.load` lay out the model and optimizer (`fnaccel.checkpoint.layouts`): a
    # transform's own layout wins over the one its capabilities choose (None: chosen from them).
    layout: CheckpointLayout | None = field(default=None, compare=False)
    init: TransformInitFn | None = field(default=None, compare=False)
    prepare_model: PrepareModelFn | None = field(default=None, compare=False)
    set_sync: SetSyncFn | None = field(default=None, compare=False)
    split_batch: SplitBatchFn | None = field(default=None, compare=False)
    forward_backward: ForwardBackwardFn | None = field(default=None, compare=False)
    scale_loss: ScaleLossFn | None = field(default=None, compare=False)
    after_backward: AfterBackwardFn | None = field(default=None, compare=False)
    before_update: BeforeUpdateFn | None = field(default=None, compare=False)
    optimizer_step: OptimizerStepFn | None = field(default=None, compare=False)
    check_update: UpdateCheckFn | None = field(default=None, compare=False)
    after_step: AfterStepFn | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return _describe(self.name, self.options)


# repr=False keeps Transform's __repr__ (the factory call), which a generated one would replace.
@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class EngineTransform(Transform):
    """A transform that hands the model and optimizer to an engine of its own (`fa.deepspeed`).

    `fa.prepare` builds the engine with ``prepare_engine`` after every
    ``prepare_model`` hook; `fa.step` runs the engine's ``backward``. A
    pipeline holds at most one engine.

    Attributes:
        prepare_engine: builds the engine (`PrepareEngineFn`).
        backward: replaces ``loss.backward()`` (`BackwardFn`); None: torch's.
        takes_over: capabilities whose ``before_update`` hooks the engine runs
            itself (DeepSpeed clips inside its step: `Capability.CLIPS_GRADIENTS`):
            a transform declaring one has that hook skipped.
        micro_steps: batches per update that the engine's own configuration
            sets (DeepSpeed's ``gradient_accumulation_steps``), used when the
            pipeline declares no `Accumulation`; 1: every batch.
    """

    prepare_engine: PrepareEngineFn = field(compare=False)
    backward: BackwardFn | None = field(default=None, compare=False)
    takes_over: frozenset[Capability] = frozenset()
    micro_steps: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """What `fa.prepare` gives a transform's ``prepare_engine`` hook.

    Attributes:
        ctx: the run's distributed context.
        pipeline: the whole training pipeline (the engine reads the settings
            other transforms state: accumulation, clipping, precision).
        model: the model, on the device, after every ``prepare_model`` hook.
        optimizer: the optimizer passed with it (None: none was; the engine
            says it needs one).
        micro_batch_size: the loader's batch size per process, when a loader
            was passed in the same call.
        state: the transform's own state.
    """

    ctx: DistContext
    pipeline: Pipeline
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    micro_batch_size: int | None
    state: Any


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Transforms (or collectives) in order, validated by `compose`.

    Call a pipeline of collectives on a tree to run them: ``collect(state, tree)``.
    """

    transforms: tuple[Transform | Collective, ...] = ()

    def __repr__(self) -> str:
        return f"compose({', '.join(map(repr, self.transforms))})"

    @property
    def names(self) -> tuple[str, ...]:
        """The transforms' names, in order."""
        return tuple(t.name for t in self.transforms)

    def get(self, name: str) -> Transform | Collective | None:
        """The transform called ``name``, or None (for users: fnaccel itself asks
        `capabilities` and `settings`, never a name)."""
        return next((t for t in self.transforms if t.name == name), None)

    @property
    def engine(self) -> EngineTransform | None:
        """The transform that hands the model and optimizer to an engine (`EngineTransform`), or None."""
        return next((t for t in self.transforms if isinstance(t, EngineTransform)), None)

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What the training transforms do, together (`Capability`)."""
        return frozenset().union(*(t.capabilities for t in self.transforms if isinstance(t, Transform)))

    @property
    def mesh_dims(self) -> frozenset[str]:
        """The mesh dimensions the training transforms lay the model over, together."""
        return frozenset().union(*(t.mesh_dims for t in self.transforms if isinstance(t, Transform)))

    def settings(self, kind: type[S]) -> S | None:
        """The settings record of type ``kind`` a transform declares (`Precision`,
        `GradientClipping`, `Accumulation`), or None when none does.

        >>> import fnaccel as fa
        >>> fa.compose(fa.autocast(fa.bf16)).settings(Precision).dtype
        torch.bfloat16
        """
        return next(
            (
                t.settings
                for t in self.transforms
                if isinstance(t, Transform) and isinstance(t.settings, kind)
            ),
            None,
        )

    def init(
        self, ctx: RunState | DistContext, existing: Mapping[str, Any] = MappingProxyType({})
    ) -> Mapping[str, Any]:
        """Each stateful transform's state, keyed by its name: ``existing``'s where it
        has one (a state prepared in parts keeps its scaler), a new one otherwise."""
        dist_ctx = as_dist(ctx)
        return MappingProxyType(
            {
                **existing,
                **{
                    t.name: t.init(dist_ctx)
                    for t in self.transforms
                    if isinstance(t, Transform) and t.init is not None and t.name not in existing
                },
            }
        )

    def __call__(self, ctx: RunState | DistContext, tree: Any, *, num_valid: int | None = None) -> Any:
        """Run the collective steps on ``tree``; ``ctx`` is a `RunState` or a `DistContext`.

        Args:
            num_valid: leading real samples of this rank's batch, for
                `gather_for_metrics`.
        """
        steps = [t for t in self.transforms if isinstance(t, Collective)]
        if not steps:
            raise TypeError(
                f"{self!r} has no collective steps to apply to a tree; a training "
                "pipeline is passed to fa.prepare(..., pipeline=...)"
            )
        dist_ctx = as_dist(ctx)
        call = CallInfo(num_valid=num_valid)
        for t in steps:
            tree, call = t.apply(dist_ctx, tree, call)
        return tree


def _flatten(
    items: tuple[Transform | Collective | Pipeline, ...],
) -> list[tuple[Transform | Collective, bool]]:
    """Each transform, and whether it came from a nested pipeline."""
    flat: list[tuple[Transform | Collective, bool]] = []
    for item in items:
        if isinstance(item, Pipeline):
            flat.extend((t, True) for t in item.transforms)
        elif isinstance(item, (Transform, Collective)):
            flat.append((item, False))
        else:
            raise TypeError(
                f"compose takes transforms such as fa.gather() or fa.autocast(fa.bf16), "
                f"got {item!r}; did you forget to call the factory?"
            )
    return flat


def compose(*transforms: Transform | Collective | Pipeline) -> Pipeline:
    """Combine transforms, or collectives, into a validated `Pipeline`.

    The transforms written out must come in the canonical order. A nested
    pipeline (already checked) is merged in: each of its transforms goes where
    the order puts it, so ``compose(fa.default_pipeline(state), fa.accumulate(4))``
    adds accumulation to what the launch asked for, wherever the launch's
    transforms fall. The result is checked whole (duplicates, conflicts).

    Raises:
        ValueError: a transform appears twice, two transforms conflict or are
            both engines, the transforms written out are out of order, or
            training transforms are mixed with collectives; the message names
            them and the fix.

    >>> import fnaccel as fa
    >>> fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    compose(pad_across_processes(dim=1, pad_index=-100), gather())
    >>> fa.compose(fa.compose(fa.autocast(fa.bf16), fa.compile()), fa.accumulate(4))
    compose(autocast(dtype=torch.bfloat16), accumulate(num_steps=4), compile())
    """
    marked = _flatten(transforms)
    flat = [t for t, _ in marked]
    training = next((t for t in flat if isinstance(t, Transform)), None)
    collective = next((t for t in flat if isinstance(t, Collective)), None)
    if training is not None and collective is not None:
        raise ValueError(
            f"compose: {training!r} is a training transform and {collective!r} a collective; compose "
            "them separately: the training pipeline goes to fa.prepare, the collectives are called "
            "on trees (collect = fa.compose(...); collect(state, tree))"
        )
    seen: dict[str, Transform | Collective] = {}
    for t in flat:
        if t.name in seen:
            raise ValueError(f"compose: {seen[t.name]!r} and {t!r} both appear; keep one {t.name}")
        for other in seen.values():
            if other.name in t.conflicts or t.name in other.conflicts:
                fix = next(
                    (x.conflict_fix for x in (t, other) if isinstance(x, Transform) and x.conflict_fix), ""
                )
                raise ValueError(
                    f"compose: {other!r} and {t!r} cannot be combined; "
                    + (fix or "keep one of them (compose a second pipeline for the other)")
                )
        seen[t.name] = t
    engines = [t for t in flat if isinstance(t, EngineTransform)]
    if len(engines) > 1:  # fa.prepare hands the model to one engine; a second would be left out silently
        raise ValueError(
            f"compose: {engines[0]!r} and {engines[1]!r} each hand the model and optimizer to "
            "an engine of their own; keep one"
        )
    written = [t for t, nested in marked if not nested]
    for before, after in itertools.pairwise(written):
        if after.phase < before.phase:
            fixed = sorted(flat, key=lambda t: t.phase)
            raise ValueError(
                f"compose: {after!r} must come before {before!r}; write "
                f"compose({', '.join(map(repr, fixed))})"
            )
    if len(written) < len(flat):  # merge the nested pipelines' transforms in (a stable sort)
        flat.sort(key=lambda t: t.phase)
    return Pipeline(tuple(flat))


def options(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
    """A factory's arguments as a transform's ``options`` (call with the non-defaults)."""
    return tuple(kwargs.items())
