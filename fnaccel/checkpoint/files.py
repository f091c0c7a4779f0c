"""Writing a checkpoint directory atomically, and reading it back verified.

A checkpoint is written into a hidden sibling directory (``.<name>.tmp-<id>``),
every file fsynced, the manifest last, the directory fsynced, and only then
moved to its name. Over an existing checkpoint the move is an atomic
exchange (Linux ``renameat2(RENAME_EXCHANGE)``), after which the old one is
deleted: at every instant the name holds a complete checkpoint, old or new.
A crash leaves at worst a hidden ``.tmp-`` directory beside it, which nothing
mistakes for a checkpoint. Files are hashed as they are written (sha256) and
checked as they are read, so a flipped byte names its file.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from fnaccel._errors import CheckpointError

__all__ = [
    "commit",
    "replace_atomically",
    "json_copy",
    "fsync_dir",
    "read_json",
    "read_tensors",
    "read_verified",
    "temporary_sibling",
    "write_bytes",
    "write_json",
    "write_tensors",
]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def temporary_sibling(final: Path, token: str) -> Path:
    """The hidden directory a checkpoint for ``final`` is written into."""
    return final.parent / f".{final.name}.tmp-{token}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dumps(value: Any, where: str, **options: Any) -> str:
    """JSON text of ``value``; what only pickle could store is refused, naming ``where``."""
    try:
        return json.dumps(value, allow_nan=True, **options)
    except TypeError as exc:
        raise CheckpointError(
            f"{where}: a value cannot be stored as JSON ({exc}); checkpoints hold only tensors "
            "and JSON values (numbers, strings, lists, dicts), never pickles"
        ) from None


def json_copy(value: Any, where: str) -> Any:
    """A deep copy of ``value`` through the JSON encoder (see `_dumps`)."""
    return json.loads(_dumps(value, where))


def replace_atomically(target: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Write one file by ``write(file)`` into a hidden sibling, then rename it onto
    ``target``: the name holds the old file or the whole new one, never a part.
    ``durable`` fsyncs the file and its directory (not for scratch files such as
    offloaded weights); a failed write removes the sibling and raises."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(partial, "wb") as handle:
            write(handle)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    if durable:
        fsync_dir(target.parent)


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` durably; return its manifest entry (sha256, size)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def write_json(path: Path, value: Any) -> dict[str, Any]:
    return write_bytes(path, _dumps(value, path.name, indent=1, sort_keys=True).encode())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    data = save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    return write_bytes(path, data)


def read_verified(directory: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """A file's bytes, checked against the manifest's size and sha256."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{directory}: the manifest lists no file {name!r}")
    path = directory / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint") from None
    if len(data) != entry["size"]:
        raise CheckpointError(
            f"{path}: truncated or extended ({len(data)} bytes, the manifest says {entry['size']})"
        )
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: corrupt (its sha256 does not match the manifest)")
    return data


def read_json(directory: Path, name: str, manifest: dict[str, Any]) -> Any:
    return json.loads(read_verified(directory, name, manifest))


def read_tensors(directory: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    return load_safetensors(read_verified(directory, name, manifest))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux); False where the kernel or libc cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _discard(old: Path, manifest: str) -> None:
    """Delete a replaced checkpoint, its manifest first: a deletion cut short
    leaves files without a manifest, which nothing takes for a checkpoint."""
    (old / manifest).unlink(missing_ok=True)
    fsync_dir(old)
    shutil.rmtree(old)


def commit(tmp: Path, final: Path, manifest: str) -> None:
    """Move the complete checkpoint ``tmp`` to ``final``, replacing an older one atomically."""
    fsync_dir(tmp)
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        _discard(tmp, manifest)  # tmp now holds the old checkpoint
    else:  # no atomic exchange here: the old one moves aside first, then is deleted
        aside = final.parent / f".{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
        os.rename(final, aside)
        os.rename(tmp, final)
        _discard(aside, manifest)
    fsync_dir(final.parent)
