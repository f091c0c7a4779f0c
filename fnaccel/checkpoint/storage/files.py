"""The files of a checkpoint: safetensors streamed to disk and mapped back, hashed on the way;
a directory written atomically; every read bounded and verified.

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
bounded by that size, and its checksum (`Checksum`) is checked, so a flipped
byte names its file. `verify_file` checks one file without loading it;
`check_checksum` is the one comparison every read goes through.

Speed: a safetensors file is written from each tensor's own memory (an 8-byte
header length, the JSON header, each tensor's bytes in order, never a
whole-file ``bytes``); the checksum of each chunk runs on a helper thread while
the calling thread writes the next (torch, zlib and hashlib release the GIL).
It is read back as a private mapping (`map_file`), checksummed whole, and each
tensor is a view of its own bytes in that mapping: no copy, as safetensors' own
``load_file``. safetensors refuses two names for one storage (an ``lm_head``
tied to the embedding): `untie` keeps the first name of each storage and
records the others as aliases, `retie` gives them back.

The checksum of a new file is ``blocksum`` (`CHECKSUM`): the file, zero-padded
to whole 4 KiB blocks, read as 64-bit little-endian words; each block's words
summed modulo 2**64; the sha256 of those sums followed by the file's size.
torch sums a block at memory speed (151 MB in 6-8 ms on the development
machine, where CRC-32 takes 42 ms and sha256 95 ms), which is what lets a
load verify every byte at near the cost of not verifying it. It names a
corrupt file with certainty for any change within one 64-bit word (every
flipped bit, every burst of up to 64), for lost, zeroed or misplaced blocks
whose sums differ, and with odds of 1 in 2**64 for random damage to a block;
what it cannot see is a change that keeps a block's sum, such as two words of
one block swapped. It guards against corruption, not forgery: a forger can
rewrite the manifest's hashes whatever the algorithm. It is the one algorithm
fnaccel writes and reads (`Checksum`; each manifest entry names it).

`DTYPES` is the one table of the dtypes a file may hold (safetensors' names,
torch's names, bytes per element), plain strings and numbers: a header is
checked (`layout`) without importing torch, which only the reads and writes of
tensors do (`torch_dtype`)."""

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
import sys
import time
import uuid
from array import array
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_checksum",
    "CHECKSUM",
    "Checksum",
    "CHECKSUM_PATTERN",
    "commit",
    "discard",
    "DTYPES",
    "ITEMSIZES",
    "json_copy",
    "layout",
    "LEFTOVER_MARKER",
    "LOCK_MARKER",
    "locked",
    "make_temporary",
    "map_file",
    "memory_of",
    "NAME_MAX",
    "not_safetensors",
    "open_inside",
    "python_block_sums",
    "read_bounded",
    "read_json",
    "read_tensors",
    "read_verified",
    "regular_size",
    "remove_leftovers",
    "remove_replaced",
    "retie",
    "safe_relative",
    "safetensors_pieces",
    "SaveLock",
    "sibling_stem",
    "temporary_sibling",
    "torch_dtype",
    "untie",
    "verify_file",
    "write_bytes",
    "write_hashed",
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


def _dumps(value: object, where: str, **options: Any) -> str:
    """JSON text of ``value``; what only pickle could store is refused, naming ``where``."""
    try:
        return json.dumps(value, allow_nan=True, **options)
    except TypeError as exc:
        raise CheckpointError(
            f"{where}: a value cannot be stored as JSON ({exc}); checkpoints hold only tensors "
            "and JSON values (numbers, strings, lists, dicts), never pickles"
        ) from None


