"""Kwargs handlers: frozen records that customise the PyTorch objects fnaccel builds.

Accelerate's handlers (`AutocastKwargs`, `DistributedDataParallelKwargs`,
`GradScalerKwargs`, `InitProcessGroupKwargs`, `FP8RecipeKwargs`, `ProfileKwargs`)
are in `fnaccel.kwargs.handlers`, the `KwargsHandler` mixin they and the
package's configuration records inherit in `fnaccel.kwargs.mixin`. Pass them to
``fa.init(kwargs_handlers=[...])``.

>>> GradScalerKwargs(init_scale=1024.0).to_kwargs()
{'init_scale': 1024.0}
"""

from fnaccel.kwargs.handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from fnaccel.kwargs.mixin import KwargsHandler

__all__ = [
    "KwargsHandler",
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "FP8RecipeKwargs",
    "ProfileKwargs",
]
