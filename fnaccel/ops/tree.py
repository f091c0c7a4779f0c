"""Operations on nested containers of tensors, with no communication.

A *tree* is any nesting of dicts (and other mappings), lists, tuples,
namedtuples and dataclass instances whose leaves are tensors or other values.
Every function here rebuilds the containers with their own types.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeGuard, TypeVar, overload

import torch

from fnaccel.checks import is_int

# a tree returned with the same containers and leaves of the same kinds (moved, cast, padded, sliced)
T = TypeVar("T")

__all__ = [
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "find_device",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_input_tensors",
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
    "tree_leaves",
    "tree_paths",
    "tree_unflatten",
]


def is_torch_tensor(value: object) -> bool:
    """True for a `torch.Tensor`."""
    return isinstance(value, torch.Tensor)


def _rebuild_mapping(data: Mapping[object, object], items: dict[object, object]) -> object:
    rebuild: Callable[..., object] = type(data)  # a concrete mapping type, whose constructor takes the items
    if isinstance(data, defaultdict):
        return rebuild(data.default_factory, items)
    return rebuild(items)


def is_namedtuple(data: object) -> TypeGuard[tuple[object, ...]]:
    """Whether ``data`` is a named tuple (`collections.namedtuple`, `typing.NamedTuple`, or a
    subclass of one): a tuple with ``_fields`` and ``_asdict``, as Accelerate tells them.

    The tree functions rebuild a named tuple with its own type, field by field; other
    tuples (a ``torch.return_types`` structseq among them) are rebuilt from one iterable.

    >>> from collections import namedtuple
    >>> is_namedtuple(namedtuple("Point", "x y")(1, 2)), is_namedtuple((1, 2))
    (True, False)
    """
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def recursively_apply(
    func: Callable[..., object],
    data: object,
    *args: object,
    test_type: Callable[[object], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: object,
) -> Any:
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``.

    Args:
        func: called as ``func(leaf, *args, **kwargs)``.
        data: a tree of dicts, lists, tuples, namedtuples and dataclasses.
        test_type: which leaves ``func`` applies to (default: tensors).
        error_on_other_type: raise `TypeError` on a leaf that fails
            ``test_type`` instead of passing it through unchanged.

    Returns:
        A tree of the same shape and container types.

    >>> recursively_apply(lambda t: t * 2, {"a": [torch.tensor(1), "x"]})
    {'a': [tensor(2), 'x']}
    """

    def apply(node: object) -> object:
        if test_type(node):
            return func(node, *args, **kwargs)
        if is_namedtuple(node):
            rebuild: Callable[..., object] = type(node)  # the named tuple's own fields, in order
            return rebuild(*(apply(v) for v in node))
        if isinstance(node, (list, tuple)):
            return type(node)(apply(v) for v in node)
        if isinstance(node, Mapping):
            return _rebuild_mapping(node, {k: apply(v) for k, v in node.items()})
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {f.name: apply(getattr(node, f.name)) for f in dataclasses.fields(node) if f.init}
            return dataclasses.replace(node, **changes)
        if error_on_other_type:
            # Accelerate's message, word for word (dataclasses are walked too): ported code matches on it
            raise TypeError(
                f"Unsupported types ({type(node)}) passed to `{getattr(func, '__name__', func)}`. "
                "Only nested list/tuple/dicts of objects that are valid for "
                f"`{getattr(test_type, '__name__', test_type)}` should be passed."
            )
        return node

    return apply(data)


@overload
def tree_leaves(data: object) -> list[torch.Tensor]: ...


@overload
def tree_leaves(data: object, test_type: Callable[[object], bool]) -> list[object]: ...


def tree_leaves(
    data: object, test_type: Callable[[object], bool] = is_torch_tensor
) -> list[torch.Tensor] | list[object]:
    """The leaves of ``data`` passing ``test_type`` (tensors by default), in a fixed traversal order."""
    leaves: list[object] = []
    recursively_apply(leaves.append, data, test_type=test_type)
    return leaves


def tree_paths(data: object, test_type: Callable[[object], bool] = is_torch_tensor) -> list[str]:
    """The path of each leaf `tree_leaves` returns, in the same order.

    >>> tree_paths({"x": [torch.ones(1), "s"], "y": torch.ones(1)})
    ["['x'][0]", "['y']"]
    """
    paths: list[str] = []

    def walk(node: object, path: str) -> None:
        if test_type(node):
            paths.append(path)
        elif is_namedtuple(node):
            for name, value in zip(getattr(node, "_fields"), node, strict=True):
                walk(value, f"{path}.{name}")
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{path}[{_key_text(key)}]")
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                if f.init:
                    walk(getattr(node, f.name), f"{path}.{f.name}")

    walk(data, "")
    return paths


