"""A checkpoint's manifest, ``fnaccel.json``: its hash, its schema, and what a save may replace.

The manifest is the one file a load trusts first, so it is read bounded
(`MAX_MANIFEST_BYTES`), its schema version compared with the one this build
reads (`SCHEMA_VERSION`: an older or newer checkpoint is refused, naming both),
checked against its own sha256, and then every field against `_FIELDS` (types
and ranges; file names that stay inside the checkpoint; each file's blocksum
and size) before anything it says is used. Each failure is a
`CheckpointError` naming the file and the key.

`target_problem` says whether a save may replace what is at its path: nothing,
an empty directory, or an fnaccel checkpoint holding only the files its
manifest lists. Anything else (a user's directory, a regular file) is refused:
a save never deletes a file that fnaccel did not write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import (
    CHECKSUM,
    CHECKSUM_PATTERN,
    LEFTOVER_MARKER,
    NAME_MAX,
    read_bounded,
    safe_relative,
)
from fnaccel.checks import is_int

__all__ = [
    "FORMAT",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "SCHEMA_VERSION",
    "manifest_hash",
    "read_manifest",
    "target_problem",
]

MANIFEST = "fnaccel.json"
# The one schema this build writes and reads. Raise it with any change to what a checkpoint holds
# or how (a reader for an older one is written when a user holds such checkpoints, not before).
# 5: files checked by blocksum ({"blocksum": ..., "size": ...}); run.json; registered objects keep
#    their types in extras.json (extras.py); the data position in rank<r>.json.
# 6: "finite": false when a save with allow_nonfinite=True wrote NaN or inf (finite.py).
SCHEMA_VERSION = 6
FORMAT = "fnaccel-checkpoint"
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest lists files: even 10,000 ranks stay far below this
_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_hash(manifest: dict[str, Any]) -> str:
    """The manifest's sha256 over its own content (so a flipped digit in a counter shows)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _files(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for name, entry in value.items():
        safe_relative(name, f"{MANIFEST}: key 'files'")
        if not (
            isinstance(entry, dict)
            and set(entry) == {CHECKSUM, "size"}
            and _count(entry["size"])
            and isinstance(entry[CHECKSUM], str)
            and CHECKSUM_PATTERN.fullmatch(entry[CHECKSUM])
        ):
            return False
    return True


# every key of a manifest, what it must be, and the test
_FIELDS: Mapping[str, tuple[str, Callable[[Any], bool]]] = MappingProxyType(
    {
        "format": (repr(FORMAT), lambda v: v == FORMAT),
        "schema_version": (str(SCHEMA_VERSION), lambda v: type(v) is int and v == SCHEMA_VERSION),
        "num_processes": ("an integer >= 1", lambda v: _count(v) and v >= 1),
        "step": ("an integer >= 0", _count),
        "micro_step": ("an integer >= 0", _count),
        "epoch": ("an integer >= 0", _count),
        "seed": ("an integer or null", lambda v: v is None or is_int(v)),
        "pipeline": ("a string", lambda v: isinstance(v, str)),
        "finite": ("true or false", lambda v: type(v) is bool),
        "tied": (
            "an object of parameter names to parameter names",
            lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values())),
        ),
        "files": ('an object of relative file names to {"blocksum": 64 hex digits, "size": bytes}', _files),
        "manifest_sha256": ("64 hex digits", lambda v: isinstance(v, str) and bool(_SHA256.fullmatch(v))),
    }
)


