"""A sharded checkpoint's index, ``sharded/metadata.json``, read and checked without torch.

An `fsdp()` or `pp()` checkpoint (`fnaccel.checkpoint.storage.sharded`) stores DCP's
Metadata as JSON: every key's global size, dtype and chunks, and which file
and key hold each chunk. `read_index` checks all of it (known dtypes and
layouts, integer sizes, chunks inside their tensors and tiling them, files
among the manifest's under ``sharded/``, declared bytes within what those
files hold) and returns it as plain records. `fnaccel.checkpoint.storage.dcpstore.metadata_from`
turns those records into DCP's classes for a load; `fnaccel checkpoint inspect`
reads sizes and dtypes from them directly, so a new process answers without
importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import ITEMSIZES, safe_relative

__all__ = [
    "is_stored_sharded",
    "FORMAT",
    "FORMAT_VERSION",
    "IndexKey",
    "LAYOUTS",
    "MEMORY_FORMATS",
    "METADATA",
    "SHARDED_DIR",
    "ShardIndex",
    "VALUES",
    "check_bytes",
    "check_chunks",
    "read_index",
]

SHARDED_DIR = "sharded"
METADATA = f"{SHARDED_DIR}/metadata.json"
VALUES = f"{SHARDED_DIR}/state.json"
FORMAT = "fnaccel-dcp"
FORMAT_VERSION = 1
LAYOUTS = ("strided", "sparse_coo")  # torch's names, without "torch."
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexKey:
    """One tensor of the index: DCP's TensorStorageMetadata, with torch's names for dtype and layout."""

    dtype: str  # a key of `fnaccel.checkpoint.storage.files.ITEMSIZES` ("float32")
    layout: str
    memory_format: str
    requires_grad: bool
    pin_memory: bool
    size: Shape
    chunks: tuple[tuple[Shape, Shape], ...]  # (offsets, sizes) of each chunk


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardIndex:
    """A checked ``sharded/metadata.json``."""

    keys: dict[str, IndexKey]
    storage: dict[tuple[str, Shape | None], tuple[str, str]]  # (fqn, chunk offset) -> (file, key)
    planner_data: dict[str, tuple[Any, ...]]
    dcp_version: str | None


def check_chunks(
    fqn: str, size: Sequence[Any], chunks: Sequence[tuple[Sequence[Any], Sequence[Any]]], source: str
) -> int:
    """Check that every chunk (offsets, sizes) of the tensor ``fqn`` of ``size`` lies inside
    it and that together they cover it; return its element count.

    >>> check_chunks("w", (4, 3), [((0, 0), (2, 3)), ((2, 0), (2, 3))], "index")
    12
    >>> check_chunks("w", (4, 3), [((0, 0), (2, 3))], "index")
    Traceback (most recent call last):
    fnaccel._errors.CheckpointError: index: key 'w': its chunks cover 6 elements of 12
    """
    size = tuple(size)
    if any(not isinstance(n, int) or n < 0 for n in size):
        raise CheckpointError(f"{source}: key {fqn!r}: size {list(size)} is not a list of counts")
    covered = 0
    for offsets, sizes in ((tuple(o), tuple(s)) for o, s in chunks):
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(
                not (isinstance(o, int) and isinstance(n, int) and o >= 0 and n >= 0 and o + n <= d)
                for o, n, d in zip(offsets, sizes, size, strict=False)
            )
        ):
            raise CheckpointError(
                f"{source}: key {fqn!r}: chunk at {list(offsets)} of size {list(sizes)} does not lie "
                f"inside the tensor's size {list(size)}"
            )
        covered += math.prod(sizes)
    if covered != math.prod(size):
        raise CheckpointError(
            f"{source}: key {fqn!r}: its chunks cover {covered} elements of {math.prod(size)}"
        )
    return covered


def check_bytes(total: int, available: int, source: str) -> None:
    """Refuse an index declaring more tensor bytes (``total``) than the files holding them have."""
    if total > available:
        raise CheckpointError(
            f"{source}: declares {total} bytes of tensors, but the files holding them have {available}; "
            "the index was edited or is hostile"
        )


def _ints(value: Any) -> Shape:
    if not isinstance(value, list) or not all(type(n) is int for n in value):
        raise TypeError(f"{value!r} is not a list of integers")
    return tuple(value)


def _choice(value: Any, names: tuple[str, ...]) -> str:
    if value not in names:
        raise ValueError(f"{value!r} is not one of {', '.join(names)}")
    return str(value)


def read_index(saved: Any, files: Mapping[str, Any], source: str) -> ShardIndex:
    """The index ``saved`` (the parsed ``sharded/metadata.json``), every field checked
    against the manifest's ``files`` before anything it says is used.

    Raises:
        CheckpointError: naming ``source``, the key and what is wrong with it.

    >>> read_index({"format": "fnaccel-dcp", "format_version": 1, "keys": {}, "storage": [],
    ...             "planner_data": {}}, {}, "index").keys
    {}
    >>> read_index({"format": "other"}, {}, "index")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fnaccel._errors.CheckpointError: index: not a sharded-checkpoint index this fnaccel reads ...
    """
    if (
        not isinstance(saved, dict)
        or saved.get("format") != FORMAT
        or saved.get("format_version") != FORMAT_VERSION
    ):
        found = saved if not isinstance(saved, dict) else (saved.get("format"), saved.get("format_version"))
        raise CheckpointError(
            f"{source}: not a sharded-checkpoint index this fnaccel reads (format and version {found!r})"
        )
    key = "keys"
    try:
        keys: dict[str, IndexKey] = {}
        for fqn, item in saved["keys"].items():
            key = f"keys/{fqn}"
            if not isinstance(item["dtype"], str) or item["dtype"] not in ITEMSIZES:
                raise CheckpointError(f"{source}: key {key!r}: unknown dtype {item['dtype']!r}")
            keys[fqn] = IndexKey(
                dtype=item["dtype"],
                layout=_choice(item["layout"], LAYOUTS),
                memory_format=_choice(item["memory_format"], MEMORY_FORMATS),
                requires_grad=bool(item["requires_grad"]),
                pin_memory=bool(item["pin_memory"]),
                size=_ints(item["size"]),
                chunks=tuple((_ints(c["offsets"]), _ints(c["sizes"])) for c in item["chunks"]),
            )
        key = "storage"
        storage: dict[tuple[str, Shape | None], tuple[str, str]] = {}
        for s in saved["storage"]:
            key = f"storage/{s.get('fqn')!r}"
            name = safe_relative(s["file"], source)
            if not name.startswith(f"{SHARDED_DIR}/") or name not in files:
                raise CheckpointError(
                    f"{source}: key {key!r}: file {name!r} is not one of the checkpoint's "
                    f"{SHARDED_DIR}/ files"
                )
            if s["fqn"] not in keys or not isinstance(s["key"], str):
                raise CheckpointError(f"{source}: key {key!r}: names no tensor of the index")
            storage[(s["fqn"], None if s["offset"] is None else _ints(s["offset"]))] = (name, s["key"])
        key = "planner_data"
        planner_data = {k: tuple(v) for k, v in saved["planner_data"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, CheckpointError):  # a ValueError too: already names the key
            raise
        raise CheckpointError(f"{source}: key {key!r} is malformed ({type(exc).__name__}: {exc})") from None
    total = sum(check_chunks(fqn, k.size, k.chunks, source) * ITEMSIZES[k.dtype] for fqn, k in keys.items())
    check_bytes(total, sum(files[name]["size"] for name in {name for name, _ in storage.values()}), source)
    return ShardIndex(
        keys=keys,
        storage=storage,
        planner_data=planner_data,
        dcp_version=saved.get("dcp_version") if isinstance(saved.get("dcp_version"), str) else None,
    )


def is_stored_sharded(manifest: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's model and optimizer are under ``sharded/`` (a sharded run saved it).

    >>> is_stored_sharded({"files": {"sharded/metadata.json": {}, "rank0.json": {}}})
    True
    """
    return any(name.startswith(f"{SHARDED_DIR}/") for name in manifest["files"])
