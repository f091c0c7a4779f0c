"""The run's parts as a checkpoint stores them, and each checked against its live counterpart.

A checkpoint is a tree of named parts; this module turns each into tensors
and JSON values and back, nothing pickled:

- the model's weights: the user's module inside the wrappers a run put around
  it (`unwrap_model`: its names carry no ``module.`` or ``_orig_mod.``
  prefix), its state dict passed through the run's save and load hooks
  (`register_save_state_pre_hook`, `register_load_state_pre_hook`);
- the optimizer's state, keyed by parameter *name* (``"<param>/<key>"``), not
  by position, so a checkpoint survives a reordering of the parameter groups
  and names what is missing (`optimizer_payload`, `optimizer_state`);
- the generators: torch's as uint8 tensors, Python's and NumPy's as JSON
  integers (`rng_payload`, `rng_from`).

The live tree is the schema (equinox's ``like``): a load reads every file,
checks each part against what the live object gives now (the model's
tensors, the optimizer's, a scheduler's or a transform's own
``state_dict()``: `check_like`, `check_tensors`) and only then restores
anything, so an edited or hostile checkpoint fails with a `CheckpointError`
naming the file and the key while the state is still fresh.

On another number of processes (docs/checkpoints.md, "Another number of
processes"), rank ``r`` reads ``rank<r>.*`` when the saving run had a rank
``r`` and rank 0's otherwise (`source_rank`); a rank the saving run did not
have gets generators derived from rank 0's and its rank
(`derived_generators`), the same on every load; gradients accumulated between
micro-steps are per-rank partial sums that cannot be split over another
number of ranks (`refuse_moved_gradients`). The model and the optimizer move
as their layout reads them (`fnaccel.checkpoint.storage.plain.layout_for`).

Here, below the transforms, because the layouts store the user's own module
and the transforms that wrap it (`fa.ddp`, `fa.compile`, `fa.deepspeed`)
import the same answer."""

from __future__ import annotations

import hashlib
import inspect
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import read_json, read_tensors, retie
from fnaccel.dist import DistContext
from fnaccel.kwargs.mixin import KwargsHandler
from fnaccel.rng import RNGState

if TYPE_CHECKING:
    from pathlib import Path

    from fnaccel.state import RunState

__all__ = [
    "data_payload",
    "rank_payload",
    "Stateful",
    "scheduler_payload",
    "CheckpointHooks",
    "StateDictHook",
    "check_kind",
    "check_layout",
    "check_like",
    "check_tensors",
    "check_unsharded",
    "derived_generators",
    "kind_of",
    "loaded_weights",
    "optimizer_payload",
    "optimizer_state",
    "read_model",
    "read_optimizer",
    "refuse_moved_gradients",
    "register_load_state_pre_hook",
    "register_save_state_pre_hook",
    "restore_groups",
    "rng_from",
    "rng_payload",
    "saved_weights",
    "source_rank",
    "unwrap_compiled",
    "unwrap_model",
]


def kind_of(obj: object) -> str:
    """The class an optimizer or scheduler is recorded under: ``module.QualName``."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_layout(
    saved: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    source: str,
    what: str,
) -> None:
    """Same keys, and each entry's ``(shape, dtype)`` as expected; else `CheckpointError`
    naming ``source`` and up to five differences."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}; {what} is not "
            "the one this checkpoint was saved from"
        )
    wrong = [
        f"{key!r} has shape {saved[key][0]} in the checkpoint but {shape} in {what}"
        if saved[key][0] != shape
        else f"{key!r} has dtype {saved[key][1]} in the checkpoint but {dtype} in {what}"
        for key, (shape, dtype) in expected.items()
        if saved[key] != (shape, dtype)
    ]
    if wrong:
        raise CheckpointError(f"{source}: {'; '.join(wrong[:5])}")


