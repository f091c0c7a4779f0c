"""A checkpoint's safetensors files read one tensor at a time, or only their headers.

`fnaccel checkpoint inspect` reads the headers alone (what tensors, which
dtypes and shapes) and `fa.diff` reads one tensor at a time, so neither
holds a whole file. Every read is bounded as a load's is: the file must be
a regular file inside the checkpoint of the size its manifest says, the
header length must fit inside the file (and under `MAX_HEADER_BYTES`), the
header is checked field by field (`fnaccel.checkpoint.storage.files.layout`),
and a tensor's bytes are read at the offsets the checked header gives.

These reads check layout, not checksums: `fnaccel checkpoint verify` (or
`fa.load`) is what proves a file intact. Opening a file and reading its header
imports no torch (a new ``fnaccel checkpoint inspect`` process answers without
it); only `TensorFile.read` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import layout, memory_of, not_safetensors, open_inside, torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_HEADER_BYTES", "TensorFile", "TensorSpec"]

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One tensor of a safetensors file: its dtype, shape and byte range in the file."""

    dtype: str  # torch's name ("float32"; `fnaccel.checkpoint.storage.files.torch_dtype` makes it a dtype)
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class TensorFile:
    """An open safetensors file of a checkpoint: its checked header, and reads of single tensors.

    >>> import tempfile, pathlib, torch, fnaccel as fa
    >>> folder = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> _ = fa.save(fa.prepare(fa.init(cpu=True), torch.nn.Linear(2, 1)), folder)
    >>> from fnaccel.checkpoint.manifest import read_manifest
    >>> with TensorFile(folder, "model.safetensors", read_manifest(folder)) as f:
    ...     sorted(f.specs), f.read("bias").shape
    (['bias', 'weight'], torch.Size([1]))
    """

    def __init__(
        self, directory: Path, name: str, manifest: dict[str, Any], specs: dict[str, TensorSpec] | None = None
    ) -> None:
        """Open ``directory/name`` and check its header (or take ``specs``, this file's
        header as an earlier `TensorFile` checked it: reopening then costs no parse)."""
        entry = manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{directory}: the manifest lists no file {name!r}")
        self.path = directory / name
        self._fd = open_inside(directory, name)
        try:
            size = os.fstat(self._fd).st_size
            if size != entry["size"]:
                raise CheckpointError(
                    f"{self.path}: truncated or extended ({size} bytes, the manifest says {entry['size']})"
                )
            self.specs = self._header(size) if specs is None else specs
        except BaseException:
            os.close(self._fd)
            raise

    def _header(self, size: int) -> dict[str, TensorSpec]:
        if size < 8:
            raise not_safetensors(self.path, "shorter than its 8-byte header length")
        length = int.from_bytes(self._pread(8, 0), "little")
        if length > size - 8:
            raise not_safetensors(self.path, f"its header length {length} runs past the end of the file")
        if length > MAX_HEADER_BYTES:
            raise not_safetensors(self.path, f"its header is {length} bytes, more than {MAX_HEADER_BYTES}")
        start = 8 + length
        return {
            key: TensorSpec(dtype=dtype, shape=tuple(shape), begin=start + begin, end=start + end)
            for begin, end, key, dtype, shape in layout(self.path, self._pread(length, 8), size - start)
        }

    def _pread(self, count: int, offset: int) -> bytes:
        data = os.pread(self._fd, count, offset)
        if len(data) != count:
            raise CheckpointError(f"{self.path}: truncated while being read")
        return data

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read from its checked byte range straight into its memory."""
        import torch

        spec = self.specs[key]
        tensor = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
        if not spec.nbytes:
            return tensor
        view, filled = memory_of(tensor), 0
        while filled < spec.nbytes:
            got = os.preadv(self._fd, [view[filled:]], spec.begin + filled)
            if not got:
                raise CheckpointError(f"{self.path}: truncated while reading tensor {key!r}")
            filled += got
        return tensor

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
