"""The run's pieces as tensors and JSON values, and back: nothing is pickled.

Optimizer state is keyed by parameter *name* (``"<param>/<key>"``), not by
position, so a checkpoint survives a reordering of the parameter groups and
names what is missing. Generator states: torch's as uint8 tensors, Python's
and NumPy's as JSON integers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.schema import check_like, kind_of
from fnaccel.checks import is_int
from fnaccel.rng import RNGState

__all__ = ["check_kind", "optimizer_payload", "optimizer_state", "restore_groups", "rng_from", "rng_payload"]


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
    """``(tensors, json)`` of an optimizer's state_dict, keyed by parameter name, with its class."""
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
    return tensors, {"kind": kind_of(optimizer), "param_groups": groups, "scalars": scalars}


def check_kind(saved: Any, live: object, source: str) -> None:
    """Refuse an optimizer or scheduler saved from another class (AdamW's state into SGD)."""
    kind = saved.get("kind") if isinstance(saved, Mapping) else None
    if kind != kind_of(live):
        raise CheckpointError(
            f"{source}: key 'kind': saved from {kind!r}, but this run's is {kind_of(live)!r}; "
            "build it the same way as the run that saved the checkpoint"
        )


def _class_defaults(optimizer: torch.optim.Optimizer) -> set[str]:
    """The group settings ``optimizer``'s class fills in itself when a state_dict lacks them
    (torch's ``__setstate__`` defaults the options newer than a checkpoint); none if it fails."""
    probe = object.__new__(type(optimizer))
    try:
        type(optimizer).__setstate__(
            probe, {"defaults": dict(optimizer.defaults), "state": {}, "param_groups": [{"params": []}]}
        )
        return set(probe.param_groups[0]) - {"params"}
    except Exception:
        return set()


def _throwaway(
    cls: type[torch.optim.Optimizer], settings: dict[str, Any], like: torch.Tensor | None
) -> torch.optim.Optimizer:
    """A ``cls`` built with the ``settings`` its constructor takes, over one one-element
    parameter of ``like``'s ndim, dtype and device (Muon takes only matrices, fused only floats)."""
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in settings.items() if k in accepted and k != "params"}
    probe = (
        torch.zeros(1)
        if like is None
        else torch.zeros((1,) * like.ndim, dtype=like.dtype, device=like.device)
    )
    return cls([torch.nn.Parameter(probe)], **kwargs)


def _check_settings(
    optimizer: torch.optim.Optimizer, settings: dict[str, Any], like: torch.Tensor | None, where: str
) -> None:
    """Numbers a C double holds, and, for torch's own optimizers, settings their constructor
    accepts (``0 <= betas[0] < 1``, ``eps >= 0``, ...), checked on a `_throwaway` one."""
    for key, value in settings.items():
        if is_int(value) and not -(2**63) <= value < 2**63:
            raise CheckpointError(f"{where}: key {key!r} is {value}, out of any range torch computes in")
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim."):
        return  # another library's constructor may need more than settings (or allocate)
    try:
        _throwaway(cls, settings, like)
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"{where}: {cls.__name__} refuses these settings ({exc})") from None


def _probe_step(
    cls: type[torch.optim.Optimizer],
    settings: dict[str, Any],
    like: torch.Tensor,
    entries: dict[str, Any] | None,
) -> None:
    """One step of a `_throwaway` ``cls`` from a zero gradient, its state ``entries`` (each
    one element, or as saved when 0-d) or a fresh state (None)."""
    optimizer = _throwaway(cls, settings, like)
    param = optimizer.param_groups[0]["params"][0]
    param.grad = torch.zeros_like(param)
    if entries is not None:
        optimizer.state[param] = entries
    optimizer.step()


def _stand_ins(saved: Mapping[str, Any], param: torch.Tensor) -> dict[str, Any] | None:
    """One-element copies of a parameter's saved state for a probe step: each tensor
    of its parameter's shape as zeros of ``param``'s ndim, 0-d ones and plain values as
    saved; None when a tensor has another shape (Adafactor's factored rows and columns)."""
    entries: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            if value.ndim and value.shape != param.shape:
                return None
            value = (
                torch.zeros((1,) * param.ndim, dtype=value.dtype, device=param.device)
                if value.ndim
                else value.clone()
            )
        entries[key] = value
    return entries


