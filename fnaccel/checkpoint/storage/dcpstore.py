"""How DCP's pieces of a sharded checkpoint are stored and read back: its `Metadata`
as JSON, the `StorageWriter`/`StorageReader` pair every byte of fnaccel's own
checkpoints goes through, and a hostile-input reader of a stock DCP directory.

DCP's stock `FileSystemWriter` pickles its ``.metadata`` file and stores
non-tensor values with ``torch.save``; `ShardWriter` stores the same Metadata
as JSON (``sharded/metadata.json``) and each rank's chunks in one safetensors
file (``sharded/rank<r>.safetensors``), written and read through
`fnaccel.checkpoint.storage.files` (fsynced writes, checksum-verified reads). See
`fnaccel.checkpoint.storage.sharded` for the checkpoint they make up.

A stock DCP directory (``.metadata`` and ``*.distcp``, e.g. Accelerate's
``pytorch_model_fsdp_0``), which ``fnaccel merge-weights`` reads, pickles its
``.metadata``: `DirectoryReader` unpickles it admitting DCP's own metadata
classes only (anything else is refused, so a planted pickle cannot run code),
checks every part of it (`check_directory_metadata`) and reads the tensors
through torch's ``weights_only`` loader.

This module imports ``torch.distributed.checkpoint`` (about a second) at its
top: import it only where a sharded checkpoint is written or read, inside the
function that does so (`fnaccel.checkpoint.storage.sharded`, `fnaccel.checkpoint.consolidate`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from fnaccel._errors import CheckpointError
from fnaccel.atomic import fsync_dir
from fnaccel.checkpoint.storage.files import (
    read_bounded,
    read_tensors,
    regular_size,
    safe_relative,
    torch_dtype,
    write_json,
    write_tensors,
)
from fnaccel.checkpoint.storage.shardindex import (
    FORMAT,
    FORMAT_VERSION,
    LAYOUTS,
    MEMORY_FORMATS,
    METADATA,
    SHARDED_DIR,
    check_bytes,
    check_chunks,
    read_index,
)

__all__ = [
    "DCP_METADATA",
    "DirectoryReader",
    "ShardReader",
    "ShardWriter",
    "check_directory_metadata",
    "load",
    "metadata_from",
    "metadata_json",
    "save",
    "set_model_state_dict",  # DCP's, for the modules that import DCP through this one
    "set_optimizer_state_dict",
]

DCP_METADATA = ".metadata"  # a stock DCP directory's index (pickled)
MAX_DCP_METADATA_BYTES = 2**30  # DCP's index of a large model is megabytes; a gigabyte is hostile


def _rank_file(rank: int) -> str:
    return f"{SHARDED_DIR}/rank{rank}.safetensors"


# -- DCP's Metadata as JSON -------------------------------------------------------------

_LAYOUTS = MappingProxyType({name: getattr(torch, name) for name in LAYOUTS})
_MEMORY_FORMATS = MappingProxyType({name: getattr(torch, name) for name in MEMORY_FORMATS})


def _name_of(value: Any, table: Mapping[str, Any]) -> str:
    for name, known in table.items():
        if known == value:
            return name
    raise CheckpointError(f"cannot store {value!r} in a sharded checkpoint's metadata")


def metadata_json(metadata: Metadata, storage: list[dict[str, Any]]) -> dict[str, Any]:
    """DCP's ``metadata`` and where each chunk went (``storage``) as ``sharded/metadata.json``."""
    keys: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):  # the sharded layout keeps these out of DCP
            raise CheckpointError(f"{fqn!r}: a non-tensor value reached the sharded checkpoint")
        props = item.properties
        keys[fqn] = {
            "dtype": str(props.dtype).removeprefix("torch."),
            "layout": _name_of(props.layout, _LAYOUTS),
            "memory_format": _name_of(props.memory_format, _MEMORY_FORMATS),
            "requires_grad": bool(props.requires_grad),
            "pin_memory": bool(props.pin_memory),
            "size": list(item.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
        }
    planner_data = metadata.planner_data or {}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dcp_version": metadata.version,
        "keys": keys,
        "storage": sorted(storage, key=lambda s: (s["fqn"], s["offset"])),
        "planner_data": {k: list(v) for k, v in planner_data.items()},
    }


