"""The value checks every record runs when built: one sentence naming the field, what it must be, the fix.

Kwargs handlers, plugins, configs and loaders call these rather than writing their
own ``isinstance`` tests, so that every bad value reads the same way: a bool is
never taken for a number. The first set raises `ValueError` (a record built in
code); the ``config_*`` and ``require_*`` set raises `ConfigError` (a plugin, or
a value read from a launch config file).

>>> check_value("interval", 0, is_int(0) and 0 >= 1, "an int >= 1", "try 1")
Traceback (most recent call last):
ValueError: interval must be an int >= 1, got 0: try 1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeGuard, overload

from fnaccel._errors import ConfigError

__all__ = [
    "require",
    "check_value",
    "check_choice",
    "is_int",
    "is_number",
    "str_to_bool",
    "config_bool",
    "config_int",
    "config_str",
    "config_names",
    "config_choice",
    "require_bools",
    "require_count",
    "require_number",
]


def require(condition: bool, message: str) -> None:
    """Raises `ValueError(message)` unless ``condition`` holds.

    >>> require(True, "never raised")
    """
    if not condition:
        raise ValueError(message)


def check_value(name: str, value: object, ok: bool, expected: str, fix: str = "") -> None:
    """Raises `ValueError` unless ``ok``: "<name> must be <expected>, got <value>: <fix>".

    Args:
        name: The field's name.
        value: The value the user gave.
        ok: Whether the value is acceptable.
        expected: What the field must be, as a phrase ("an int >= 1").
        fix: What to do instead; left out of the message when empty.

    >>> check_value("margin", 2, is_int(2), "an int")
    """
    require(ok, f"{name} must be {expected}, got {value!r}" + (f": {fix}" if fix else ""))


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raises `ValueError` naming the ``choices`` unless ``value`` is one of them.

    >>> check_choice("fp8 opt_level", "O3", ("O1", "O2"))
    Traceback (most recent call last):
    ValueError: unknown fp8 opt_level 'O3': use one of O1, O2
    """
    require(value in choices, f"unknown {name} {value!r}: use one of {', '.join(choices)}")


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool.

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float and not a bool.

    >>> is_number(0.5), is_number(2), is_number(False)
    (True, True, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TRUE = ("1", "y", "yes", "t", "true", "on")
_FALSE = ("0", "n", "no", "f", "false", "off")


@overload
def str_to_bool(value: str, to_bool: Literal[False] = False) -> int: ...
@overload
def str_to_bool(value: str, to_bool: Literal[True]) -> bool: ...
def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Reads a yes/no string: 1/0 (or True/False with `to_bool`), as Accelerate does.

    True values are "1", "y", "yes", "t", "true", "on"; false values "0", "n",
    "no", "f", "false", "off"; case and surrounding spaces are ignored.

    Raises:
        ValueError: `value` is neither.

    >>> str_to_bool("Yes"), str_to_bool("off", to_bool=True)
    (1, False)
    """
    text = value.strip().lower()
    if text in _TRUE:
        return True if to_bool else 1
    if text in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"{value!r} is not a yes/no value: use one of {', '.join(_TRUE + _FALSE)}")


# --- config files and plugins: the same checks, raising ConfigError ---------------------------------
# A launch config's values arrive as YAML scalars or as the text `fnaccel launch` carries in the
# environment, so the readers below also accept "true" / "3"; ``what`` names where the value came
# from ("fsdp_config: key 'fsdp_version'", "DeepSpeedPlugin: zero3_init_flag").


def config_bool(value: object, what: str, *, optional: bool = False) -> bool | None:
    """A yes/no value: a bool, or a yes/no string (`str_to_bool`'s); None too if ``optional``.

    >>> config_bool("off", "fsdp_config: key 'fsdp_cpu_offload'")
    False
    >>> config_bool("maybe", "fsdp_config: key 'fsdp_cpu_offload'")
    Traceback (most recent call last):
    ...
    fnaccel._errors.ConfigError: fsdp_config: key 'fsdp_cpu_offload' must be true or false, got 'maybe'
    """
    if isinstance(value, bool) or (optional and value is None):
        return value
    if isinstance(value, str) or optional:
        try:
            return str_to_bool(str(value), to_bool=True)
        except ValueError:
            pass
    raise ConfigError(f"{what} must be true or false, got {value!r}")


def config_int(value: object, what: str) -> int:
    """An integer: an int (not a bool) or its decimal text."""
    if is_int(value):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{what} must be an integer, got {value!r}")


def config_str(value: object, what: str) -> str:
    """A string."""
    if isinstance(value, str):
        return value
    raise ConfigError(f"{what} must be a string, got {value!r}")


def config_names(value: object, what: str) -> tuple[str, ...]:
    """Class names: a list of strings, or one comma-separated string."""
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{what} must be class names (a list or a comma-separated string), got {value!r}")


def config_choice(value: object, what: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``, given in any case; returned upper-cased."""
    text = config_str(value, what).upper()
    if text not in choices:
        raise ConfigError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return text


def require_bools(record: object, optional: tuple[str, ...], required: tuple[str, ...]) -> None:
    """A record's yes/no fields hold real bools (None allowed for ``optional``): a
    string such as "false" would otherwise read as true."""
    for name in (*optional, *required):
        value = getattr(record, name)
        if not isinstance(value, bool) and not (value is None and name in optional):
            allowed = "True, False or None" if name in optional else "True or False"
            raise ConfigError(f"{type(record).__name__}: key '{name}': must be {allowed}, got {value!r}")


def require_count(owner: str, name: str, value: object, least: int = 1) -> None:
    """``value`` is None or an int (not a bool) of at least ``least`` (1 or 0).

    >>> require_count("Plugin", "steps", 0)
    Traceback (most recent call last):
    ...
    fnaccel._errors.ConfigError: Plugin: steps must be a positive int, got 0
    """
    if value is not None and (not is_int(value) or value < least):
        raise ConfigError(
            f"{owner}: {name} must be {'a positive' if least else 'a non-negative'} int, got {value!r}"
        )


def require_number(owner: str, name: str, value: object) -> None:
    """``value`` is None or a non-negative int or float (not a bool)."""
    if value is not None and (not is_number(value) or value < 0):
        raise ConfigError(f"{owner}: {name} must be a non-negative number, got {value!r}")
