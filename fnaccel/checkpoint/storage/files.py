"""Writing a checkpoint directory atomically, and reading it back verified.

A checkpoint is written into a hidden sibling directory (``.<name>.tmp-<id>``,
marked by a `LEFTOVER_MARKER` file written first), every file fsynced, the
manifest last, the directory fsynced, and only then moved to its name. Over
an existing checkpoint the move is an atomic exchange (Linux
``renameat2(RENAME_EXCHANGE)``), after which the old one is deleted, off the
save's critical path (`remove_replaced`, on the run's save queue's thread): at every
instant the name holds a complete checkpoint, old or new. A crash leaves at
worst a hidden, marked directory beside it, which nothing mistakes for a
checkpoint and the next save to that name removes (`remove_leftovers`).

Reading trusts nothing: a file is opened only if it is a regular file inside
the checkpoint directory (no symbolic link, FIFO or device, no ``..``), its
size is compared with the manifest's before a byte is read, the read is
bounded by that size, and its checksum (blocksum,
`fnaccel.checkpoint.storage.tensorfile.Checksum`) is checked, so a flipped byte names
its file. `verify_file` checks one file without
loading it; `check_checksum` is the one comparison every read goes through.

Speed: safetensors files are written from each tensor's own memory, their
checksum computed on a helper thread while the writes go on, and read back as
a private mapping whose tensors are views of it
(`fnaccel.checkpoint.storage.tensorfile`); no whole-checkpoint ``bytes`` is built.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir
from fnaccel.checkpoint.storage.tensorfile import (
    CHECKSUM,
    Checksum,
    layout,
    map_file,
    not_safetensors,
    safetensors_pieces,
    torch_dtype,
    write_hashed,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "LEFTOVER_MARKER",
    "LOCK_MARKER",
    "NAME_MAX",
    "check_checksum",
    "commit",
    "discard",
    "json_copy",
    "locked",
    "make_temporary",
    "open_inside",
    "read_bounded",
    "read_json",
    "read_tensors",
    "read_verified",
    "regular_size",
    "remove_leftovers",
    "remove_replaced",
    "SaveLock",
    "safe_relative",
    "sibling_stem",
    "temporary_sibling",
    "verify_file",
    "write_bytes",
    "write_json",
    "write_tensors",
]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
LEFTOVER_MARKER = ".fnaccel-leftover"  # inside every directory fnaccel may delete as its own leftover
_CHUNK = 1 << 30  # reads go in pieces of at most 1 GiB (Linux returns at most ~2 GiB per read)


_SIBLING_ROOM = len(".") + len(".tmp-") + 32  # what a hidden sibling adds to its checkpoint's name
NAME_MAX = 255  # bytes in one file name on Linux's file systems (ext4, xfs, btrfs, tmpfs, NFS)


def sibling_stem(name: str) -> str:
    """The part of ``name`` its hidden siblings (``.<stem>.tmp-<id>``, ``.old-``, ``.lock``)
    carry: ``name`` itself, or, where that would pass the 255-byte file-name limit, its
    first characters and ``~`` and 8 hex digits of its sha256 (still recognisable,
    distinct for distinct names).

    >>> sibling_stem("ckpt")
    'ckpt'
    >>> len(sibling_stem("x" * 250).encode())
    217
    """
    room = NAME_MAX - _SIBLING_ROOM
    if len(os.fsencode(name)) <= room:
        return name
    digest = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    head = name
    while len(os.fsencode(head)) > room - len(digest):
        head = head[:-1]
    return head + digest


def temporary_sibling(final: Path, token: str) -> Path:
    """The hidden directory a checkpoint for ``final`` is written into."""
    return final.parent / f".{sibling_stem(final.name)}.tmp-{token}"


def _aside(final: Path, token: str) -> Path:
    """The hidden name a former checkpoint at ``final`` is deleted under."""
    return final.parent / f".{sibling_stem(final.name)}.old-{token}"


def _mark(directory: Path) -> None:
    """Mark ``directory`` as fnaccel's own, to be deleted (see `remove_leftovers`)."""
    (directory / LEFTOVER_MARKER).write_bytes(b"fnaccel: a checkpoint being written or deleted\n")


def make_temporary(final: Path, token: str) -> Path:
    """Create the marked temporary directory a checkpoint for ``final`` is written into."""
    tmp = temporary_sibling(final, token)
    tmp.mkdir()
    _mark(tmp)
    return tmp