def metadata_from(
    saved: Any, files: Mapping[str, Any], source: str
) -> tuple[Metadata, dict[Any, tuple[str, str]]]:
    """DCP's Metadata and ``{chunk index: (file, key)}`` from ``sharded/metadata.json``,
    checked first by `read_index` (known dtypes and layouts, chunks inside their tensors,
    files among the manifest's ``files`` under ``sharded/``, declared sizes within theirs)."""
    index = read_index(saved, files, source)
    state_dict_metadata: dict[str, Any] = {
        fqn: TensorStorageMetadata(
            properties=TensorProperties(
                dtype=torch_dtype(item.dtype),
                layout=_LAYOUTS[item.layout],
                requires_grad=item.requires_grad,
                memory_format=_MEMORY_FORMATS[item.memory_format],
                pin_memory=item.pin_memory,
            ),
            size=torch.Size(item.size),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, sizes in item.chunks
            ],
        )
        for fqn, item in index.keys.items()
    }
    storage = {MetadataIndex(fqn, offset): where for (fqn, offset), where in index.storage.items()}
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=index.planner_data,
        storage_data=storage,
        version=index.dcp_version,
    )
    return metadata, storage


# -- saving and loading through DCP ---------------------------------------------------


def _checkpoint_error(exc: BaseException, action: str, *, name_rank: bool = True) -> CheckpointError:
    """The first rank's own error inside DCP's CheckpointException, as our error (naming
    its rank where several processes read or wrote: ``name_rank``)."""
    failures = getattr(exc, "failures", {}) or {}
    for rank in sorted(failures):
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, CheckpointError):
            return CheckpointError(f"{inner} (rank {rank})" if name_rank else str(inner))
    first = next(iter(failures.values()), None)
    inner = first[0] if isinstance(first, tuple) else first
    detail = f"{type(inner).__name__}: {inner}" if inner is not None else str(exc)
    return CheckpointError(f"{action}: torch.distributed.checkpoint failed: {detail}")


def save(tensors: Mapping[str, Any], root: Path, rank: int, group: Any) -> dict[str, dict[str, Any]]:
    """Write ``tensors`` (nested dicts of DTensor shards) under ``root / "sharded"`` with
    `ShardWriter`, collectively over ``group``; the manifest entries of this rank's files."""
    writer = ShardWriter(root, rank)
    try:
        dcp.save(dict(tensors), storage_writer=writer, planner=DefaultSavePlanner(), process_group=group)
    except CheckpointException as exc:
        raise _checkpoint_error(exc, "fa.save") from None
    return writer.entries


def load(targets: dict[str, Any], reader: StorageReader, group: Any, action: str) -> None:
    """Fill ``targets`` (flat ``{DCP key: tensor}``) from ``reader``: collectively over
    ``group``, or, with ``group`` None, all of it in this one process."""
    try:
        with warnings.catch_warnings():  # DCP warns that it "assumes" the one process we asked for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(
                targets,
                storage_reader=reader,
                planner=DefaultLoadPlanner(),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as exc:
        raise _checkpoint_error(exc, action, name_rank=group is not None) from None


# -- the storage layer fnaccel's own checkpoints go through ---------------------------


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class ShardWriter(StorageWriter):
    """Writes this rank's chunks to one safetensors file, DCP's Metadata to JSON."""

    def __init__(self, root: Path, rank: int) -> None:
        self.root = root
        self.rank = rank
        self.entries: dict[str, dict[str, Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.entries = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = _rank_file(self.rank)
        tensors: dict[str, torch.Tensor] = {}
        storages: set[tuple[str, int]] = set()
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(
                    f"{item.index.fqn!r}: DCP would pickle this non-tensor value; fnaccel stores those in JSON"
                )
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            offset = list(item.index.offset or ())
            key = f"{item.index.fqn}@{','.join(map(str, offset))}"
            tensor = data.detach()
            storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
            if storage in storages and tensor.numel():  # safetensors refuses shared storage
                tensor = tensor.clone()
            storages.add(storage)
            tensors[key] = tensor
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=data.numel() * data.element_size(),
                    storage_data={"file": name, "key": key},
                )
            )
        if tensors:
            self.entries[name] = write_tensors(self.root / name, tensors)
            fsync_dir((self.root / name).parent)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = [
            {"fqn": r.index.fqn, "offset": list(r.index.offset or ()), **r.storage_data}
            for rank_results in results
            for r in rank_results
        ]
        self.entries[METADATA] = write_json(self.root / METADATA, metadata_json(metadata, storage))
        fsync_dir((self.root / METADATA).parent)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


class ShardReader(StorageReader):
    """Reads the chunks back, every file verified against the run's manifest first."""

    def __init__(
        self, root: Path, manifest: dict[str, Any], metadata: Metadata, storage: Mapping[Any, tuple[str, str]]
    ) -> None:
        self.root = root
        self.manifest = manifest
        self.metadata = metadata
        self.storage = storage

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            name, _ = self.storage[item.storage_index]
            by_file.setdefault(name, []).append(item)
        for name, items in sorted(by_file.items()):
            tensors = read_tensors(self.root, name, self.manifest)  # checksum-verified
            for item in items:
                _, key = self.storage[item.storage_index]
                source = tensors.get(key)
                if source is None:
                    raise CheckpointError(f"{self.root / name}: no tensor {key!r}")
                piece = source[
                    tuple(
                        slice(start, start + length)
                        for start, length in zip(item.storage_offsets, item.lengths, strict=False)
                    )
                ]
                target = planner.resolve_tensor(item).detach()
                if target.shape != piece.shape:
                    raise CheckpointError(
                        f"{self.root / name}: {key!r} gives a chunk of shape {tuple(piece.shape)} "
                        f"where the model needs {tuple(target.shape)}"
                    )
                target.copy_(piece)
                planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


