"""The public storage half of a checkpoint: how its owner supplies the model and optimizer part.

A checkpoint is a tree of named parts: the model and optimizer, the scheduler,
the generators, the data position, the transform states and the registered
objects. Each part comes from its owner. The model and the optimizer belong
to the parallelism in charge, which declares how they are stored: a
transform's ``layout`` (`fa.fsdp`, `fa.tp` and `fa.pp` declare the sharded
layout, `fa.deepspeed` the ZeRO one, a transform written outside fnaccel its
own); a run that declares none is stored plainly. `fa.save` and `fa.load` take
the first declared layout that `CheckpointLayout.holds` the run, and never
look at the model to choose one.

A layout is the part's ``state_dict`` / ``load_state_dict`` pair, split so that
a save can write on a background thread and a load can check every file before
it changes anything: ``snapshot`` then ``write`` on a save, ``read`` then
``restore`` on a load. What ``read`` returns is checked against the live model
and optimizer (the live tree is the schema); `read_checkpoint_tensors` and
`read_checkpoint_json` read a file the manifest lists, bounded and
checksum-verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from fnaccel.checkpoint.storage.files import read_json, read_tensors

if TYPE_CHECKING:
    from fnaccel.dist import DistContext
    from fnaccel.state import RunState

__all__ = ["CheckpointFiles", "CheckpointLayout", "read_checkpoint_json", "read_checkpoint_tensors"]


class CheckpointFiles(Protocol):
    """The files a save is gathering, as a layout's ``snapshot`` adds to them.

    Attributes:
        rank: this process's rank; its own files are named ``rank<rank>.*``.
        writer: whether this rank writes the files every rank shares.
        per_node: every machine's first process writes the shared files to its own disk
            (``ProjectConfiguration(save_on_each_node=True)``).
        tied: ``{alias: stored name}`` for weights stored once under another name.
        background: the files are written on a background thread while training goes
            on: what ``snapshot`` returns must hold copies, not the live tensors.
    """

    rank: int
    writer: bool
    per_node: bool
    tied: dict[str, str]

    @property
    def background(self) -> bool: ...

    def add_tensors(self, file: str, tensors: Mapping[str, torch.Tensor], *, transient: bool = False) -> None:
        """Store ``tensors`` in the safetensors ``file`` (``transient``: copy them now)."""
        ...

    def add_json(self, file: str, value: object) -> None:
        """Store ``value`` in the JSON ``file`` (refused when JSON cannot hold it)."""
        ...


@runtime_checkable
class CheckpointLayout(Protocol):
    """How a parallelism stores its model and optimizer: the part it supplies to a checkpoint.

    A save calls ``snapshot`` on the caller's thread, then ``write`` (on the
    save's background thread when it does not block); a load calls ``read``,
    which checks everything and changes nothing, then ``restore``.
    """

    def holds(self, state: RunState) -> bool:
        """Whether this layout stores ``state``'s run, from what the run was set up with
        (its mesh, its engine's settings): a sharded layout in a world of one does not."""
        ...

    def snapshot(self, state: RunState, files: CheckpointFiles) -> Any:
        """Capture the model's and optimizer's state now; every rank calls it.

        Add files with ``files.add_tensors`` / ``files.add_json`` (this rank's
        own, and the shared ones where ``files.writer``), and set
        ``files.tied``. Returns what ``write`` needs beyond those files.

        Raises:
            CheckpointError: the state cannot be saved in this layout.
        """
        ...

    def write(self, captured: Any, ctx: DistContext, directory: Path) -> Mapping[str, Any]:
        """Write ``captured`` into ``directory``, collectively over ``ctx``'s group
        (every rank calls it); returns the manifest entries of the files written."""
        ...

    def read(
        self,
        state: RunState,
        directory: Path,
        manifest: dict[str, Any],
        gradients: Mapping[str, torch.Tensor],
    ) -> Any:
        """Read the part from ``directory`` and check it against ``state``'s live model and
        optimizer, changing nothing; ``gradients`` are this rank's saved ones (a save
        between micro-steps), by parameter name. Returns what ``restore`` takes."""
        ...

    def restore(self, state: RunState, read: Any) -> None:
        """Put what ``read`` returned into ``state``'s live model and optimizer; every rank calls it."""
        ...


def read_checkpoint_tensors(directory: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``name`` of the checkpoint in ``directory``.

    Only a regular file inside ``directory`` that ``manifest`` lists is read, no
    more bytes than it records, and its checksum verified.

    Raises:
        CheckpointError: naming the file: unlisted, missing, of another size,
            corrupt, or not safetensors.
    """
    return read_tensors(directory, name, manifest)


def read_checkpoint_json(directory: Path, name: str, manifest: dict[str, Any]) -> Any:
    """The value of the JSON file ``name`` of the checkpoint in ``directory``, read as
    `read_checkpoint_tensors` reads (listed, bounded, verified).

    Raises:
        CheckpointError: naming the file.
    """
    return read_json(directory, name, manifest)
