"""How DCP's pieces of a sharded checkpoint are stored: its `Metadata` as JSON, and
the `StorageWriter`/`StorageReader` pair every byte goes through.

DCP's stock `FileSystemWriter` pickles its ``.metadata`` file and stores
non-tensor values with ``torch.save``; these classes store the same Metadata
as JSON (``sharded/metadata.json``) and each rank's chunks in one safetensors
file (``sharded/rank<r>.safetensors``), written and read through
`fnaccel.checkpoint.files` (fsynced writes, checksum-verified reads). See
`fnaccel.checkpoint.sharded` for the checkpoint they make up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.files import fsync_dir, read_tensors, write_json, write_tensors
from fnaccel.checkpoint.shardindex import (
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
from fnaccel.checkpoint.tensorfile import torch_dtype

__all__ = ["check_metadata", "metadata_from", "metadata_json", "storage_classes"]


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


def metadata_json(metadata: Any, storage: list[dict[str, Any]]) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    keys: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):  # _split keeps these out of DCP
            raise CheckpointError(f"{fqn!r}: a non-tensor value reached the sharded checkpoint")
        assert isinstance(item, TensorStorageMetadata)
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


def check_metadata(metadata: Any, available: int, source: str) -> None:
    """Every tensor's chunks lie inside it and tile it, and all of them together need at
    most ``available`` bytes (what the files holding them have): so nothing a hostile
    index declares is allocated beyond what is on disk. For DCP's own Metadata (a
    ``.metadata`` file); fnaccel's JSON index is checked by `read_index` before it
    becomes one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = [(chunk.offsets, chunk.sizes) for chunk in item.chunks]
            total += check_chunks(fqn, item.size, chunks, source) * item.properties.dtype.itemsize
    check_bytes(total, available, source)


def metadata_from(saved: Any, files: Mapping[str, Any], source: str) -> tuple[Any, dict[Any, tuple[str, str]]]:
    """DCP's Metadata and ``{chunk index: (file, key)}`` from ``sharded/metadata.json``,
    checked first by `read_index` (known dtypes and layouts, chunks inside their tensors,
    files among the manifest's ``files`` under ``sharded/``, declared sizes within theirs)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    index = read_index(saved, files, source)
    state_dict_metadata: dict[str, Any] = {
        fqn: TensorStorageMetadata(
            properties=TensorProperties(
                dtype=torch_dtype(item.dtype), layout=_LAYOUTS[item.layout], requires_grad=item.requires_grad,
                memory_format=_MEMORY_FORMATS[item.memory_format], pin_memory=item.pin_memory,
            ),
            size=torch.Size(item.size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                    for offsets, sizes in item.chunks],
        )
        for fqn, item in index.keys.items()
    }
    storage = {MetadataIndex(fqn, offset): where for (fqn, offset), where in index.storage.items()}
    metadata = Metadata(state_dict_metadata=state_dict_metadata, planner_data=index.planner_data,
                        storage_data=storage, version=index.dcp_version)
    return metadata, storage


# -- the storage layer DCP writes through and reads from ------------------------------


def storage_classes() -> tuple[type, type]:
    """`_Writer` and `_Reader`, defined on first use (torch.distributed imports lazily)."""
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.futures import Future

    class _Writer(StorageWriter):
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
                        f"{item.index.fqn!r}: DCP would pickle this non-tensor value; "
                        "fnaccel stores those in JSON"
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
                results.append(WriteResult(
                    index=item.index,
                    size_in_bytes=data.numel() * data.element_size(),
                    storage_data={"file": name, "key": key},
                ))
            if tensors:
                self.entries[name] = write_tensors(self.root / name, tensors)
                fsync_dir((self.root / name).parent)
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
            storage = [
                {"fqn": r.index.fqn, "offset": list(r.index.offset or ()), **r.storage_data}
                for rank_results in results for r in rank_results
            ]
            self.entries[METADATA] = write_json(self.root / METADATA, metadata_json(metadata, storage))
            fsync_dir((self.root / METADATA).parent)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return False

    class _Reader(StorageReader):
        """Reads the chunks back, every file verified against the run's manifest first."""

        def __init__(self, root: Path, manifest: dict[str, Any], metadata: Any,
                     storage: Mapping[Any, tuple[str, str]]) -> None:
            self.root = root
            self.manifest = manifest
            self.metadata = metadata
            self.storage = storage

        def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
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
                    piece = source[tuple(
                        slice(start, start + length)
                        for start, length in zip(item.storage_offsets, item.lengths)
                    )]
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != piece.shape:
                        raise CheckpointError(
                            f"{self.root / name}: {key!r} gives a chunk of shape {tuple(piece.shape)} "
                            f"where the model needs {tuple(target.shape)}"
                        )
                    target.copy_(piece)
                    planner.commit_tensor(item, target)
            future: Future[None] = Future()
            future.set_result(None)
            return future

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return False

    return _Writer, _Reader