def json_copy(value: object, where: str) -> Any:
    """A deep copy of ``value`` through the JSON encoder (see `_dumps`)."""
    return json.loads(_dumps(value, where))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` as a safetensors file straight from their memory (see
    `fnaccel.checkpoint.storage.files`); return its manifest entry (checksum, size)."""
    pieces, keep_alive = safetensors_pieces(path, tensors)
    entry = write_hashed(path, pieces)
    del keep_alive  # the views in ``pieces`` read these tensors' memory until written
    return entry


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` durably; return its manifest entry (checksum, size)."""
    return write_hashed(path, [memoryview(data)])


def write_json(path: Path, value: object) -> dict[str, Any]:
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


CHECKSUM = "blocksum"  # the algorithm, and the key a manifest entry records its digest under
CHECKSUM_PATTERN = re.compile(r"[0-9a-f]{64}")  # its digest: lowercase hex
_BLOCK = 4096  # blocksum's block, in bytes: 512 words
_MASK64 = 2**64 - 1

_WRITE_CHUNK = 16 << 20  # writes and hash updates go in 16 MiB pieces, so the two overlap
_HASH_THREAD_MIN = 4 << 20  # smaller files are hashed inline: a thread costs more than it saves
# safetensors dtype name -> (torch dtype name, bytes per element): the dtypes safetensors itself
# reads back. A plain table, so that reading a header (`fnaccel checkpoint inspect`) needs no torch.
DTYPES = MappingProxyType(
    {
        "F64": ("float64", 8),
        "F32": ("float32", 4),
        "F16": ("float16", 2),
        "BF16": ("bfloat16", 2),
        "I64": ("int64", 8),
        "I32": ("int32", 4),
        "I16": ("int16", 2),
        "I8": ("int8", 1),
        "U8": ("uint8", 1),
        "BOOL": ("bool", 1),
        "U64": ("uint64", 8),
        "U32": ("uint32", 4),
        "U16": ("uint16", 2),
        "F8_E4M3": ("float8_e4m3fn", 1),
        "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
        "F8_E5M2": ("float8_e5m2", 1),
        "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
        "C64": ("complex64", 8),
    }
)
_SAFETENSORS_NAMES = MappingProxyType({torch_name: name for name, (torch_name, _) in DTYPES.items()})
ITEMSIZES = MappingProxyType({torch_name: size for torch_name, size in DTYPES.values()})


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a torch dtype name of `DTYPES` (``"bfloat16"``); imports torch.

    >>> torch_dtype("bfloat16")
    torch.bfloat16
    """
    import torch

    dtype = getattr(torch, name, None)
    if name not in ITEMSIZES or not isinstance(dtype, torch.dtype):
        raise CheckpointError(
            f"dtype {name!r} is not one this torch {torch.__version__} stores in safetensors"
        )
    return dtype


class Checksum:
    """A file's running blocksum (`CHECKSUM`), fed the file's bytes in order, in chunks
    of any size.

    >>> whole, parts = Checksum(), Checksum()
    >>> whole.update(bytes(range(256)) * 20)
    >>> for start in range(0, 5120, 1000):
    ...     parts.update((bytes(range(256)) * 20)[start:start + 1000])
    >>> whole.hexdigest() == parts.hexdigest() != Checksum().hexdigest()
    True
    """

    __slots__ = ("_carry", "_sha", "_size")

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._carry = bytearray()  # the start of a block not yet whole
        self._size = 0

    def update(self, chunk: memoryview | bytes) -> None:
        view = memoryview(chunk).cast("B")
        self._size += len(view)
        if self._carry:
            taken = _BLOCK - len(self._carry)
            self._carry += view[:taken]
            view = view[taken:]
            if len(self._carry) < _BLOCK:
                return
            self._sha.update(_block_sums(self._carry))
            self._carry = bytearray()
        whole = len(view) - len(view) % _BLOCK
        if whole:
            self._sha.update(_block_sums(view[:whole] if not view.readonly else bytearray(view[:whole])))
        self._carry = bytearray(view[whole:])

    def hexdigest(self) -> str:
        sha = self._sha.copy()
        if self._carry:
            sha.update(_block_sums(self._carry + bytes(_BLOCK - len(self._carry))))
        sha.update(self._size.to_bytes(8, "little"))
        return sha.hexdigest()


def _block_sums(blocks: memoryview | bytearray) -> bytes:
    """The sum modulo 2**64 of each 4 KiB block's 64-bit words (whole, writable
    ``blocks``), as little-endian bytes (on the little-endian hosts fnaccel writes
    safetensors from, whose words it reads): by torch at memory speed, whose integer
    sum wraps (a sum modulo 2**64 is the same in any order, so every build and
    thread count agrees); where torch is not imported (`fnaccel checkpoint inspect`
    never imports it), by `python_block_sums`."""
    if "torch" not in sys.modules:
        return python_block_sums(blocks)
    import torch

    sums = torch.frombuffer(blocks, dtype=torch.int64).view(-1, _BLOCK // 8).sum(1)
    return bytes(memory_of(sums))  # memory_of's view does not keep ``sums`` alive: copied while it is


def python_block_sums(blocks: memoryview | bytearray | bytes) -> bytes:
    """`_block_sums` without torch, at about 100 MB/s.

    >>> python_block_sums(bytes(4096)) == bytes(8)
    True
    """
    words = memoryview(blocks).cast("B").cast("Q")
    step = _BLOCK // 8
    return array("Q", [sum(words[i : i + step]) & _MASK64 for i in range(0, len(words), step)]).tobytes()


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]


