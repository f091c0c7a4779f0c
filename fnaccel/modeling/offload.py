"""Weights offloaded to a folder, read back lazily.

The folder is Accelerate's layout, so an offload folder written by either
library loads in the other: each tensor is a raw file ``<name>.dat`` holding
its bytes in C order and the machine's byte order, nothing else, and
``index.json`` maps each name to ``{"dtype": "float32", "shape": [...]}``.
bfloat16 is stored as its raw 2-byte words under ``"bfloat16"``, as Accelerate
does (it goes through numpy, which has no bfloat16). No pickle anywhere:
the tensors are bytes, the metadata JSON.

Why raw files rather than a safetensors file per weight: the two are equally
safe and equally lazy (both are memory-mapped), but raw files are what
Accelerate writes and reads, and reading one needs no numpy:
`torch.from_file` maps it privately (copy-on-write), so a tensor costs no
memory until it is used, writes to it never reach the file, and its pages go
when the tensor is freed. An index entry may also point into a safetensors
file (``{"safetensors_file": path, "weight_name": name}``), as transformers
writes when the checkpoint is already safetensors; and fnaccel records a tied
name stored once under another name as ``{"dtype", "shape", "weight_name":
stored name}`` (Accelerate would look for a file of the tied name).

Each ``.dat`` file is written with ordinary file writes under a temporary
name and renamed, and the index last, so a crash never leaves a name pointing
at half a file, and a full disk is an ``OSError`` (a write through a shared
mapping would turn it into a ``SIGBUS``). Nothing is fsynced: an offload
folder is scratch space that the next load rewrites.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypedDict

import torch
from safetensors import safe_open
from torch import nn

from fnaccel._errors import CheckpointError
from fnaccel.atomic import replace_atomically
from fnaccel.checkpoint.storage.files import untie
from fnaccel.checks import is_int
from fnaccel.modeling.sizes import as_torch_dtype
from fnaccel.modeling.tensors import DeviceLike, as_device, owner_of, set_module_tensor_to_device
from fnaccel.modeling.tied import find_tied_parameters, retie_parameters

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "index_tied_names",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "offload_state_dict",
    "offload_weight",
    "read_offload_index",
    "save_offload_index",
]

INDEX_NAME = "index.json"
PathLike = str | os.PathLike[str]


class OffloadEntry(TypedDict, total=False):
    """One tensor's entry in an offload folder's ``index.json`` (Accelerate's keys).

    An index read back is a mapping of plain JSON values: each value is checked
    where it is used.
    """

    dtype: str
    shape: list[int]
    weight_name: str  # the name its data was written under (a tied partner's)
    safetensors_file: str  # served from this safetensors file instead of a .dat


OffloadIndex = dict[str, OffloadEntry]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: object, where: str) -> torch.dtype:
    dtype = as_torch_dtype(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: {name!r} is not a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as it is (C order, the machine's byte
    order, bfloat16 as its raw words), without a copy; valid while ``tensor`` lives."""
    return memoryview(
        (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    )


def offload_weight(
    weight: torch.Tensor,
    weight_name: str,
    offload_folder: PathLike,
    index: OffloadIndex | None = None,
) -> OffloadIndex | None:
    """Write ``weight`` to ``<offload_folder>/<weight_name>.dat`` and note it in ``index``.

    Args:
        weight: the tensor, on any device but ``meta``.
        weight_name: its name in the model's state dict.
        offload_folder: the folder; created if missing.
        index: where to record ``{"dtype", "shape"}`` under ``weight_name``
            (`save_offload_index` writes it); None records nothing.

    Returns:
        ``index``.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     offload_weight(torch.ones(2, 3, dtype=torch.bfloat16), "w", folder, index={})
    {'w': {'dtype': 'bfloat16', 'shape': [2, 3]}}
    """
    if weight.is_meta:
        raise ValueError(f"{weight_name!r} is on the meta device and holds no data to offload")
    tensor = weight.detach()
    host = tensor.cpu().contiguous().resolve_conj().resolve_neg()  # no copy for a contiguous CPU tensor
    # scratch space: not fsynced; a failed write (a full disk) raises OSError
    replace_atomically(
        Path(offload_folder) / f"{weight_name}.dat",
        lambda file: file.write(_bytes_of(host)) if host.numel() else None,
        durable=False,
    )
    if index is not None:
        index[weight_name] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    return index


def load_offloaded_weight(weight_file: PathLike, weight_info: Mapping[str, object]) -> torch.Tensor:
    """The tensor in ``weight_file`` (written by `offload_weight`), memory-mapped.

    Nothing is read until the tensor is used; writing to it does not change
    the file.

    Args:
        weight_file: the ``.dat`` file.
        weight_info: its index entry, ``{"dtype": ..., "shape": [...]}``.

    Raises:
        CheckpointError: the file is missing or its size does not match the entry.

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     index = offload_weight(torch.arange(3), "steps", folder, index={})
    ...     load_offloaded_weight(os.path.join(folder, "steps.dat"), index["steps"])
    tensor([0, 1, 2])
    """
    path = Path(weight_file)
    dtype = _parse_dtype(weight_info.get("dtype"), str(path))
    saved_shape = weight_info.get("shape", ())
    if not isinstance(saved_shape, (list, tuple)) or not all(is_int(n) and n >= 0 for n in saved_shape):
        raise CheckpointError(
            f"{path}: its index entry's shape must be a list of sizes, got {saved_shape!r:.80}; "
            "offload the weights again"
        )
    shape = tuple(int(n) for n in saved_shape)
    numel = math.prod(shape)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: offload the weights again") from None
    if size != numel * dtype.itemsize:
        raise CheckpointError(
            f"{path} holds {size} bytes, but its index entry ({dtype}, shape {list(shape)}) needs "
            f"{numel * dtype.itemsize}: the file is truncated or from another model; offload the weights again"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(path), shared=False, size=numel, dtype=dtype).view(shape)


def read_offload_index(offload_folder: PathLike) -> dict[str, dict[str, object]]:
    """The ``index.json`` of an offload folder ({} where there is none)."""
    path = Path(offload_folder) / INDEX_NAME
    if not path.is_file():
        return {}
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable offload index: {exc}") from None
    if not isinstance(index, dict) or not all(isinstance(v, dict) for v in index.values()):
        raise CheckpointError(f"{path} is not an offload index: it must map tensor names to their entries")
    return index


def save_offload_index(index: Mapping[str, Mapping[str, object]] | None, offload_folder: PathLike) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (written whole, then renamed into place)."""
    if not index:
        return
    folder = Path(offload_folder)
    merged = {**read_offload_index(folder), **index}
    text = json.dumps(merged, indent=2, sort_keys=True) + "\n"
    replace_atomically(folder / INDEX_NAME, lambda file: file.write(text.encode("utf-8")), durable=False)


def offload_state_dict(save_dir: PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Offload every tensor of ``state_dict`` into ``save_dir``, with its index.

    Names sharing one tensor (tied weights) are written once; the others are
    recorded as pointing at it.

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     offload_state_dict(folder, torch.nn.Linear(2, 1).state_dict())
    ...     sorted(os.listdir(folder))
    ['bias.dat', 'index.json', 'weight.dat']
    """
    index: OffloadIndex = {}
    kept, aliases = untie(state_dict)
    for name, tensor in kept.items():
        offload_weight(tensor, name, save_dir, index=index)
    for alias, name in aliases.items():
        index[alias] = {**index[name], "weight_name": name}
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    save_offload_index(index, save_dir)


class OffloadedWeightsLoader(Mapping[str, torch.Tensor]):
    """A lazy mapping over a state dict and an offload folder: tensors are read when asked for.

    Args:
        state_dict: tensors held in memory; they take precedence.
        save_folder: an offload folder (`offload_state_dict`, or the
            ``offload_folder`` of `load_checkpoint_in_model`).
        index: the entries to serve; defaults to ``save_folder``'s ``index.json``.
        device: where to put the tensors read from files (default: the CPU,
            memory-mapped).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     offload_state_dict(folder, {"a": torch.zeros(2)})
    ...     weights = OffloadedWeightsLoader(state_dict={"b": torch.ones(1)}, save_folder=folder)
    ...     sorted(weights), weights["a"]
    (['a', 'b'], tensor([0., 0.]))
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: PathLike | None = None,
        index: Mapping[str, Mapping[str, object]] | None = None,
        device: DeviceLike | None = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError(
                "OffloadedWeightsLoader needs a state_dict, a save_folder or an index to serve weights from"
            )
        self.state_dict: Mapping[str, torch.Tensor] = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else Path(save_folder)
        if index is None and self.save_folder is not None:
            index = read_offload_index(self.save_folder)
        self.index: Mapping[str, Mapping[str, object]] = {} if index is None else index
        self.all_keys = (*self.state_dict, *(key for key in self.index if key not in self.state_dict))
        self.device = None if device is None else as_device(device)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        stored = _entry_text(info, "weight_name")
        if stored is None:
            stored = key
        file = _entry_text(info, "safetensors_file")
        if file is not None:
            with safe_open(file, framework="pt", device=str(self.device or "cpu")) as handle:
                tensor: torch.Tensor = handle.get_tensor(stored)
            if "dtype" in info:
                tensor = tensor.to(_parse_dtype(info["dtype"], file))
        elif self.save_folder is None:
            raise ValueError(f"{key!r} is offloaded to a .dat file, but this loader was given no save_folder")
        else:
            tensor = load_offloaded_weight(self.save_folder / f"{stored}.dat", info)
        return tensor if self.device is None else tensor.to(self.device)

    def __contains__(self, key: object) -> bool:  # without reading the tensor
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def _entry_text(info: Mapping[str, object], field: str) -> str | None:
    value = info.get(field)
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"an offload index entry's {field} must be a string, got {value!r:.80}")
    return value


class PrefixedDataset(Mapping[str, torch.Tensor]):
    """The entries of ``dataset`` under ``prefix``, without it: one module's view of a model's weights.

    >>> PrefixedDataset({"block.weight": torch.ones(1), "head.weight": torch.zeros(1)}, "block.")["weight"]
    tensor([1.])
    """

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[self.prefix + key]

    def __iter__(self) -> Iterator[str]:
        return (key[len(self.prefix) :] for key in self.dataset if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def extract_submodules_state_dict(
    state_dict: Mapping[str, torch.Tensor], submodule_names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that belong to the named submodules ("" is the whole model).

    >>> sorted(extract_submodules_state_dict({"h.1.w": 1, "h.10.w": 2, "h.1": 3}, ["h.1"]))
    ['h.1', 'h.1.w']
    """
    return {
        key: tensor
        for key, tensor in state_dict.items()
        if any(name == "" or key == name or key.startswith(name + ".") for name in submodule_names)
    }


def load_offloaded_weights(
    model: nn.Module, index: Mapping[str, Mapping[str, object]] | None, offload_folder: PathLike
) -> None:
    """Load the weights offloaded in ``offload_folder`` back into ``model``, on the CPU.

    Each tensor is read into memory (the model does not keep the files open)
    and cast to the dtype of the model's tensor; a weight stored once for
    several tied names is read once, and the model's ties are kept.

    Args:
        model: the model, its offloaded tensors typically on ``meta``.
        index: the entries to load (names as in the model's state dict), as
            `offload_state_dict` or `load_checkpoint_in_model` wrote them.
        offload_folder: the folder holding the ``.dat`` files.

    >>> import tempfile
    >>> source = torch.nn.Linear(2, 1)
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(2, 1)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     offload_state_dict(folder, source.state_dict())
    ...     load_offloaded_weights(model, read_offload_index(folder), folder)
    >>> torch.equal(model.weight, source.weight)
    True
    """
    if not index:
        return
    tied = find_tied_parameters(model)
    weights = OffloadedWeightsLoader(save_folder=offload_folder, index=index)
    read: dict[tuple[str, str], torch.Tensor] = {}
    for name, info in index.items():
        key = (str(info.get("safetensors_file")), str(info.get("weight_name", name)))
        if key not in read:
            read[key] = weights[name].clone()
        set_module_tensor_to_device(model, name, "cpu", value=read[key])
    retie_parameters(model, tied)


def index_tied_names(
    model: nn.Module, tied: Sequence[Sequence[str]], offloaded: set[str], folder: Path, index: OffloadIndex
) -> None:
    """Give each offloaded name of a tied group an ``index`` entry: the file its
    group was written to, or, where none was, a file written from a partner in memory."""
    for group in tied:
        names = [name for name in group if name in offloaded and name not in index]
        if not names:
            continue
        stored = next((name for name in group if name in index), None)
        if stored is None:
            partner = next((t for n in group if not (t := getattr(*owner_of(model, n))).is_meta), None)
            if partner is None:
                continue  # never loaded: the loader reports it missing
            stored = names[0]
            offload_weight(partner, stored, folder, index=index)
        entry = index[stored]
        for name in names:
            if name != stored:
                index[name] = {**entry, "weight_name": entry.get("weight_name", stored)}
