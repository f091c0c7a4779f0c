"""Objects registered for checkpointing, stored pickle-free and given back as they went in.

Anything with ``state_dict()`` / ``load_state_dict()`` (an EMA of the weights,
a GAN's second optimizer, a custom sampler) can ride along with the run:
``state = fa.utils.register_for_checkpointing(state, disc_opt=disc_opt)``.

Its state_dict comes back as ``torch.save`` would give it back: JSON alone
cannot say whether ``[0.9, 0.999]`` was a tuple or a list, or ``"0"`` an int
key (an optimizer's state is keyed by parameter index), so every container
is stored with its type (`split` and `join`):

==========================  ===========================================
value                       in extras.json
==========================  ===========================================
None, bool, int, float, str the JSON value itself (NaN and infinities too)
list                        a JSON array of the items
tuple                       ``{"tuple": [items]}``
dict                        ``{"dict": [[key, value], ...]}`` in order
collections.OrderedDict     ``{"odict": [[key, value], ...]}``, with
                            ``"metadata"`` when it has torch's ``_metadata``
tensor                      ``{"tensor": key}``, the key in extras.safetensors
==========================  ===========================================

Keys are encoded like values (an int, a str, a tuple of them...). Anything
else, a subclass included (a NumPy float, an IntEnum, a defaultdict), is
refused at save with a `CheckpointError` naming the object and the key:
it could only come back as something else. Tensors come back as CPU
tensors of the same dtype and shape (not as parameters, and not sharing
memory with one another).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from fnaccel._errors import CheckpointError

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["join", "register_for_checkpointing", "split"]

_SCALARS = (type(None), bool, int, float, str)


def register_for_checkpointing(state: RunState, **objects: Any) -> RunState:
    """The state with ``objects`` saved and loaded with it, under their names
    (the state is not consumed). Each object's ``state_dict()`` comes back to its
    ``load_state_dict`` with the same types (int keys, tuples, tensors, nesting);
    what cannot is refused when the run is saved (docs/checkpoints.md).

    >>> import fnaccel as fa, torch
    >>> state = fa.utils.register_for_checkpointing(fa.init(cpu=True), ema=torch.nn.Linear(1, 1))
    >>> sorted(state.extras)
    ['ema']
    """
    for name, obj in objects.items():
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"register_for_checkpointing: {name}={type(obj).__name__} has no state_dict() and "
                "load_state_dict(); only such objects can be saved with the run"
            )
        if "/" in name:
            raise ValueError(f"register_for_checkpointing: name {name!r} may not contain '/'")
    return state.replace(extras=MappingProxyType({**state.extras, **objects}))


def split(value: Any, name: str, tensors: dict[str, torch.Tensor], copy: bool) -> Any:
    """Registered object ``name``'s ``value`` (its state_dict) as a typed JSON tree, its
    tensors moved into ``tensors`` under their key paths (copied to the CPU when ``copy``).

    >>> split({0: {"step": 3}, "betas": (0.9, 0.99)}, "opt", {}, False)
    {'dict': [[0, {'dict': [['step', 3]]}], ['betas', {'tuple': [0.9, 0.99]}]]}
    """
    return _encode(value, name, tensors, copy, name)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], copy: bool, name: str) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        key = path
        while key in tensors:  # the keys 1 and "1" of one dict: both stored, under two names
            key += "'"
        tensors[key] = value.detach().to("cpu", copy=True) if copy else value.detach()
        return {"tensor": key}
    if kind is list:
        return [_encode(item, f"{path}/{i}", tensors, copy, name) for i, item in enumerate(value)]
    if kind is tuple:
        return {"tuple": [_encode(item, f"{path}/{i}", tensors, copy, name) for i, item in enumerate(value)]}
    if kind is dict or kind is OrderedDict:
        pairs = []
        for key, item in value.items():
            where = f"{path}/{key}"
            if type(key) not in _SCALARS and type(key) is not tuple:
                _refuse(name, where, f"its key is a {type(key).__name__}")
            pairs.append([_encode(key, where, {}, False, name), _encode(item, where, tensors, copy, name)])
        if kind is dict:
            return {"dict": pairs}
        out: dict[str, Any] = {"odict": pairs}
        metadata = getattr(value, "_metadata", None)  # torch's module versions, read by load_state_dict
        if metadata is not None:
            out["metadata"] = _encode(metadata, f"{path}/_metadata", {}, False, name)
        return out
    _refuse(
        name,
        path,
        f"a {kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else f"a {kind.__name__}",
    )


def _refuse(name: str, path: str, what: str) -> None:
    key = path.partition("/")[2]
    raise CheckpointError(
        f"registered object {name!r}: key {key!r}: {what} cannot be stored so that it comes back as it went "
        "in (checkpoints hold no pickle); a state_dict saved with the run may hold tensors, None, bool, int, "
        "float, str, and lists, tuples, dicts and OrderedDicts of them (exactly these types, no subclasses)"
    )


def join(tree: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """The inverse of `split`, validating as it goes: every object one of the tags, every
    key hashable and given once, every tensor key in ``tensors``; else a `CheckpointError`
    naming ``where`` (the file and the object) and the key path.

    >>> join({"dict": [[0, {"tuple": [1, 2.5]}]]}, {}, "extras.json: opt")
    {0: (1, 2.5)}
    """
    try:
        return _decode(tree, tensors, where, "")
    except RecursionError:
        raise CheckpointError(f"{where}: nested too deeply") from None


def _decode(tree: Any, tensors: Mapping[str, torch.Tensor], where: str, path: str) -> Any:
    if type(tree) in _SCALARS:
        return tree
    if isinstance(tree, list):
        return [_decode(item, tensors, where, f"{path}/{i}") for i, item in enumerate(tree)]

    def fail(detail: str) -> CheckpointError:
        return CheckpointError(
            f"{where}: key {path.lstrip('/')!r}: {detail}; the checkpoint was edited or is hostile"
        )

    if not isinstance(tree, dict) or (
        len(tree) != 1 and not (len(tree) == 2 and {"odict", "metadata"} == set(tree))
    ):
        raise fail(f"{_short(tree)} is not one of the stored forms (tuple, dict, odict, tensor)")
    ((tag, body),) = ((k, v) for k, v in tree.items() if k != "metadata")
    if tag == "tensor":
        if not isinstance(body, str) or body not in tensors:
            raise fail(f"tensor {_short(body)} is not in extras.safetensors")
        return tensors[body]
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(item, tensors, where, f"{path}/{i}") for i, item in enumerate(body))
    if tag in ("dict", "odict") and isinstance(body, list):
        out: dict[Any, Any] = {} if tag == "dict" else OrderedDict()
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise fail(f"an entry {_short(pair)} is not a [key, value] pair")
            key = _decode(pair[0], {}, where, path)
            try:
                hash(key)
            except TypeError:
                raise fail(f"a key {_short(pair[0])} is not hashable") from None
            if key in out:
                raise fail(f"the key {key!r} is given twice")
            out[key] = _decode(pair[1], tensors, where, f"{path}/{key}")
        if "metadata" in tree:
            out._metadata = _decode(tree["metadata"], {}, where, f"{path}/_metadata")  # type: ignore[attr-defined]
        return out
    raise fail(f"{_short(tree)} is not one of the stored forms (tuple, dict, odict, tensor)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
