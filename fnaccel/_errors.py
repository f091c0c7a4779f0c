"""The exceptions fnaccel raises for a user's mistake; all share `FnaccelError`."""

from __future__ import annotations

__all__ = [
    "FnaccelError",
    "StaleStateError",
    "ConfigError",
    "CollectiveMismatchError",
    "CheckpointError",
]


class FnaccelError(Exception):
    """Base class of every error fnaccel raises on purpose."""


class StaleStateError(FnaccelError):
    """A `RunState` that an earlier call already advanced was used again."""


class ConfigError(FnaccelError, ValueError):
    """A launch configuration (YAML file, environment or argument) is invalid."""


class CollectiveMismatchError(FnaccelError):
    """Ranks entered a collective with different shapes, dtypes or structures."""


class CheckpointError(FnaccelError):
    """A checkpoint is missing, corrupt, truncated or does not fit the run."""
