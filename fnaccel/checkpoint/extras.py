"""Objects registered for checkpointing, stored pickle-free.

Anything with ``state_dict()`` / ``load_state_dict()`` (an EMA of the weights,
a custom sampler, a running-metric object) can ride along with the run:
``state = fa.utils.register_for_checkpointing(state, ema=ema)``. Its
state_dict is split into tensors (safetensors) and a JSON tree in which each
tensor is a ``{"__tensor__": key}`` placeholder; anything else raises a
`CheckpointError` naming where it sits. Tuples come back as lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from fnaccel._errors import CheckpointError

__all__ = ["join", "register_for_checkpointing", "split"]

_PLACEHOLDER = "__tensor__"


def register_for_checkpointing(state: Any, **objects: Any) -> Any:
    """The state with ``objects`` saved and loaded with it, under their names
    (the state is not consumed).

    >>> import fnaccel as fa, torch
    >>> state = fa.utils.register_for_checkpointing(fa.init(cpu=True), ema=torch.nn.Linear(1, 1))
    >>> sorted(state.extras)
    ['ema']
    """
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"register_for_checkpointing: {name}={type(obj).__name__} has no state_dict() and "
                "load_state_dict(); only such objects can be saved with the run"
            )
        if "/" in name:
            raise ValueError(f"register_for_checkpointing: name {name!r} may not contain '/'")
    return state.replace(extras=MappingProxyType({**state.extras, **objects}))


def split(value: Any, where: str, tensors: dict[str, torch.Tensor], copy: bool) -> Any:
    """``value`` as a JSON tree, its tensors moved into ``tensors`` under their paths."""
    if isinstance(value, torch.Tensor):
        tensors[where] = value.detach().to("cpu", copy=True) if copy else value.detach()
        return {_PLACEHOLDER: where}
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(f"{where}: key {key!r} is not a string or int; it cannot be stored without pickle")
            out[str(key)] = split(item, f"{where}/{key}", tensors, copy)
        return out
    if isinstance(value, (list, tuple)):
        return [split(item, f"{where}/{i}", tensors, copy) for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"{where}: a {type(value).__name__} cannot be stored without pickle; state_dicts "
        "saved with the run may hold tensors, numbers, strings, lists and dicts"
    )


def join(tree: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """The inverse of `split`; a placeholder naming no stored tensor is a `CheckpointError`
    naming ``where`` (the file and the object)."""
    if isinstance(tree, dict):
        if set(tree) == {_PLACEHOLDER}:
            key = tree[_PLACEHOLDER]
            if not isinstance(key, str) or key not in tensors:
                raise CheckpointError(f"{where}: placeholder {key!r} names no tensor in extras.safetensors")
            return tensors[key]
        return {key: join(item, tensors, where) for key, item in tree.items()}
    if isinstance(tree, list):
        return [join(item, tensors, where) for item in tree]
    return tree