def _check_state_fits(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    state: Mapping[int, Mapping[str, Any]],
    like: Mapping[int, torch.Tensor],
    source: str,
) -> None:
    """For torch's own optimizers: the saved state of each group's first parameter with
    state fits the saved settings (``amsgrad`` needs ``max_exp_avg_sq``; ``capturable``
    a device that has it), or the first step would fail after the state was consumed.
    Judged by one throwaway step on a one-element parameter (about 0.3 ms); a failing
    one is refused only where the same step with the live group's settings and a
    fresh state succeeds (LBFGS needs a closure, SparseAdam sparse gradients: no
    judgment there). ``like``: index to parameter."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim."):
        return
    for group, live in zip(groups, optimizer.param_groups, strict=False):
        index = next((i for i in group["params"] if i in state), None)
        if index is None:
            continue
        entries = _stand_ins(state[index], like[index])
        if entries is None:
            continue
        try:
            _probe_step(cls, group, like[index], entries)
        except Exception as exc:
            try:
                _probe_step(cls, live, like[index], None)  # _throwaway takes no "params" from a group
            except Exception:
                continue
            raise CheckpointError(
                f"{source}: the state saved for {sorted(entries)} does not fit the group's settings: "
                f"{cls.__name__}'s step fails with them ({type(exc).__name__}: {exc})"
            ) from None


def restore_groups(
    saved: Any, current: list[dict[str, Any]], source: str, optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """The saved param groups, checked against the live optimizer's (``params`` as names in
    both), with the live ``params`` and the live tuple types (JSON has none) put back.

    A saved group may hold settings the live one lacks (a scheduler adds ``initial_lr``),
    and lack only those ``optimizer``'s class fills in itself; the settings both have must
    be alike (lists of the same length), and ``optimizer``'s own constructor must accept them.
    """
    if not (
        isinstance(saved, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved)
    ):
        raise CheckpointError(f"{source}: key 'param_groups' must be a list of objects with 'params'")
    if [g["params"] for g in saved] != [list(g["params"]) for g in current]:
        raise CheckpointError(
            f"{source}: the optimizer's parameter groups do not match the checkpoint's "
            f"(saved {[len(g['params']) for g in saved]} parameters per group); build the "
            "optimizer the same way as the run that saved it"
        )
    filled = _class_defaults(optimizer)
    restored = []
    for i, (group, now) in enumerate(zip(saved, current, strict=False)):
        where = f"{source}: param_groups/{i}"
        settings = {k: v for k, v in group.items() if k != "params"}
        live = {k: v for k, v in now.items() if k != "params"}
        missing = sorted(set(live) - set(settings) - filled)
        if missing:
            raise CheckpointError(f"{where}: key {missing[0]!r} is missing (the settings lack {missing})")
        check_like(
            {k: v for k, v in settings.items() if k in live},
            {k: v for k, v in live.items() if k in settings},
            where,
        )
        live_params = optimizer.param_groups[i]["params"]
        _check_settings(optimizer, settings, live_params[0] if live_params else None, where)
        restored.append(
            {
                **{k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in settings.items()},
                "params": now["params"],
            }
        )
    return restored


def _check_state_tensor(key: str, value: torch.Tensor, param: torch.Tensor, source: str) -> None:
    """A per-parameter optimizer state tensor: a scalar (a step count) or the parameter's
    shape with size 1 allowed in any dimension (Adafactor's factored moments), in the
    parameter's dtype."""
    if value.ndim == 0:
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise CheckpointError(f"{source}: key {key!r} has dtype {value.dtype}, not a real number")
        return
    fits = value.ndim == param.ndim and all(
        s in (1, n) for s, n in zip(value.shape, param.shape, strict=False)
    )
    if not fits or value.dtype != param.dtype:
        raise CheckpointError(
            f"{source}: key {key!r} has shape {tuple(value.shape)} and dtype {value.dtype}, but its "
            f"parameter has shape {tuple(param.shape)} and dtype {param.dtype}"
        )


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    saved: Any,
    source: str,
) -> dict[str, Any]:
    """The state_dict to give ``optimizer``, built from `optimizer_payload`'s output and checked
    (class, groups, every state entry) before anything is restored. ``params``: name to parameter."""
    if not isinstance(saved, dict) or set(saved) != {"kind", "param_groups", "scalars"}:
        raise CheckpointError(f"{source}: must hold exactly the keys 'kind', 'param_groups', 'scalars'")
    check_kind(saved, optimizer, source)
    by_id = {id(p): n for n, p in params.items()}
    order = _param_names(optimizer, by_id)
    index = {name: i for i, name in enumerate(order)}
    current = optimizer.state_dict()
    named = [{**g, "params": [order[i] for i in g["params"]]} for g in current["param_groups"]]
    groups = restore_groups(saved["param_groups"], named, source, optimizer)
    for group, now in zip(groups, current["param_groups"], strict=False):
        group["params"] = now["params"]
    live = {order[i]: fields for i, fields in current["state"].items()}
    state: dict[int, dict[str, Any]] = {}
    tensor_source = source.removesuffix(".json") + ".safetensors"
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise CheckpointError(
                f"{tensor_source}: key {key!r}: optimizer state for unknown parameter {name!r}"
            )
        _check_state_tensor(key, value, params[name], tensor_source)
        state.setdefault(index[name], {})[field] = value
    scalars = saved["scalars"]
    if not isinstance(scalars, dict):
        raise CheckpointError(f"{source}: key 'scalars' must be an object of parameter names")
    for name, fields in scalars.items():
        if name not in index or not isinstance(fields, dict):
            raise CheckpointError(f"{source}: key 'scalars/{name}': not a parameter of this optimizer")
        for field, value in fields.items():
            if not (value is None or isinstance(value, (bool, int, float, str))):
                raise CheckpointError(
                    f"{source}: key 'scalars/{name}/{field}' must be a number, string or null"
                )
        state.setdefault(index[name], {}).update(fields)
    for name, fields in live.items():  # a run that already stepped: its state says what fits
        if index[name] in state:
            check_like(state[index[name]], fields, f"{source}: state of {name!r}", strict=False)
    _check_state_fits(optimizer, groups, state, {index[name]: params[name] for name in index}, source)
    return {"state": state, "param_groups": groups}


