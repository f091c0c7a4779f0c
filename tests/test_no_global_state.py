"""No module of fnaccel keeps mutable state at module level (principle 1)."""

from __future__ import annotations

import importlib
import pkgutil

import fnaccel

_MUTABLE = (list, dict, set, bytearray)


def _modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(fnaccel.__path__, "fnaccel.")]


def test_no_module_level_mutable_containers() -> None:
    offenders = []
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr == "__all__" or attr.startswith("__"):
                continue
            if isinstance(value, _MUTABLE):
                offenders.append(f"{name}.{attr} ({type(value).__name__})")
    assert not offenders, (
        f"module-level mutable state: {offenders}; use tuples, frozensets or MappingProxyType"
    )


def test_the_walk_sees_the_whole_package() -> None:
    names = _modules()
    assert "fnaccel.ops.collectives" in names and "fnaccel.runtime" in names
