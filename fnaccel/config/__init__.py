"""Configuration and the launch environment: what a run is told before it starts.

- `fnaccel.config.launch`: `LaunchConfig` and its YAML file (`fnaccel config`
  writes it, `fnaccel launch` and `fa.init` read it, the launcher hands it to the
  processes as ``FNACCEL_*`` variables).
- `fnaccel.config.parallelism`: `ParallelismConfig`, the ranks' layout on a mesh.
- `fnaccel.config.environment`: what this machine offers (the ``is_*_available``
  checks) and scoped changes to the process environment.
- `fnaccel.config.numa`: NUMA affinity; `fnaccel.config.purge`: a test
  decorator that drops the ``FNACCEL_*`` variables a test set.

>>> from fnaccel.config import LaunchConfig
>>> LaunchConfig().num_processes
1
"""

from fnaccel.config.launch import (
    LaunchConfig,
    default_config_file,
    load_config,
    read_config_bytes,
    write_basic_config,
    write_config,
)

__all__ = [
    "LaunchConfig",
    "default_config_file",
    "load_config",
    "read_config_bytes",
    "write_basic_config",
    "write_config",
]
