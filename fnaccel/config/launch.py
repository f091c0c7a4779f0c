"""The launch configuration: `LaunchConfig`, and the YAML file `fnaccel config` writes.

One schema (`LaunchConfig`) serves `fa.init` (which reads the file named by
``FNACCEL_CONFIG_FILE`` or the default location) and the command line. Field
names are Accelerate's ``default_config.yaml`` keys, so a user can point
``FNACCEL_CONFIG_FILE`` at an existing Accelerate config. Every key is checked
against its type; an unknown key, a wrongly typed value or a malformed file
raises `ConfigError` naming the key and the file. This module says what a valid
config holds, finds, reads and writes the file, and carries it to `fnaccel
launch`'s processes through the environment.

>>> config_from_mapping({"num_processes": 2, "mixed_precision": "bf16"}).num_processes
2
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fnaccel._errors import ConfigError
from fnaccel.atomic import replace_atomically
from fnaccel.checks import is_int

__all__ = [
    "LaunchConfig",
    "KEY_TYPES",
    "PRECISIONS",
    "check_config_value",
    "config_from_mapping",
    "default_config_file",
    "load_config",
    "read_config_bytes",
    "write_basic_config",
    "write_config",
]

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
    fsdp_config: dict[str, object] = field(default_factory=dict)
    deepspeed_config: dict[str, object] = field(default_factory=dict)
    megatron_lm_config: dict[str, object] = field(default_factory=dict)
    dynamo_config: dict[str, object] = field(default_factory=dict)
    fp8_config: dict[str, object] = field(default_factory=dict)
    ipex_config: dict[str, object] = field(default_factory=dict)
    mpirun_config: dict[str, object] = field(default_factory=dict)
    parallelism_config: dict[str, object] = field(default_factory=dict)
    source: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The fields that a YAML file would hold (``source`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}


# What YAML may hold for each key: bool is not an int here, and an int is a float.
KEY_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {
        f.name: (
            (bool,)
            if f.type == "bool"
            else (int,)
            if f.type == "int"
            else (int, type(None))
            if f.type == "int | None"
            else (str, type(None))
            if f.type == "str | None"
            else (str,)
            if f.type == "str"
            else (list,)
            if f.type.startswith("list")
            else (dict,)
        )
        for f in fields(LaunchConfig)
        if f.name != "source"
    }
)


def _choices() -> Mapping[str, tuple[str, ...]]:
    from fnaccel.constants import ComputeEnvironment, DistributedType

    return MappingProxyType(
        {
            "compute_environment": tuple(e.value for e in ComputeEnvironment),
            "distributed_type": tuple(d.value for d in DistributedType),
            "rdzv_backend": ("static", "c10d", "etcd", "etcd-v2"),
        }
    )


_CHOICES = _choices()


def check_config_value(key: str, value: object, source: str) -> Any:
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
    if key == "gpu_ids" and is_int(value):
        value = str(value)
    if key == "mixed_precision" and value is None:
        value = "no"
    ok = isinstance(value, expected) and not (isinstance(value, bool) and bool not in expected)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
        raise ConfigError(f"{source}: key '{key}' must be {names}, got {type(value).__name__} {value!r}")
    if key == "mixed_precision" and value not in PRECISIONS:
        raise ConfigError(
            f"{source}: key 'mixed_precision' must be one of {', '.join(PRECISIONS)}, got {value!r}"
        )
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ConfigError(f"{source}: key '{key}' must be one of {', '.join(_CHOICES[key])}, got {value!r}")
    if key in _INT_RANGES:
        low, high = _INT_RANGES[key]
        assert isinstance(value, int)  # its expected type, checked above
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
_INT_RANGES: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        "num_processes": (1, 2**31 - 1),
        "num_machines": (1, 2**31 - 1),
        "machine_rank": (0, 2**31 - 1),
        "main_process_port": (1, 65535),
    }
)

# Keys the oldest Accelerate files hold in another spelling (Accelerate converts them the same way).
_FP16_KEY = "fp16"


def config_from_mapping(data: Mapping[str, object], source: str = "<config>") -> LaunchConfig:
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
            f"{source}: unknown key '{unknown[0]}'; known keys are {', '.join(sorted(KEY_TYPES))}"
        )
    values = {key: check_config_value(key, value, source) for key, value in data.items()}
    return LaunchConfig(**values, source=source)


def _upgrade(data: Mapping[str, object]) -> dict[str, object]:
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


CONFIG_FILE_ENV = "FNACCEL_CONFIG_FILE"

MAX_CONFIG_BYTES = 1 << 20  # a launch config is a page of YAML; anything larger is refused unread


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


def read_config_bytes(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of the config file ``path``, at most ``limit`` of them: a larger file is
    refused after reading ``limit + 1`` bytes (a config may come from anyone).

    Raises:
        ConfigError: naming the file and ``what`` it should be, when it cannot be
            read or is larger than ``limit``.
    """
    try:
        with open(path, "rb") as file:
            raw = file.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    if len(raw) > limit:
        raise ConfigError(f"{path}: a {what} is at most {limit} bytes; this is larger")
    return raw