def _key_text(key: object) -> str:
    """A mapping key as every process writes it: the repr of a plain value, the type
    of anything else (whose repr may hold a memory address)."""
    if isinstance(key, (str, int, float, bool, enum.Enum)) or key is None:
        return repr(key)
    return f"<{type(key).__name__}>"


def tree_unflatten(
    data: T, leaves: Sequence[object], test_type: Callable[[object], bool] = is_torch_tensor
) -> T:
    """``data`` with its leaves replaced, in `tree_leaves` order, by ``leaves`` (of the
    kinds they replace: the collectives put tensors where tensors were)."""
    replacements: Iterator[object] = iter(leaves)
    rebuilt: T = recursively_apply(lambda _: next(replacements), data, test_type=test_type)
    return rebuilt


def send_to_device(
    tensor: T,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> T:
    """Move every tensor of a tree to ``device``.

    Args:
        tensor: a tensor or a tree of them; other leaves with a ``.to``
            method (a tokenizer's ``BatchEncoding``) are moved too.
        device: the target device.
        non_blocking: overlap the copy with compute (pinned CPU memory to CUDA).
        skip_keys: mapping keys whose values stay where they are.

    >>> send_to_device({"x": torch.ones(1), "ids": [1, 2]}, "cpu")
    {'x': tensor([1.]), 'ids': [1, 2]}
    """
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())

    def is_target(node: object) -> bool:
        if isinstance(node, torch.Tensor):
            return True
        if isinstance(node, Mapping):
            # `move` rebuilds it, leaving the skipped keys alone; a mapping that moves itself (a
            # tokenizer's BatchEncoding) is moved by its `.to`, which keeps its own state
            return bool(skip) or callable(getattr(node, "to", None))
        if isinstance(node, type):
            return False
        if dataclasses.is_dataclass(node):
            return True  # `move` copies it, its fields moved
        if isinstance(node, (list, tuple)):
            return False
        return callable(getattr(node, "to", None))

    def move(node: Any) -> object:  # a tensor, a dataclass, a mapping, or anything with .to
        if isinstance(node, torch.Tensor):
            return node.to(device, non_blocking=non_blocking)
        if dataclasses.is_dataclass(node):
            # A copy with its fields moved, never rebuilt through __init__: a __post_init__
            # that transforms a field (scales it, say) already ran when the batch was made.
            out = copy.copy(node)
            for f in dataclasses.fields(node):
                if hasattr(node, f.name):
                    object.__setattr__(
                        out, f.name, recursively_apply(move, getattr(node, f.name), test_type=is_target)
                    )
            return out
        if isinstance(node, Mapping) and skip:
            return _rebuild_mapping(
                node,
                {
                    k: v if k in skip else recursively_apply(move, v, test_type=is_target)
                    for k, v in node.items()
                },
            )
        return node.to(device)

    moved: T = recursively_apply(move, tensor, test_type=is_target)
    return moved


def find_device(data: object) -> torch.device | None:
    """The device of the first tensor in ``data`` (a tensor or a tree of them), or None
    when it holds none; the other tensors are assumed to be on the same device.

    >>> find_device([1, "a", {"x": torch.ones(1)}]), find_device([1, "a"])
    (device(type='cpu'), None)
    """
    if isinstance(data, torch.Tensor):  # the common case, without walking a tree
        return data.device
    first = next(iter(tree_leaves(data)), None)
    return None if first is None else first.device


