"""Where each part of a model goes: device maps.

A device map is a dict from module (or parameter) names to a device: a GPU
index (``0``, ``1``...), ``"mps"``, ``"cpu"`` or ``"disk"``; ``""`` names the
whole model. `infer_auto_device_map` computes one from module sizes alone
(pure arithmetic: no device is touched, so a map for GPUs can be planned on a
CPU-only machine), filling the GPUs in order, then the CPU, then the disk,
within the budgets of `fnaccel.modeling.memory_budget`.

>>> from torch import nn
>>> model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])  # 440 bytes each
>>> infer_auto_device_map(model, max_memory={0: 1000, "cpu": 1000})
{'0': 0, '1': 'cpu', '2': 'disk', '3': 'disk'}

GPU 0 keeps room for the largest layer still to place (440 bytes) so that a
layer offloaded to the CPU can be brought in to run, and the CPU likewise for
a layer on disk: so '1' does not fit next to '0', nor '2' next to '1'.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fnaccel.checks import is_int
from fnaccel.modeling.memory_budget import (
    Device,
    class_names,
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_memory,
)
from fnaccel.modeling.sizes import (
    DTypeLike,
    compute_module_sizes,
    get_max_layer_size,
    top_level_entries,
)
from fnaccel.modeling.tied import find_tied_parameters

__all__ = [
    "STRATEGIES",
    "check_device_map",
    "clean_device_map",
    "convert_file_size_to_int",  # these three live in memory_budget
    "get_balanced_memory",
    "get_max_memory",
    "infer_auto_device_map",
    "resolve_device_map",
]

_LOG = logging.getLogger(__name__)

Entry = tuple[str, "nn.Module | torch.Tensor"]

# The names a device_map may be instead of a dict (Accelerate's).
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _within(name: str, module_name: str) -> bool:
    """Whether ``name`` is ``module_name`` or inside it."""
    return module_name == "" or name == module_name or name.startswith(module_name + ".")


def clean_device_map(device_map: Mapping[str, Device], module_name: str = "") -> dict[str, Device]:
    """``device_map`` with the children of each module that sit on one device merged into the module.

    >>> clean_device_map({"a.0": 0, "a.1": 0, "b": "cpu"})
    {'a': 0, 'b': 'cpu'}
    >>> clean_device_map({"a.0": 0, "a.1": 0})
    {'': 0}
    """
    inside = [key for key in device_map if key != module_name and _within(key, module_name)]
    if len(inside) > 1 and len({device_map[key] for key in inside}) == 1:
        merged: dict[str, Device] = {}
        for key, device in device_map.items():
            merged[module_name if key in inside else key] = device  # at its first child's place
        return merged
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = dict.fromkeys(".".join(key.split(".")[:depth]) for key in inside)
    result = dict(device_map)
    for child in children:
        result = clean_device_map(result, child)
    return result


def check_device_map(model: nn.Module, device_map: Mapping[str, int | str | torch.device]) -> None:
    """Check that ``device_map`` gives a device to every tensor of ``model`` and names only its parts.

    Raises:
        ValueError: a parameter or persistent buffer has no device, a key
            names nothing in the model, or a value is not a device.

    >>> check_device_map(nn.Linear(2, 2), {"weight": 0, "bias": "cpu"})
    >>> check_device_map(nn.Linear(2, 2), {"weight": 0})
    Traceback (most recent call last):
    ...
    ValueError: the device_map gives no device to 'bias': add it (or a module that holds it, or '' for the whole model)
    """
    tensors = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    tensors += [
        name
        for name, _ in model.named_buffers(remove_duplicate=False)
        if name.rpartition(".")[2]
        not in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
    ]
    known = {name for name, _ in model.named_modules(remove_duplicate=False)} | set(tensors)
    for key, device in device_map.items():
        if key not in known:
            raise ValueError(f"the device_map names {key!r}, which is not a module or tensor of the model")
        if not (is_int(device) and device >= 0) and device != "disk":
            try:
                torch.device(device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"the device_map puts {key!r} on {device!r}, which is not a device: use a GPU index, "
                    "'cpu', 'mps', 'disk' or a torch device"
                ) from None
    missing = [name for name in tensors if not any(_within(name, key) for key in device_map)]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        raise ValueError(
            f"the device_map gives no device to {shown}: add it (or a module that holds it, "
            "or '' for the whole model)"
        )


def _splittable(module: nn.Module | torch.Tensor, no_split: Sequence[str]) -> bool:
    return (
        isinstance(module, nn.Module)
        and type(module).__name__ not in no_split
        and next(module.children(), None) is not None
    )


def _parts(name: str, module: nn.Module | torch.Tensor) -> list[Entry]:
    """The entries a module splits into: its own parameters, its children, its own buffers."""
    assert isinstance(module, nn.Module)
    return [(f"{name}.{part}", value) for part, value in top_level_entries(module)]


def _tied_entries(name: str, to_treat: Sequence[Entry], tied_groups: Sequence[Sequence[str]]) -> list[Entry]:
    """The entries of ``to_treat`` that must go where ``name`` goes: those holding a parameter
    tied to one inside ``name`` or inside another such entry."""
    together, dragged = [name], []
    grown = True
    while grown:
        grown = False
        for group in tied_groups:
            if not any(_within(param, held) for param in group for held in together):
                continue
            for param in group:
                if any(_within(param, held) for held in together):
                    continue
                entry = next((e for e in to_treat if _within(param, e[0])), None)
                assert entry is not None, f"{param!r} is tied into {name!r} but was placed before it"
                together.append(entry[0])
                dragged.append(entry)
                grown = True
    return dragged


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    dtype: DTypeLike | None = None,
    special_dtypes: Mapping[str, DTypeLike] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, Device]:
    """A device map for ``model``: the GPUs filled in order, then the CPU, then the disk.

    Modules are taken in registration order and put on the current device
    while they fit; one that does not fit is split into its parameters and
    children, unless it has none or its class is in
    ``no_split_module_classes``, in which case the next device is used. So:

    - no device gets more than its budget;
    - GPU 0 (and the CPU) keep room for the largest layer still to be placed,
      so that a layer offloaded to the CPU (or disk) can be loaded to run;
    - a module of a no-split class is never spread over devices;
    - tied parameters (and the modules holding them) land on one device;
    - whatever does not fit anywhere goes to ``"disk"``.

    Only sizes are used, so the model may be on the meta device and GPU
    budgets can be planned on a machine without GPUs.

    Args:
        model: the model to place.
        max_memory: budgets by device, as for `get_max_memory`; ``None``
            measures the free memory of this machine.
        no_split_module_classes: class names of modules never split (blocks
            with a residual connection, say).
        dtype: size floating-point tensors in this dtype (the one to load in).
        special_dtypes: dtypes for particular tensors, by full name.
        verbose: print each decision.
        clean_result: merge the children of a module that all sit on one
            device into the module (``{"": "cpu"}`` when all fits on the CPU).
        offload_buffers: the buffers of offloaded modules are offloaded with
            them; otherwise they will sit on the main device, and a warning
            says when they do not fit on any GPU.
        fallback_allocation: when the next module cannot be placed on a
            device that holds nothing yet, search the modules after it
            (breadth first, into their children) for one that fits beside
            the room kept for it, and put that one there first, rather than
            leave the device empty.

    Returns:
        ``{module or tensor name: device}``, in the model's order.

    >>> model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])  # 440 bytes each
    >>> infer_auto_device_map(model, max_memory={0: 1000, "cpu": 1000})
    {'0': 0, '1': 'cpu', '2': 'disk', '3': 'disk'}
    """
    memory = get_max_memory(max_memory)
    no_split = class_names(no_split_module_classes)
    devices: list[Device] = [*memory, *(["disk"] if "disk" not in memory else [])]
    gpus = [device for device in devices if device not in ("cpu", "disk")]
    main_devices: list[Device] = ["mps"] if "mps" in gpus else [gpus[0], "cpu"] if gpus else ["cpu"]
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    buffer_sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True)
    tied_groups = find_tied_parameters(model)

    def say(message: str) -> None:
        if verbose:
            print(message)

    device_map: dict[str, Device] = {}
    peak: dict[Device, int] = {}  # bytes used plus the reserve kept, by device
    unfilled: dict[Device, int] = {}  # devices left empty: the bytes their first module needed
    offloaded_buffers = 0
    to_treat = top_level_entries(model)
    reserve_size, reserve_names = get_max_layer_size(to_treat, sizes, no_split)
    index, used = 0, 0
    while to_treat:
        name, module = to_treat.pop(0)
        say(f"\nTreating module {name}.")
        # The reserve is for the largest layer still to place; it shrinks as layers are placed.
        reserve_names = [n for n in reserve_names if not _within(n, name)]
        if not reserve_names:
            reserve_size, reserve_names = get_max_layer_size(to_treat, sizes, no_split)
        device = devices[index]
        reserve = reserve_size if device in main_devices else 0
        space = None if device == "disk" else memory[device] - reserve - used
        tied = _tied_entries(name, to_treat, tied_groups)
        needed = sizes[name] + sum(sizes[n] for n, _ in tied)
        if tied:
            say(f"  {name} is tied to {[n for n, _ in tied]}: they go together ({needed} bytes).")
        if space is not None and needed > space:
            say(f"Not enough space on {device} to put {name} (space available {space}, needed {needed}).")
            # Too big alone: only splitting it helps. Too big with its ties: split one of those.
            candidates = [(name, module)] if sizes[name] > space else tied
            to_split = next((e for e in candidates if _splittable(e[1], no_split)), None)
            fallback = None
            if to_split is None and fallback_allocation and used == 0:
                # room is kept for this module too: it must still be loadable once offloaded
                room = memory[device] - max(reserve_size, needed)
                fallback = _fallback_entry(to_treat, sizes, room, no_split, tied_groups)
            if fallback is not None:
                say(f"Fallback allocation: {fallback} fits on {device}; {name} waits.")
                to_treat = _bring_forward(fallback, to_treat)
                to_treat.insert(1, (name, module))
            elif to_split is None:
                say("It cannot be split, going to the next device.")
                if used == 0:
                    unfilled[device] = needed + reserve
                peak[device] = used + reserve
                index, used = index + 1, 0
                to_treat.insert(0, (name, module))
            else:
                say(f"Splitting {to_split[0]}.")
                if to_split[0] == name:
                    to_treat = _parts(name, module) + to_treat
                else:
                    at = next(i for i, e in enumerate(to_treat) if e[0] == to_split[0])
                    to_treat[at : at + 1] = _parts(*to_split)
                    to_treat.insert(0, (name, module))
                reserve_size, reserve_names = get_max_layer_size(to_treat, sizes, no_split)
            continue
        say(
            f"Putting {name} (size={sizes[name]}) on {device}"
            + ("." if space is None else f" (available={space}).")
        )
        dragged = {n for n, _ in tied}
        for placed in (name, *dragged):
            device_map[placed] = device
            if device in ("cpu", "disk"):
                offloaded_buffers += buffer_sizes[placed]
        to_treat = [e for e in to_treat if e[0] not in dragged]
        reserve_names = [n for n in reserve_names if not any(_within(n, d) for d in dragged)]
        used += needed
        peak[device] = used + reserve

    if (
        offloaded_buffers
        and not offload_buffers
        and gpus
        and not any(memory[gpu] >= offloaded_buffers + peak.get(gpu, 0) for gpu in gpus)
    ):
        warnings.warn(
            f"the buffers of the offloaded modules ({offloaded_buffers} bytes) stay on the main device "
            "but do not fit in any GPU's remaining memory; pass offload_buffers=True to offload them too",
            stacklevel=2,
        )
    if unfilled:
        # Accelerate's channel and words, which callers match on: INFO, "insufficient memory"
        _LOG.info(
            "Based on the current allocation process, no modules could be assigned to the following devices "
            "due to insufficient memory:\n%s\nThese minimums are specific to this allocation: give these "
            "devices at least that much memory, or pass fallback_allocation=True to put a smaller module "
            "there first.",
            "\n".join(f"  - {device}: {size} bytes required" for device, size in unfilled.items()),
        )
    return clean_device_map(device_map) if clean_result else device_map


def _fallback_entry(
    entries: Sequence[Entry],
    sizes: Mapping[str, int],
    space: int,
    no_split: Sequence[str],
    tied_groups: Sequence[Sequence[str]],
) -> str | None:
    """The first module or tensor, breadth first through ``entries`` and their children, that fits in ``space``
    together with what is tied to it."""
    queue = list(entries)
    while queue:
        name, module = queue.pop(0)
        others = [e for e in entries if not _within(e[0], name) and not _within(name, e[0])]
        if sizes[name] + sum(sizes[n] for n, _ in _tied_entries(name, others, tied_groups)) <= space:
            return name
        if _splittable(module, no_split):
            queue.extend(_parts(name, module))
    return None


def _bring_forward(target: str, entries: list[Entry]) -> list[Entry]:
    """``entries`` with the ancestors of ``target`` split until it is an entry of its own, moved to the front."""
    while not any(name == target for name, _ in entries):
        at = next(i for i, (name, _) in enumerate(entries) if _within(target, name))
        entries[at : at + 1] = _parts(*entries[at])
    at = next(i for i, (name, _) in enumerate(entries) if name == target)
    return [entries[at], *entries[:at], *entries[at + 1 :]]


def resolve_device_map(
    model: nn.Module,
    device_map: str,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    dtype: DTypeLike | None = None,
    special_dtypes: Mapping[str, DTypeLike] | None = None,
    offload_buffers: bool = False,
) -> dict[str, Device]:
    """The device map a strategy name stands for: ``"sequential"`` fills the
    devices in order (`infer_auto_device_map` within ``max_memory``);
    ``"auto"`` and ``"balanced"`` first spread the model evenly over the GPUs
    (`get_balanced_memory`), ``"balanced_low_0"`` keeping GPU 0 as free as it can.

    Args:
        model: the model to place (may be on the meta device).
        device_map: one of `STRATEGIES`.
        max_memory, no_split_module_classes, dtype, special_dtypes,
            offload_buffers: as for `infer_auto_device_map`.

    Raises:
        ValueError: ``device_map`` is not one of `STRATEGIES`, or a bad ``max_memory``.

    >>> model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])  # 440 bytes each
    >>> resolve_device_map(model, "sequential", max_memory={0: 1000, "cpu": 1000})
    {'0': 0, '1': 'cpu', '2': 'disk', '3': 'disk'}
    >>> resolve_device_map(model, "balanced", max_memory={0: 10_000, 1: 10_000})
    {'0': 0, '1': 0, '2': 1, '3': 1}
    """
    if device_map not in STRATEGIES:
        raise ValueError(
            f"device_map={device_map!r}: a string must be one of {', '.join(STRATEGIES)} "
            "(or pass a dict from module names to devices)"
        )
    if device_map != "sequential":
        max_memory = get_balanced_memory(
            model,
            max_memory,
            no_split_module_classes,
            dtype,
            special_dtypes,
            low_zero=device_map == "balanced_low_0",
        )
    return infer_auto_device_map(
        model, max_memory, no_split_module_classes, dtype, special_dtypes, offload_buffers=offload_buffers
    )
