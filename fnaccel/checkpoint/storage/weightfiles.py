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
import os
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir
from fnaccel.checkpoint.storage.files import DTYPES, torch_dtype, untie, write_bytes
from fnaccel.checks import is_int
from fnaccel.constants import SAFE_MODEL_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = [
    "PICKLE_SUFFIXES",
    "checkpoint_files",
    "convert_file_size_to_int",
    "fsync_file",
    "index_files",
    "read_dtypes_and_shapes",
    "read_header",
    "read_index",
    "refuse_pickle",
    "shard_checkpoint",
    "size_in_bytes",
    "staging_folder",
    "unreadable",
    "write_weights",
]

_PRIVATE = ".fnaccel-"  # staging and parked folders inside a save directory
_SHARD_NAME = re.compile(
    re.escape(SAFE_MODEL_NAME) + r"-\d{5}-of-\d{5}\.safetensors"
)  # as shard_checkpoint names them
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B)\s*$", re.IGNORECASE)

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
    return cast(dict[str, Any], data)


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


def convert_file_size_to_int(size: int | str) -> int:
    """A size in bytes, from an int or a string such as ``"10GiB"`` or ``"256MB"``.

    KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB powers of 10, whatever the
    case; a lowercase ``b`` ending a decimal unit (``"8Gb"``) means bits, as
    in Accelerate and transformers (``"1kib"`` is still 1024 bytes).
    `fa.save_model`'s ``max_shard_size`` is read the same way.

    Raises:
        ValueError: ``size`` is negative or not a size.

    >>> convert_file_size_to_int("1GiB"), convert_file_size_to_int("256MB"), convert_file_size_to_int("8kb")
    (1073741824, 256000000, 1000)
    """
    if is_int(size) and size >= 0:
        return size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(
            f"{size!r} is not a size: pass a number of bytes or a string such as '10GiB' or '256MB' "
            "(KiB/MiB/GiB/TiB: powers of 2; KB/MB/GB/TB: powers of 10)"
        )
    number, unit = float(match.group(1)), match.group(2)
    power = "KMGT".index(unit[0].upper()) + 1
    binary = unit[1] in "iI"
    nbytes = int(number * (2 ** (10 * power) if binary else 10 ** (3 * power)))
    return nbytes // 8 if unit.endswith("b") and not binary else nbytes


def shard_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    max_shard_size: int | str = "10GB",
    weights_name: str = SAFE_WEIGHTS_NAME,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any] | None]:
    """Split ``state_dict`` into shards of at most ``max_shard_size`` bytes each.

    Greedy in key order (no bin packing), as in Accelerate and transformers: a
    tensor that would tip the current shard over the limit starts the next
    one, and a tensor larger than the limit gets a shard of its own.

    Args:
        state_dict: tensor names to tensors (tied names once: see `untie`).
        max_shard_size: bytes, or a size such as ``"10GB"``, ``"500MB"``,
            ``"5GiB"``, read as `convert_file_size_to_int` reads ``max_memory``:
            KB/MB/GB/TB are decimal (10^3 ... 10^12), KiB/MiB/GiB/TiB binary
            (2^10 ... 2^40); as in transformers, a lowercase final ``b`` of a
            decimal unit means bits (``"8Mb"`` is 10^6 bytes).
        weights_name: the file name of an unsharded checkpoint.

    Returns:
        ``(shards, index)``: shards maps file names to their tensors. One shard
        is ``{weights_name: ...}`` with index None; several are named
        ``model-00001-of-00003.safetensors`` and so on, and the index is
        ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.

    Raises:
        ValueError: ``max_shard_size`` is not a positive size.

    >>> weights = {"a": torch.zeros(100, dtype=torch.uint8), "b": torch.zeros(100, dtype=torch.uint8)}
    >>> shards, index = shard_checkpoint(weights, max_shard_size=150)
    >>> index["weight_map"]
    {'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}
    """
    limit = size_in_bytes(max_shard_size)
    blocks: list[dict[str, torch.Tensor]] = [{}]
    block_size = total_size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if blocks[-1] and block_size + nbytes > limit:
            blocks.append({})
            block_size = 0
        blocks[-1][name] = tensor
        block_size += nbytes
        total_size += nbytes
    if len(blocks) == 1:
        return {weights_name: blocks[0]}, None
    stem, suffix = os.path.splitext(weights_name)
    names = [f"{stem}-{i:05d}-of-{len(blocks):05d}{suffix}" for i in range(1, len(blocks) + 1)]
    shards = dict(zip(names, blocks, strict=False))
    weight_map = {key: file for file, block in shards.items() for key in block}
    return shards, {"metadata": {"total_size": total_size}, "weight_map": weight_map}


