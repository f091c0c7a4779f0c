"""A sharded checkpoint's model weights, consolidated into safetensors (``fnaccel merge-weights``).

Reads either

- an fnaccel checkpoint (``fa.save``), sharded by ``fsdp()`` or not: its
  pickle-free layout (``fnaccel.json``, ``sharded/metadata.json``, the ranks'
  ``sharded/rank<r>.safetensors``), every file checked against the manifest's
  checksum; nothing is unpickled;
- a ``torch.distributed.checkpoint`` directory (``.metadata`` and
  ``*.distcp`` files, e.g. Accelerate's ``pytorch_model_fsdp_0``), through
  `fnaccel.checkpoint.storage.dcpstore.DirectoryReader` (an allowlist unpickler for
  its ``.metadata``, torch's ``weights_only`` loader for the tensors).

Both are read as hostile: the index (``sharded/metadata.json`` or
``.metadata``) may name only regular files inside the checkpoint (no
absolute or ``..`` path, no symbolic link, FIFO or device), every stored
piece must lie inside its file, every chunk inside its tensor, and the
tensors it declares must fit in the bytes the files hold, so a hostile index
cannot make a merge allocate more than the checkpoint's size.

It writes ``model.safetensors`` into ``output_path`` (past 10GB, shards and
``model.safetensors.index.json``), as `fa.save_model` does, atomically. From a
checkpoint holding ``{"model": ..., "optimizer": ...}`` only the model is kept.

Imports ``torch.distributed.checkpoint`` at its top (through dcpstore): the
command line and `fnaccel.utils` import this module when a merge runs.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.manifest import MANIFEST, read_manifest
from fnaccel.checkpoint.storage import dcpstore
from fnaccel.checkpoint.storage.files import read_json, read_tensors, retie
from fnaccel.checkpoint.storage.shardindex import METADATA
from fnaccel.checkpoint.storage.weightfiles import write_weights
from fnaccel.constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["MAX_SHARD_SIZE", "Merged", "merge_fsdp_weights", "merge_weights"]

MAX_SHARD_SIZE = 10 * 10**9  # fa.save_model's default "10GB"


@dataclass(frozen=True, slots=True, kw_only=True)
class Merged:
    """What `merge_weights` wrote, for the command's report."""

    path: Path  # the file a loader opens: model.safetensors or its index
    source_kind: str
    num_tensors: int


def _model_names(metadata: Metadata) -> dict[str, str]:
    """``{DCP key: weight name}`` for the model's tensors among the checkpoint's keys.

    A checkpoint of ``{"model": ..., ...}`` gives the model's entries; one
    holding a single dict gives that dict's entries (Accelerate's rule); a
    flat one gives every tensor.
    """
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


def _model_tensors(metadata: Metadata, reader: StorageReader) -> dict[str, torch.Tensor]:
    """The model's full tensors, assembled from their chunks by DCP in this one process."""
    names = _model_names(metadata)
    full = {}
    for key in names:
        item = metadata.state_dict_metadata[key]
        assert isinstance(item, TensorStorageMetadata)  # _model_names keeps tensors only
        full[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if full:
        dcpstore.load(full, reader, None, "merge-weights")
    return {names[key]: tensor for key, tensor in full.items()}


def _read_fnaccel(source: Path) -> dict[str, torch.Tensor]:
    manifest = read_manifest(source)
    if METADATA in manifest["files"]:  # an fsdp() run: DCP's chunks in pickle-free files
        metadata, storage = dcpstore.metadata_from(
            read_json(source, METADATA, manifest), manifest["files"], str(source / METADATA)
        )
        return _model_tensors(metadata, dcpstore.ShardReader(source, manifest, metadata, storage))
    if "model.safetensors" in manifest["files"]:  # already whole: ties restored, as fa.load does
        return retie(read_tensors(source, "model.safetensors", manifest), manifest["tied"])
    raise CheckpointError(f"{source}: this fnaccel checkpoint holds no model weights")


def _not_a_checkpoint(source: Path) -> CheckpointError:
    hint = ""
    if (source.parent / MANIFEST).is_file():
        hint = f"; pass {source.parent}, the checkpoint directory holding {MANIFEST}"
    else:
        markers = (MANIFEST, dcpstore.DCP_METADATA)
        inner = sorted({p.parent.name for marker in markers for p in source.glob(f"*/{marker}")})
        if inner:
            hint = (
                f"; it holds the checkpoint directories {inner}: pass one of them (e.g. {source / inner[0]})"
            )
    return CheckpointError(
        f"{source}: not a checkpoint: no {MANIFEST} (fa.save) and no {dcpstore.DCP_METADATA} "
        f"(torch.distributed.checkpoint){hint}"
    )


def merge_weights(checkpoint_dir: str | Path, output_path: str | Path, remove_checkpoint_dir: bool) -> Merged:
    """`merge_fsdp_weights`, saying what it read and wrote (``fnaccel merge-weights`` prints it).

    Raises:
        ValueError: ``output_path`` is a file, or lies inside ``checkpoint_dir``
            (written into an fnaccel checkpoint, or deleted with it).
        CheckpointError: see `merge_fsdp_weights`.
        OSError: the output (or the removal) could not be written.
    """
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
    elif (source / dcpstore.DCP_METADATA).is_file():
        marker = dcpstore.DCP_METADATA
        kind = "torch.distributed.checkpoint directory (pickled .metadata read through an allowlist)"
        reader = dcpstore.DirectoryReader(source)
        weights = _model_tensors(reader.read_metadata(), reader)
    else:
        raise _not_a_checkpoint(source)
    if not weights:
        raise CheckpointError(f"{source}: the checkpoint holds no tensors to merge")
    write_weights(weights, output, MAX_SHARD_SIZE)
    if remove_checkpoint_dir:
        (source / marker).unlink()  # first: a removal cut short leaves no checkpoint-looking directory
        shutil.rmtree(source)
    name = SAFE_WEIGHTS_INDEX_NAME if (output / SAFE_WEIGHTS_INDEX_NAME).is_file() else SAFE_WEIGHTS_NAME
    return Merged(path=output / name, source_kind=kind, num_tensors=len(weights))


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
    return merge_weights(checkpoint_dir, output_path, remove_checkpoint_dir).path
