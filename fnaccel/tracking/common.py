"""What the service trackers share: importing their package with a clear error, flattening values."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from numbers import Real
from types import MappingProxyType, ModuleType

__all__ = ["PACKAGES", "flatten", "is_installed", "numbers_and_text", "require"]

# tracker name -> (the module to import, the pip package); the extra is the name without "_"
PACKAGES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "wandb": ("wandb", "wandb"),
        "mlflow": ("mlflow", "mlflow-skinny"),
        "comet_ml": ("comet_ml", "comet_ml"),
        "aim": ("aim", "aim"),
        "clearml": ("clearml", "clearml"),
        "dvclive": ("dvclive", "dvclive"),
        "swanlab": ("swanlab", "swanlab"),
        "trackio": ("trackio", "trackio"),
    }
)


def require(name: str) -> ModuleType:
    """The tracker's package, imported; an ImportError naming the pip package and the extra if absent."""
    module, package = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"log_with names {name!r} but its package is not installed ({exc}): "
            f"pip install {package} (or fnaccel[{name.replace('_', '')}])"
        ) from None


def is_installed(name: str) -> bool:
    """Whether the tracker's package can be found, without importing it."""
    module = PACKAGES[name][0]
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def flatten(values: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """Nested dicts as ``"a/b"`` keys (for trackers whose metrics are a flat namespace)."""
    flat: dict[str, object] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def numbers_and_text(values: Mapping[str, object]) -> tuple[dict[str, float], dict[str, str]]:
    """Flattened ``values`` split into numbers (bools as 0/1) and strings."""
    numbers: dict[str, float] = {}
    text: dict[str, str] = {}
    for key, value in flatten(values).items():
        if isinstance(value, str):
            text[key] = value
        elif isinstance(value, Real):
            numbers[key] = float(value)
    return numbers, text
