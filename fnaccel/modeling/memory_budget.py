"""Memory budgets: how many bytes each device may hold, for `infer_auto_device_map`.

A budget maps devices to bytes: GPU indices (``0``, ``1``...) first, then
``"mps"``, ``"cpu"`` and ``"disk"``. `get_max_memory` measures or converts
one (sizes such as ``"10GiB"`` go through `convert_file_size_to_int`), and
`get_balanced_memory` shrinks the GPUs' budgets so that a model spreads evenly
over them instead of filling GPU 0 first.

>>> get_max_memory({"cpu": "1GB", 0: "1KiB"})
{0: 1024, 'cpu': 1000000000}
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fnaccel.checkpoint.storage.weightfiles import convert_file_size_to_int
from fnaccel.checks import is_int
from fnaccel.modeling.sizes import DTypeLike, compute_module_sizes

__all__ = ["convert_file_size_to_int", "get_balanced_memory", "get_max_memory"]  # the first: weightfiles'

_LOG = logging.getLogger(__name__)

Device = int | str

_NAMED_DEVICES = ("mps", "cpu", "disk")  # after the GPUs, in this order


def _available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def get_max_memory(max_memory: Mapping[Device, int | str] | None = None) -> dict[Device, int]:
    """The memory budget of each device, in bytes, GPUs first, then ``"mps"``, ``"cpu"``, ``"disk"``.

    Args:
        max_memory: budgets by device (``{0: "10GiB", "cpu": "30GB"}``); GPU
            keys are integers. ``None`` measures the free memory of each GPU
            and the available RAM (``{"cpu": ...}`` on a machine without GPU).

    Raises:
        ValueError: a key is not a device or a budget is not a size.

    >>> get_max_memory({"cpu": "1GB", 1: "2GiB", 0: 1000})
    {0: 1000, 1: 2147483648, 'cpu': 1000000000}
    """
    if max_memory is None:
        memory: dict[Device, int] = {}
        if torch.cuda.is_available():
            memory = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
        name = "mps" if torch.backends.mps.is_available() else "cpu"  # the MPS device shares the RAM
        memory[name] = _available_cpu_memory()
        return memory
    for key in max_memory:
        if not (is_int(key) and key >= 0) and key not in _NAMED_DEVICES:
            raise ValueError(
                f"max_memory has the key {key!r}, which is not a device: use integers for GPUs "
                f"(0, 1...) and 'mps', 'cpu' or 'disk' for the others"
            )
    gpus = sorted(key for key in max_memory if isinstance(key, int))
    if gpus and torch.cuda.is_available() and gpus[-1] >= torch.cuda.device_count():
        _LOG.warning("max_memory names GPU %d but this machine has %d", gpus[-1], torch.cuda.device_count())
    order: list[Device] = [*gpus, *(name for name in _NAMED_DEVICES if name in max_memory)]
    return {key: convert_file_size_to_int(max_memory[key]) for key in order}


def class_names(no_split_module_classes: Sequence[str] | str | None) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    dtype: DTypeLike | None = None,
    special_dtypes: Mapping[str, DTypeLike] | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """A ``max_memory`` for `infer_auto_device_map` that spreads the model evenly over the GPUs.

    Each GPU but the last gets the model's size divided by the number of GPUs,
    plus a margin (1.25 times the larger of the biggest no-split block and the
    mean leaf module) so that layers do not spill over; the last GPU keeps its
    full budget. Without GPUs the budget is returned unchanged.

    Args:
        model: the model to place (may be on the meta device).
        max_memory: budgets by device, as for `get_max_memory`; ``None`` uses
            90% of a single GPU's free memory, or all of several GPUs'.
        no_split_module_classes: class names of modules never split over devices.
        dtype: size floating-point tensors in this dtype.
        special_dtypes: dtypes for particular tensors, by full name.
        low_zero: put as little as possible on GPU 0 (keep it free for
            generation and other work).

    >>> model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])  # 1760 bytes
    >>> get_balanced_memory(model, {0: 10_000, 1: 10_000, "cpu": 10_000})
    {0: 1430, 1: 10000, 'cpu': 10000}
    """
    user_gave_no_budget = max_memory is None
    memory = get_max_memory(max_memory)
    gpus = [key for key, budget in memory.items() if isinstance(key, int) and budget > 0]
    if not gpus:
        return memory
    if len(gpus) == 1:
        low_zero = False  # nothing to move GPU 0's share to
        if user_gave_no_budget:
            memory[gpus[0]] = int(memory[gpus[0]] * 0.9)  # leave room for activations
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))

    no_split = class_names(no_split_module_classes)
    block_sizes = [
        sizes.get(name, 0)
        for name, module in model.named_modules()
        if name and type(module).__name__ in no_split
    ]
    # The leaf modules are the modules that own tensors directly and have no submodule holding any.
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    owners |= {name.rpartition(".")[0] for name, _ in model.named_buffers()}
    leaves = [
        name
        for name in owners
        if not any(other.startswith(f"{name}.") or (name == "" and other) for other in owners)
    ]
    mean_leaf = int(sum(sizes.get(name, 0) for name in leaves) / max(len(leaves), 1))
    per_gpu += int(1.25 * max(max(block_sizes, default=0), mean_leaf))

    for gpu in gpus[:-1]:  # the last one keeps its budget, in case the margin was not enough
        memory[gpu] = min(memory[gpu] if low_zero and gpu == gpus[0] else per_gpu, memory[gpu])
    if low_zero:
        memory[gpus[0]] = min(max(0, sizes[""] - sum(memory[gpu] for gpu in gpus[1:])), memory[gpus[0]])
    return memory
