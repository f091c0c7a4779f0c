"""`LaunchConfig`: the keys of a launch config file, their types, and their checks.

`fnaccel.config` reads and writes the file and lays the launch environment
over it; this module says what a valid config holds. Field names are
Accelerate's ``default_config.yaml`` keys; an unknown key or a wrongly typed
value raises `ConfigError` naming the key and where it came from.

>>> config_from_mapping({"num_processes": 2, "mixed_precision": "bf16"}).num_processes
2
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from fnaccel._errors import ConfigError

__all__ = ["LaunchConfig", "KEY_TYPES", "PRECISIONS", "check_config_value", "config_from_mapping"]

PRECISIONS = ("no", "fp16", "bf16", "fp8")  # the values of the mixed_precision key


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
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_vm: list[str] = field(default_factory=list)
    tpu_env: list[str] = field(default_factory=list)
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] = field(default_factory=list)
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    megatron_lm_config: dict[str, Any] = field(default_factory=dict)
    dynamo_config: dict[str, Any] = field(default_factory=dict)
    fp8_config: dict[str, Any] = field(default_factory=dict)
    ipex_config: dict[str, Any] = field(default_factory=dict)
    mpirun_config: dict[str, Any] = field(default_factory=dict)
    parallelism_config: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that a YAML file would hold (``source`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}


# What YAML may hold for each key: bool is not an int here, and an int is a float.
KEY_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType({
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


def _choices() -> Mapping[str, tuple[str, ...]]:
    from fnaccel.constants import ComputeEnvironment, DistributedType

    return MappingProxyType({
        "compute_environment": tuple(e.value for e in ComputeEnvironment),
        "distributed_type": tuple(d.value for d in DistributedType),
        "rdzv_backend": ("static", "c10d", "etcd", "etcd-v2"),
    })


_CHOICES = _choices()


def check_config_value(key: str, value: Any, source: str) -> Any:
    """The value of the known config key ``key``, checked against its type, choices and range.

    An int ``gpu_ids`` becomes a string and a null ``mixed_precision`` "no",
    as Accelerate reads them.

    Args:
        key: A field of `LaunchConfig` other than ``source``.
        value: The value read for it.
        source: Where the value came from (a file, a variable), named in the error.

    Returns:
        The value, normalised.

    Raises:
        ConfigError: The value does not fit the key.

    >>> check_config_value("gpu_ids", 0, "config.yaml")
    '0'
    >>> check_config_value("main_process_port", 70000, "config.yaml")
    Traceback (most recent call last):
    fnaccel._errors.ConfigError: config.yaml: key 'main_process_port' must be from 1 to 65535, got 70000
    """
    expected = KEY_TYPES[key]
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
    if key == "mixed_precision" and value not in PRECISIONS:
        raise ConfigError(
            f"{source}: key 'mixed_precision' must be one of {', '.join(PRECISIONS)}, "
            f"got {value!r}"
        )
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ConfigError(
            f"{source}: key '{key}' must be one of {', '.join(_CHOICES[key])}, got {value!r}"
        )
    if key in _INT_RANGES:
        low, high = _INT_RANGES[key]
        if not low <= value <= high:
            shown = value if abs(value) < 10**18 else f"a {len(str(abs(value)))}-digit number"
            raise ConfigError(f"{source}: key '{key}' must be from {low} to {high}, got {shown}")
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"{source}: key '{key}' holds the key {bad!r}, which is not a string")
    return value


# Whole-number keys and their ranges (a process count's upper bound is the launcher's:
# it depends on the machine, see fnaccel.commands.launch).
_INT_RANGES: Mapping[str, tuple[int, int]] = MappingProxyType({
    "num_processes": (1, 2**31 - 1),
    "num_machines": (1, 2**31 - 1),
    "machine_rank": (0, 2**31 - 1),
    "main_process_port": (1, 65535),
})

# Keys the oldest Accelerate files hold in another spelling (Accelerate converts them the same way).
_FP16_KEY = "fp16"


def config_from_mapping(data: Mapping[str, Any], source: str = "<config>") -> LaunchConfig:
    """Validate a parsed config mapping into a `LaunchConfig`.

    Raises:
        ConfigError: an unknown key or a wrongly typed value; the message
            names the key and ``source``.

    >>> config_from_mapping({"fp16": True}, "old.yaml").mixed_precision
    'fp16'
    """
    bad = next((key for key in data if not isinstance(key, str)), None)
    if bad is not None:
        raise ConfigError(f"{source}: the key {bad!r} is not a string; keys are names like num_processes")
    # Accelerate writes null for "not set" (`commands: null`, `gpu_ids: null`): the default holds
    data = _upgrade({key: value for key, value in data.items() if value is not None})
    unknown = sorted(set(data) - set(KEY_TYPES))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{unknown[0]}'; known keys are "
            f"{', '.join(sorted(KEY_TYPES))}"
        )
    values = {key: check_config_value(key, value, source) for key, value in data.items()}
    return LaunchConfig(**values, source=source)


def _upgrade(data: Mapping[str, Any]) -> dict[str, Any]:
    """Older Accelerate files spell the compile backend as a top-level ``dynamo_backend``
    and, before ``mixed_precision`` existed, fp16 training as ``fp16: true``."""
    data = dict(data)
    if _FP16_KEY in data:
        fp16 = data.pop(_FP16_KEY)
        if not isinstance(fp16, bool):
            raise ConfigError(f"key 'fp16' (older Accelerate files) must be true or false, got {fp16!r}")
        data.setdefault("mixed_precision", "fp16" if fp16 else "no")
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        if "dynamo_config" not in data and str(backend).upper() != "NO":
            data["dynamo_config"] = {"dynamo_backend": backend}
    return data
