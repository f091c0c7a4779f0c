"""The kinds of training transform: what each carries, and the one they all share.

A training transform is a frozen, named record built by a lowercase factory,
in the spirit of optax's ``GradientTransformation``; like optax, it grows by
subtype, never by optional fields every transform carries:

- `Transform`: what every kind has (name, printed options, place in the
  order, conflicts, capabilities, settings) and the hooks any kind may use:
  ``check`` (its contract with what `fa.prepare` is given), ``init``,
  ``prepare_model`` and ``after_step`` (`fa.compile`,
  `fa.checkpoint_activations`, `fa.local_sgd`, `fa.profile`);
- `StepTransform`: adds the gradient hooks of a step (`fa.accumulate`, the
  clips, `fa.grad_scaler`, `fa.skip_nonfinite`);
- `PrecisionTransform`: declares the `Precision` the model computes in (`fa.autocast`);
- `ParallelismTransform`: a `StepTransform` that decides where the model and
  the batch live (`fa.ddp`, `fa.fsdp`, `fa.tp`, `fa.pp`, `fa.sp`): its mesh
  dimensions, gradient sync, batch split, own forward and backward, and the
  checkpoint layout of the model and optimizer it holds;
- `EngineTransform`: a `ParallelismTransform` that hands the model and the
  optimizer to an engine of its own (`fa.deepspeed`).

When each hook runs, and with what, is described once, in
`fnaccel.transforms.contract`, which also holds what `fa.prepare` hands them
(`PrepareRequest`, `EngineRequest`).

A transform declares what it is, so that nothing outside it asks its name:
``capabilities`` and ``settings`` (`fnaccel.transforms.declared`). Its
``check`` receives a `PrepareRequest` and owns its whole contract there:
`fa.prepare` itself checks only what concerns every pipeline (collectives
passed as training transforms, replicas without averaging, mesh dimensions
no transform consumes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fnaccel.transforms.declared import Capability, Precision

if TYPE_CHECKING:
    from fnaccel.checkpoint.storage.layout import CheckpointLayout
    from fnaccel.transforms.contract import (
        AfterBackwardFn,
        AfterStepFn,
        BackwardFn,
        BeforeUpdateFn,
        ForwardBackwardFn,
        OptimizerStepFn,
        PrepareCheckFn,
        PrepareEngineFn,
        PrepareModelFn,
        ScaleLossFn,
        SetSyncFn,
        SplitBatchFn,
        TransformInitFn,
        UpdateCheckFn,
    )

__all__ = [
    "EngineTransform",
    "ParallelismTransform",
    "PrecisionTransform",
    "StepTransform",
    "Transform",
    "describe",
    "options",
]

Options = tuple[tuple[str, object], ...]


def describe(name: str, options: Options) -> str:
    """A factory call as it is printed: ``name(key=value, ...)``."""
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in options)})"


def options(**kwargs: object) -> Options:
    """A factory's arguments as a transform's ``options`` (call with the non-defaults)."""
    return tuple(kwargs.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class Transform:
    """What every training transform is; see the module docstring for the kinds.

    Attributes:
        name: a stable key (the factory's name); the transform's state is
            stored under it.
        options: the factory's non-default arguments, for printing, equality
            and the saved pipeline record only.
        phase: its canonical position in a pipeline (a `Phase`).
        conflicts: names of transforms it cannot be composed with.
        conflict_fix: what `compose` tells the user when a conflict is found
            (the generic advice when empty).
        capabilities: what it does (`Capability`), asked instead of its name.
        settings: a typed record of the settings other code reads
            (`GradientClipping`, `Accumulation`, ...), or None.
        check: its contract with what `fa.prepare` is given (`PrepareCheckFn`).
        init: builds its state record (`TransformInitFn`); None: it has none.
        prepare_model: wraps or converts the model (`PrepareModelFn`).
        after_step: runs after each step (`AfterStepFn`).
    """

    name: str
    options: Options = ()
    phase: int = 0
    conflicts: frozenset[str] = frozenset()
    conflict_fix: str = field(default="", compare=False)
    capabilities: frozenset[Capability] = frozenset()
    settings: object = None
    check: PrepareCheckFn | None = field(default=None, compare=False)
    init: TransformInitFn | None = field(default=None, compare=False)
    prepare_model: PrepareModelFn | None = field(default=None, compare=False)
    after_step: AfterStepFn | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return describe(self.name, self.options)


# repr=False on each subtype keeps Transform's __repr__ (the factory call), which a generated one would replace.
@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class StepTransform(Transform):
    """A transform that works on the loss and the gradients of each step.

    Attributes:
        scale_loss: the loss backward runs on (`ScaleLossFn`).
        after_backward: sees each backward's loss and aux (`AfterBackwardFn`).
        before_update: works on the gradients at an update boundary (`BeforeUpdateFn`).
        optimizer_step: replaces ``optimizer.step()`` (`OptimizerStepFn`).
        check_update: may hold the update back (`UpdateCheckFn`).
    """

    scale_loss: ScaleLossFn | None = field(default=None, compare=False)
    after_backward: AfterBackwardFn | None = field(default=None, compare=False)
    before_update: BeforeUpdateFn | None = field(default=None, compare=False)
    optimizer_step: OptimizerStepFn | None = field(default=None, compare=False)
    check_update: UpdateCheckFn | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class PrecisionTransform(Transform):
    """A transform that sets the precision the model computes in (`fa.autocast`).

    Attributes:
        settings: the `Precision` it declares (what `fa.step`'s autocast,
            `fa.evaluate` and the engines read, with ``pipeline.settings(Precision)``).
    """

    settings: Precision


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class ParallelismTransform(StepTransform):
    """A transform that decides where the model and the batch live (ddp, fsdp, tp, pp, sp).

    Attributes:
        mesh_dims: the mesh dimensions (`fnaccel.config.parallelism.MESH_DIMS`) it lays the
            model over (``fa.tp``: ``tp``); `fa.prepare` refuses a run whose
            mesh has such a dimension larger than one that no transform consumes.
        layout: how `fa.save` / `fa.load` store the model and optimizer it
            holds (`CheckpointLayout`); None: stored as any run's are (plainly).
        backward_inputs: whether `fa.step` may name the optimizer's
            parameters as backward's ``inputs`` (so a loss through another
            run's model leaves nothing there); False when the gradients land
            on tensors of its own (FSDP2's unsharded copies).
        set_sync: switches gradient communication for the next backward (`SetSyncFn`).
        split_batch: the part of the batch this rank computes on (`SplitBatchFn`).
        forward_backward: replaces the loss function and backward (`ForwardBackwardFn`).
    """

    mesh_dims: frozenset[str] = frozenset()
    layout: CheckpointLayout | None = field(default=None, compare=False)
    backward_inputs: bool = True
    set_sync: SetSyncFn | None = field(default=None, compare=False)
    split_batch: SplitBatchFn | None = field(default=None, compare=False)
    forward_backward: ForwardBackwardFn | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class EngineTransform(ParallelismTransform):
    """A parallelism that hands the model and optimizer to an engine of its own (`fa.deepspeed`).

    A pipeline holds at most one engine.

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