def rng_payload(rng: RNGState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng/torch": rng.torch}
    tensors.update({f"rng/cuda/{i}": s for i, s in enumerate(rng.cuda)})
    version, words, gauss = rng.python
    numpy = None
    if rng.numpy is not None:
        kind, key, pos, has_gauss, cached = rng.numpy
        numpy = [kind, [int(k) for k in key], int(pos), int(has_gauss), float(cached)]
    return tensors, {"python": [version, list(words), gauss], "cuda": len(rng.cuda), "numpy": numpy}


def _uint32s(words: list[int]) -> bool:
    """Integers ``words`` (already checked to be ints) all fit a generator's 32-bit words."""
    return not words or (min(words) >= 0 and max(words) < 2**32)


def _finite(value: object) -> bool:
    """A generator's cached Gaussian as saved: a finite float (never an int, NaN or infinity)."""
    return isinstance(value, float) and math.isfinite(value)


def rng_from(tensors: Mapping[str, torch.Tensor], saved: Any, live: RNGState, source: str) -> RNGState:
    """The generators `rng_payload` stored, checked against this process's (``live``):
    the same generators, each state of the same size, every word in range."""
    tensor_source = source.removesuffix(".json") + ".safetensors"
    _, live_json = rng_payload(live)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{source}: key 'rng' must be an object")
    check_like(saved, live_json, f"{source}: rng")
    if saved["cuda"] != len(live.cuda) or (saved["numpy"] is None) != (live.numpy is None):
        raise CheckpointError(
            f"{source}: key 'rng': saved with {saved['cuda']} CUDA generator(s) and NumPy "
            f"{'absent' if saved['numpy'] is None else 'present'}, this process has {len(live.cuda)} and "
            f"NumPy {'absent' if live.numpy is None else 'present'}; resume on the same kind of machine"
        )
    # check_like above made every word of both states an int, as in this process's
    version, words, gauss = saved["python"]
    # random.setstate refuses another version only when the state is installed (fa.evaluate,
    # a step with step_rng_types "python"): after the state was consumed
    if version != live.python[0] or not _uint32s(words) or not (gauss is None or _finite(gauss)):
        raise CheckpointError(
            f"{source}: key 'rng/python' is not a Python generator state of version "
            f"{live.python[0]} (32-bit words, a finite or null cached Gaussian)"
        )
    for name, now in (("rng/torch", live.torch), *((f"rng/cuda/{i}", s) for i, s in enumerate(live.cuda))):
        value = tensors.get(name)
        if value is None:
            raise CheckpointError(f"{tensor_source}: key {name!r} is missing")
        check_like(value, now, tensor_source + f": {name}")
    numpy = None
    if saved["numpy"] is not None and live.numpy is not None:
        import numpy as np

        kind, key, pos, has_gauss, cached = saved["numpy"]
        if (
            kind != live.numpy[0]
            or not _uint32s(key)
            or not 0 <= pos <= len(key)
            or has_gauss not in (0, 1)
            or not _finite(cached)
        ):
            raise CheckpointError(f"{source}: key 'rng/numpy' is not a NumPy generator state")
        numpy = (kind, np.array(key, dtype=np.uint32), pos, has_gauss, cached)
    return RNGState(
        python=(version, tuple(words), gauss),
        torch=tensors["rng/torch"],
        cuda=tuple(tensors[f"rng/cuda/{i}"] for i in range(len(live.cuda))),
        numpy=numpy,
    )