def load_config(path: str | os.PathLike[str]) -> LaunchConfig:
    """Read and validate a YAML launch config file.

    Raises:
        ConfigError: the file is missing, is not YAML, is not a mapping, or
            holds an unknown key or a wrongly typed value.
    """
    import yaml  # here, not at import: most runs have no config file (14 ms of import time)

    source = str(path)
    raw = read_config_bytes(path, MAX_CONFIG_BYTES, "config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: malformed YAML{where}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a launch config") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ConfigError(f"{source}: a value cannot be read ({str(exc).split(';')[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a config file must hold a mapping, got {type(data).__name__}")
    return config_from_mapping(data, source)


# The launch environment: each LaunchConfig field that `fnaccel launch` hands to its
# processes, and the variable that carries it. `launch_env` encodes, `with_launch_env`
# decodes; no other module names these variables.
LAUNCH_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        "mixed_precision": "FNACCEL_MIXED_PRECISION",
        "distributed_type": "FNACCEL_DISTRIBUTED_TYPE",
        "use_cpu": "FNACCEL_USE_CPU",
        "debug": "FNACCEL_DEBUG_MODE",
        "enable_cpu_affinity": "FNACCEL_CPU_AFFINITY",
    }
)
# Sections travel key by key: fsdp_offload_params as FNACCEL_FSDP_OFFLOAD_PARAMS, and so on. Keys of
# the sections whose names carry no prefix of their own get one (zero_stage: FNACCEL_DEEPSPEED_ZERO_STAGE).
# (section, the prefix its variables start with, what precedes the key's name in a variable, the
# distributed type a launch must have for the section to travel; None: always)
_SECTIONS = (
    ("fsdp_config", "FNACCEL_FSDP_", "FNACCEL_", "FSDP"),
    ("dynamo_config", "FNACCEL_DYNAMO_", "FNACCEL_", None),
    ("parallelism_config", "FNACCEL_PARALLELISM_CONFIG_", "FNACCEL_", None),
    ("deepspeed_config", "FNACCEL_DEEPSPEED_", "FNACCEL_DEEPSPEED_", "DEEPSPEED"),
    ("fp8_config", "FNACCEL_FP8_", "FNACCEL_FP8_", None),
)
_USE_FSDP = "FNACCEL_USE_FSDP"  # Accelerate's ACCELERATE_USE_FSDP; read when no distributed type is


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def launch_env(config: LaunchConfig) -> dict[str, str]:
    """The variables that carry ``config`` (fully resolved by `fnaccel launch`) to
    every process; `with_launch_env` reads them back.

    >>> env = launch_env(LaunchConfig(mixed_precision="bf16", use_cpu=True))
    >>> env["FNACCEL_MIXED_PRECISION"], env["FNACCEL_USE_CPU"]
    ('bf16', 'true')
    >>> with_launch_env(LaunchConfig(), env).mixed_precision
    'bf16'
    """
    env = {name: _text(getattr(config, key)) for key, name in LAUNCH_VARIABLES.items()}
    env[_USE_FSDP] = _text(config.distributed_type == "FSDP")
    if config.source is not None:
        env[CONFIG_FILE_ENV] = str(Path(config.source).resolve())
    for key, _, head, only_for in _SECTIONS:
        if only_for is not None and config.distributed_type != only_for:
            continue
        for name, value in getattr(config, key).items():
            if value is not None:
                env[f"{head}{name.upper()}"] = _text(value)
    return env


