"""``fnaccel env``: what a bug report needs, in the layout of ``accelerate env``.

Versions, platform, CPUs and memory, CUDA, the ``torch.distributed``
backends, and the launch config file a run would read. The config is
validated as `fa.init` would: an invalid file is an error (exit 2), since a
report that hid it would send the reader looking elsewhere.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

import fnaccel
from fnaccel.commands.launch import check_launchable
from fnaccel.commands.main import Subcommands
from fnaccel.config.launch import CONFIG_FILE_ENV, default_config_file, load_config

__all__ = ["environment_report", "register", "run"]

# The distributions whose versions a report shows, with the names people know them by.
_PACKAGES = (
    ("PyTorch", "torch"),
    ("torchdata", "torchdata"),
    ("safetensors", "safetensors"),
    ("PyYAML", "PyYAML"),
    ("NumPy", "numpy"),
    ("einops", "einops"),
    ("typing_extensions", "typing_extensions"),
)


def register(subparsers: Subcommands) -> None:
    """Add ``fnaccel env`` to the command line."""
    parser = subparsers.add_parser(
        "env",
        help="Print the environment and config to paste into a bug report.",
        description="Print fnaccel's environment (versions, hardware, CUDA, distributed backends) "
        "and the launch config file, to paste into a GitHub issue.",
    )
    parser.add_argument(
        "--config_file",
        default=None,
        help="The config file to show. Default: $FNACCEL_CONFIG_FILE, else "
        f"{default_config_file()} when it exists.",
    )
    parser.set_defaults(handler=run, command_name="env")


def run(args: argparse.Namespace) -> int:
    """Print the report; a missing or invalid ``--config_file`` raises `ConfigError`."""
    print(environment_report(args.config_file))
    return 0


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _system_ram() -> str:
    """Physical memory where the OS says it without a dependency (Linux, macOS)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        return "unknown"
    return f"{total / 2**30:.2f} GiB"


def _cpu_count() -> str:
    total = os.cpu_count()
    affinity = getattr(os, "sched_getaffinity", None)
    usable = len(affinity(0)) if affinity is not None else total
    if usable != total:  # a container or taskset limits this process: both matter
        return f"{total} ({usable} usable by this process)"
    return str(total)


def _config_section(config_file: str | None) -> list[str]:
    """The config file a run would read, named, with its validated values."""
    if config_file is not None:
        path, origin = Path(config_file), "--config_file"
    elif env_path := os.environ.get(CONFIG_FILE_ENV):
        path, origin = Path(env_path), f"${CONFIG_FILE_ENV}"
    else:
        path, origin = default_config_file(), "default location"
        if not path.is_file():
            return [f"- `fnaccel` config file ({origin}): {path}", "\tnot found"]
    config = load_config(path)  # raises ConfigError naming the file and the key
    check_launchable(config)  # what launch refuses is no valid config here either
    lines = [f"- `fnaccel` config file ({origin}): {path}"]
    lines += [f"\t- {key}: {value}" for key, value in config.to_dict().items()]
    return lines


def environment_report(config_file: str | None = None) -> str:
    """The text ``fnaccel env`` prints.

    Args:
        config_file: the config file to show; None shows the one `fa.init`
            would read (``$FNACCEL_CONFIG_FILE``, else the default file).

    Returns:
        A header line and one ``- name: value`` line per fact.

    Raises:
        ConfigError: ``config_file`` (or the file found) is missing or invalid.

    >>> "- `fnaccel` version:" in environment_report()
    True
    """
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    lines = [
        f"- `fnaccel` version: {fnaccel.__version__}",
        f"- Platform: {platform.platform()}",
        f"- `fnaccel` bash location: {shutil.which('fnaccel') or 'not on PATH'}",
        f"- Python version: {platform.python_version()} ({sys.executable})",
    ]
    lines += [f"- {label} version: {_version(dist_name)}" for label, dist_name in _PACKAGES]
    lines += [
        f"- CPU count: {_cpu_count()}",
        f"- System RAM: {_system_ram()}",
        f"- CUDA available: {cuda}",
        f"- CUDA version (PyTorch built with): {torch.version.cuda or 'none (CPU-only build)'}",
        f"- GPU count: {len(devices)}",
        f"- GPU type: {', '.join(devices) if devices else 'none'}",
        "- Distributed backends: " + ", ".join(f"{name} {ok}" for name, ok in backends.items()),
    ]
    fnaccel_vars = sorted(name for name in os.environ if name.startswith("FNACCEL_"))
    lines.append(
        "- FNACCEL_* variables: "
        + (", ".join(f"{name}={os.environ[name]}" for name in fnaccel_vars) or "none")
    )
    lines += _config_section(config_file)
    return "\nCopy-and-paste the text below in your GitHub issue\n\n" + "\n".join(lines) + "\n"
