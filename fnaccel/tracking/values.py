"""Reading logged values: every tensor of a `log` call in one transfer per device."""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral, Real
from typing import TypeAlias

import torch

#: A logged number or string, as a tracker receives it.
Scalar: TypeAlias = bool | int | float | str
#: What `read_values` returns: scalars, nested under names.
Values: TypeAlias = dict[str, "Scalar | Values"]

__all__ = ["read_values"]


def read_values(values: Mapping[str, object]) -> Values:
    """``values`` as plain Python: each tensor replaced by its number, all tensors on a
    device read with one stack and one ``tolist`` (one device-to-host transfer)."""
    tensors: list[torch.Tensor] = []
    tree = _collect(values, "", tensors)
    assert isinstance(tree, dict)
    return _fill(tree, _to_host(tensors))


class _Pending:
    """Where a tensor's value goes once every tensor of the call has been read."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


# `_collect`'s tree: a `_Pending` where a tensor's number will go
_Tree: TypeAlias = "Scalar | _Pending | _Branch"
_Branch: TypeAlias = dict[str, _Tree]


def _collect(value: object, key: str, tensors: list[torch.Tensor]) -> _Tree:
    """``value`` with each tensor replaced by a `_Pending` (checked, not read yet)."""
    if isinstance(value, Mapping):
        out: _Branch = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"fa.log: metric names are strings, got {name!r} under {key or 'values'!r}")
            out[name] = _collect(item, f"{key}/{name}" if key else name, tensors)
        return out
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(
                f"fa.log: {key!r} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
                "log one real number per name (reduce it first, e.g. .mean())"
            )
        tensors.append(value)
        return _Pending(len(tensors) - 1)
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        return float(value)
    raise TypeError(
        f"fa.log: {key!r} is of type {type(value).__name__}; log numbers, strings, one-element "
        "tensors, or dicts of these"
    )


def _to_host(tensors: list[torch.Tensor]) -> list[Scalar]:
    """Every tensor's value, with one transfer per device (one stack, one tolist)."""
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    numbers: list[Scalar] = [0] * len(tensors)
    for device, indices in by_device.items():
        values = [tensors[i].detach().reshape(()) for i in indices]
        if device.type == "mps":  # MPS has no float64: bring the values over first, in one transfer
            values = _to_cpu_at_once(values)
        # float64 holds every float dtype exactly (and integers up to 2**53)
        stacked = torch.stack([value.to(torch.float64) for value in values])
        for index, number in zip(indices, stacked.tolist(), strict=True):
            dtype = tensors[index].dtype
            numbers[index] = (
                bool(number) if dtype == torch.bool else number if dtype.is_floating_point else int(number)
            )
    return numbers


def _to_cpu_at_once(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` (0-d tensors on one device, of any dtypes) on the CPU, unchanged
    bit for bit, in one transfer: their bytes, concatenated, then viewed back."""
    raw = torch.cat([value.reshape(1).view(torch.uint8) for value in values]).cpu()
    out, start = [], 0
    for value in values:
        end = start + value.element_size()
        out.append(raw[start:end].clone().view(value.dtype).reshape(()))  # clone: aligned for the view
        start = end
    return out


def _fill(tree: _Branch, numbers: list[Scalar]) -> Values:
    return {
        key: numbers[value.index]
        if isinstance(value, _Pending)
        else _fill(value, numbers)
        if isinstance(value, dict)
        else value
        for key, value in tree.items()
    }
