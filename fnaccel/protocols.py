"""The interfaces lower layers name for what higher ones build, so that imports point down.

`RunState` holds a pipeline and a step plan that are built higher up
(`fnaccel.transforms`, `fnaccel.preparation`, `fnaccel.train`); it types them by what every layer
may ask of them, defined here. A `Transform` may carry a `CheckpointLayout`, which the
checkpoint layer (above the transforms) implements and calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CheckpointLayout", "PipelineLike", "StepPlanLike"]


class PipelineLike(Protocol):
    """A composed pipeline (`fnaccel.transforms.pipeline.Pipeline`), as the layers below the
    transforms see it: ``==`` and ``repr``. No transform's name: code outside the transforms
    asks what a transform does (``tests/test_no_name_checks.py``), so the names and the lookup
    by name are the pipeline's own, not the core's."""


class StepPlanLike(Protocol):
    """A pipeline's hooks resolved for stepping (`fnaccel.train.StepPlan`)."""

    @property
    def micro_steps(self) -> int: ...

    def set_sync_for(self, model: nn.Module, micro_step: int) -> None: ...


@runtime_checkable
class CheckpointLayout(Protocol):
    """How a checkpoint holds a run's model and optimizer (`fnaccel.checkpoint.layouts`).

    The rest of a checkpoint (counters, generators, data position, transform
    states, scheduler, registered objects, the run's record) is the same in
    every layout. `fa.save` and `fa.load` choose one layout per call from what
    the pipeline declares (`fnaccel.checkpoint.layouts.layout_for`): a
    transform's own ``layout`` wins, so a transform written outside fnaccel can
    bring one. A save calls ``snapshot`` on the caller's thread, then ``write``
    (on the save's background thread when it does not block); a load calls
    ``read``, which checks everything and changes nothing, then ``restore``.
    """

    def snapshot(self, state: Any, files: Any) -> Any:
        """Capture the model's and optimizer's state now; every rank calls it.

        ``files`` is the save's `fnaccel.checkpoint.writer.Snapshot`: add files
        with its ``add_tensors`` / ``add_json`` (its ``rank``'s own, and the
        shared ones where it is a ``writer``), and set its ``tied`` aliases
        for the weights stored once. Returns what ``write`` needs beyond
        those files. Raises `fnaccel.CheckpointError` for a state this layout
        cannot save.
        """
        ...

    def write(self, captured: Any, ctx: Any, directory: Path) -> Mapping[str, Any]:
        """Write ``captured`` into ``directory``, collectively over ``ctx``'s group
        (every rank calls it); returns the manifest entries of the files written."""
        ...

    def read(
        self, state: Any, directory: Path, manifest: dict[str, Any], gradients: Mapping[str, Any]
    ) -> Any:
        """Read and check the model's and optimizer's part of the checkpoint in
        ``directory`` against the live ``state``, changing nothing; ``gradients``
        are those this rank's file holds (a save between micro-steps), by
        parameter name. Returns what ``restore`` takes."""
        ...

    def restore(self, state: Any, read: Any) -> None:
        """Put what ``read`` returned into ``state``'s live model and optimizer; every rank calls it."""
        ...
