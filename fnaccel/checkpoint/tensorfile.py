"""Safetensors files streamed to and from disk, hashed on the way: the speed half of
checkpoint/files.py (which keeps the safety half: where files may be opened,
atomic commit).

A file is written from each tensor's own memory (an 8-byte header length, the
JSON header, each tensor's bytes in order, never a whole-file ``bytes``) and
read straight into each tensor's own memory after its header is checked
field by field. The sha256 of each chunk runs on a helper thread while the
calling thread writes or reads the next (hashlib releases the GIL), so the
hash costs wall time only where it outlasts the I/O.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from fnaccel._errors import CheckpointError

__all__ = ["HashedReader", "layout", "memory_of", "not_safetensors", "safetensors_pieces", "write_hashed"]

_WRITE_CHUNK = 16 << 20  # writes and hash updates go in 16 MiB pieces, so the two overlap
_HASH_THREAD_MIN = 4 << 20  # smaller files are hashed inline: a thread costs more than it saves
# torch dtype -> safetensors dtype name: the dtypes safetensors itself reads back
_DTYPE_NAMES = MappingProxyType({
    dtype: name
    for attr, name in (
        ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
        ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"),
        ("bool", "BOOL"), ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16"),
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2", "F8_E5M2"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("complex64", "C64"),
    )
    if isinstance(dtype := getattr(torch, attr, None), torch.dtype)
})


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk):]


def write_hashed(path: Path, pieces: Iterable[memoryview]) -> dict[str, Any]:
    """Write ``pieces`` in order to a new file ``path``, fsync it, and return its
    manifest entry (sha256, size): the hash runs on a helper thread over the
    same chunks while this thread writes them (FIFO on one worker keeps order)."""
    digest = hashlib.sha256()
    size = 0
    pool: ThreadPoolExecutor | None = None
    pending: list[Future[None]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for piece in pieces:
            if pool is None and len(piece) >= _HASH_THREAD_MIN:
                pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fnaccel-sha256")
            for start in range(0, len(piece), _WRITE_CHUNK):
                chunk = piece[start:start + _WRITE_CHUNK]
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
    return {"sha256": digest.hexdigest(), "size": size}


def _tensor_bytes(name: str, tensor: torch.Tensor, where: Path) -> tuple[torch.Tensor, str]:
    """``tensor`` as a dense, contiguous CPU tensor whose memory holds exactly its
    values (conjugate and negative views resolved), and its safetensors dtype name."""
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise CheckpointError(
            f"{where}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
            f"convert it to one of {sorted(str(d) for d in _DTYPE_NAMES)} before saving"
        )
    if tensor.layout != torch.strided:
        raise CheckpointError(f"{where}: tensor {name!r} is {tensor.layout}; save its dense form (.to_dense())")
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous(), dtype


def memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must outlive the view)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def not_safetensors(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a valid safetensors file ({why})")


_Spec = tuple[int, int, str, torch.dtype, list[int]]  # begin, end, name, dtype, shape


def layout(path: Path, text: bytes, data_size: int) -> list[_Spec]:
    """The tensors a safetensors header ``text`` describes, in file order, every
    field checked: known dtype, non-negative integer shape, offsets that tile the
    ``data_size`` bytes after the header exactly."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise not_safetensors(path, "its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise not_safetensors(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    by_name = {dtype_name: dtype for dtype, dtype_name in _DTYPE_NAMES.items()}
    specs: list[_Spec] = []
    for key, spec in header.items():
        fields = spec if isinstance(spec, dict) else {}
        shape, offsets = fields.get("shape"), fields.get("data_offsets")
        dtype = by_name.get(fields["dtype"]) if isinstance(fields.get("dtype"), str) else None
        if not (
            dtype is not None and isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
            and all(type(x) is int and x >= 0 for x in [*shape, *offsets])
        ):
            raise not_safetensors(path, f"tensor {key!r} has a malformed dtype, shape or data_offsets")
        numel = 1
        for x in shape:
            numel *= x
        if offsets[1] - offsets[0] != numel * dtype.itemsize:
            raise not_safetensors(path, f"tensor {key!r}: its offsets do not hold shape {shape} of {dtype}")
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


class HashedReader:
    """Reads a file descriptor in order into given memory, the sha256 of each chunk
    computed on a helper thread while the next chunk is read."""

    def __init__(self, fd: int, path: Path, size: int, pool: ThreadPoolExecutor) -> None:
        self.fd, self.path, self.size, self.pool = fd, path, size, pool
        self.digest = hashlib.sha256()
        self.done = 0

    def into(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            got = os.readv(self.fd, [view[filled:filled + _WRITE_CHUNK]])
            if not got:
                raise CheckpointError(f"{self.path}: truncated while being read ({self.done} of {self.size} bytes)")
            self.pool.submit(self.digest.update, view[filled:filled + got])
            filled += got
            self.done += got

    def bytes(self, count: int) -> bytes:
        data = bytearray(count)
        self.into(memoryview(data))
        return bytes(data)

    def finish(self) -> str:
        """Read (and hash) what is left; the whole file's sha256, hex."""
        while self.done < self.size:
            self.into(memoryview(bytearray(min(self.size - self.done, _WRITE_CHUNK))))
        self.pool.shutdown(wait=True)
        return self.digest.hexdigest()


def safetensors_pieces(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[list[memoryview], list[torch.Tensor]]:
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
