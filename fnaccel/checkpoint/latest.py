"""`fa.latest_checkpoint`: the checkpoint a restarted run should load, across tiers.

A run that saves to a RAM tier (``/dev/shm``) every few steps and to disk
every few hundred restarts from whichever holds the newest complete
checkpoint. Candidates are ordered by their manifests alone (bounded reads,
`read_manifest`), then verified newest first with the code behind ``fnaccel
checkpoint verify`` (`fnaccel.checkpoint.summary.verify`: every byte
checksummed, each read bounded by the manifest and ``stat``) until one holds:
a restart pays one verification, not one per checkpoint kept. Everything
passed over that looked like a checkpoint is named in a
`SkippedCheckpointWarning`.
"""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.manifest import MANIFEST, read_manifest
from fnaccel.checkpoint.storage.files import LEFTOVER_MARKER, locked, sibling_stem
from fnaccel.checkpoint.summary import verify

__all__ = ["SkippedCheckpointWarning", "latest_checkpoint"]

# what fa.save leaves while it writes or deletes a checkpoint (files.temporary_sibling, files._aside)
_UNFINISHED = re.compile(r"\..+\.(tmp|old)-[0-9a-f]{32}")


class SkippedCheckpointWarning(UserWarning):
    """`latest_checkpoint` passed over a checkpoint that is unfinished, incomplete or corrupt
    (named in the message, with the reason)."""


def _skip(what: str, why: str) -> None:
    warnings.warn(f"fa.latest_checkpoint skipped {what}: {why}", SkippedCheckpointWarning, stacklevel=3)


