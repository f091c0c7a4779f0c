"""The value checks every record runs when built: one sentence naming the field, what it must be, the fix.

Kwargs handlers, plugins, configs and loaders call these rather than writing their
own ``isinstance`` tests, so that every bad value reads the same way.

>>> check_value("interval", 0, is_int(0) and 0 >= 1, "an int >= 1", "try 1")
Traceback (most recent call last):
ValueError: interval must be an int >= 1, got 0: try 1
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["require", "check_value", "check_choice", "is_int", "is_number"]


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


def is_int(value: object) -> bool:
    """Whether ``value`` is an int and not a bool.

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or a float and not a bool.

    >>> is_number(0.5), is_number(2), is_number(False)
    (True, True, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)
