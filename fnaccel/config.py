"""The launch configuration: the YAML file `fnaccel config` writes, validated.

One schema (`LaunchConfig`, in `fnaccel.config_schema`, importable from here
too) serves `fa.init` (which reads the file named by ``FNACCEL_CONFIG_FILE``
or the default location) and the command line. Every key is checked against
its type; an unknown key, a wrongly typed value or a malformed file raises
`ConfigError` naming the key and the file. This module finds, reads and
writes the file, and carries it to `fnaccel launch`'s processes.

Accelerate's ``default_config.yaml`` uses the same top-level keys, so a user
can point ``FNACCEL_CONFIG_FILE`` at an existing Accelerate config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fnaccel._errors import ConfigError
from fnaccel.config_schema import KEY_TYPES, PRECISIONS, LaunchConfig, check_config_value, config_from_mapping

__all__ = ["LaunchConfig", "default_config_file", "load_config", "read_config_bytes", "write_basic_config",
           "write_config"]

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
LAUNCH_VARIABLES: Mapping[str, str] = MappingProxyType({
    "mixed_precision": "FNACCEL_MIXED_PRECISION",
    "distributed_type": "FNACCEL_DISTRIBUTED_TYPE",
    "use_cpu": "FNACCEL_USE_CPU",
    "debug": "FNACCEL_DEBUG_MODE",
    "enable_cpu_affinity": "FNACCEL_CPU_AFFINITY",
})
# Sections travel key by key: fsdp_offload_params as FNACCEL_FSDP_OFFLOAD_PARAMS, and so on. Keys of
# the sections whose names carry no prefix of their own get one (zero_stage: FNACCEL_DEEPSPEED_ZERO_STAGE).
_SECTIONS = (("fsdp_config", "FNACCEL_FSDP_"), ("dynamo_config", "FNACCEL_DYNAMO_"),
             ("parallelism_config", "FNACCEL_PARALLELISM_CONFIG_"))
_PREFIXED_SECTIONS = (("deepspeed_config", "FNACCEL_DEEPSPEED_"), ("fp8_config", "FNACCEL_FP8_"))
_USE_FSDP = "FNACCEL_USE_FSDP"  # Accelerate's ACCELERATE_USE_FSDP; read when no distributed type is


def _text(value: Any) -> str:
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
    for key, prefix in _SECTIONS:
        if key == "fsdp_config" and config.distributed_type != "FSDP":
            continue
        for name, value in getattr(config, key).items():
            if value is not None:
                env[f"FNACCEL_{name.upper()}"] = _text(value)
    for key, prefix in _PREFIXED_SECTIONS:
        if key == "deepspeed_config" and config.distributed_type != "DEEPSPEED":
            continue
        for name, value in getattr(config, key).items():
            if value is not None:
                env[f"{prefix}{name.upper()}"] = _text(value)
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
    from dataclasses import replace

    changes: dict[str, Any] = {}
    for key, name in LAUNCH_VARIABLES.items():
        text = environ.get(name)
        if text is None or (text == "" and key == "distributed_type"):
            continue
        value: Any = _flag(name, text) if KEY_TYPES[key] == (bool,) else text
        changes[key] = check_config_value(key, value, name)
    if "distributed_type" not in changes and _flag(_USE_FSDP, environ.get(_USE_FSDP, "")):
        changes["distributed_type"] = "FSDP"
    for key, prefix in _SECTIONS:
        overlay = {name[len("FNACCEL_"):].lower(): value for name, value in environ.items()
                   if name.startswith(prefix)}
        if overlay:
            changes[key] = {**getattr(config, key), **overlay}
    for key, prefix in _PREFIXED_SECTIONS:
        overlay = {name[len(prefix):].lower(): value for name, value in environ.items()
                   if name.startswith(prefix)}
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

    from fnaccel.atomic import replace_atomically

    target = Path(path)
    text = yaml.safe_dump(config.to_dict(), sort_keys=True, default_flow_style=False)
    try:
        replace_atomically(target, lambda file: file.write(text.encode("utf-8")))
    except OSError as exc:
        raise ConfigError(f"{target}: cannot write the config file ({exc.strerror or exc}); "
                          "choose a writable --config_file") from None
    return target


def basic_config(mixed_precision: str = "no") -> LaunchConfig:
    """The config `write_basic_config` writes: every GPU of this machine, else its CPU."""
    import torch

    if mixed_precision not in PRECISIONS:
        raise ConfigError(
            f"mixed_precision must be one of {', '.join(PRECISIONS)}, got {mixed_precision!r}"
        )
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus > 0:
        return LaunchConfig(
            mixed_precision=mixed_precision, num_processes=num_gpus,
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
