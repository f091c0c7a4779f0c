"""`KwargsHandler`: the mixin every kwargs handler and configuration record inherits.

It gives `to_kwargs()` (the fields changed from their defaults) and checks the
bool fields when built; a handler's own fields are checked by its `_validate`,
with the value checks of `fnaccel.checks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, cast

from fnaccel.checks import check_value

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["KwargsHandler"]


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
        for f in dataclasses.fields(cast("DataclassInstance", self)):
            # Annotations are strings under `from __future__ import annotations`, types otherwise.
            if f.type in ("bool", "bool | None", bool, bool | None):
                value, optional = getattr(self, f.name), f.type not in ("bool", bool)
                check_value(
                    f.name,
                    value,
                    isinstance(value, bool) or (optional and value is None),
                    "True or False" + (" or None" if optional else ""),
                )
        self._validate()

    def __reduce__(
        self,
    ) -> tuple[Callable[..., KwargsHandler], tuple[type[KwargsHandler], dict[str, object]]]:
        # Rebuild through __init__: the read-only mapping proxies cannot be pickled or deep-copied.
        fields = dataclasses.fields(cast("DataclassInstance", self))
        return (_rebuild, (type(self), {f.name: _plain(getattr(self, f.name)) for f in fields}))

    def _validate(self) -> None:
        """Checks and normalises the non-bool fields; handlers override it."""

    def to_kwargs(self) -> dict[str, Any]:
        """Returns the fields whose value differs from the field's default, as a new dict."""
        if not dataclasses.is_dataclass(self):
            raise TypeError(
                f"{type(self).__name__} inherits KwargsHandler but is not a dataclass: decorate it "
                "with @dataclasses.dataclass"
            )
        changed: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if f.name not in self._not_kwargs and value != default:
                changed[f.name] = _plain(value)
        return changed


def _plain(value: object) -> object:
    return dict(value) if isinstance(value, MappingProxyType) else value


def _rebuild(cls: type[KwargsHandler], fields: dict[str, object]) -> KwargsHandler:
    return cls(**fields)