def check_tensors(
    saved: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    source: str,
    what: str = "the model",
) -> None:
    """Same keys, and each tensor with the expected shape and dtype."""
    check_layout(
        {k: (tuple(t.shape), t.dtype) for k, t in saved.items()},
        {k: (tuple(t.shape), t.dtype) for k, t in expected.items()},
        source,
        what,
    )


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, torch.Tensor):
        return "a tensor"
    return type(value).__name__


def check_like(
    saved: object, live: object, where: str, *, strict: bool = True, depth: int | None = None
) -> None:
    """``saved`` has the structure of ``live`` (what the live object's ``state_dict()`` gives,
    or the part a save of the live run would write: the live tree is the schema).

    Tensors: same shape and dtype. Objects: the same keys (``strict``; else
    the keys both have are compared). Lists: the same length (``strict``; else
    the items both have). Numbers: an integer where the live value is one (a
    float may be saved as an integer); booleans, strings and nulls as live.
    ``where`` names the file and the key path. ``depth``: how many levels of
    objects and lists are opened (None: all); below it only each value's kind
    (object, list, number, ...) is compared, and the part's own reader checks
    inside (a file's top level against the part the live run would save).

    >>> check_like({"last_epoch": 3}, {"last_epoch": 0}, "scheduler.json")
    >>> check_like({"last_epoch": "abc"}, {"last_epoch": 0}, "scheduler.json")
    Traceback (most recent call last):
    fnaccel._errors.CheckpointError: scheduler.json: key 'last_epoch' must be an integer, not a string ('abc')
    """
    _like(saved, live, where, "", strict, -1 if depth is None else depth)


