"""The exceptions fnaccel raises for a user's mistake; all share `FnaccelError`."""

from __future__ import annotations

__all__ = [
    "FnaccelError",
    "StaleStateError",
    "ConfigError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollectiveCallError",
    "DistributedOperationException",
    "CheckpointError",
]


class FnaccelError(Exception):
    """Base class of every error fnaccel raises on purpose."""


class StaleStateError(FnaccelError):
    """A `RunState` that an earlier call already advanced was used again."""


class ConfigError(FnaccelError, ValueError):
    """A launch configuration (YAML file, environment or argument) is invalid."""


class DistributedOperationException(Exception):
    """Accelerate's name for a collective that cannot run with the tensors the ranks gave it.

    fnaccel raises its subclass `CollectiveMismatchError`, so an ``except
    DistributedOperationException`` written for Accelerate catches fnaccel's.
    """


class CollectiveMismatchError(FnaccelError, DistributedOperationException):
    """Ranks entered a collective with different shapes, dtypes or structures.

    Also Accelerate's `DistributedOperationException` (``fnaccel.utils``).
    """


class CollectiveTimeoutError(FnaccelError, RuntimeError):
    """A collective waited past the process group's timeout for a rank that never joined it.

    Also a ``RuntimeError``, which torch raises for the same event.
    """


class CollectiveCallError(CollectiveMismatchError, RuntimeError):
    """Ranks are in different collective fnaccel calls (one in ``fa.save``, another in
    ``fa.step``): every rank raises it, naming what each was doing and the fix.

    Also a ``RuntimeError``, as torch's own error for a broken collective, which it replaces.
    """


class CheckpointError(FnaccelError, ValueError, RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not fit the run.

    Also a ``ValueError`` and a ``RuntimeError``: Accelerate's
    ``load_checkpoint_in_model`` raises one or the other for the same mistakes
    (``ValueError`` for a bad path, index or shape under a device map,
    ``torch``'s ``RuntimeError`` from ``load_state_dict(strict=True)``), so
    ``except`` clauses written for it catch fnaccel's too.
    """