def pad_input_tensors(tensor: T, batch_size: int, num_processes: int, dim: int = 0) -> T:
    """Pad every tensor of a tree along ``dim`` with zeros, from ``batch_size`` to the next
    multiple of ``num_processes`` (at least ``num_processes``), so the batch splits evenly.

    Accelerate's name and arguments (it pads inputs before splitting them over pipeline
    stages). Accelerate's arithmetic reaches the next multiple only in some cases (8 on 2
    processes gives it 10); fnaccel always pads to it, and a batch that already splits
    evenly comes back unchanged.

    Args:
        tensor: a tensor or a tree of them; any other leaf is a `TypeError`.
        batch_size: the length of the batch along ``dim``.
        num_processes: what the padded length must be a multiple of.
        dim: the dimension to pad.

    Raises:
        ValueError: ``num_processes`` is not a positive int, or a tensor is longer than
            ``batch_size`` along ``dim``.

    >>> pad_input_tensors(torch.tensor([1, 2, 3]), batch_size=3, num_processes=2)
    tensor([1, 2, 3, 0])
    """
    if not is_int(num_processes) or num_processes < 1:
        raise ValueError(f"pad_input_tensors: num_processes must be a positive int, got {num_processes!r}")
    target = max(num_processes, -(-batch_size // num_processes) * num_processes)

    def pad(t: torch.Tensor) -> torch.Tensor:
        length = t.shape[dim]
        if length > batch_size:
            raise ValueError(
                f"pad_input_tensors: a tensor of shape {tuple(t.shape)} is longer than batch_size="
                f"{batch_size} along dim {dim}; pass the batch's real length as batch_size"
            )
        if length == target:
            return t
        shape = list(t.shape)
        shape[dim] = target - length
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    padded: T = recursively_apply(pad, tensor, error_on_other_type=True)
    return padded


def listify(data: object) -> Any:
    """Turn every tensor of a tree into nested Python lists (``tensor.tolist()``)."""

    def to_list(t: torch.Tensor) -> object:
        return (t.float() if t.dtype == torch.bfloat16 else t).tolist()

    return recursively_apply(to_list, data)


def convert_to_fp32(tensor: T) -> T:
    """Cast the fp16 and bf16 tensors of a tree to fp32; others are left alone.

    >>> convert_to_fp32({"y": torch.ones(1, dtype=torch.float16)})["y"].dtype
    torch.float32
    """

    def is_half(t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)

    cast: T = recursively_apply(torch.Tensor.float, tensor, test_type=is_half)
    return cast


class ConvertOutputsToFp32(Generic[T]):
    """A forward function whose outputs are cast to fp32 (picklable, unlike a closure)."""

    def __init__(self, model_forward: Callable[..., T]) -> None:
        self.model_forward = model_forward

    def __call__(self, *args: object, **kwargs: object) -> T:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> dict[str, Callable[..., T]]:
        return {"model_forward": self.model_forward}

    def __setstate__(self, state: dict[str, Callable[..., T]]) -> None:
        self.model_forward = state["model_forward"]


def convert_outputs_to_fp32(model_forward: Callable[..., T]) -> Callable[..., T]:
    """Wrap a forward function so that its fp16 / bf16 outputs come back in fp32."""
    return ConvertOutputsToFp32(model_forward)


def slice_tensors(data: T, tensor_slice: slice | int | tuple[slice | int | None, ...]) -> T:
    """Index every tensor of a tree with ``tensor_slice``.

    >>> slice_tensors({"x": torch.arange(4)}, slice(1, 3))
    {'x': tensor([1, 2])}
    """
    sliced: T = recursively_apply(lambda t: t[tensor_slice], data)
    return sliced


def _structure(node: object) -> object:
    """The containers, keys (in order) and tensor positions of a tree, comparable with ``==``.

    Leaves are matched by position, so two dicts with the same keys in another
    order are different structures."""
    if isinstance(node, torch.Tensor):
        return torch.Tensor
    if isinstance(node, Mapping):
        return type(node), [(k, _structure(v)) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return type(node), [_structure(v) for v in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        fields = [f for f in dataclasses.fields(node) if f.init]
        return type(node), [_structure(getattr(node, f.name)) for f in fields]
    return None


def concatenate(data: Sequence[T], dim: int = 0) -> T:
    """Concatenate a list of trees of the same shape, leaf by leaf, along ``dim``.

    Tensor leaves are concatenated; a non-tensor leaf must be equal in every
    tree and is kept once (a `TypeError` otherwise, as Accelerate's "Can only
    concatenate tensors"). A list of one tree returns a tree equal to it.

    >>> concatenate([{"x": torch.ones(1), "tag": "a"}, {"x": torch.zeros(2), "tag": "a"}])
    {'x': tensor([1., 0., 0.]), 'tag': 'a'}
    >>> concatenate(["s"])
    's'
    """
    if not data:
        raise ValueError("concatenate needs at least one tree")
    first = _structure(data[0])
    for i, tree in enumerate(data):
        if _structure(tree) != first:
            raise ValueError(
                f"concatenate: tree {i} is not shaped like tree 0 (different containers, keys "
                "or number of tensors); every tree must have the same structure"
            )
    others = [tree_leaves(tree, test_type=is_other_leaf) for tree in data]
    paths = tree_paths(data[0], test_type=is_other_leaf)
    for i, leaves in enumerate(others[1:], start=1):
        for path, mine, theirs in zip(paths, others[0], leaves, strict=True):
            if not _same_value(mine, theirs):
                raise TypeError(
                    f"concatenate: Can only concatenate tensors, but the leaf {path or 'itself'} "
                    f"is a {type(theirs).__name__} that differs between tree 0 ({mine!r}) and "
                    f"tree {i} ({theirs!r}); make it a tensor or equal in every tree"
                )
    columns = [tree_leaves(tree) for tree in data]
    joined: T = tree_unflatten(
        data[0], [torch.cat(list(parts), dim=dim) for parts in zip(*columns, strict=True)]
    )
    return joined


def is_other_leaf(node: object) -> bool:
    """A leaf that is not a tensor (nor a container `recursively_apply` walks into)."""
    return not (
        isinstance(node, (torch.Tensor, list, tuple, Mapping))
        or (dataclasses.is_dataclass(node) and not isinstance(node, type))
    )


def _same_value(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