# -- a stock DCP directory, read as hostile -------------------------------------------

_DCP_METADATA_CLASSES = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")]
    + [("pathlib._local", name) for name in ("Path", "PosixPath", "WindowsPath")]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    ]
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own classes and torch dtypes, nothing else."""

    def __init__(self, file: IO[bytes], source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.source}: refers to {module}.{name}, which is not part of torch.distributed."
            "checkpoint's metadata; refusing to unpickle it (a pickle can run any code)"
        )


class DirectoryReader(dcp.FileSystemReader):
    """A stock DCP directory's reader whose ``.metadata`` comes through an unpickler that
    admits DCP's metadata classes only and is checked (`check_directory_metadata`)
    before DCP plans a read."""

    def __init__(self, source: Path) -> None:
        super().__init__(source)
        self.source = source
        self.metadata: Metadata | None = None  # read once, for the caller and for dcp.load

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is not None:
            return self.metadata
        path = self.source / DCP_METADATA
        data = read_bounded(self.source, DCP_METADATA, limit=MAX_DCP_METADATA_BYTES)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
        except (
            pickle.UnpicklingError,
            EOFError,
            AttributeError,
            ValueError,
            TypeError,
            IndexError,
            KeyError,
            RecursionError,
        ) as exc:
            raise CheckpointError(f"{path}: corrupt ({type(exc).__name__}: {exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
        check_directory_metadata(metadata, self.source)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata = metadata
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's own read, one file at a time, so that a file torch cannot read is named
        (torch's own error names none, and advises unpickling it with weights_only=False).
        DCP records no checksum: a flipped byte that still unpickles is not seen."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"{self.source / name}: corrupt (torch cannot read a tensor stored in it: "
                    f"{type(exc).__name__}); the file was damaged after it was written"
                ) from None
        return _done(None)


def _check_types(metadata: Metadata, where: str) -> None:
    """Every part of DCP's Metadata is of the class DCP makes it: the unpickler admits those
    classes, but a planted pickle may put any of them (or a list) anywhere."""

    def fail(key: object, detail: str) -> CheckpointError:
        return CheckpointError(f"{where}: key {key!r}: {detail}; the checkpoint was edited or is hostile")

    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise fail(fqn, "a key must be a string")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not (
            isinstance(item, TensorStorageMetadata)
            and isinstance(item.properties, TensorProperties)
            and isinstance(item.properties.dtype, torch.dtype)
            and isinstance(item.chunks, list)
            and all(isinstance(chunk, ChunkStorageMetadata) for chunk in item.chunks)
        ):
            raise fail(fqn, "not a tensor's metadata (properties with a torch dtype, a list of chunks)")
    for index in metadata.storage_data:
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)):
            raise fail(index, "a stored piece's index must name its key by a string")
    planned = metadata.planner_data
    if planned is not None and not (
        isinstance(planned, dict)
        and all(
            isinstance(path, (list, tuple)) and all(isinstance(part, (str, int)) for part in path)
            for path in planned.values()
        )
    ):
        raise fail("planner_data", "must map keys to their paths (lists of names)")


def check_directory_metadata(metadata: Metadata, source: Path) -> None:
    """A stock DCP directory's ``.metadata`` names only regular files inside ``source``,
    each stored piece lies inside its file, every chunk lies inside its tensor and they
    tile it, and all the tensors it declares fit in the bytes those files hold: so
    nothing it declares is allocated beyond what is on disk (fnaccel's own JSON index
    is checked the same way by `read_index` before it becomes a Metadata)."""
    where = str(source / DCP_METADATA)
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{where}: malformed (no state_dict_metadata or storage_data)")
    _check_types(metadata, where)
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = safe_relative(getattr(info, "relative_path", None), where)
        if name not in sizes:
            sizes[name] = regular_size(source, name)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (
            isinstance(offset, int)
            and isinstance(length, int)
            and offset >= 0
            and length >= 0
            and offset + length <= sizes[name]
        ):
            raise CheckpointError(
                f"{where}: key {getattr(index, 'fqn', index)!r} is stored at bytes {offset!r}..+{length!r} "
                f"of {name}, which holds {sizes[name]} bytes"
            )
    total = 0
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = [(chunk.offsets, chunk.sizes) for chunk in item.chunks]
            total += check_chunks(fqn, item.size, chunks, where) * item.properties.dtype.itemsize
    check_bytes(total, sum(sizes.values()), where)
