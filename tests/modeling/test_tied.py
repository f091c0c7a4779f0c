"""`find_tied_parameters` and `retie_parameters`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.tied import find_tied_parameters, retie_parameters


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight


def test_finds_the_embedding_tie() -> None:
    assert find_tied_parameters(LM()) == [["embed.weight", "lm_head.weight"]]
    assert find_tied_parameters(nn.Linear(2, 2)) == []


def test_finds_ties_on_the_meta_device() -> None:
    with init_empty_weights():
        model = LM()
    assert model.embed.weight.is_meta
    assert find_tied_parameters(model) == [["embed.weight", "lm_head.weight"]]


def test_groups_are_sorted_whatever_the_registration_order() -> None:
    shared = nn.Parameter(torch.ones(2))
    model = nn.Module()
    for name in ("z", "a", "m"):
        sub = nn.Module()
        sub.p = shared
        model.add_module(name, sub)
    model.other = nn.Linear(2, 2)
    model.again = model.other  # a module registered twice ties all its parameters
    assert find_tied_parameters(model) == [
        ["a.p", "m.p", "z.p"],
        ["again.bias", "other.bias"],
        ["again.weight", "other.weight"],
    ]


def test_retie_restores_a_broken_tie_with_the_real_weights() -> None:
    with init_empty_weights():
        model = LM()
    tied = find_tied_parameters(model)
    model.lm_head.weight = nn.Parameter(torch.arange(40.0).reshape(10, 4))  # loaded: no longer tied
    assert model.embed.weight.is_meta
    retie_parameters(model, tied)
    assert model.embed.weight is model.lm_head.weight
    assert torch.equal(model.embed.weight, torch.arange(40.0).reshape(10, 4))
    assert find_tied_parameters(model) == tied


def test_retie_leaves_an_all_meta_group_alone() -> None:
    with init_empty_weights():
        model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    before = model.b.weight
    retie_parameters(model, [["a.weight", "b.weight"]])
    assert model.b.weight is before and model.a.weight is not before


def test_retie_names_what_is_not_a_parameter() -> None:
    with pytest.raises(ValueError, match="'body.nothing' names no parameter"):
        retie_parameters(LM(), [["embed.weight", "body.nothing"]])
    with pytest.raises(ValueError, match="'missing.weight' names no parameter"):
        retie_parameters(LM(), [["missing.weight"]])
