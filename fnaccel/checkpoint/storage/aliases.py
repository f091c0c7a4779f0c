"""Tied and shared tensors: stored once, re-tied on load.

safetensors refuses two names for one storage (an ``lm_head`` tied to the
embedding), and storing both would double the file and untie them on load.
`untie` keeps the first name of each storage and records the others as
aliases; `retie` gives the aliases back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["retie", "untie"]


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    # the same storage viewed the same way is the same tensor; a different view is not
    return (
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def untie(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split ``tensors`` into one entry per storage and ``{alias: kept name}``.

    >>> w = torch.ones(2)
    >>> untie({"a": w, "b": w, "c": torch.zeros(1)})[1]
    {'b': 'a'}
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[object, ...], str] = {}
    for name, tensor in tensors.items():
        key = _storage_key(tensor) if tensor.numel() else (id(tensor),)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = tensor
    return unique, aliases


def retie(tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``tensors`` with every alias pointing at its kept tensor again."""
    out = dict(tensors)
    for alias, name in aliases.items():
        out[alias] = out[name]
    return out