def read_manifest(directory: Path) -> dict[str, Any]:
    """A checkpoint's ``fnaccel.json``, checked: a regular file of bounded size, JSON,
    fnaccel's format, the schema version this build reads, its own sha256, then every field.

    Raises:
        CheckpointError: naming the file (and the key) and what is wrong with it; a
            checkpoint of another schema version names its version and this build's.
    """
    path = directory / MANIFEST
    if not os.path.lexists(path):
        hint = " (it is not a directory)" if directory.exists() and not directory.is_dir() else ""
        raise CheckpointError(f"{directory}: not a complete fnaccel checkpoint: {MANIFEST} is missing{hint}")
    data = read_bounded(directory, MANIFEST, limit=MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{path}: corrupt (not valid JSON)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an fnaccel checkpoint manifest")
    version = manifest.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        age = ("older than" if version < SCHEMA_VERSION else "newer than") if type(version) is int else "not"
        raise CheckpointError(
            f"{path}: checkpoint schema version {version!r} is {age} the one this fnaccel reads "
            f"(schema version {SCHEMA_VERSION}); load it with the fnaccel that wrote it"
        )
    if manifest.get("manifest_sha256") != manifest_hash(manifest):
        raise CheckpointError(f"{path}: corrupt (its content does not match its own sha256)")
    unknown = sorted(set(manifest) - set(_FIELDS))
    if unknown:
        raise CheckpointError(
            f"{path}: key {unknown[0]!r} is not part of schema version {manifest['schema_version']}"
        )
    for key, (what, ok) in _FIELDS.items():
        if key not in manifest:
            raise CheckpointError(f"{path}: key {key!r} is missing")
        if not ok(manifest[key]):
            raise CheckpointError(f"{path}: key {key!r} must be {what}, not {_short(manifest[key])}")
    return manifest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _foreign(directory: Path, listed: set[str]) -> list[str]:
    """What is inside ``directory`` that its manifest does not list (relative names);
    fnaccel's own leftover mark (a crash while the checkpoint was committed or deleted) is not."""
    known = listed | {MANIFEST, LEFTOVER_MARKER}
    folders = {"/".join(name.split("/")[:i]) for name in known for i in range(1, name.count("/") + 1)}
    out: list[str] = []
    for root, dirs, files in os.walk(directory):
        base = Path(root).relative_to(directory)
        for name in list(dirs):
            relative = (base / name).as_posix()
            if relative not in folders or os.path.islink(Path(root) / name):
                out.append(relative + "/")
                dirs.remove(name)
        out.extend(relative for name in files if (relative := (base / name).as_posix()) not in known)
    return sorted(out)


def target_problem(final: Path) -> str | None:
    """Why a save may not replace what is at ``final``, or None when it may.

    A save may create ``final``, fill an empty directory, or replace an fnaccel
    checkpoint that holds only the files its manifest lists, in a directory
    this process may write in (the one the save creates its temporary sibling
    in, or the nearest one above that exists).
    """
    size = len(os.fsencode(final.name))
    if size > NAME_MAX:
        return (
            f"{final}: its name is {size} bytes, more than the {NAME_MAX} a file name may have; "
            "choose a shorter name"
        )
    if not os.path.lexists(final):
        above = next((p for p in final.parents if os.path.lexists(p)), None)
        if above is not None and not above.is_dir():
            return (
                f"{final}: {above} is a file, not a directory a checkpoint can be written in; "
                "choose another path"
            )
        return None if above is None else _unwritable(final, above)
    problem = _replaceable(final)
    return problem if problem is not None else _unwritable(final, final.parent)


def _unwritable(final: Path, directory: Path) -> str | None:
    """Why this process may not create entries in ``directory`` (as root too: a read-only
    file system or the immutable attribute), or None."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:  # gone since: the save's own mkdir will say so
        return None
    why = (
        "on a read-only file system"
        if read_only
        else "not writable by this process (its permissions or its immutable attribute)"
    )
    return (
        f"{final}: cannot be written: {directory} is {why}; nothing was written; save to a directory "
        "this process may write in"
    )


def _replaceable(final: Path) -> str | None:
    """Why a save may not replace what exists at ``final``, or None."""
    if not final.is_dir():
        return (
            f"{final} is a file, not a checkpoint directory; fa.save writes a directory there and "
            "never deletes a file it did not write: choose another path"
        )
    entries = sorted(os.listdir(final))
    if not entries:
        return None
    refuse = (
        f"{final} is a directory that is not an fnaccel checkpoint; a save replaces the whole "
        "directory and never deletes files it did not write: save to a new or empty directory "
        f"(e.g. a subdirectory such as {final / 'checkpoint'})"
    )
    if MANIFEST not in entries:
        return f"{refuse} (it holds {entries[:5]})"
    try:
        listed = set(read_manifest(final)["files"])
    except CheckpointError as exc:
        return f"{refuse} ({exc})"
    foreign = _foreign(final, listed)
    if foreign:
        return (
            f"{final} is an fnaccel checkpoint that also holds files it did not write ({foreign[:5]}); "
            "a save would replace the directory and lose them: move them out, or save elsewhere"
        )
    return None
