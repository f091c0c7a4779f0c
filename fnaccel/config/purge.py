"""A decorator for tests: the ``FNACCEL_*`` variables a test sets do not outlive it.

`purge_fnaccel_environment`, also under Accelerate's name
`purge_accelerate_environment` (which purges ``ACCELERATE_*`` there).
"""

from __future__ import annotations

import functools
import os
import unittest
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

__all__ = ["purge_accelerate_environment", "purge_fnaccel_environment"]

_PURGED_PREFIX = "FNACCEL_"
_Decorated = TypeVar("_Decorated", bound=Callable[..., Any] | type)
P = ParamSpec("P")
R = TypeVar("R")


def _restore_fnaccel_variables(before: Mapping[str, str]) -> None:
    for key in [k for k in os.environ if k.startswith(_PURGED_PREFIX) and k not in before]:
        del os.environ[key]
    os.environ.update(before)


def _purging(function: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(function)
    def purged(*args: P.args, **kwargs: P.kwargs) -> R:
        before = {k: v for k, v in os.environ.items() if k.startswith(_PURGED_PREFIX)}
        try:
            return function(*args, **kwargs)
        finally:
            _restore_fnaccel_variables(before)

    return purged


def purge_fnaccel_environment(function_or_class: _Decorated) -> _Decorated:
    """Decorate a test (function or class) so that the ``FNACCEL_*`` variables it sets do not outlive it.

    After each call (each ``test*`` method of a class; for a
    ``unittest.TestCase``, from ``setUp`` through ``tearDown``), every
    ``FNACCEL_*`` variable is back to what it was before: new ones removed,
    changed or removed ones restored. Other variables are left alone.
    `purge_accelerate_environment` is the same decorator under Accelerate's name.

    Raises:
        TypeError: the decorated object is neither a function nor a class.

    >>> @purge_fnaccel_environment
    ... def test_something():
    ...     os.environ["FNACCEL_DOC_PURGED"] = "1"
    >>> test_something()
    >>> "FNACCEL_DOC_PURGED" in os.environ
    False
    """
    if not isinstance(function_or_class, type):
        if not callable(function_or_class):
            raise TypeError(
                f"purge_fnaccel_environment decorates a test function or class, got "
                f"{type(function_or_class).__name__}"
            )
        return _purging(function_or_class)  # type: ignore[return-value]
    cls = function_or_class
    if issubclass(cls, unittest.TestCase):
        set_up = cls.setUp

        @functools.wraps(set_up)
        def purged_set_up(self: unittest.TestCase) -> None:
            self.addCleanup(
                _restore_fnaccel_variables,
                {k: v for k, v in os.environ.items() if k.startswith(_PURGED_PREFIX)},
            )
            set_up(self)

        cls.setUp = purged_set_up  # type: ignore[method-assign]
        return function_or_class
    for name, method in list(vars(cls).items()):
        if name.startswith("test") and callable(method):
            setattr(cls, name, _purging(method))
    return function_or_class


purge_accelerate_environment = purge_fnaccel_environment