def remove_leftovers(parent: Path, names: str, *, holding: SaveLock | None = None) -> list[Path]:
    """Delete what fnaccel's own crashed or failed saves left in ``parent``.

    Only hidden directories named ``.<name>.tmp-<32 hex>`` or ``.<name>.old-<32 hex>``,
    ``<name>`` matching the regular expression ``names``, that hold a
    `LEFTOVER_MARKER` regular file are removed: a directory with the right name
    but no marker (or a symbolic link) is someone else's and is kept, and so is
    one whose name's `SaveLock` a live save holds (it is that save's), unless
    the caller is that save (``holding``). Returns the directories removed.
    """
    pattern = re.compile(r"\.(" + names + r")\.(tmp|old)-[0-9a-f]{32}")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not (match and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            marked = stat.S_ISREG(os.lstat(Path(entry.path) / LEFTOVER_MARKER).st_mode)
        except OSError:
            marked = False
        lock = parent / f".{match.group(1)}.lock"
        if marked and ((holding is not None and holding.path == lock) or not locked(lock)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


LOCK_MARKER = b"fnaccel: a save to this checkpoint is in progress\n"


class SaveLock:
    """The lock a save holds on its target from its start until it is committed: the file
    ``.<name>.lock`` beside the checkpoint, starting with `LOCK_MARKER`, then the owner
    (pid, host, start) as JSON, held with ``flock``, which the kernel releases when the
    owner dies, so a crashed owner's lock file is taken over by the next save."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @staticmethod
    def take(final: Path) -> SaveLock | str:
        """The lock on ``final`` (its parent directories are made), or why not: another live
        save holds it (named), or the lock's name holds something fnaccel did not write."""
        path = final.parent / f".{sibling_stem(final.name)}.lock"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{final}: cannot create its directory {final.parent} ({exc.strerror})"
        for _ in range(3):  # the path may be unlinked by its owner between our open and our flock
            try:
                fd = os.open(
                    path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644
                )
            except OSError as exc:
                return f"{final}: cannot create the save's lock file {path} ({exc.strerror})"
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return (
                        f"{final}: {path} is not a regular file; fnaccel keeps its save lock there: remove it"
                    )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    owner = os.pread(fd, 4096, 0).removeprefix(LOCK_MARKER).decode(errors="replace").strip()
                    return (
                        f"{final}: another save to this path is in progress ({owner or 'starting'}); two "
                        "runs saving to one path would replace each other's checkpoints: save elsewhere, "
                        "or wait for it to end"
                    )
                content = os.pread(fd, len(LOCK_MARKER), 0)
                if content and content != LOCK_MARKER:
                    return f"{final}: {path} is not fnaccel's save lock, and fnaccel keeps its lock there: move it"
                try:
                    current = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    owner = json.dumps(
                        {
                            "pid": os.getpid(),
                            "host": socket.gethostname(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                        }
                    )
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, LOCK_MARKER + owner.encode() + b"\n", 0)
                    lock, fd = SaveLock(path, fd), -1
                    return lock
            finally:
                if fd >= 0:
                    os.close(fd)
        return f"{final}: its save lock {path} kept being replaced by other saves; save elsewhere"

    def release(self) -> None:
        """Remove the lock file (while still holding it: the next save locks a new one), then unlock."""
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def locked(path: Path) -> bool:
    """Whether a live save holds the lock file ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def safe_relative(name: object, where: str) -> str:
    """``name`` if it is a relative path that stays inside its directory, else a `CheckpointError`."""
    if not (
        isinstance(name, str)
        and name
        and not name.startswith("/")
        and "\\" not in name
        and "\0" not in name
        and all(part not in ("", ".", "..") for part in name.split("/"))
    ):
        raise CheckpointError(
            f"{where}: file name {name!r} does not name a file inside the checkpoint "
            "(absolute, empty, '.' or '..' parts); the checkpoint was edited or is hostile"
        )
    return name


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


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` as a safetensors file straight from their memory (see
    `fnaccel.checkpoint.storage.tensorfile`); return its manifest entry (checksum, size)."""
    pieces, keep_alive = safetensors_pieces(path, tensors)
    entry = write_hashed(path, pieces)
    del keep_alive  # the views in ``pieces`` read these tensors' memory until written
    return entry


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` durably; return its manifest entry (checksum, size)."""
    return write_hashed(path, [memoryview(data)])


def write_json(path: Path, value: Any) -> dict[str, Any]:
    return write_bytes(path, _dumps(value, path.name, indent=1, sort_keys=True).encode())


def open_inside(directory: Path, name: str) -> int:
    """A read-only descriptor of the regular file ``directory/name``, opened without
    following a symbolic link at any step below ``directory`` and without blocking
    on a FIFO; anything else is a `CheckpointError` naming the path."""
    path = directory / name
    *parents, leaf = safe_relative(name, str(directory)).split("/")
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no such checkpoint directory") from None
    except NotADirectoryError:
        raise CheckpointError(f"{directory}: not a directory") from None
    try:
        for part in parents:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=fd)
            os.close(fd)
            fd = inner
        file_fd = os.open(leaf, os.O_RDONLY | os.O_NONBLOCK | nofollow, dir_fd=fd)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointError(
                f"{path}: a symbolic link (or a path through one); a checkpoint's files must be "
                "regular files inside its directory"
            ) from None
        raise CheckpointError(f"{path}: cannot be opened ({exc.strerror})") from None
    finally:
        os.close(fd)
    mode = os.fstat(file_fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(file_fd)
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "not a regular file"
        )
        raise CheckpointError(
            f"{path}: {kind}; a checkpoint's files must be regular files inside its directory"
        )
    return file_fd


def regular_size(directory: Path, name: str) -> int:
    """The size of ``directory/name``, a regular file inside ``directory`` (see `open_inside`)."""
    fd = open_inside(directory, name)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_bounded(directory: Path, name: str, *, size: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``directory/name`` (see `open_inside`), read only
    after ``fstat`` agrees: exactly ``size`` bytes, or at most ``limit``."""
    path = directory / name
    fd = open_inside(directory, name)
    try:
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            raise CheckpointError(f"{path}: truncated or extended ({actual} bytes, the manifest says {size})")
        if limit is not None and actual > limit:
            raise CheckpointError(f"{path}: {actual} bytes, more than the {limit} such a file may hold")
        pieces, left = [], actual
        while left > 0:  # one read for any file under 1 GiB: no copy beyond the bytes returned
            piece = os.read(fd, min(left, _CHUNK))
            if not piece:
                raise CheckpointError(
                    f"{path}: truncated while being read ({actual - left} of {actual} bytes)"
                )
            pieces.append(piece)
            left -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)  # b"" for an empty file
    finally:
        os.close(fd)


def check_checksum(path: Path, entry: dict[str, Any], digest: Checksum) -> None:
    """Raise unless ``digest`` (of the whole file ``path``) is the one its manifest
    ``entry`` records."""
    if digest.hexdigest() != entry[CHECKSUM]:
        raise CheckpointError(f"{path}: corrupt (its {CHECKSUM} does not match the manifest)")


def _entry(directory: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{directory}: the manifest lists no file {name!r}")
    return cast(dict[str, Any], entry)  # read_manifest checked every entry's fields


def _checked_size(fd: int, path: Path, entry: dict[str, Any]) -> int:
    size = os.fstat(fd).st_size
    if size != entry["size"]:
        raise CheckpointError(
            f"{path}: truncated or extended ({size} bytes, the manifest says {entry['size']})"
        )
    return size


def verify_file(directory: Path, name: str, manifest: dict[str, Any]) -> None:
    """Check one file of a checkpoint against its (already validated) manifest without
    keeping its bytes: a regular file inside ``directory``, the size the manifest
    records (by ``fstat``, before a byte is read), and the checksum; the read is
    bounded by that size.

    Raises:
        CheckpointError: naming the file and what is wrong with it.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> entry = write_bytes(folder / "a.txt", b"abc")
    >>> entry["size"], sorted(entry)
    (3, ['blocksum', 'size'])
    >>> verify_file(folder, "a.txt", {"files": {"a.txt": entry}})
    >>> _ = (folder / "a.txt").write_bytes(b"abd")
    >>> verify_file(folder, "a.txt", {"files": {"a.txt": entry}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fnaccel._errors.CheckpointError: ...a.txt: corrupt (its blocksum does not match the manifest)
    """
    _mapped(directory, name, manifest)


def _mapped(directory: Path, name: str, manifest: dict[str, Any]) -> mmap.mmap | bytearray:
    """The regular file ``directory/name`` as a private mapping (`map_file`), its size
    (by ``fstat``, before a byte is read) and checksum compared with its manifest
    entry."""
    entry = _entry(directory, name, manifest)
    fd = open_inside(directory, name)
    try:
        data = map_file(fd, _checked_size(fd, directory / name, entry))
    finally:
        os.close(fd)
    digest = Checksum()
    digest.update(memoryview(data))
    check_checksum(directory / name, entry, digest)
    return data


def read_verified(directory: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """A file's bytes, checked against the manifest's size (before reading) and
    checksum (over a mapping of the file, so the bytes are copied once)."""
    return bytes(_mapped(directory, name, manifest))


def read_json(directory: Path, name: str, manifest: dict[str, Any]) -> Any:
    data = read_verified(directory, name, manifest)  # its CheckpointError is also a ValueError
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # hashes matched: written so on purpose
        raise CheckpointError(f"{directory / name}: not valid JSON (or nested too deeply)") from None


def read_tensors(directory: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, each a view of its own bytes in a private mapping
    of the file (`map_file`: no copy; writing a tensor leaves the file as it is),
    made only after the whole file's size (checked by ``fstat`` before a byte is
    read) and checksum match the manifest, then its header field by field: a
    corrupt file is named corrupt, one hashed as written but malformed is named
    not a safetensors file."""
    path = directory / name
    data = _mapped(directory, name, manifest)
    size = len(data)
    if size < 8:
        raise not_safetensors(path, "shorter than its 8-byte header length")
    length = int.from_bytes(data[:8], "little")
    if length > size - 8:
        raise not_safetensors(path, f"its header length {length} runs past the end of the file")
    specs = layout(path, bytes(data[8 : 8 + length]), size - 8 - length)
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for begin, end, key, dtype_name, shape in specs:
        dtype, offset = torch_dtype(dtype_name), 8 + length + begin
        if begin == end:
            tensors[key] = torch.empty(shape, dtype=dtype)
        elif offset % dtype.itemsize:  # another writer's unaligned tensor: copied out aligned
            raw = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=offset)
            tensors[key] = raw.clone().view(dtype).view(shape)
        else:
            tensors[key] = torch.frombuffer(
                data, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=offset
            ).view(shape)
    return tensors


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


def _delete(old: Path, manifest: str) -> None:
    """Delete a marked, hidden former checkpoint: its manifest first, its mark last, so that
    a crash at any instant leaves a marked leftover the next save removes (`remove_leftovers`)."""
    (old / manifest).unlink(missing_ok=True)
    fsync_dir(old)
    for entry in os.scandir(old):
        if entry.name == LEFTOVER_MARKER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    (old / LEFTOVER_MARKER).unlink()
    old.rmdir()


def remove_replaced(old: Path, manifest: str) -> None:
    """Delete the former checkpoint `commit` moved aside. Off the save's critical path
    (`SaveQueue.remove_later`), so an error is not the save's: what is left stays
    marked, and the next save to that name removes it as a leftover (as another
    run's save may already have done: then nothing is left here)."""
    with contextlib.suppress(OSError):
        _delete(old, manifest)


def discard(checkpoint: Path, manifest: str) -> None:
    """Delete a complete checkpoint without ever showing it half deleted: it is marked,
    moved to a hidden ``.<name>.old-<id>`` (a crash then leaves a leftover that
    `remove_leftovers` recognises), then deleted."""
    _mark(checkpoint)
    aside = _aside(checkpoint, uuid.uuid4().hex)
    os.rename(checkpoint, aside)
    fsync_dir(checkpoint.parent)
    _delete(aside, manifest)


def commit(tmp: Path, final: Path, manifest: str) -> Path | None:
    """Move the complete checkpoint ``tmp`` to ``final``, replacing an older one atomically.

    Every directory is marked for as long as it has a hidden name: the old
    checkpoint is marked before it moves there, the new one keeps its mark until
    it has moved to ``final``. A crash at any instant thus leaves only marked
    leftovers (`remove_leftovers`), at worst with a mark inside the checkpoint,
    which nothing else reads.

    Returns:
        The former checkpoint, now under a hidden marked name, for the caller to
        delete (`remove_replaced`: its removal is no part of the commit); None
        when ``final`` held none.
    """
    fsync_dir(tmp)
    old: Path | None = None
    if not final.exists():
        os.rename(tmp, final)
    else:
        _mark(final)  # the old checkpoint is about to go under a hidden name
        if _exchange(tmp, final):
            old = tmp
        else:  # no atomic exchange here: the old one moves aside first
            old = _aside(final, tmp.name.rsplit("-", 1)[-1])
            os.rename(final, old)
            os.rename(tmp, final)
    (final / LEFTOVER_MARKER).unlink()
    fsync_dir(final)
    fsync_dir(final.parent)
    return old
