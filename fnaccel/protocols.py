"""The interfaces the state names, so that `fnaccel.state` imports nothing above it.

`RunState` holds a pipeline and a step plan that are built higher up
(`fnaccel.transforms`, `fnaccel.preparation`, `fnaccel.train`); it types them by what every layer
may ask of them, defined here.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["PipelineLike", "StepPlanLike"]


class PipelineLike(Protocol):
    """A composed pipeline (`fnaccel.transforms.base.Pipeline`)."""

    @property
    def names(self) -> tuple[str, ...]: ...

    def get(self, name: str) -> Any: ...


class StepPlanLike(Protocol):
    """A pipeline's hooks resolved for stepping (`fnaccel.train.StepPlan`)."""

    @property
    def micro_steps(self) -> int: ...

    def set_sync_for(self, model: Any, micro_step: int) -> None: ...