def write_hashed(path: Path, pieces: Iterable[memoryview]) -> dict[str, Any]:
    """Write ``pieces`` in order to a new file ``path``, fsync it, and return its
    manifest entry (`CHECKSUM`, size): the checksum runs on a helper thread over
    the same chunks while this thread writes them (FIFO on one worker keeps order)."""
    digest = Checksum()
    size = 0
    pool: ThreadPoolExecutor | None = None
    pending: list[Future[None]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for piece in pieces:
            if pool is None and len(piece) >= _HASH_THREAD_MIN:
                pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fnaccel-checksum")
            for start in range(0, len(piece), _WRITE_CHUNK):
                chunk = piece[start : start + _WRITE_CHUNK]
                if pool is None:
                    digest.update(chunk)
                else:
                    pending.append(pool.submit(digest.update, chunk))
                _write_all(fd, chunk)
                size += len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
        if pool is not None:
            pool.shutdown(wait=True)  # the chunks must outlive every update that reads them
    for future in pending:
        future.result()
    return {CHECKSUM: digest.hexdigest(), "size": size}


def _tensor_bytes(name: str, tensor: torch.Tensor, where: Path) -> tuple[torch.Tensor, str]:
    """``tensor`` as a dense, contiguous CPU tensor whose memory holds exactly its
    values (conjugate and negative views resolved), and its safetensors dtype name."""
    import torch

    dtype = _SAFETENSORS_NAMES.get(str(tensor.dtype).removeprefix("torch."))
    if dtype is None:
        raise CheckpointError(
            f"{where}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
            f"convert it to one of {sorted(f'torch.{d}' for d in _SAFETENSORS_NAMES)} before saving"
        )
    if tensor.layout != torch.strided:
        raise CheckpointError(
            f"{where}: tensor {name!r} is {tensor.layout}; save its dense form (.to_dense())"
        )
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous(), dtype


def memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must outlive the view)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def not_safetensors(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a valid safetensors file ({why})")


_Spec = tuple[int, int, str, str, list[int]]  # begin, end, name, torch dtype name (of `DTYPES`), shape


def layout(path: Path, text: bytes, data_size: int) -> list[_Spec]:
    """The tensors a safetensors header ``text`` describes, in file order, every
    field checked: known dtype, non-negative integer shape, offsets that tile the
    ``data_size`` bytes after the header exactly. Dtypes come back as torch's names
    (``"float32"``; `torch_dtype` makes them torch dtypes): no torch is imported."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise not_safetensors(path, "its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise not_safetensors(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    specs: list[_Spec] = []
    for key, spec in header.items():
        fields = spec if isinstance(spec, dict) else {}
        shape, offsets = fields.get("shape"), fields.get("data_offsets")
        known = DTYPES.get(fields["dtype"]) if isinstance(fields.get("dtype"), str) else None
        if not (
            known is not None
            and isinstance(shape, list)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(x) is int and x >= 0 for x in [*shape, *offsets])
        ):
            raise not_safetensors(path, f"tensor {key!r} has a malformed dtype, shape or data_offsets")
        numel = 1
        for x in shape:
            numel *= x
        dtype, itemsize = known
        if offsets[1] - offsets[0] != numel * itemsize:
            raise not_safetensors(
                path, f"tensor {key!r}: its offsets do not hold shape {shape} of torch.{dtype}"
            )
        specs.append((offsets[0], offsets[1], key, dtype, shape))
    specs.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, key, _, _ in specs:
        if begin != end:
            raise not_safetensors(path, f"tensor {key!r}: the data offsets overlap or leave a gap")
        end = stop
    if end != data_size:
        raise not_safetensors(path, f"the tensors hold {end} bytes, the file {data_size} after its header")
    return specs


def map_file(fd: int, size: int) -> mmap.mmap | bytearray:
    """The ``size`` bytes of the open regular file ``fd`` as a private, copy-on-write
    mapping: reading it reads the page cache without a copy, and a tensor made
    over it may be written without touching the file. Tensors over it stay valid
    after the file is replaced or deleted (fnaccel's saves do both by rename and
    unlink), but not if it is truncated in place."""
    if size == 0:
        return bytearray()
    return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)


def safetensors_pieces(
    path: Path, tensors: dict[str, torch.Tensor]
) -> tuple[list[memoryview], list[torch.Tensor]]:
    """The pieces of the safetensors file of ``tensors`` (header, then each tensor's
    bytes as a view of its memory), and the tensors those views read, which must
    stay alive until the pieces are written. Tensors go largest element first
    (then by name), so each starts at a multiple of its element size, as in
    safetensors' own writer."""
    dense = {name: _tensor_bytes(name, t, path) for name, t in tensors.items()}
    order = sorted(dense, key=lambda name: (-dense[name][0].element_size(), name))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        tensor, dtype = dense[name]
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    pieces = [memoryview(len(text).to_bytes(8, "little") + text)]
    pieces += [memory_of(dense[name][0]) for name in order if dense[name][0].numel()]
    return pieces, [tensor for tensor, _ in dense.values()]


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    # the same storage viewed the same way is the same tensor; a different view is not
    return (
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def untie(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split ``tensors`` into one entry per storage and ``{alias: kept name}``.

    >>> import torch
    >>> w = torch.ones(2)
    >>> untie({"a": w, "b": w, "c": torch.zeros(1)})[1]
    {'b': 'a'}
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[object, ...], str] = {}
    for name, tensor in tensors.items():
        key = _storage_key(tensor) if tensor.numel() else (id(tensor),)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = tensor
    return unique, aliases


def retie(tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``tensors`` with every alias pointing at its kept tensor again."""
    out = dict(tensors)
    for alias, name in aliases.items():
        out[alias] = out[name]
    return out
