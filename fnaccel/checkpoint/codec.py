"""The run's pieces as tensors and JSON values, and back: nothing is pickled.

Optimizer state is keyed by parameter *name* (``"<param>/<key>"``), not by
position, so a checkpoint survives a reordering of the parameter groups and
names what is missing. Generator states: torch's as uint8 tensors, Python's
and NumPy's as JSON integers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.rng import RNGState

__all__ = ["load_optimizer", "optimizer_payload", "rng_from", "rng_payload"]


def _param_names(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str]:
    """Every optimizer parameter's name, in the optimizer's own index order."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    "the optimizer holds a parameter that is not in the prepared model; "
                    "build the optimizer from model.parameters()"
                )
            out.append(names[id(p)])
    return out


def optimizer_payload(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, json)`` of an optimizer's state_dict, keyed by parameter name."""
    order = _param_names(optimizer, names)
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, param_state in state_dict["state"].items():
        name = order[index]
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [order[i] for i in group["params"]]}
        for group in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    tensors: Mapping[str, torch.Tensor],
    saved: Mapping[str, Any],
    source: str,
) -> None:
    """Restore an optimizer from `optimizer_payload`'s output."""
    order = _param_names(optimizer, names)
    index = {name: i for i, name in enumerate(order)}
    current = optimizer.state_dict()["param_groups"]
    saved_groups = saved["param_groups"]
    if [g["params"] for g in saved_groups] != [[order[i] for i in g["params"]] for g in current]:
        raise CheckpointError(
            f"{source}: the optimizer's parameter groups do not match the checkpoint's "
            f"(saved {[len(g['params']) for g in saved_groups]} parameters per group); build "
            "the optimizer the same way as the run that saved it"
        )
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise CheckpointError(f"{source}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    for name, fields in saved["scalars"].items():
        state.setdefault(index[name], {}).update(fields)
    groups = []
    for group, now in zip(saved_groups, current):
        restored = {k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in group.items()}
        restored["params"] = now["params"]
        groups.append(restored)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_payload(rng: RNGState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng/torch": rng.torch}
    tensors.update({f"rng/cuda/{i}": s for i, s in enumerate(rng.cuda)})
    version, words, gauss = rng.python
    numpy = None
    if rng.numpy is not None:
        kind, key, pos, has_gauss, cached = rng.numpy
        numpy = [kind, [int(k) for k in key], int(pos), int(has_gauss), float(cached)]
    return tensors, {"python": [version, list(words), gauss], "cuda": len(rng.cuda), "numpy": numpy}


def rng_from(tensors: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> RNGState:
    version, words, gauss = saved["python"]
    numpy = None
    if saved["numpy"] is not None:
        import numpy as np

        kind, key, pos, has_gauss, cached = saved["numpy"]
        numpy = (kind, np.array(key, dtype=np.uint32), pos, has_gauss, cached)
    return RNGState(
        python=(version, tuple(words), gauss),
        torch=tensors["rng/torch"],
        cuda=tuple(tensors[f"rng/cuda/{i}"] for i in range(saved["cuda"])),
        numpy=numpy,
    )
