"""`ProjectConfiguration`: where checkpoints go by default, and how many stay.

With ``automatic_checkpoint_naming=True``, ``fa.save(state)`` writes
``<project_dir>/checkpoints/checkpoint_<n>`` with ``n`` one past the highest
``checkpoint_<n>`` there, complete or not (a pure function of the directory,
no counter kept in memory); with ``total_limit=k`` the oldest complete
checkpoints beyond the newest ``k`` are deleted after each save, never the
one just written. A deleted checkpoint is first renamed to a hidden, marked
leftover, so a crash never leaves a visible ``checkpoint_<n>`` without its
manifest; the leftovers of crashed saves and deletions go with the next
rotation.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fnaccel.checkpoint.manifest import MANIFEST, target_problem
from fnaccel.checkpoint.storage.files import discard, remove_leftovers
from fnaccel.kwargs.mixin import KwargsHandler

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "DEFAULT_PROJECT",
    "ProjectConfiguration",
    "next_checkpoint",
    "project_dir_of",
    "project_of",
    "rotate",
]

_NAMES = r"checkpoint_\d+"
_NAME = re.compile(r"checkpoint_(\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProjectConfiguration(KwargsHandler):
    """Accelerate's project configuration (pass it to ``fa.init(kwargs_handlers=[...])``).

    Args:
        project_dir: the project's directory (``fa.init(project_dir=...)`` sets it too).
        logging_dir: where trackers write; default ``project_dir``.
        automatic_checkpoint_naming: ``fa.save(state)`` picks
            ``checkpoints/checkpoint_<n>`` itself.
        total_limit: keep at most this many automatic checkpoints.
        save_on_each_node: every machine writes the shared files to its own
            disk (for machines without a shared filesystem).

    Not carried over: Accelerate's mutable ``iteration`` counter; the next
    number is read from the directory.

    >>> ProjectConfiguration(total_limit=2).to_kwargs()
    {'total_limit': 2}
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    save_on_each_node: bool = False

    def _validate(self) -> None:
        if self.total_limit is not None and (isinstance(self.total_limit, bool) or self.total_limit < 1):
            raise ValueError(
                f"ProjectConfiguration: total_limit must be None or >= 1, got {self.total_limit!r}"
            )


def _numbered(root: Path, *, complete: bool) -> list[tuple[int, Path]]:
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and (not complete or (path / MANIFEST).is_file()):
                found.append((int(match.group(1)), path))
    return sorted(found)


def next_checkpoint(project_dir: Path) -> Path:
    """``checkpoints/checkpoint_<n>``, one past the highest there (a save never
    lands on a directory it may not replace)."""
    existing = _numbered(project_dir / "checkpoints", complete=False)
    number = existing[-1][0] + 1 if existing else 0
    return project_dir / "checkpoints" / f"checkpoint_{number}"


def rotate(project_dir: Path, total_limit: int, newest: Path) -> None:
    """Delete the oldest complete checkpoints beyond ``total_limit``, never ``newest``,
    and the leftovers of crashed saves and deletions there.

    A checkpoint holding a file fnaccel did not write is the user's now: never deleted and
    not counted; a warning names it when the rotation passes over it."""
    root = project_dir / "checkpoints"
    existing = [path for _, path in _numbered(root, complete=True) if path != newest]
    problems = {path: target_problem(path) for path in existing}
    owned = [path for path in existing if problems[path] is None]
    doomed = owned[: max(0, len(owned) + 1 - total_limit)]
    passed = existing[: existing.index(doomed[-1])] if doomed else []  # in number order
    for path in passed:
        if problems[path] is not None:
            warnings.warn(f"total_limit: {path} is kept: {problems[path]}", stacklevel=3)
    for path in doomed:
        discard(path, MANIFEST)
    remove_leftovers(root, _NAMES)


DEFAULT_PROJECT = ProjectConfiguration()  # a run without the handler: built once, not at every save


def project_dir_of(state: RunState, config: ProjectConfiguration) -> Path | None:
    """The run's project directory, absolute: ``config``'s, else ``fa.init(project_dir=...)``'s."""
    directory = config.project_dir or state.project_dir
    return None if directory is None else Path(directory).absolute()


def project_of(state: RunState) -> tuple[ProjectConfiguration, Path | None]:
    """A run's `ProjectConfiguration` (its kwargs handler, else the defaults) and its
    project directory (`project_dir_of`)."""
    config = state.kwargs_handlers.get("ProjectConfiguration", DEFAULT_PROJECT)
    assert isinstance(config, ProjectConfiguration)
    return config, project_dir_of(state, config)
