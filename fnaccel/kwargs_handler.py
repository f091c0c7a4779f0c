"""The `KwargsHandler` mixin, and the field checks every kwargs handler runs when built.

The handlers themselves are in `fnaccel.kwargs` (and `fnaccel.profile_kwargs`);
the checks raise `ValueError` with a sentence naming the field, what it must
be and, where one helps, the fix.

>>> check_value("interval", 0, is_int(0) and 0 >= 1, "an int >= 1", "try 1")
Traceback (most recent call last):
ValueError: interval must be an int >= 1, got 0: try 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, ClassVar, cast

__all__ = ["KwargsHandler", "require", "check_value", "check_choice", "is_int", "is_number"]


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


class KwargsHandler:
    """Mixin for dataclasses: `to_kwargs()` returns the fields changed from their defaults.

    Not a dataclass itself, so that any dataclass can inherit it, frozen or
    not, as Accelerate documents for its own ``KwargsHandler``; fnaccel's
    handlers are frozen, slotted, keyword-only dataclasses. Bool fields are
    checked when built.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class MyKwargs(KwargsHandler):
    ...     something: int = 1
    ...     enabled: bool = True
    >>> MyKwargs(something=3).to_kwargs()
    {'something': 3}
    """

    __slots__ = ()
    # Fields that configure fnaccel itself rather than the torch call `to_kwargs` feeds.
    _not_kwargs: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(cast(Any, self)):
            # Annotations are strings under `from __future__ import annotations`, types otherwise.
            if f.type in ("bool", "bool | None", bool, bool | None):
                value, optional = getattr(self, f.name), f.type not in ("bool", bool)
                check_value(f.name, value, isinstance(value, bool) or (optional and value is None),
                       "True or False" + (" or None" if optional else ""))
        self._validate()

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through __init__: the read-only mapping proxies cannot be pickled or deep-copied.
        fields = dataclasses.fields(cast(Any, self))
        return (_rebuild, (type(self), {f.name: _plain(getattr(self, f.name)) for f in fields}))

    def _validate(self) -> None:
        """Checks and normalises the non-bool fields; handlers override it."""

    def to_kwargs(self) -> dict[str, Any]:
        """Returns the fields whose value differs from the field's default, as a new dict."""
        if not dataclasses.is_dataclass(self):
            raise TypeError(f"{type(self).__name__} inherits KwargsHandler but is not a dataclass: decorate it "
                            "with @dataclasses.dataclass")
        changed: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if f.name not in self._not_kwargs and value != default:
                changed[f.name] = _plain(value)
        return changed


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, MappingProxyType) else value


def _rebuild(cls: type[KwargsHandler], fields: dict[str, Any]) -> KwargsHandler:
    return cls(**fields)
