"""`TorchDynamoPlugin`: the launch config's ``dynamo_config`` section, carried out by `fa.compile`.

``dynamo_config`` (or the ``--dynamo_*`` flags of `fnaccel launch`) holds
Accelerate's keys; regional compilation, which this build does not carry out,
is refused with a `ConfigError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fnaccel._errors import ConfigError
from fnaccel.checks import config_bool, config_choice, require_bools
from fnaccel.constants import DynamoBackend
from fnaccel.kwargs.mixin import KwargsHandler
from fnaccel.transforms.plugins.sections import refuse, section_record

if TYPE_CHECKING:
    from fnaccel.transforms.kinds import Transform

__all__ = ["TorchDynamoPlugin"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchDynamoPlugin(KwargsHandler):
    """Accelerate's TorchDynamo settings, carried out by `fa.compile`; a `KwargsHandler`
    whose `to_kwargs()` gives ``torch.compile``'s arguments, as Accelerate's does.

    >>> TorchDynamoPlugin.from_config({"dynamo_backend": "AOT_EAGER", "dynamo_use_fullgraph": True}).transform()
    compile(backend='aot_eager', fullgraph=True)
    >>> TorchDynamoPlugin(backend="INDUCTOR", mode="max-autotune").to_kwargs()
    {'backend': 'inductor', 'mode': 'max-autotune'}
    """

    backend: str = "NO"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: Mapping[str, object] | None = None
    disable: bool = False
    use_regional_compilation: bool = False

    @classmethod
    def from_config(cls, section: Mapping[str, Any], source: str = "dynamo_config") -> TorchDynamoPlugin:
        """Read a config file's ``dynamo_config`` mapping (Accelerate's ``dynamo_*`` keys).

        Raises:
            ConfigError: an unknown key, a wrongly typed value, an unknown
                backend or mode; the message names the key.
        """
        from fnaccel.transforms.compile import COMPILE_MODES

        values: dict[str, Any] = {}
        for key, raw in section.items():
            name, what = key.removeprefix("dynamo_"), f"{source}: key '{key}'"
            if name == "backend":
                values[name] = config_choice(raw, what, tuple(b.value for b in DynamoBackend))
            elif name == "mode":
                if raw not in COMPILE_MODES:
                    raise ConfigError(
                        f"{source}: key '{key}' must be one of "
                        f"{', '.join(str(m) for m in COMPILE_MODES[1:])}, got {raw!r}"
                    )
                values[name] = raw
            elif name in ("use_fullgraph", "use_dynamic", "use_regional_compilation"):
                field_name = {"use_fullgraph": "fullgraph", "use_dynamic": "dynamic"}.get(name, name)
                values[field_name] = None if raw is None and name == "use_dynamic" else config_bool(raw, what)
            else:
                raise ConfigError(
                    f"{source}: unknown key '{key}'; known keys are dynamo_backend, dynamo_mode, "
                    "dynamo_use_fullgraph, dynamo_use_dynamic, dynamo_use_regional_compilation"
                )
        return section_record(cls, values, source)

    def __post_init__(self) -> None:
        from fnaccel.transforms.compile import COMPILE_MODES

        source = type(self).__name__
        require_bools(self, ("dynamic",), ("fullgraph", "disable", "use_regional_compilation"))
        if self.mode not in COMPILE_MODES:
            raise refuse(
                "mode",
                source,
                f"must be one of {', '.join(str(m) for m in COMPILE_MODES[1:])}, got {self.mode!r}",
            )
        if str(self.backend).upper() not in tuple(b.value for b in DynamoBackend):
            raise refuse("dynamo_backend", source, f"unknown backend {self.backend!r}")
        if self.use_regional_compilation:
            raise refuse(
                "dynamo_use_regional_compilation",
                source,
                "true is not supported: regional compilation is not built; compile the whole model",
            )
        if self.options:
            raise refuse(
                "options",
                source,
                "backend options are not passed on by fa.compile; call torch.compile yourself for them",
            )

    def to_kwargs(self) -> dict[str, Any]:
        """The fields changed from their defaults, as ``torch.compile(model, **kwargs)``
        takes them: the backend in torch's lowercase spelling, left out when it is NO."""
        kwargs = KwargsHandler.to_kwargs(self)
        if "backend" in kwargs:
            backend = str(kwargs["backend"]).lower()
            if backend == "no":
                del kwargs["backend"]
            else:
                kwargs["backend"] = backend
        return kwargs

    def transform(self) -> Transform | None:
        """The `fa.compile` transform, or None when the backend is NO or ``disable`` is set."""
        from fnaccel.transforms.compile import compile

        if str(self.backend).upper() == "NO" or self.disable:
            return None
        return compile(
            backend=str(self.backend).lower(), mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic
        )
