"""The interfaces lower layers name for what higher ones build, so that imports point down.

`RunState` holds a pipeline and a step plan that are built higher up
(`fnaccel.transforms`, `fnaccel.preparation`, `fnaccel.train`); it types them by what every layer
may ask of them, defined here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PipelineLike", "StepPlanLike"]


class PipelineLike(Protocol):
    """A composed pipeline (`fnaccel.transforms.pipeline.Pipeline`), as the layers below the
    transforms see it: what a checkpoint records and stores of it (its transforms, the layouts
    they declare), besides ``==`` and ``repr``. No transform's name: code outside the transforms
    asks what a transform does (``tests/test_no_name_checks.py``), so the names and the lookup
    by name are the pipeline's own, not the core's."""

    @property
    def transforms(self) -> tuple[Any, ...]: ...

    @property
    def layouts(self) -> tuple[object, ...]:
        """The checkpoint layouts its transforms declare, in order (each a
        `fnaccel.checkpoint.storage.layout.CheckpointLayout`, a layer above this one)."""
        ...


class StepPlanLike(Protocol):
    """A pipeline's hooks resolved for stepping (`fnaccel.train.StepPlan`)."""

    @property
    def micro_steps(self) -> int: ...

    def set_sync_for(self, model: nn.Module, micro_step: int) -> None: ...