def _flag(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off", ""):
        return False
    raise ConfigError(f"environment variable {name}={text!r} must be true or false")


def with_launch_env(config: LaunchConfig, environ: Mapping[str, str]) -> LaunchConfig:
    """``config`` with the launch environment (`launch_env`) laid over it: each
    variable of `LAUNCH_VARIABLES` that is set, then the ``FNACCEL_FSDP_*`` /
    ``FNACCEL_DYNAMO_*`` / ``FNACCEL_PARALLELISM_CONFIG_*`` keys over the file's sections; each value is checked as
    a config file's would be, the variable named in the error."""
    changes: dict[str, Any] = {}
    for key, name in LAUNCH_VARIABLES.items():
        text = environ.get(name)
        if text is None or (text == "" and key == "distributed_type"):
            continue
        value: bool | str = _flag(name, text) if KEY_TYPES[key] == (bool,) else text
        changes[key] = check_config_value(key, value, name)
    if "distributed_type" not in changes and _flag(_USE_FSDP, environ.get(_USE_FSDP, "")):
        changes["distributed_type"] = "FSDP"
    for key, prefix, head, _ in _SECTIONS:
        overlay = {
            name[len(head) :].lower(): value for name, value in environ.items() if name.startswith(prefix)
        }
        if overlay:
            changes[key] = {**getattr(config, key), **overlay}
    return replace(config, **changes) if changes else config


def resolve_config(config: str | os.PathLike[str] | LaunchConfig | None) -> LaunchConfig:
    """The config `fa.init` uses: the argument, else ``FNACCEL_CONFIG_FILE``, else the
    default file when it exists, else the defaults; a file's values under what
    `fnaccel launch` put in the environment (`with_launch_env`)."""
    if isinstance(config, LaunchConfig):
        return config
    if config is not None:
        found = load_config(config)
    elif env_path := os.environ.get(CONFIG_FILE_ENV):
        found = load_config(env_path)
    elif default_config_file().is_file():
        found = load_config(default_config_file())
    else:
        found = LaunchConfig()
    return with_launch_env(found, os.environ)


def write_config(config: LaunchConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``config`` as YAML to ``path`` atomically (a temporary file renamed
    into place), creating its directory. Returns the path written."""
    import yaml

    target = Path(path)
    text = yaml.safe_dump(config.to_dict(), sort_keys=True, default_flow_style=False)
    try:
        replace_atomically(target, lambda file: file.write(text.encode("utf-8")))
    except OSError as exc:
        raise ConfigError(
            f"{target}: cannot write the config file ({exc.strerror or exc}); choose a writable --config_file"
        ) from None
    return target


def basic_config(mixed_precision: str = "no") -> LaunchConfig:
    """The config `write_basic_config` writes: every GPU of this machine, else its CPU."""
    import torch

    if mixed_precision not in PRECISIONS:
        raise ConfigError(f"mixed_precision must be one of {', '.join(PRECISIONS)}, got {mixed_precision!r}")
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus > 0:
        return LaunchConfig(
            mixed_precision=mixed_precision,
            num_processes=num_gpus,
            distributed_type="MULTI_GPU" if num_gpus > 1 else "NO",
        )
    return LaunchConfig(mixed_precision=mixed_precision, use_cpu=True, num_processes=1)


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | bool:
    """Write a config for this machine (all its GPUs, else its CPU) without prompts.

    Accelerate's ``write_basic_config``: an existing file is left alone.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        save_location: the file to write; `default_config_file()` when None.

    Returns:
        The path written, or False when a file was already there.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.yaml"
    >>> write_basic_config("bf16", path) == path, load_config(path).mixed_precision
    (True, 'bf16')
    >>> write_basic_config("no", path)
    False
    """
    target = Path(save_location) if save_location is not None else default_config_file()
    config = basic_config(mixed_precision)
    if target.exists():
        return False
    return write_config(config, target)
