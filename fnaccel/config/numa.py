"""NUMA affinity: pin a process to the CPUs of the memory node nearest its device.

Accelerate's `set_numa_affinity` / `override_numa_affinity` ask NVML for the
CPUs of a GPU's NUMA node. fnaccel reads the same facts from Linux's ``/sys``:
the node of a CUDA device is ``/sys/bus/pci/devices/<bus id>/numa_node``, a
node's CPUs are ``/sys/devices/system/node/node<N>/cpulist``. On a machine
without CUDA, local process ``i`` gets node ``i mod <number of nodes>``, so
CPU-only workers spread over the sockets. Only CPUs the process may already
use are chosen (containers and ``taskset`` limits are kept).

Elsewhere (macOS, Windows, no ``/sys``) both are a no-op that returns None.
Accelerate caches the first call per process; fnaccel keeps no such cache
(no global state): setting the same affinity again changes nothing, so the
two functions are one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fnaccel.checks import is_int

__all__ = ["numa_node_cpus", "override_numa_affinity", "parse_cpu_list", "set_numa_affinity"]

SYSFS = Path("/sys")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list such as ``"0-3,8,10-11"``.

    Raises:
        ValueError: ``text`` is not a CPU list.

    >>> sorted(parse_cpu_list("0-2,8\\n"))
    [0, 1, 2, 8]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like '0-3,8'")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_node_cpus(local_process_index: int, sysfs: Path = SYSFS) -> set[int] | None:
    """The CPUs of the NUMA node for local process ``local_process_index``, from ``sysfs``; None when unknown.

    >>> numa_node_cpus(0, Path("/no/such/sysfs")) is None
    True
    """
    nodes_dir = sysfs / "devices" / "system" / "node"
    nodes = sorted(int(p.name[4:]) for p in nodes_dir.glob("node[0-9]*")) if nodes_dir.is_dir() else []
    if not nodes:
        return None
    node = nodes[local_process_index % len(nodes)]
    if torch.cuda.is_available() and local_process_index < torch.cuda.device_count():
        props = torch.cuda.get_device_properties(local_process_index)
        pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)  # type: ignore[attr-defined]
        bus_id = "{:04x}:{:02x}:{:02x}.0".format(*pci)
        node_file = sysfs / "bus" / "pci" / "devices" / bus_id / "numa_node"
        if node_file.is_file():
            gpu_node = int(node_file.read_text().strip())
            node = gpu_node if gpu_node >= 0 else node  # -1: the platform does not say
    cpulist = nodes_dir / f"node{node}" / "cpulist"
    return parse_cpu_list(cpulist.read_text()) if cpulist.is_file() else None


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> set[int] | None:
    """Pin this process to the CPUs of its NUMA node (see the module's docstring for which node).

    Args:
        local_process_index: the process's index on this machine (``state.dist.local_rank``).
        verbose: print the CPUs chosen.

    Returns:
        The CPUs the process is now pinned to, or None where nothing was
        done (no ``/sys`` NUMA information, no ``sched_setaffinity``, or none
        of the node's CPUs is allowed to this process).

    Raises:
        ValueError: ``local_process_index`` is negative.

    >>> before = os.sched_getaffinity(0)
    >>> cpus = override_numa_affinity(0)
    >>> cpus is None or cpus == os.sched_getaffinity(0)
    True
    >>> os.sched_setaffinity(0, before)  # this example gives the CPUs back
    """
    if not is_int(local_process_index) or local_process_index < 0:
        raise ValueError(
            f"local_process_index must be an int >= 0 (state.dist.local_rank), got {local_process_index!r}"
        )
    if not hasattr(os, "sched_setaffinity"):
        return None
    node_cpus = numa_node_cpus(local_process_index)
    if node_cpus is None:
        return None
    cpus = node_cpus & os.sched_getaffinity(0)
    if not cpus:
        return None
    os.sched_setaffinity(0, cpus)
    if verbose:
        print(f"Assigning {len(cpus)} CPUs {sorted(cpus)} to local process {local_process_index}")
    return cpus


def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> set[int] | None:
    """Accelerate's name for `override_numa_affinity` (which fnaccel does not cache per process).

    >>> before = os.sched_getaffinity(0)
    >>> set_numa_affinity(0) == override_numa_affinity(0)
    True
    >>> os.sched_setaffinity(0, before)
    """
    return override_numa_affinity(local_process_index, verbose)
