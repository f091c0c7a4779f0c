"""What the plugins share: a refusal naming the config key, and a record built from a config section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from fnaccel._errors import ConfigError

__all__ = ["refuse", "section_record"]

T = TypeVar("T")


def refuse(key: str, source: str, why: str) -> ConfigError:
    """The error for a key this build cannot honour: "<source>: key '<key>': <why>"."""
    return ConfigError(f"{source}: key '{key}': {why}")


def section_record(cls: type[T], values: Mapping[str, Any], source: str) -> T:
    """``cls(**values)``, its validation errors naming ``source`` (the config file's section)."""
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(cls.__name__, source, 1)) from None