def _unfinished(entry: os.DirEntry[str]) -> bool:
    """A hidden directory of a save that did not finish (or a deletion): marked as fnaccel's."""
    if not (_UNFINISHED.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
        return False
    try:
        return stat.S_ISREG(os.lstat(Path(entry.path) / LEFTOVER_MARKER).st_mode)
    except OSError:
        return False


def _candidates(directory: Path) -> tuple[list[Path], list[Path]]:
    """``directory`` when it is a checkpoint, else its children that are (or claim to be:
    those holding a manifest entry of any kind, so a planted one is named, not ignored);
    and the unfinished saves among its children."""
    if os.path.lexists(directory / MANIFEST):
        return [directory], []
    found, unfinished = [], []
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if _unfinished(entry):
                unfinished.append(directory / entry.name)
            elif (
                not entry.name.startswith(".")
                and entry.is_dir(follow_symlinks=False)
                and os.path.lexists(Path(entry.path) / MANIFEST)
            ):
                found.append(directory / entry.name)
    return found, unfinished


def latest_checkpoint(*directories: str | Path) -> Path | None:
    """The newest complete, verified checkpoint in ``directories``, or None.

    Each directory is a checkpoint itself or holds checkpoints as its
    children (one level: ``fa.save(state, "/dev/shm/run/latest")`` and
    ``<project_dir>/checkpoints``); a directory that does not exist yet holds
    none. The newest is the one with the most optimizer steps (then micro-steps)
    in its manifest; on a tie the one in the directory given first wins (list
    the fastest tier first), then the one whose manifest was written last.
    Candidates are verified newest first, every file against its size and
    checksum as ``fnaccel checkpoint verify`` does, and the first that holds is
    returned; older ones are not read. A checkpoint written with NaN or inf
    values (``fa.save(..., allow_nonfinite=True)``, ``"finite": false`` in its
    manifest) comes after every finite one, however new: it is returned only
    when no finite checkpoint holds, with a warning. Symbolic links among the children and
    directories without a manifest (logs, a hidden cache) are passed over
    quietly. A `SkippedCheckpointWarning` names each one passed over for a
    reason: an unfinished save (a hidden ``.<name>.tmp-<id>``), one a live save
    is replacing (its lock is held), a missing, truncated or corrupt file, a
    manifest that is not fnaccel's.

    Each process decides from what it sees: on one machine, or with every
    tier on a file system all machines share, every rank returns the same
    path (see docs/checkpoints.md for a RAM tier on several machines).

    Args:
        *directories: the tiers, fastest first (e.g. ``/dev/shm/run``, ``ckpt``).

    Returns:
        The checkpoint's path (a directory given, or that joined with a
        child's name), for `fa.load`; None when there is none.

    Raises:
        TypeError: no directory given, or one that is not a path.
        ValueError: a path given is a file, not a directory, or empty (``""``
            would scan the current directory).

    >>> import fnaccel as fa, torch, tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> state = fa.prepare(fa.init(cpu=True), torch.nn.Linear(3, 2))
    >>> _ = fa.save(state, root / "disk" / "step_0")
    >>> fa.latest_checkpoint(root / "shm", root / "disk") == root / "disk" / "step_0"
    True
    """
    if not directories:
        raise TypeError(
            "fa.latest_checkpoint: give at least one directory (e.g. '/dev/shm/run', 'checkpoints')"
        )
    for index, given in enumerate(directories):
        if not isinstance(given, (str, os.PathLike)):
            raise TypeError(
                f"fa.latest_checkpoint: directories[{index}] must be a path (str or os.PathLike), "
                f"got {type(given).__name__} {given!r}"[:300]
            )
        if os.fspath(given) in ("", b""):
            raise ValueError(
                f"fa.latest_checkpoint: directories[{index}] is an empty path, which would scan "
                "the current directory; give the directory that holds the checkpoints ('.' for "
                "the current one)"
            )
    ranked: list[tuple[tuple[bool, int, int, int, int], Path, str]] = []
    for tier, given in enumerate(directories):
        directory = Path(os.fsdecode(given))
        if not directory.exists():
            continue
        if not directory.is_dir():
            raise ValueError(
                f"fa.latest_checkpoint: {directory} is not a directory; give the directories "
                "that hold checkpoints (or checkpoints themselves)"
            )
        found, unfinished = _candidates(directory)
        for path in unfinished:
            _skip(str(path), "an unfinished save or deletion (the next save to that name removes it)")
        for path in found:
            try:
                manifest = read_manifest(path)
            except CheckpointError as exc:
                _skip(str(path), str(exc))
                continue
            written = os.stat(path / MANIFEST).st_mtime_ns
            # sorted ascending: finite ones, then most steps, then the first tier, then the latest manifest
            ranked.append(
                (
                    (not manifest["finite"], -manifest["step"], -manifest["micro_step"], tier, -written),
                    path,
                    f"step {manifest['step']}",
                )
            )
    ranked.sort(key=lambda item: item[0])
    for key, path, step in ranked:
        lock = path.parent / f".{sibling_stem(path.name)}.lock"
        if locked(lock):
            _skip(
                f"{path} ({step})",
                f"a save to it is in progress (it holds {lock.name}) and may replace it while it is read",
            )
            continue
        try:
            verify(path)
        except CheckpointError as exc:
            _skip(f"{path} ({step})", str(exc))
            continue
        _name_nonfinite(ranked, key, path)
        return path
    return None


def _name_nonfinite(
    ranked: list[tuple[tuple[bool, int, int, int, int], Path, str]],
    chosen: tuple[bool, int, int, int, int],
    path: Path,
) -> None:
    """Warn about the checkpoints with NaN or inf passed over for a finite, older ``path``; or,
    when ``path`` is such a checkpoint itself (no finite one held), that it is one."""
    nonfinite = "saved with NaN or inf values (fa.save(..., allow_nonfinite=True))"
    if chosen[0]:
        warnings.warn(
            f"fa.latest_checkpoint: no finite checkpoint holds; {path} is {nonfinite}",
            SkippedCheckpointWarning,
            stacklevel=3,
        )
        return
    for key, other, step in ranked:
        if key[0] and key[1:3] < chosen[1:3]:
            _skip(
                f"{other} ({step})", f"it was {nonfinite}; the newest finite checkpoint, {path}, comes first"
            )
