"""``fnaccel merge-weights``: a sharded checkpoint's model weights, consolidated into safetensors.

Reads either

- an fnaccel checkpoint (``fa.save``), sharded by ``fsdp()`` or not: its
  pickle-free layout (``fnaccel.json``, ``sharded/metadata.json``, the ranks'
  ``sharded/rank<r>.safetensors``), every file checked against the manifest's
  checksum; nothing is unpickled;
- a ``torch.distributed.checkpoint`` directory (``.metadata`` and
  ``*.distcp`` files, e.g. Accelerate's ``pytorch_model_fsdp_0``). DCP pickles
  its ``.metadata``: it is read through an unpickler that admits DCP's own
  metadata classes only (anything else is refused, so a planted pickle cannot
  run code), and the tensors through torch's ``weights_only`` loader.

Both are read as hostile: the index (``sharded/metadata.json`` or
``.metadata``) may name only regular files inside the checkpoint (no
absolute or ``..`` path, no symbolic link, FIFO or device), every stored
piece must lie inside its file, every chunk inside its tensor, and the
tensors it declares must fit in the bytes the files hold, so a hostile index
cannot make this command allocate more than the checkpoint's size.

and writes ``model.safetensors`` into ``output_path`` (past 10GB, shards and
``model.safetensors.index.json``), as `fa.save_model` does, atomically. From a
checkpoint holding ``{"model": ..., "optimizer": ...}`` only the model is kept.
Accelerate's ``--unsafe_serialization`` (write a pickled ``.bin``) is refused.
"""

from __future__ import annotations

import argparse
import io
import pickle
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.files import read_bounded, read_json, read_tensors, regular_size, safe_relative
from fnaccel.checkpoint.manifest import MANIFEST, read_manifest
from fnaccel.checkpoint.shardindex import METADATA
from fnaccel.checkpoint.dcpstore import check_metadata, metadata_from, storage_classes
from fnaccel.checkpoint.sharded import checkpoint_error
from fnaccel.checkpoint.tied import retie
from fnaccel.commands.main import CommandError

__all__ = ["merge_fsdp_weights", "register", "run"]

DCP_METADATA = ".metadata"
MAX_DCP_METADATA_BYTES = 2**30  # DCP's index of a large model is megabytes; a gigabyte is hostile
MAX_SHARD_SIZE = 10 * 10**9  # fa.save_model's default "10GB"

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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Merged:
    """What `_merge` wrote, for the command's report."""

    path: Path
    source_kind: str
    num_tensors: int


def _dcp_reader(source: Path) -> Any:
    """A ``FileSystemReader`` for ``source`` whose metadata comes through `_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class _Reader(FileSystemReader):
        metadata: Metadata | None = None  # read once, for the caller and for dcp.load

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if self.metadata is not None:
                return self.metadata
            path = source / DCP_METADATA
            data = read_bounded(source, DCP_METADATA, limit=MAX_DCP_METADATA_BYTES)
            try:
                metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError,
                    KeyError, RecursionError) as exc:
                raise CheckpointError(f"{path}: corrupt ({type(exc).__name__}: {exc})") from None
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
            _check_dcp_storage(metadata, source)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self.metadata = metadata
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            """DCP's own read, one file at a time, so that a file torch cannot read is named
            (torch's own error names none, and advises unpickling it with weights_only=False).
            DCP records no checksum: a flipped byte that still unpickles is not seen."""
            import dataclasses

            from torch.futures import Future

            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except CheckpointError:
                    raise
                except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on damaged bytes
                    raise CheckpointError(f"{source / name}: corrupt (torch cannot read a tensor stored in it: "
                                          f"{type(exc).__name__}); the file was damaged after it was written") from None
            done: Future[None] = Future()
            done.set_result(None)
            return done

    return _Reader(source)


def _check_dcp_types(metadata: Any, where: str) -> None:
    """Every part of DCP's Metadata is of the class DCP makes it: the unpickler admits those
    classes, but a planted pickle may put any of them (or a list) anywhere."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def fail(key: object, detail: str) -> CheckpointError:
        return CheckpointError(f"{where}: key {key!r}: {detail}; the checkpoint was edited or is hostile")

    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise fail(fqn, "a key must be a string")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not (isinstance(item, TensorStorageMetadata) and isinstance(item.properties, TensorProperties)
                and isinstance(item.properties.dtype, torch.dtype) and isinstance(item.chunks, list)
                and all(isinstance(chunk, ChunkStorageMetadata) for chunk in item.chunks)):
            raise fail(fqn, "not a tensor's metadata (properties with a torch dtype, a list of chunks)")
    for index in metadata.storage_data:
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)):
            raise fail(index, "a stored piece's index must name its key by a string")
    planned = metadata.planner_data
    if planned is not None and not (
        isinstance(planned, dict)
        and all(isinstance(path, (list, tuple)) and all(isinstance(part, (str, int)) for part in path)
                for path in planned.values())
    ):
        raise fail("planner_data", "must map keys to their paths (lists of names)")


