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
earlier steps learnt). A `Transform`'s hooks (every one optional):
    init(ctx) -> state: the transform's own state (None for stateless ones).
    Training hooks, used by `fa.prepare` / `fa.step` (see fnaccel/preparation.py, fnaccel/train.py):
    prepare_model(ctx, model, state) -> model: wrap or shard the model once.
    set_sync(model, enabled): switch gradient communication for the next
        backward (accumulation's non-boundary micro-steps turn it off).
    scale_loss(loss, state) -> loss: before backward (the fp16 scaler).
    before_update(model, optimizer, state) -> metrics: at an update boundary,
        before the optimizer steps (unscaling, clipping).
    optimizer_step(optimizer, state) -> metrics: replaces `optimizer.step()`
        (the fp16 scaler); its metrics include ``skipped`` (a bool tensor),
        which also holds back the scheduler.
    check_update(model, optimizer, metrics, state, step, position) -> bool:
        at an update boundary, after before_update and any optimizer_step hook
        (``metrics`` holds theirs: ``grad_norm``, ``skipped``); True holds the
        update back: no optimizer step (without an optimizer_step hook) and no
        scheduler step, gradients cleared. It may add metrics to ``metrics``.
        ``step`` and ``position`` are the update's (`UpdateCheckFn`).
    after_backward(loss, aux, state) -> metrics | None: after each backward,
        with the loss and the loss function's aux (item counting); metrics it
        returns replace `fa.step`'s of the same name (``loss`` included).
    after_step(state): after every micro-step (the profiler).
    forward_backward(model, batch, divisor, state) -> (loss, aux): replaces
        the loss function and backward of `fa.step` (a pipeline schedule runs
        both); gradients are divided by ``divisor`` (`accumulate`'s count, or
        None when the loss is a sum normalised at the update).
    Engine hooks, for a transform that hands the model and optimizer to an
    engine of its own (`fa.deepspeed`):
    prepare_engine(request) -> (model, optimizer): build the engine from an
        `EngineRequest` (the model after every prepare_model hook, the
        optimizer, the pipeline); the model becomes the state's.
    backward(loss, state): replaces ``loss.backward()``.
    ``takes_over`` names transforms whose update hooks the engine runs itself
    (DeepSpeed clips inside its step): their ``before_update`` is skipped.

Every transform has a ``phase``; a pipeline lists phases in non-decreasing
order (padding before gathering), and ``conflicts`` names the transforms it
cannot be combined with (``conflict_fix`` says why and what to do instead).
`compose` enforces both, and rejects duplicates, with a message that names
the transforms and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol

from fnaccel.dist import DistContext, as_dist
from fnaccel.ops._shapes import ShapeTable

__all__ = ["CallInfo", "Capability", "Collective", "EngineRequest", "Pipeline", "Transform", "compose"]


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
    """Builds a transform's state record for a run."""

    def __call__(self, ctx: DistContext) -> Any: ...


class UpdateCheckFn(Protocol):
    """Whether an update is held back (`Transform.check_update`, `fa.skip_nonfinite`).

    ``step`` is the run's update count before this update; ``position`` the
    data position once the update's batches are consumed (for error messages).
    """

    def __call__(self, model: Any, optimizer: Any, metrics: dict[str, Any], state: Any,
                 step: int, position: Any) -> bool: ...


class TransformApplyFn(Protocol):
    """Applies a collective step to a tree."""

    def __call__(self, ctx: DistContext, tree: Any, call: CallInfo) -> tuple[Any, CallInfo]: ...


class Capability(Enum):
    """What a training transform does, declared on it (`Transform.capabilities`).

    `fa.prepare`, `fa.step` and the checkpoint layer ask a pipeline for these,
    never for a transform's name, so a transform written outside fnaccel (a
    data-parallel wrapper of one's own) takes part as fnaccel's own do.
    """

    AVERAGES_GRADIENTS = "averages the data-parallel replicas' gradients"
    SHARDS_PARAMETERS = "holds the model's parameters as shards (DTensor) across ranks"
    SPLITS_MODEL = "keeps only part of the model on each rank (pipeline stages)"
    RUNS_FORWARD_BACKWARD = "runs the forward and backward passes itself"
    SAME_BATCH_ACROSS_RANKS = "needs every rank of its group to read the same batches"
    TENSOR_PARALLEL = "splits layers over the mesh's tensor-parallel dimension"
    SCALES_LOSS = "scales the loss before backward (fp16)"
    OWNS_OPTIMIZER_STEP = "runs the optimizer step itself (an engine)"


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

    def __call__(self, ctx: Any, tree: Any, *, num_valid: int | None = None) -> Any:
        """Apply this one collective: ``fa.gather()(state, tree)``."""
        return compose(self)(ctx, tree, num_valid=num_valid)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transform:
    """A named record of training hooks; see the module docstring.

    Attributes:
        name: a stable key (the factory's name); the transform's state is
            stored under it.
        options: the factory's non-default arguments, for printing and equality.
        phase: its canonical position in a pipeline.
        conflicts: names of transforms it cannot be composed with.
        conflict_fix: what `compose` tells the user when a conflict is found
            (the generic advice when empty).
        capabilities: what it does (`Capability`), asked instead of its name.
        init: builds its state record, or None when it has none.
        micro_steps: batches per optimizer update (`accumulate`); 1 otherwise.
        sync_each_batch: communicate gradients on every micro-step anyway.
        sums_items: the loss is a sum over items, normalised at the update
            (``accumulate(normalize="items")``): backward does not divide it.
        prepare_model, set_sync, scale_loss, before_update, optimizer_step,
            check_update, after_step, forward_backward: the training hooks
            listed in the module docstring.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    phase: int = 0
    conflicts: frozenset[str] = frozenset()
    conflict_fix: str = field(default="", compare=False)
    capabilities: frozenset[Capability] = frozenset()
    init: TransformInitFn | None = field(default=None, compare=False)
    micro_steps: int = 1
    sync_each_batch: bool = False
    sums_items: bool = False
    prepare_model: Callable[[DistContext, Any, Any], Any] | None = field(default=None, compare=False)
    set_sync: Callable[[Any, bool], None] | None = field(default=None, compare=False)
    scale_loss: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    before_update: Callable[[Any, Any, Any], dict[str, Any]] | None = field(
        default=None, compare=False
    )
    optimizer_step: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    check_update: UpdateCheckFn | None = field(default=None, compare=False)
    after_backward: Callable[[Any, Any, Any], dict[str, Any] | None] | None = field(default=None, compare=False)
    after_step: Callable[[Any], None] | None = field(default=None, compare=False)
    forward_backward: Callable[[Any, Any, Any, Any], tuple[Any, Any]] | None = field(
        default=None, compare=False
    )
    prepare_engine: Callable[[EngineRequest], tuple[Any, Any]] | None = field(default=None, compare=False)
    backward: Callable[[Any, Any], None] | None = field(default=None, compare=False)
    takes_over: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return _describe(self.name, self.options)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """What `fa.prepare` gives a transform's ``prepare_engine`` hook.

    Attributes:
        ctx: the run's distributed context.
        pipeline: the whole training pipeline (the engine reads the settings
            other transforms state: accumulation, clipping, precision).
        model: the model, on the device, after every ``prepare_model`` hook.
        optimizer: the optimizer passed with it.
        micro_batch_size: the loader's batch size per process, when a loader
            was passed in the same call.
        state: the transform's own state.
    """

    ctx: DistContext
    pipeline: Pipeline
    model: Any
    optimizer: Any
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
        """The transform called ``name``, or None."""
        return next((t for t in self.transforms if t.name == name), None)

    def init(self, ctx: Any, existing: Mapping[str, Any] = MappingProxyType({})) -> Mapping[str, Any]:
        """Each stateful transform's state, keyed by its name: ``existing``'s where it
        has one (a state prepared in parts keeps its scaler), a new one otherwise."""
        dist_ctx = as_dist(ctx)
        return MappingProxyType({**existing, **{
            t.name: t.init(dist_ctx) for t in self.transforms
            if isinstance(t, Transform) and t.init is not None and t.name not in existing
        }})

    def __call__(self, ctx: Any, tree: Any, *, num_valid: int | None = None) -> Any:
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


def _flatten(items: tuple[Transform | Collective | Pipeline, ...]) -> list[tuple[Transform | Collective, bool]]:
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
        ValueError: a transform appears twice, two transforms conflict, the
            transforms written out are out of order, or training transforms are
            mixed with collectives; the message names them and the fix.

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
            raise ValueError(
                f"compose: {seen[t.name]!r} and {t!r} both appear; keep one {t.name}"
            )
        for other in seen.values():
            if other.name in t.conflicts or t.name in other.conflicts:
                fix = next((x.conflict_fix for x in (t, other)
                            if isinstance(x, Transform) and x.conflict_fix), "")
                raise ValueError(
                    f"compose: {other!r} and {t!r} cannot be combined; "
                    + (fix or "keep one of them (compose a second pipeline for the other)")
                )
        seen[t.name] = t
    written = [t for t, nested in marked if not nested]
    for before, after in zip(written, written[1:]):
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
