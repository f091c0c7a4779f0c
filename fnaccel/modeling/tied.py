"""Tied parameters: one ``nn.Parameter`` reachable under several names.

A language model's output projection often shares its weight with the input
embedding (``lm_head.weight is embed.weight``). Anything that moves parameters
one name at a time (loading onto the meta device, dispatching over devices)
can break the link; `find_tied_parameters` records the groups beforehand and
`retie_parameters` restores them.

These work on parameter identity, so they see ties on the meta device too.
(`fnaccel.checkpoint.storage.files` is the storage-level counterpart used when writing
state dicts: it compares data pointers, which meta tensors do not have.)

>>> from torch import nn
>>> model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
>>> model.head.weight = model.embed.weight
>>> find_tied_parameters(model)
[['embed.weight', 'head.weight']]
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fnaccel.modeling.tensors import owner_of

__all__ = ["find_tied_parameters", "retie_parameters"]


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """The groups of parameter names that share one ``nn.Parameter``.

    Each group is sorted, and the groups are sorted too, so the answer does not
    depend on the order in which modules were registered. A module registered
    under two names ties all its parameters.

    Args:
        model: the model to inspect.

    Returns:
        A list of groups, each a sorted list of at least two full names.

    >>> shared = nn.Linear(2, 2)
    >>> find_tied_parameters(nn.Sequential(shared, nn.ReLU(), shared))
    [['0.bias', '2.bias'], ['0.weight', '2.weight']]
    """
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    return sorted(sorted(names) for names in names_by_param.values() if len(names) > 1)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Parameter]:
    """The module that holds the parameter ``name``, its name there, and the parameter."""
    wrong = f"{name!r} names no parameter of the model: pass groups as find_tied_parameters returns them"
    try:
        module, leaf = owner_of(model, name)
    except ValueError:
        raise ValueError(wrong) from None
    param = module._parameters.get(leaf)
    if not isinstance(param, nn.Parameter):  # a buffer
        raise ValueError(wrong)
    return module, leaf, param


def retie_parameters(model: nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Make every name of each group point at one parameter again, in place.

    In each group, the first parameter that holds data (is not on the ``meta``
    device) becomes the one all names share; a group whose parameters are all
    on ``meta`` is left as it is.

    Args:
        model: the model to retie.
        tied_params: groups of names, as `find_tied_parameters` returns them.

    Raises:
        ValueError: a name does not name a parameter of the model.

    >>> model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    >>> retie_parameters(model, [["a.weight", "b.weight"]])
    >>> model.a.weight is model.b.weight
    True
    """
    for group in tied_params:
        owners = [_owner(model, name) for name in group]
        shared = next((param for _, _, param in owners if param.device.type != "meta"), None)
        if shared is None:
            continue
        for module, leaf, _ in owners:
            setattr(module, leaf, shared)
