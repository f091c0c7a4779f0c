"""Module attributes loaded on first use (PEP 562), for `fnaccel` and `fnaccel.utils`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    module: str, table: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` for the names in ``table``
    (name -> the module defining it, or the submodule itself when it is
    ``<module>.<name>``). A name loaded once becomes a plain attribute of
    ``namespace`` (the module's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module '{module}' has no attribute {name!r}")
        loaded = importlib.import_module(source)
        value = loaded if source == f"{module}.{name}" else getattr(loaded, name)  # a submodule
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace["__all__"]})

    return __getattr__, __dir__
