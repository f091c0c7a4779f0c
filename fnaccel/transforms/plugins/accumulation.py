"""`GradientAccumulationPlugin`: Accelerate's gradient accumulation settings, carried out by `fa.accumulate`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fnaccel.checks import is_int, require_bools
from fnaccel.transforms.plugins.sections import refuse

if TYPE_CHECKING:
    from fnaccel.transforms.kinds import StepTransform

__all__ = ["GradientAccumulationPlugin"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientAccumulationPlugin:
    """Accelerate's gradient accumulation settings, carried out by `fa.accumulate`.

    `fa.step` steps the scheduler only at optimizer updates, never on the
    micro-steps between (``adjust_scheduler=True``; how many steps per update:
    `fnaccel.train.SchedulerConfiguration`). Accumulation boundaries run across
    epoch ends (every ``num_steps`` batches), so ``sync_with_dataloader``
    defaults to False here and True is refused rather than ignored.

    >>> GradientAccumulationPlugin(num_steps=4).transform()
    accumulate(num_steps=4)
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = False
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        source = type(self).__name__
        require_bools(self, (), ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"))
        if not is_int(self.num_steps) or self.num_steps < 1:
            raise refuse("num_steps", source, f"must be a positive int, got {self.num_steps!r}")
        if not self.adjust_scheduler:
            raise refuse(
                "adjust_scheduler",
                source,
                "false is not supported: fa.step steps the "
                "scheduler only at optimizer updates, never between",
            )
        if self.sync_with_dataloader:
            raise refuse(
                "sync_with_dataloader",
                source,
                "true is not built: boundaries fall every "
                "num_steps batches across epoch ends; pick num_steps dividing an epoch",
            )

    def transform(self) -> StepTransform:
        """The `fa.accumulate` transform these settings describe."""
        from fnaccel.transforms.accumulate import accumulate

        assert self.num_steps is not None
        return accumulate(self.num_steps, sync_each_batch=self.sync_each_batch)
