"""Atomic, durable single-file writes: the leaf that config files, checkpoints and
offloaded weights share."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["fsync_dir", "replace_atomically"]


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(target: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Write one file by ``write(file)`` into a hidden sibling, then rename it onto
    ``target``: the name holds the old file or the whole new one, never a part.
    ``durable`` fsyncs the file and its directory (not for scratch files such as
    offloaded weights); a failed write removes the sibling and raises.

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "config.yaml"
    >>> replace_atomically(target, lambda f: f.write(b"a: 1\\n"))
    >>> target.read_bytes()
    b'a: 1\\n'
    """
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
