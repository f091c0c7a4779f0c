"""Pre-save and pre-load hooks: a user's transform of the model's state dict at `fa.save` / `fa.load`.

Accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
register callables on the `Accelerator`. Here they are values of the run: a
`CheckpointHooks` record among the state's kwargs handlers, extended by the
two ``register_*`` functions (each returns a new state; the old one keeps its
hooks, so "removing" a hook is using the state from before it).

A save hook sees the (unwrapped) model and the state dict about to be written
to ``model.safetensors`` and returns the dict to write (or edits it in place
and returns None): renaming keys to another library's layout, casting,
dropping frozen weights is not possible (a load checks every key), but
storing them transformed is. A load hook sees the model and the dict read from
the file and returns what `load_state_dict` gets: the inverse transform.
An `fsdp()` run's sharded weights go through `torch.distributed.checkpoint`,
not through these hooks: `fa.save` refuses such a run that has hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fnaccel.kwargs.mixin import KwargsHandler

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "CheckpointHooks",
    "StateDictHook",
    "check_unsharded",
    "loaded_weights",
    "register_load_state_pre_hook",
    "register_save_state_pre_hook",
    "saved_weights",
]

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


def _hooks(state: RunState) -> CheckpointHooks:
    found = state.kwargs_handlers.get("CheckpointHooks")
    return found if found is not None else CheckpointHooks()


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
    >>> from fnaccel.checkpoint.storage.weight_hooks import register_save_state_pre_hook, saved_weights
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
    >>> from fnaccel.checkpoint.storage.weight_hooks import register_load_state_pre_hook, loaded_weights
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