def size_in_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes (a positive `convert_file_size_to_int`)."""
    try:
        nbytes = convert_file_size_to_int(size)
    except ValueError:
        nbytes = 0
    if nbytes <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '10GB', "
            f"'500MB' or '5GiB' (KB/MB/GB/TB: powers of 10; KiB/MiB/GiB/TiB: powers of 2), got {size!r}"
        )
    return nbytes


def _storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors takes contiguous tensors that own their storage: copy the
    others (views into one storage, transposed parameters), and only those."""
    users = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    return {
        name: t
        if t.is_contiguous() and users[t.untyped_storage().data_ptr()] == 1
        else t.clone(memory_format=torch.contiguous_format)
        for name, t in tensors.items()
    }


def write_weights(weights: Mapping[str, torch.Tensor], path: Path, limit: int) -> None:
    """Write ``weights`` into the directory ``path`` as `save_model` does (shards past
    ``limit`` bytes, tied tensors once), replacing an older save file by file."""
    kept, aliases = untie(weights)
    shards, index = shard_checkpoint(_storable(kept), limit)
    staging = staging_folder(path)
    try:
        for file, tensors in shards.items():
            metadata = {"format": "pt", **{a: k for a, k in aliases.items() if k in tensors}}
            save_file(tensors, staging / file, metadata=metadata)
            fsync_file(staging / file)
        if index is not None:
            _write_index(staging / SAFE_WEIGHTS_INDEX_NAME, index)
        fsync_dir(staging)
        _commit(path, staging, list(shards), sharded=index is not None)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def staging_folder(path: Path) -> Path:
    """A new private folder inside the save directory ``path`` (created if missing)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"fa.save_model writes into a directory, but {path} is a file; pass a directory")
    path.mkdir(parents=True, exist_ok=True)
    staging = path / f"{_PRIVATE}tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    return staging


def fsync_file(file: Path) -> None:
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())


def _write_index(file: Path, index: Mapping[str, Any]) -> None:
    write_bytes(file, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())


def _commit(path: Path, staging: Path, files: list[str], sharded: bool) -> None:
    """Rename the staged files into ``path``, keeping it loadable throughout."""
    live_index = path / SAFE_WEIGHTS_INDEX_NAME
    try:
        old_index = read_index(live_index) if live_index.is_file() else None
    except CheckpointError:  # an unreadable old index loads nothing: nothing to keep loadable
        old_index = None
    old_files = set(old_index["weight_map"].values()) if old_index else set()
    if sharded and old_index and old_files & set(files):
        _park(path, staging, old_index, old_files & set(files))
    for file in files:
        os.replace(staging / file, path / file)
    if sharded:
        os.replace(staging / SAFE_WEIGHTS_INDEX_NAME, live_index)
    fsync_dir(path)
    # the new set is live (model.safetensors shadows an index, so a single file
    # took over at its rename; an old single file goes now): clear the old one
    current = {*files, SAFE_WEIGHTS_INDEX_NAME} if sharded else set(files)
    stale = {SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, *old_files}
    stale.update(name for name in os.listdir(path) if _SHARD_NAME.fullmatch(name))
    for name in stale - current:
        if Path(name).name == name and (path / name).is_file():
            (path / name).unlink()
    for entry in path.iterdir():
        if entry.name.startswith(_PRIVATE) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(path)


def _park(path: Path, staging: Path, old_index: Mapping[str, Any], files: set[str]) -> None:
    """Hard-link the old shards the new ones will overwrite into a private
    folder, and point the live index at the links (copies where the
    filesystem has no hard links)."""
    parked = path / f"{_PRIVATE}old-{uuid.uuid4().hex}"
    parked.mkdir()
    for file in files:
        try:
            os.link(path / file, parked / file)
        except OSError:
            shutil.copyfile(path / file, parked / file)
            fsync_file(parked / file)
    fsync_dir(parked)
    weight_map = {
        name: f"{parked.name}/{file}" if file in files else file
        for name, file in old_index["weight_map"].items()
    }
    _write_index(staging / "parked.index.json", {**old_index, "weight_map": weight_map})
    os.replace(staging / "parked.index.json", path / SAFE_WEIGHTS_INDEX_NAME)
    fsync_dir(path)
