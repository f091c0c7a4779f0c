"""Checking what a checkpoint holds against what the run expects, before anything is restored.

A load reads every file, checks it here against the live objects (the
model's tensors, the optimizer's, a scheduler's or a transform's own
``state_dict()``), and only then restores anything: an edited or hostile
checkpoint fails with a `CheckpointError` naming the file and the key while
the state is still fresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fnaccel._errors import CheckpointError

__all__ = ["check_layout", "check_like", "check_tensors", "kind_of"]


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


def _kind(value: Any) -> str:
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


def check_like(saved: Any, live: Any, where: str, *, strict: bool = True) -> None:
    """``saved`` has the structure of ``live`` (what the live object's ``state_dict()`` gives).

    Tensors: same shape and dtype. Objects: the same keys (``strict``; else
    the keys both have are compared). Lists: the same length (``strict``; else
    the items both have). Numbers: an integer where the live value is one (a
    float may be saved as an integer); booleans, strings and nulls as live.
    ``where`` names the file and the key path.

    >>> check_like({"last_epoch": 3}, {"last_epoch": 0}, "scheduler.json")
    >>> check_like({"last_epoch": "abc"}, {"last_epoch": 0}, "scheduler.json")
    Traceback (most recent call last):
    fnaccel._errors.CheckpointError: scheduler.json: key 'last_epoch' must be an integer, not a string ('abc')
    """
    _like(saved, live, where, "", strict)


def _like(saved: Any, live: Any, file: str, key: str, strict: bool) -> None:
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
            _like(
                saved[saved_keys[name]], live[live_keys[name]], file, f"{key}/{name}" if key else name, strict
            )
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            raise fail(f"must be a list, not {_kind(saved)}")
        if strict and len(saved) != len(live):
            raise fail(f"holds {len(saved)} items in the checkpoint but {len(live)} in this run")
        if all(type(x) is int for x in live) and all(type(x) is int for x in saved):
            return  # integers where integers are (a generator's 625 words): no call per item
        for i, (item, now) in enumerate(zip(saved, live, strict=False)):
            _like(item, now, file, f"{key}/{i}" if key else str(i), strict)
        return
    if live is None:
        return  # unset in a fresh object: nothing says what it must hold later
    expected = _kind(live)
    actual = _kind(saved)
    if isinstance(live, float) and actual == "an integer":
        return
    if expected in ("a boolean", "an integer", "a number", "a string") and actual != expected:
        raise fail(f"must be {expected}, not {actual} ({saved!r})"[:300])