def _like(saved: object, live: object, file: str, key: str, strict: bool, depth: int) -> None:
    def fail(detail: str) -> CheckpointError:
        at = f" key {key!r}" if key else ""
        return CheckpointError(f"{file}:{at} {detail}")

    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise fail(f"must be a tensor, not {_kind(saved)}")
        if saved.shape != live.shape or saved.dtype != live.dtype:
            raise fail(
                f"has shape {tuple(saved.shape)} and dtype {saved.dtype} in the checkpoint but "
                f"{tuple(live.shape)} and {live.dtype} in this run"
            )
        return
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            raise fail(f"must be an object, not {_kind(saved)}")
        if depth == 0:
            return
        live_keys = {str(k): k for k in live}
        saved_keys = {str(k): k for k in saved}
        if strict and set(live_keys) != set(saved_keys):
            missing, extra = (
                sorted(set(live_keys) - set(saved_keys)),
                sorted(set(saved_keys) - set(live_keys)),
            )
            raise fail(
                f"holds keys that differ from this run's: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name in sorted(set(live_keys) & set(saved_keys)):
            path = f"{key}/{name}" if key else name
            _like(saved[saved_keys[name]], live[live_keys[name]], file, path, strict, depth - 1)
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            raise fail(f"must be a list, not {_kind(saved)}")
        if depth == 0:
            return
        if strict and len(saved) != len(live):
            raise fail(f"holds {len(saved)} items in the checkpoint but {len(live)} in this run")
        if all(type(x) is int for x in live) and all(type(x) is int for x in saved):
            return  # integers where integers are (a generator's 625 words): no call per item
        for i, (item, now) in enumerate(zip(saved, live, strict=False)):
            _like(item, now, file, f"{key}/{i}" if key else str(i), strict, depth - 1)
        return
    if live is None:
        return  # unset in a fresh object: nothing says what it must hold later
    expected = _kind(live)
    actual = _kind(saved)
    if isinstance(live, float) and actual == "an integer":
        return
    if expected in ("a boolean", "an integer", "a number", "a string") and actual != expected:
        raise fail(f"must be {expected}, not {actual} ({saved!r})"[:300])


def unwrap_compiled(model: Any) -> Any:
    """The module inside a `torch.compile` wrapper (the model itself otherwise)."""
    return getattr(model, "_orig_mod", model)


def unwrap_model(model: object) -> nn.Module:
    """The user's module inside `torch.compile`, `DistributedDataParallel` and DeepSpeed
    engine wrappers (FSDP2 shards in place, so a sharded model is its own module).

    >>> import torch
    >>> layer = torch.nn.Linear(1, 1)
    >>> unwrap_model(torch.compile(layer)) is layer
    True
    """
    inner = unwrap_compiled(model)
    if isinstance(inner, DistributedDataParallel):
        return cast(nn.Module, inner.module)
    ds = sys.modules.get("deepspeed")  # only a run that built an engine has imported it
    return cast(
        nn.Module, inner.module if ds is not None and isinstance(inner, ds.DeepSpeedEngine) else inner
    )


class Stateful(Protocol):
    """What a checkpoint stores a part of through its own pair (a scheduler, a registered object)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> object: ...


StateDictHook = Callable[[torch.nn.Module, dict[str, torch.Tensor]], "dict[str, torch.Tensor] | None"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointHooks(KwargsHandler):
    """The run's state-dict hooks, applied in order.

    Args:
        save_state_pre: ``hook(model, state_dict) -> state_dict | None``,
            called by `fa.save` before the weights are written.
        load_state_pre: ``hook(model, state_dict) -> state_dict | None``,
            called by `fa.load` before the weights are loaded.
    """

    _not_kwargs = frozenset({"save_state_pre", "load_state_pre"})
    save_state_pre: tuple[StateDictHook, ...] = ()
    load_state_pre: tuple[StateDictHook, ...] = ()

    def _validate(self) -> None:
        for name in ("save_state_pre", "load_state_pre"):
            hooks = getattr(self, name)
            if not isinstance(hooks, tuple) or not all(callable(h) for h in hooks):
                raise TypeError(f"CheckpointHooks.{name} must be a tuple of callables, got {hooks!r}")


_NO_HOOKS = CheckpointHooks()  # a run that registered none: built once, not at every save


def _hooks(state: RunState) -> CheckpointHooks:
    found: CheckpointHooks | None = state.kwargs_handlers.get("CheckpointHooks")
    return found if found is not None else _NO_HOOKS


def _with(state: RunState, kind: str, hook: StateDictHook) -> RunState:
    if not callable(hook):
        raise TypeError(
            f"register_{kind}_hook takes a callable hook(model, state_dict), got {type(hook).__name__}"
        )
    current = _hooks(state)
    updated = CheckpointHooks(
        **{
            "save_state_pre": current.save_state_pre,
            "load_state_pre": current.load_state_pre,
            kind: (*getattr(current, kind), hook),
        }
    )
    return state.replace(kwargs_handlers={**state.kwargs_handlers, "CheckpointHooks": updated})


def register_save_state_pre_hook(state: RunState, hook: StateDictHook) -> RunState:
    """Returns ``state`` with ``hook`` run on the model's state dict before `fa.save` writes it; consumes nothing.

    Args:
        state: the run's `RunState`.
        hook: ``hook(model, state_dict)``; returns the dict to write, or None
            after editing ``state_dict`` in place. Runs on the ranks that
            write the weights (the main process).

    Raises:
        TypeError: ``hook`` is not callable.

    >>> import torch, fnaccel as fa
    >>> from fnaccel.checkpoint.storage.parts import register_save_state_pre_hook, saved_weights
    >>> model = torch.nn.Linear(1, 1)
    >>> half = lambda model, sd: {k: v.half() for k, v in sd.items()}
    >>> state = register_save_state_pre_hook(fa.init(cpu=True), half)
    >>> saved_weights(state, model)["weight"].dtype
    torch.float16
    """
    return _with(state, "save_state_pre", hook)


def register_load_state_pre_hook(state: RunState, hook: StateDictHook) -> RunState:
    """Returns ``state`` with ``hook`` run on the weights `fa.load` read before they reach the model; consumes nothing.

    Args:
        state: the run's `RunState`.
        hook: ``hook(model, state_dict)``; returns the dict to load, or None
            after editing ``state_dict`` in place. Runs on every rank that loads.

    Raises:
        TypeError: ``hook`` is not callable.

    >>> import torch, fnaccel as fa
    >>> from fnaccel.checkpoint.storage.parts import register_load_state_pre_hook, loaded_weights
    >>> model = torch.nn.Linear(1, 1)
    >>> to_float = lambda model, sd: {k: v.float() for k, v in sd.items()}
    >>> state = register_load_state_pre_hook(fa.init(cpu=True), to_float)
    >>> loaded_weights(state, model, {"weight": torch.ones(1, 1).half()})["weight"].dtype
    torch.float32
    """
    return _with(state, "load_state_pre", hook)


def _run(
    hooks: tuple[StateDictHook, ...], model: torch.nn.Module, weights: Mapping[str, torch.Tensor], kind: str
) -> dict[str, torch.Tensor]:
    current = dict(weights)
    for hook in hooks:
        returned = hook(model, current)
        if returned is not None:
            if not isinstance(returned, Mapping):
                raise TypeError(
                    f"a {kind} hook ({getattr(hook, '__name__', hook)!r}) returned "
                    f"{type(returned).__name__}; return a dict of tensors, or None after editing it in place"
                )
            current = dict(returned)
    return current


def saved_weights(state: RunState, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as the run's save hooks transform it (what `fa.save` writes)."""
    return _run(_hooks(state).save_state_pre, model, model.state_dict(), "save_state_pre")


def loaded_weights(
    state: RunState, model: torch.nn.Module, weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``weights`` read from a checkpoint as the run's load hooks transform them (what the model gets)."""
    return _run(_hooks(state).load_state_pre, model, weights, "load_state_pre")


def check_unsharded(state: RunState) -> None:
    """Raise if the run has state-dict hooks but its weights are sharded (they would not run)."""
    hooks = _hooks(state)
    if hooks.save_state_pre or hooks.load_state_pre:
        raise ValueError(
            "this run has save/load state pre-hooks, but an fsdp() run's weights are saved "
            "sharded through torch.distributed.checkpoint and never pass through them; "
            "drop the hooks (use the state from before register_*_state_pre_hook)"
        )


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


def scheduler_payload(scheduler: Stateful) -> dict[str, object]:
    """``scheduler.json``: the scheduler's class and its ``state_dict``."""
    return {"kind": kind_of(scheduler), "state_dict": scheduler.state_dict()}


def check_kind(saved: object, live: object, source: str) -> None:
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
        if type(value) is int and not -(2**63) <= value < 2**63:  # JSON's integers (a bool is not one)
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
    saved: object, current: list[dict[str, Any]], source: str, optimizer: torch.optim.Optimizer
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
    saved: object,
    source: str,
) -> dict[str, Any]:
    """The state_dict to give ``optimizer``, built from `optimizer_payload`'s output and checked
    (class, groups, every state entry) before anything is restored. ``params``: name to parameter."""
    by_id = {id(p): n for n, p in params.items()}
    check_like(saved, optimizer_payload(optimizer, by_id)[1], source, depth=1)  # what this run would save
    assert isinstance(saved, dict), "check_like held it to the live part, an object"
    check_kind(saved, optimizer, source)
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
    scalars = saved["scalars"]  # an object: held to the live part's above
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


def rank_payload(state: RunState) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """This rank's own part (``rank<r>.safetensors``, ``rank<r>.json``): its generators, its
    transforms' states and the data position; what a load checks ``rank<r>.json`` against."""
    tensors, rng = rng_payload(state.rng)
    transforms = {
        name: value.state_dict()
        for name, value in state.transform_states.items()
        if callable(getattr(value, "state_dict", None))
    }
    return tensors, {"rng": rng, "transforms": transforms, "data": data_payload(state)}


def data_payload(state: RunState) -> dict[str, Any]:
    """The data position past the epoch (the manifest has the epoch), and the layout
    of the loader it belongs to (None without a loader)."""
    position = state.data_position
    return {
        "num_batches": position.num_batches,
        "loader_state": None if position.loader_state is None else dict(position.loader_state),
        "layout": None if state.loader is None else state.loader.layout.to_dict(),
    }


def _uint32s(words: list[int]) -> bool:
    """Integers ``words`` (already checked to be ints) all fit a generator's 32-bit words."""
    return not words or (min(words) >= 0 and max(words) < 2**32)


def _finite(value: object) -> bool:
    """A generator's cached Gaussian as saved: a finite float (never an int, NaN or infinity)."""
    return isinstance(value, float) and math.isfinite(value)


def rng_from(tensors: Mapping[str, torch.Tensor], saved: object, live: RNGState, source: str) -> RNGState:
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


def read_model(
    state: RunState, module: torch.nn.Module, directory: Path, manifest: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """``model.safetensors`` re-tied and passed through the run's load hooks, checked
    against ``module``'s keys, shapes and dtypes (its global ones when sharded)."""
    source = str(directory / "model.safetensors")
    weights = read_tensors(directory, "model.safetensors", manifest)
    for alias, name in manifest["tied"].items():
        if name not in weights or alias in weights:
            raise CheckpointError(
                f"{directory / 'fnaccel.json'}: key 'tied/{alias}' names {name!r}, "
                f"which is not a stored weight of {source} (or {alias!r} is stored too)"
            )
    weights = loaded_weights(state, module, retie(weights, manifest["tied"]))
    check_tensors(weights, module.state_dict(), source)
    return weights


def read_optimizer(
    state: RunState, module: torch.nn.Module, directory: Path, manifest: dict[str, Any]
) -> dict[str, Any] | None:
    """``optimizer.*`` as the state_dict ``state.optimizer`` takes (parameters by index),
    checked against it; None for a run without an optimizer."""
    if state.optimizer is None:
        return None
    return optimizer_state(
        state.optimizer,
        dict(module.named_parameters()),
        read_tensors(directory, "optimizer.safetensors", manifest),
        read_json(directory, "optimizer.json", manifest),
        str(directory / "optimizer.json"),
    )


def source_rank(manifest: Mapping[str, Any], ctx: DistContext) -> int:
    """Whose ``rank<r>.*`` files this process reads: its own rank's when the saving
    run had it, rank 0's otherwise.

    >>> source_rank({"num_processes": 2}, DistContext(num_processes=4, rank=3))
    0
    >>> source_rank({"num_processes": 2}, DistContext(num_processes=4, rank=1))
    1
    """
    return ctx.rank if ctx.rank < manifest["num_processes"] else 0


def derived_generators(saved: RNGState, rank: int) -> RNGState:
    """Generators for a rank the saving run did not have: every generator seeded
    from a hash of ``saved`` (rank 0's torch generator state) and ``rank``, so the new
    ranks draw different streams from each other and from rank 0, and the same ones
    on every load of the checkpoint.

    >>> a, b = derived_generators(RNGState.seeded(0), 2), derived_generators(RNGState.seeded(0), 3)
    >>> bool(torch.equal(a.torch, derived_generators(RNGState.seeded(0), 2).torch)), bool(torch.equal(a.torch, b.torch))
    (True, False)
    """
    digest = hashlib.sha256(saved.torch.numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    return RNGState.seeded(int.from_bytes(digest[:8], "little") >> 1)


def refuse_moved_gradients(
    grads: Mapping[str, torch.Tensor], manifest: Mapping[str, Any], ctx: DistContext, source: str
) -> None:
    """Refuse gradients accumulated between micro-steps on another number of processes."""
    saved = manifest["num_processes"]
    if grads and saved != ctx.num_processes:
        raise CheckpointError(
            f"{source}: the checkpoint was saved between accumulation micro-steps by {saved} process(es); "
            f"each holds gradients summed over its own samples, which cannot be split over "
            f"{ctx.num_processes}. Resume it on {saved} process(es), or save after an optimizer step "
            "(when state.micro_step is a multiple of the accumulation steps) to change the number"
        )
