"""Which layout stores a run's model and optimizer: the one its parallelism declares.

`fa.save` and `fa.load` ask the pipeline for the layouts its transforms declare
(`CheckpointLayout`) and take the first that holds the run; a run that declares
none, or none that holds it (`fa.fsdp` in a world of one), is stored plainly.
The model is never looked at: what a layout holds follows from how the run was
set up. A load also follows the checkpoint: a sharded one goes into a run stored
plainly through the sharded layout (DCP reads whole tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fnaccel.checkpoint.storage.layout import CheckpointLayout
from fnaccel.checkpoint.storage.plain import PlainLayout
from fnaccel.checkpoint.storage.sharded import ShardedLayout, is_stored_sharded

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["layout_for"]


def layout_for(state: RunState, manifest: dict[str, Any] | None = None) -> CheckpointLayout:
    """The layout that stores ``state``'s model and optimizer: the first one its pipeline's
    transforms declare that holds the run (`CheckpointLayout.holds`), else the plain one.
    The model is never asked. A load passes the checkpoint's ``manifest``: a sharded
    checkpoint goes into a run stored plainly through the sharded layout (DCP reads
    whole tensors).

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(1, 1)
    >>> type(layout_for(fa.prepare(fa.init(cpu=True), model, pipeline=fa.accumulate(2)))).__name__
    'PlainLayout'
    """
    declared = () if state.pipeline is None else state.pipeline.layouts
    for layout in declared:
        if not isinstance(layout, CheckpointLayout):
            raise TypeError(
                f"fa.save/fa.load: a transform's layout must implement CheckpointLayout (holds, snapshot, "
                f"write, read, restore), got {type(layout).__name__}"
            )
        if layout.holds(state):
            return layout
    if manifest is not None and state.model is not None and is_stored_sharded(manifest):
        return ShardedLayout()
    return PlainLayout()
