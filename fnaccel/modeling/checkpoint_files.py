"""A safetensors checkpoint's files and headers, read without reading a weight.

A checkpoint is ``model.safetensors``, or shards listed by an index
(``model.safetensors.index.json``: ``{"weight_map": {tensor name: file}}``).
`checkpoint_files` finds the files of one, `read_index` reads an index,
`read_header` and `read_dtypes_and_shapes` read a file's header (names,
dtypes, shapes) through safetensors, which validates it. Pickles (``.bin``,
``.pt``) are refused with how to convert them, never unpickled.

>>> import tempfile, safetensors.torch, torch
>>> with tempfile.TemporaryDirectory() as path:
...     safetensors.torch.save_file({"w": torch.ones(2, 3, dtype=torch.float16)}, f"{path}/model.safetensors")
...     [(file.name, names) for file, names in checkpoint_files(Path(path))]
...     read_dtypes_and_shapes(Path(path) / "model.safetensors")
[('model.safetensors', None)]
{'w': (torch.float16, (2, 3))}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.tensorfile import DTYPES, torch_dtype
from fnaccel.constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = [
    "PICKLE_SUFFIXES",
    "checkpoint_files",
    "index_files",
    "read_dtypes_and_shapes",
    "read_header",
    "read_index",
    "refuse_pickle",
    "unreadable",
]

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})


def refuse_pickle(path: Path) -> CheckpointError:
    """The error for a pickle checkpoint, saying how to convert it."""
    return CheckpointError(
        f"{path} is a pickle checkpoint; fnaccel never unpickles (that can run arbitrary code). "
        "Convert it once where you trust it: load it with torch.load(..., weights_only=True) "
        "into the model and write it with fa.save_model (or safetensors.torch.save_model)"
    )


def unreadable(file: Path, exc: Exception) -> CheckpointError:
    """The error for a file safetensors cannot read."""
    return CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}")


def checkpoint_files(path: Path) -> list[tuple[Path, frozenset[str] | None]]:
    """The safetensors files of a checkpoint, each with the names its index maps to it.

    Args:
        path: a ``.safetensors`` file, an index ``.json``, or a directory
            holding ``model.safetensors`` or one ``*.index.json``.

    Returns:
        ``(file, names)`` pairs; ``names`` is None for a checkpoint without index.

    Raises:
        CheckpointError: no checkpoint there, a pickle, a bad index or a missing shard.
    """
    if path.is_dir():
        if (path / SAFE_WEIGHTS_NAME).is_file():
            return [(path / SAFE_WEIGHTS_NAME, None)]
        indexes = sorted(path.glob("*.index.json"))
        if len(indexes) == 1:
            return index_files(indexes[0])
        pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if not indexes and pickles:
            raise refuse_pickle(pickles[0])
        raise CheckpointError(
            f"{path} holds no {SAFE_WEIGHTS_NAME} and "
            + (f"several indexes {[p.name for p in indexes]}" if indexes else f"no {SAFE_WEIGHTS_INDEX_NAME}")
            + "; pass the file or index to load"
        )
    if path.is_file():
        if path.name.endswith(".json"):
            return index_files(path)
        if path.suffix in PICKLE_SUFFIXES:
            raise refuse_pickle(path)
        return [(path, None)]
    raise CheckpointError(f"no checkpoint at {path}")


def read_index(index: Path) -> dict[str, Any]:
    """A sharded checkpoint's index (``{"weight_map": {name: file}}``, or the flat
    ``{name: file}``), checked to map tensor names to file names."""
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index} is not a readable JSON index: {exc}") from None
    if isinstance(data, dict) and "weight_map" not in data:
        data = {"weight_map": data}  # a flat {tensor name: file} index, as Accelerate also reads
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(
            f"{index} maps no tensor names to file names: an index is "
            '{"weight_map": {name: file}} or a flat {name: file}'
        )
    return data


def index_files(index: Path) -> list[tuple[Path, frozenset[str] | None]]:
    """The files an index maps tensors to, in the index's order, each with its tensor names.

    Raises:
        CheckpointError: an unreadable index, a pickle shard, or a shard missing beside the index.
    """
    by_file: dict[str, set[str]] = {}
    for name, file in read_index(index)["weight_map"].items():
        by_file.setdefault(file, set()).add(name)
    for file in by_file:
        if Path(file).suffix in PICKLE_SUFFIXES:
            raise refuse_pickle(index)
        if not (index.parent / file).is_file():
            raise CheckpointError(f"{index} maps tensors to {file}, which is missing from {index.parent}")
    return [(index.parent / file, frozenset(names)) for file, names in by_file.items()]


def _read(file: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """Each stored tensor's safetensors dtype name and shape, and the file's metadata."""
    try:
        with safe_open(file, framework="pt", device="cpu") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)
            tensors = {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise unreadable(file, exc) from None
    return tensors, metadata


def read_header(file: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A safetensors file's tensor shapes by name (aliases included) and its
    aliases, from the header alone.

    An alias is a name the file's metadata maps to a stored tensor (`fa.save_model`
    stores a tied tensor once).

    Raises:
        CheckpointError: an unreadable file, or TensorFlow or Flax weights.
    """
    tensors, metadata = _read(file)
    if metadata.get("format") in ("tf", "flax"):
        raise CheckpointError(
            f"{file} holds {metadata['format']} weights (other layouts); load PyTorch ('pt') ones"
        )
    shapes = {name: shape for name, (_, shape) in tensors.items()}
    aliases = {alias: kept for alias, kept in metadata.items() if kept in shapes and alias not in shapes}
    return {**shapes, **{alias: shapes[kept] for alias, kept in aliases.items()}}, aliases


def read_dtypes_and_shapes(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of each tensor stored in a safetensors file (aliases
    not included), from the header alone.

    Raises:
        CheckpointError: an unreadable file, or a dtype torch has no dtype for.
    """
    tensors, _ = _read(file)
    unknown = sorted({dtype for dtype, _ in tensors.values() if dtype not in DTYPES})
    if unknown:
        raise CheckpointError(f"{file} holds tensors of dtypes {unknown}, which torch has no dtype for")
    return {name: (torch_dtype(DTYPES[dtype][0]), shape) for name, (dtype, shape) in tensors.items()}