def _check_dcp_storage(metadata: Any, source: Path) -> None:
    """DCP's ``.metadata`` names only regular files inside ``source``, each stored piece lies
    inside its file, and the tensors it declares fit in those files (`check_metadata`)."""
    where = str(source / DCP_METADATA)
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{where}: malformed (no state_dict_metadata or storage_data)")
    _check_dcp_types(metadata, where)
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = safe_relative(getattr(info, "relative_path", None), where)
        if name not in sizes:
            sizes[name] = regular_size(source, name)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= sizes[name]):
            raise CheckpointError(
                f"{where}: key {getattr(index, 'fqn', index)!r} is stored at bytes {offset!r}..+{length!r} "
                f"of {name}, which holds {sizes[name]} bytes"
            )
    check_metadata(metadata, sum(sizes.values()), where)


def _model_names(metadata: Any) -> dict[str, str]:
    """``{DCP key: weight name}`` for the model's tensors among the checkpoint's keys.

    A checkpoint of ``{"model": ..., ...}`` gives the model's entries; one
    holding a single dict gives that dict's entries (Accelerate's rule); a
    flat one gives every tensor.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    planned = metadata.planner_data or {}
    paths = {
        key: tuple(str(part) for part in planned.get(key, (key,)))
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    nested = all(len(path) > 1 for path in paths.values())
    tops = {path[0] for path in paths.values()}
    if nested and "model" in tops:
        return {key: ".".join(path[1:]) for key, path in paths.items() if path[0] == "model"}
    if nested and len(tops) == 1:
        return {key: ".".join(path[1:]) for key, path in paths.items()}
    return {key: ".".join(path) for key, path in paths.items()}


def _load_model_tensors(metadata: Any, reader: Any) -> dict[str, torch.Tensor]:
    """The model's full tensors, assembled from their chunks by DCP in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    names = _model_names(metadata)
    full = {
        key: torch.empty(
            metadata.state_dict_metadata[key].size, dtype=metadata.state_dict_metadata[key].properties.dtype
        )
        for key in names
    }
    try:
        with warnings.catch_warnings():  # torch warns that no_dist means one process: it does
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            if full:
                dcp.load(full, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except CheckpointException as exc:  # DCP wraps what the reader raised
        own = [f[0] if isinstance(f, tuple) else f for f in (getattr(exc, "failures", {}) or {}).values()]
        named = next((f for f in own if isinstance(f, CheckpointError)), None)
        if named is not None:  # it names its file; one process read everything: no rank to name
            raise CheckpointError(str(named)) from None
        raise checkpoint_error(exc, "merge-weights") from None
    return {names[key]: tensor for key, tensor in full.items()}


def _read_fnaccel(source: Path) -> dict[str, torch.Tensor]:
    manifest = read_manifest(source)
    if METADATA in manifest["files"]:  # an fsdp() run: DCP's chunks in pickle-free files
        metadata, storage = metadata_from(read_json(source, METADATA, manifest), manifest["files"],
                                          str(source / METADATA))
        _, reader_cls = storage_classes()
        return _load_model_tensors(metadata, reader_cls(source, manifest, metadata, storage))
    if "model.safetensors" in manifest["files"]:  # already whole: ties restored, as fa.load does
        return retie(read_tensors(source, "model.safetensors", manifest), manifest["tied"])
    raise CheckpointError(f"{source}: this fnaccel checkpoint holds no model weights")


def _not_a_checkpoint(source: Path) -> CheckpointError:
    hint = ""
    if (source.parent / MANIFEST).is_file():
        hint = f"; pass {source.parent}, the checkpoint directory holding {MANIFEST}"
    else:
        inner = sorted(
            {p.parent.name for marker in (MANIFEST, DCP_METADATA) for p in source.glob(f"*/{marker}")}
        )
        if inner:
            hint = (
                f"; it holds the checkpoint directories {inner}: pass one of them (e.g. {source / inner[0]})"
            )
    return CheckpointError(
        f"{source}: not a checkpoint: no {MANIFEST} (fa.save) and no {DCP_METADATA} "
        f"(torch.distributed.checkpoint){hint}"
    )


def _merge(checkpoint_dir: str | Path, output_path: str | Path, remove_checkpoint_dir: bool) -> _Merged:
    from fnaccel.checkpoint.weights import write_weights
    from fnaccel.constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    # resolved: '..' and symlinks must not hide that the output lies inside the source
    source, output = Path(checkpoint_dir).resolve(), Path(output_path).resolve()
    if not source.is_dir():
        raise CheckpointError(
            f"{source}: {'not a directory' if source.exists() else 'no such directory'}; "
            "give the checkpoint directory"
        )
    if output.exists() and not output.is_dir():
        raise ValueError(
            f"{output} is a file; output_path names the directory to write the merged weights into"
        )
    if remove_checkpoint_dir and output.is_relative_to(source):
        raise ValueError(
            f"{output} is inside {source}, which --remove_checkpoint_dir would delete; "
            "write the merged weights elsewhere"
        )
    if output == source or (output.is_relative_to(source) and (source / MANIFEST).is_file()):
        # writing model.safetensors into an fnaccel checkpoint would break its checksums
        raise ValueError(f"{output} is inside the checkpoint {source}; write the merged weights elsewhere")
    if (source / MANIFEST).is_file():
        marker, kind, weights = MANIFEST, "fnaccel checkpoint", _read_fnaccel(source)
    elif (source / DCP_METADATA).is_file():
        marker, kind = (
            DCP_METADATA,
            "torch.distributed.checkpoint directory (pickled .metadata read through an allowlist)",
        )
        reader = _dcp_reader(source)
        weights = _load_model_tensors(reader.read_metadata(), reader)
    else:
        raise _not_a_checkpoint(source)
    if not weights:
        raise CheckpointError(f"{source}: the checkpoint holds no tensors to merge")
    write_weights(weights, output, MAX_SHARD_SIZE)
    if remove_checkpoint_dir:
        (source / marker).unlink()  # first: a removal cut short leaves no checkpoint-looking directory
        shutil.rmtree(source)
    name = SAFE_WEIGHTS_INDEX_NAME if (output / SAFE_WEIGHTS_INDEX_NAME).is_file() else SAFE_WEIGHTS_NAME
    return _Merged(path=output / name, source_kind=kind, num_tensors=len(weights))


def merge_fsdp_weights(
    checkpoint_dir: str | Path,
    output_path: str | Path,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> Path:
    """Consolidate a sharded checkpoint's model weights into safetensors (Accelerate's name).

    Runs in one process, with no process group: the chunks every rank wrote
    are assembled here, so the machine needs the memory of the full model.

    Args:
        checkpoint_dir: an fnaccel checkpoint (``fa.save``; sharded by
            ``fsdp()`` or not) or a ``torch.distributed.checkpoint`` directory.
        output_path: the directory to write ``model.safetensors`` into
            (shards and an index past 10GB); created if missing.
        safe_serialization: must be True: fnaccel never writes pickles.
        remove_checkpoint_dir: delete ``checkpoint_dir`` once the weights are written.

    Returns:
        The file a loader opens: ``model.safetensors`` or the index.

    Raises:
        ValueError: ``safe_serialization=False``, ``output_path`` is a file,
            or lies inside a ``checkpoint_dir`` to be removed.
        CheckpointError: no checkpoint there, a corrupt or truncated file (named),
            a ``.metadata`` pickle naming anything but DCP's metadata classes.

    >>> import tempfile, torch, torch.distributed.checkpoint as dcp
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     weights = {"model": torch.nn.Linear(2, 1).state_dict()}
    ...     _ = dcp.save(weights, checkpoint_id=f"{tmp}/ckpt", no_dist=True)
    ...     merge_fsdp_weights(f"{tmp}/ckpt", f"{tmp}/merged").name
    'model.safetensors'
    """
    if not safe_serialization:
        raise ValueError(
            "merge_fsdp_weights: safe_serialization=False (--unsafe_serialization) writes a pickled "
            ".bin, which fnaccel never does (loading one runs arbitrary code); drop it to write "
            "safetensors"
        )
    return _merge(checkpoint_dir, output_path, remove_checkpoint_dir).path


def register(subparsers: Any) -> None:
    """Add ``merge-weights`` to the ``fnaccel`` parser (``accelerate merge-weights``' flags)."""
    parser = subparsers.add_parser(
        "merge-weights",
        help="Merge a sharded (FSDP / torch.distributed.checkpoint) checkpoint into safetensors weights.",
        description=(
            "Consolidate the model weights of a sharded checkpoint, an fnaccel checkpoint saved under "
            "fsdp() or a torch.distributed.checkpoint directory, into model.safetensors (shards and "
            "an index past 10GB) in output_path."
        ),
    )
    parser.add_argument(
        "checkpoint_directory",
        help=(
            "The checkpoint directory: an fnaccel checkpoint (with fnaccel.json) or a "
            "torch.distributed.checkpoint directory (with .metadata)."
        ),
    )
    parser.add_argument("output_path", help="The directory to write the merged weights into.")
    parser.add_argument(
        "--unsafe_serialization",
        action="store_true",
        help="Accelerate's flag to write a pickled .bin instead of safetensors; fnaccel refuses it.",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        action="store_true",
        help="Delete the checkpoint directory once the merged weights are written.",
    )
    parser.set_defaults(handler=run, command_name="merge-weights")


def run(args: argparse.Namespace) -> int:
    """Merge ``args.checkpoint_directory`` into ``args.output_path``; report what was written."""
    if args.unsafe_serialization:
        raise CommandError(
            "--unsafe_serialization writes a pickled .bin, which fnaccel never does (loading one "
            "runs arbitrary code); drop the flag to write safetensors"
        )
    try:
        merged = _merge(args.checkpoint_directory, args.output_path, args.remove_checkpoint_dir)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:  # the output (or a removal) could not be written: reads raise CheckpointError
        where = exc.filename if exc.filename is not None else args.output_path
        raise CommandError(f"{where}: {exc.strerror or exc} (output_path {args.output_path})") from None
    print(
        f"Merged {merged.num_tensors} tensors from the {merged.source_kind} {args.checkpoint_directory} "
        f"into {merged.path}"
    )
    if args.remove_checkpoint_dir:
        print(f"Removed {args.checkpoint_directory}")
    return 0
