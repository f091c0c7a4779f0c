"""Each public module's __all__ is exactly what docs/api.md documents (after httpx)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

import fnaccel
import fnaccel.ops
import fnaccel.testing

_API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _documented(module_name: str) -> set[str]:
    text = _API.read_text()
    section = re.search(rf"^## `{re.escape(module_name)}`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section is not None, f"docs/api.md has no section for {module_name}"
    return set(re.findall(r"^- `(\w+)`", section.group(1), re.M))


@pytest.mark.parametrize("module", [fnaccel, fnaccel.ops, fnaccel.testing], ids=lambda m: m.__name__)
def test_all_is_exactly_the_documented_surface(module: ModuleType) -> None:
    exported = set(module.__all__)
    documented = _documented(module.__name__)
    assert exported == documented, (
        f"exported but not documented: {sorted(exported - documented)}; "
        f"documented but not exported: {sorted(documented - exported)}"
    )
    assert len(module.__all__) == len(exported), "duplicates in __all__"
    for name in module.__all__:
        assert hasattr(module, name), name


def test_utils_exports_exist_and_are_unique() -> None:
    assert len(fnaccel.utils.__all__) == len(set(fnaccel.utils.__all__))
    for name in fnaccel.utils.__all__:
        assert hasattr(fnaccel.utils, name), name


def test_import_fnaccel_leaves_the_heavy_layers_for_first_use() -> None:
    """`import fnaccel` stays close to `import torch` (docs/benchmarks.md): these load when used."""
    import subprocess
    import sys

    code = (
        "import sys, fnaccel, fnaccel.utils\n"
        "heavy = ('fnaccel.checkpoint.run', 'fnaccel.checkpoint.writer', 'fnaccel.checkpoint.weights', "
        "'fnaccel.tracking', 'fnaccel.plugins', 'fnaccel.engines', 'fnaccel.modeling', "
        "'fnaccel.commands', 'yaml')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
        "fnaccel.save, fnaccel.log, fnaccel.utils.infer_auto_device_map, fnaccel.utils.DeepSpeedPlugin\n"
        "print('__version__' in dir(fnaccel), 'save' in dir(fnaccel))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "True True"]


@pytest.mark.parametrize("facade", [fnaccel, fnaccel.utils], ids=lambda m: m.__name__)
def test_no_lazy_name_resolves_through_a_package_holding_a_submodule_of_that_name(facade: ModuleType) -> None:
    """A package's attribute ``x`` becomes its submodule ``x`` whenever that submodule is
    (re)imported: ``fa.profile`` then was a module ("'module' object is not callable", as
    `pytest --doctest-modules fnaccel/transforms/profile.py` showed). Each name is read
    from the module defining it instead."""
    import importlib.util

    shadowable = []
    for name, source in facade._LAZY.items():
        if source != f"{facade.__name__}.{name}" and importlib.util.find_spec(source).submodule_search_locations:
            if importlib.util.find_spec(f"{source}.{name}") is not None:
                shadowable.append(f"{name} -> {source}")
    assert not shadowable
    for name in facade._LAZY:
        assert not isinstance(getattr(facade, name), ModuleType) or name in facade._LAZY[name].split(".")


def test_only_the_documented_modules_are_modules() -> None:
    """docs/api.md lists `ops` and `utils` under "Modules:"; every other public name is the
    function or class it documents. `fa.autocast_context` was the module
    `fnaccel.autocast_context` (the lazy table took a name equal to its module's for a
    submodule), so `with fa.autocast_context(state):` raised "'module' object is not callable"."""
    modules = set(re.findall(r"^- `(\w+)`", _API.read_text().split("\nModules:\n")[1].split("\n## ")[0], re.M))
    assert modules == {"ops", "utils"}
    assert sorted(n for n in fnaccel.__all__ if isinstance(getattr(fnaccel, n), ModuleType)) == sorted(modules)
    assert callable(fnaccel.autocast_context)
