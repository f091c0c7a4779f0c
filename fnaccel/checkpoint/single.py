"""`save` and `load`: Accelerate's ``accelerate.utils.save`` / ``load``, one file from one process, pickle-free."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as to_bytes

from fnaccel.atomic import replace_atomically
from fnaccel.dist import DistContext, as_dist

__all__ = ["drop_shared_tensors", "load", "save"]

_LOG = logging.getLogger(__name__)


def drop_shared_tensors(obj: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``obj`` without the names whose tensor is the very same view as an earlier name's (tied
    weights), logging which were dropped (Accelerate's behaviour). Distinct views of one storage
    (slices, transposes) are kept: each is stored as its own copy.

    >>> w = torch.ones(2)
    >>> sorted(drop_shared_tensors({"a": w, "b": w, "c": w[:1]}))
    ['a', 'c']
    """
    kept: dict[str, torch.Tensor] = {}
    first_of: dict[tuple[Any, ...], str] = {}
    dropped: list[str] = []
    for name, tensor in obj.items():
        key = (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in first_of:
            dropped.append(name)
            continue
        first_of[key] = name
        kept[name] = tensor
    if dropped:
        _LOG.warning(
            "Removed shared tensor %s while saving (each is the same tensor as one kept); tie them "
            "again after loading (fnaccel.utils.retie_parameters)",
            sorted(dropped),
        )
    return kept


def save(
    state: DistContext | Any,
    obj: Mapping[str, torch.Tensor],
    f: str | os.PathLike[str],
    save_on_each_node: bool = False,
    safe_serialization: bool = True,
) -> None:
    """Write ``obj`` (a mapping of names to tensors) to ``f`` as safetensors, from
    the main process only (from each machine's main process with
    ``save_on_each_node``). Reads the state (a `RunState` or its `DistContext`);
    consumes nothing.

    The file is written beside its name and renamed into place, so ``f`` holds
    the old file or the whole new one, never a part. Tied tensors (two names,
    one tensor) are stored once: the later names are dropped and logged
    (a warning on ``fnaccel.checkpoint.single``), as Accelerate does;
    other views of one storage are stored as copies.

    Args:
        state: the run (only its ranks are read).
        obj: e.g. a ``state_dict()``.
        f: the file to write.
        save_on_each_node: write on every machine's local main process.
        safe_serialization: must stay True: fnaccel writes no pickles.

    Raises:
        ValueError: ``obj`` holds something other than tensors, or
            ``safe_serialization=False``.

    >>> import fnaccel as fa, tempfile, pathlib, safetensors.torch
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "weights.safetensors"
    >>> save(fa.init(cpu=True), {"w": torch.ones(2)}, path)
    >>> safetensors.torch.load_file(path)["w"]
    tensor([1., 1.])
    """
    if not safe_serialization:
        raise ValueError(
            "save: safe_serialization=False would write a pickle, which fnaccel never does "
            "(a pickle runs code when loaded); leave it True to write safetensors"
        )
    if not isinstance(obj, Mapping):
        raise ValueError(f"save: obj must map names to tensors (e.g. a state_dict), got {type(obj).__name__}")
    dtensor = getattr(torch.distributed, "tensor", None)
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"save: safetensors holds tensors under string names; {name!r} is a {type(value).__name__}"
            )
        if dtensor is not None and isinstance(value, getattr(dtensor, "DTensor", ())):
            # every rank holds only its shard: one process cannot write the whole tensor
            raise ValueError(
                f"save: {name!r} is sharded over the ranks (an fsdp() model's state_dict); "
                "write the model with fa.save_model(state, path), which gathers the shards"
            )
    ctx = as_dist(state)
    if not (ctx.is_local_main_process if save_on_each_node else ctx.is_main_process):
        return
    # safetensors refuses shared storage: each name kept gets its own contiguous copy
    data = to_bytes(
        {name: t.detach().cpu().contiguous().clone() for name, t in drop_shared_tensors(obj).items()}
    )
    replace_atomically(Path(f), lambda file: file.write(data))


def load(
    f: str | os.PathLike[str], map_location: str | torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `save` (or anyone): Accelerate's ``accelerate.utils.load``.

    Pickles (``.bin``, ``.pt``: what ``torch.load`` reads) are refused, since
    loading one runs code.

    Args:
        f: the ``.safetensors`` file.
        map_location: the device to put the tensors on (default: the CPU).

    Returns:
        The tensors by name.

    Raises:
        ValueError: ``f`` is not a safetensors file (a pickle, or damaged).
        FileNotFoundError: there is no ``f``.

    >>> import fnaccel as fa, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "weights.safetensors"
    >>> save(fa.init(cpu=True), {"w": torch.ones(2)}, path)
    >>> load(path)
    {'w': tensor([1., 1.])}
    """
    path = Path(f)
    if not path.is_file():
        raise FileNotFoundError(f"load: there is no file {path}")
    device = torch.device("cpu" if map_location is None else map_location)
    try:
        tensors = load_file(path, device="cpu")
    except SafetensorError as exc:
        raise ValueError(
            f"load: {path} is not a safetensors file ({exc}); fnaccel reads no pickles: convert a "
            "torch.save file with safetensors.torch.save_file in a process you trust"
        ) from None
    return tensors if device.type == "cpu" else {name: t.to(device) for name, t in tensors.items()}
