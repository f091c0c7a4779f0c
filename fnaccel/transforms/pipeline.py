"""`compose` and the `Pipeline` it builds; the `Collective` record it also composes.

`compose` turns training transforms (`fnaccel.transforms.kinds`) or
collectives (never both) into a `Pipeline`: a value that prints as the code
that built it, compares equal to an identical pipeline, and keys each
transform's state by the transform's name (optax's ``named_chain``), so saved
states survive reordering. Every transform has a ``phase``
(`fnaccel.transforms.phases.Phase`, the one table of the order); a pipeline
lists phases in non-decreasing order, and ``conflicts`` names the transforms
it cannot be combined with (``conflict_fix`` says why and what to do
instead). `compose` enforces both, and rejects duplicates and a second
engine, with a message that names the transforms and the fix.

A `Collective` (``gather()``, ``pad_across_processes(dim=1)``) holds one
hook, ``apply(ctx, tree, call) -> (tree, call)``, run on a tree when the
pipeline is called; ``call`` is the `CallInfo` passed along the chain (what
earlier steps learnt).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fnaccel.dist import DistContext, as_dist
from fnaccel.transforms.declared import Capability
from fnaccel.transforms.kinds import EngineTransform, Options, ParallelismTransform, Transform, describe

if TYPE_CHECKING:
    from fnaccel.checkpoint.storage.layout import CheckpointLayout
    from fnaccel.ops.collectives import ShapeTable
    from fnaccel.state import RunState

__all__ = ["CallInfo", "Collective", "Pipeline", "TransformApplyFn", "compose"]

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


class TransformApplyFn(Protocol):
    """``Collective.apply``: a collective step on a tree (the tree is the user's: any nesting)."""

    def __call__(self, ctx: DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]: ...


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
    options: Options = ()
    phase: int = 0
    conflicts: frozenset[str] = frozenset()
    apply: TransformApplyFn = field(compare=False)

    def __repr__(self) -> str:
        return describe(self.name, self.options)

    def __call__(self, ctx: RunState | DistContext, tree: Any, *, num_valid: int | None = None) -> Any:
        """Apply this one collective: ``fa.gather()(state, tree)``."""
        return compose(self)(ctx, tree, num_valid=num_valid)


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
    def layouts(self) -> tuple[CheckpointLayout, ...]:
        """The checkpoint layouts the training transforms declare, in order."""
        return tuple(
            t.layout for t in self.transforms if isinstance(t, ParallelismTransform) and t.layout is not None
        )

    @property
    def forward_backward(self) -> ParallelismTransform | None:
        """The transform that runs the forward and backward passes itself (`fa.pp`), or None."""
        return next(
            (
                t
                for t in self.transforms
                if isinstance(t, ParallelismTransform) and t.forward_backward is not None
            ),
            None,
        )

    @property
    def mesh_dims(self) -> frozenset[str]:
        """The mesh dimensions the training transforms lay the model over, together."""
        return frozenset().union(
            *(t.mesh_dims for t in self.transforms if isinstance(t, ParallelismTransform))
        )

    def settings(self, kind: type[S]) -> S | None:
        """The settings record of type ``kind`` a transform declares (`Precision`,
        `GradientClipping`, `Accumulation`), or None when none does.

        >>> import fnaccel as fa
        >>> from fnaccel.transforms.declared import Precision
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
        self, ctx: RunState | DistContext, existing: Mapping[str, object] = MappingProxyType({})
    ) -> Mapping[str, object]:
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
