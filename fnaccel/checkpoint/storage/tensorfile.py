"""Safetensors files streamed to disk and mapped back, hashed on the way: the speed
half of checkpoint/storage/files.py (which keeps the safety half: where files may be
opened, atomic commit).

A file is written from each tensor's own memory (an 8-byte header length, the
JSON header, each tensor's bytes in order, never a whole-file ``bytes``); the
checksum of each chunk runs on a helper thread while the calling thread writes
the next (torch, zlib and hashlib release the GIL). It is read back as a
private mapping (`map_file`), checksummed whole, and each tensor is a view of
its own bytes in that mapping: no copy, as safetensors' own ``load_file``.

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
tensors do (`torch_dtype`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import re
import sys
from array import array
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fnaccel._errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKSUM",
    "CHECKSUM_PATTERN",
    "Checksum",
    "DTYPES",
    "ITEMSIZES",
    "layout",
    "map_file",
    "memory_of",
    "not_safetensors",
    "python_block_sums",
    "safetensors_pieces",
    "torch_dtype",
    "write_hashed",
]

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
