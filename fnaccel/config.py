"""The launch configuration: the YAML file `fnaccel config` writes, validated.

One schema serves `fa.init` (which reads the file named by
``FNACCEL_CONFIG_FILE`` or the default location) and the command line. Every
key is checked against its type; an unknown key, a wrongly typed value or a
malformed file raises `ConfigError` naming the key and the file.

Accelerate's ``default_config.yaml`` uses the same top-level keys, so a user
can point ``FNACCEL_CONFIG_FILE`` at an existing Accelerate config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fnaccel._errors import ConfigError

__all__ = ["LaunchConfig", "default_config_file", "load_config"]

CONFIG_FILE_ENV = "FNACCEL_CONFIG_FILE"

_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def default_config_file() -> Path:
    """Where `fnaccel config` writes and `fa.init` looks when nothing says otherwise.

    ``$HF_HOME/fnaccel/default_config.yaml``, else
    ``$XDG_CACHE_HOME/huggingface/fnaccel/default_config.yaml``, else
    ``~/.cache/huggingface/fnaccel/default_config.yaml``.
    """
    if hf_home := os.environ.get("HF_HOME"):
        return Path(hf_home) / "fnaccel" / "default_config.yaml"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "huggingface" / "fnaccel" / "default_config.yaml"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """The validated contents of a launch config file.

    Field names are Accelerate's ``default_config.yaml`` keys. Nested sections
    (``fsdp_config``, ``dynamo_config``, ...) are kept as read-only mappings;
    the features that use them validate their own keys.
    """

    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: str = "NO"
    mixed_precision: str = "no"
    use_cpu: bool = False
    debug: bool = False
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "static"
    same_network: bool = True
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    gpu_ids: str = "all"
    downcast_bf16: str = "no"
    tpu_env: list[str] = field(default_factory=list)
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    megatron_lm_config: dict[str, Any] = field(default_factory=dict)
    dynamo_config: dict[str, Any] = field(default_factory=dict)
    fp8_config: dict[str, Any] = field(default_factory=dict)
    ipex_config: dict[str, Any] = field(default_factory=dict)
    mpirun_config: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that a YAML file would hold (``source`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}


# What YAML may hold for each key: bool is not an int here, and an int is a float.
_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType({
    f.name: (
        (bool,) if f.type == "bool"
        else (int,) if f.type == "int"
        else (int, type(None)) if f.type == "int | None"
        else (str, type(None)) if f.type == "str | None"
        else (str,) if f.type == "str"
        else (list,) if f.type.startswith("list")
        else (dict,)
    )
    for f in fields(LaunchConfig)
    if f.name != "source"
})


def _check_value(key: str, value: Any, source: str) -> Any:
    expected = _TYPES[key]
    if key == "gpu_ids" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if key == "mixed_precision" and value is None:
        value = "no"
    ok = isinstance(value, expected) and not (
        isinstance(value, bool) and bool not in expected
    )
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
        raise ConfigError(
            f"{source}: key '{key}' must be {names}, got {type(value).__name__} {value!r}"
        )
    if key == "mixed_precision" and value not in _PRECISIONS:
        raise ConfigError(
            f"{source}: key 'mixed_precision' must be one of {', '.join(_PRECISIONS)}, "
            f"got {value!r}"
        )
    if key in ("num_processes", "num_machines") and value < 1:
        raise ConfigError(f"{source}: key '{key}' must be at least 1, got {value}")
    if key == "machine_rank" and value < 0:
        raise ConfigError(f"{source}: key 'machine_rank' must be >= 0, got {value}")
    return value


def config_from_mapping(data: Mapping[str, Any], source: str = "<config>") -> LaunchConfig:
    """Validate a parsed config mapping into a `LaunchConfig`.

    Raises:
        ConfigError: an unknown key or a wrongly typed value; the message
            names the key and ``source``.
    """
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{unknown[0]}'; known keys are "
            f"{', '.join(sorted(_TYPES))}"
        )
    values = {key: _check_value(key, value, source) for key, value in data.items()}
    return LaunchConfig(**values, source=source)


def load_config(path: str | os.PathLike[str]) -> LaunchConfig:
    """Read and validate a YAML launch config file.

    Raises:
        ConfigError: the file is missing, is not YAML, is not a mapping, or
            holds an unknown key or a wrongly typed value.
    """
    import yaml  # here, not at import: most runs have no config file (14 ms of import time)

    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: malformed YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a config file must hold a mapping, got {type(data).__name__}")
    return config_from_mapping(data, source)


def resolve_config(config: str | os.PathLike[str] | LaunchConfig | None) -> LaunchConfig:
    """The config `fa.init` uses: the argument, else ``FNACCEL_CONFIG_FILE``, else the
    default file when it exists, else the defaults."""
    if isinstance(config, LaunchConfig):
        return config
    if config is not None:
        return load_config(config)
    if env_path := os.environ.get(CONFIG_FILE_ENV):
        return load_config(env_path)
    default = default_config_file()
    if default.is_file():
        return load_config(default)
    return LaunchConfig()
