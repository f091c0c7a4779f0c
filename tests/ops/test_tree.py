"""Tree operations (no communication): every container type comes back exactly."""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections import OrderedDict, defaultdict
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.ops import (
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from tests.ops._dist_fns import Box, FrozenBox, Pair, assert_tree_equal


@dataclasses.dataclass
class Derived:
    """A dataclass with a field computed in ``__post_init__`` (not an ``__init__`` argument)."""

    x: torch.Tensor
    numel: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.numel = self.x.numel()


class Movable:
    """A leaf with its own ``.to`` (like a tokenizer's BatchEncoding)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def to(self, device: Any) -> Movable:
        return Movable(str(device))


def sample_tree(k: int = 1) -> dict[str, Any]:
    """Every container type, with tensors multiplied by ``k`` and non-tensor leaves."""
    default: defaultdict[str, Any] = defaultdict(list)
    default["x"] = [torch.ones(2) * k, "keep"]
    return {
        "tensor": torch.arange(4.0) * k,
        "list": [torch.tensor(1) * k, 3, "text"],
        "tuple": (torch.ones(2, 2) * k, None),
        "pair": Pair(
            x=torch.zeros(3) + k,
            y=[Box(value=torch.ones(1) * k, extra={"k": torch.tensor([2.0]) * k})],
        ),
        "frozen": FrozenBox(value=(torch.tensor([5.0]) * k,)),
        "default": default,
        "ordered": OrderedDict(b=torch.ones(1) * k, a=torch.zeros(1)),
        "empty": torch.zeros(0, 3),
    }


# --------------------------------------------------------------------- recursively_apply


def test_recursively_apply_keeps_every_container_type() -> None:
    tree = sample_tree()
    out = recursively_apply(lambda t: t * 2, tree)
    assert_tree_equal(out, sample_tree(2))
    assert_tree_equal(tree, sample_tree(1))  # the input is rebuilt, not modified
    assert out["default"].default_factory is list
    assert type(out["pair"]) is Pair and type(out["frozen"]) is FrozenBox


def test_recursively_apply_on_a_bare_tensor_and_a_bare_leaf() -> None:
    assert_tree_equal(recursively_apply(torch.neg, torch.ones(2)), -torch.ones(2))
    assert recursively_apply(torch.neg, "text") == "text"


def test_recursively_apply_forwards_args_and_kwargs() -> None:
    out = recursively_apply(torch.Tensor.to, [torch.ones(1)], torch.int64, copy=True)
    assert_tree_equal(out, [torch.ones(1, dtype=torch.int64)])


def test_recursively_apply_with_a_custom_test_type() -> None:
    tree = {"n": [1, 2.5, torch.ones(1)], "s": "a"}
    out = recursively_apply(lambda v: v + 1, tree, test_type=lambda v: isinstance(v, int))
    assert_tree_equal(out, {"n": [2, 2.5, torch.ones(1)], "s": "a"})


def test_recursively_apply_error_on_other_type_names_the_function() -> None:
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\) passed to `double`"):
        recursively_apply(double, {"x": torch.ones(1), "name": "a"}, error_on_other_type=True)
    out = recursively_apply(double, (torch.ones(1),), error_on_other_type=True)
    assert_tree_equal(out, (torch.full((1,), 2.0),))


def test_recursively_apply_recomputes_init_false_dataclass_fields() -> None:
    out = recursively_apply(lambda t: torch.cat([t, t]), Derived(x=torch.ones(3)))
    assert type(out) is Derived
    assert_tree_equal(out.x, torch.ones(6))
    assert out.numel == 6


def test_recursively_apply_leaves_classes_alone() -> None:
    assert recursively_apply(torch.neg, {"cls": Box}) == {"cls": Box}


# --------------------------------------------------------------------- send_to_device


def _on_meta(tree: Any) -> Any:
    return recursively_apply(lambda t: t.to("meta"), tree)


def test_send_to_device_moves_every_tensor_and_keeps_containers() -> None:
    tree = sample_tree()
    out = send_to_device(tree, "meta")
    assert_tree_equal(out, _on_meta(sample_tree()))
    assert_tree_equal(tree, sample_tree())  # still on the CPU


def test_send_to_device_moves_objects_with_a_to_method() -> None:
    out: dict[str, Any] = send_to_device({"enc": Movable(), "n": 3}, torch.device("meta"))
    assert out["enc"].device == "meta" and out["n"] == 3


@pytest.mark.parametrize("skip_keys", ["labels", ["labels", "ids"]])
def test_send_to_device_skip_keys(skip_keys: str | list[str]) -> None:
    labels, ids, x = torch.ones(2), torch.arange(2), torch.zeros(1)
    tree = {
        "x": x,
        "labels": labels,
        "nested": [{"labels": labels, "ids": ids, "y": x}],
        "box": Box(value={"labels": labels, "y": x}),
        "default": defaultdict[str, Any](int, labels=labels, y=x),
    }
    out: dict[str, Any] = send_to_device(tree, "meta", skip_keys=skip_keys)
    meta_x = x.to("meta")
    skipped_ids = ids if isinstance(skip_keys, list) else ids.to("meta")
    assert_tree_equal(
        out,
        {
            "x": meta_x,
            "labels": labels,
            "nested": [{"labels": labels, "ids": skipped_ids, "y": meta_x}],
            "box": Box(value={"labels": labels, "y": meta_x}),
            "default": defaultdict[str, Any](int, labels=labels, y=meta_x),
        },
    )
    assert out["labels"] is labels and out["nested"][0]["labels"] is labels  # not copied
    assert out["default"].default_factory is int


def test_send_to_device_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    original = torch.Tensor.to

    def recording_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get("non_blocking", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    tree = {"a": torch.ones(1), "b": [torch.zeros(2)]}
    send_to_device(tree, "meta", non_blocking=True)
    assert seen == [True, True]
    seen.clear()
    send_to_device(tree, "meta", skip_keys="b", non_blocking=True)
    assert seen == [True]
    seen.clear()
    send_to_device(tree, "meta")
    assert seen == [False, False]


# --------------------------------------------------------------------- listify, fp32


def test_listify_nested_and_bf16() -> None:
    tree = {
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "pair": Pair(x=torch.tensor(3), y=[torch.tensor([[True, False]])]),
        "frozen": FrozenBox(value=(torch.tensor([0.25], dtype=torch.float16), "s")),
    }
    out = listify(tree)
    expected = {
        "bf16": [1.5, -2.0],
        "pair": Pair(x=3, y=[[[True, False]]]),
        "frozen": FrozenBox(value=([0.25], "s")),
    }
    assert_tree_equal(out, expected)
    assert all(type(v) is float for v in out["bf16"])
    assert type(out["pair"].x) is int


def test_convert_to_fp32_casts_only_half_precision() -> None:
    f64, ids = torch.ones(1, dtype=torch.float64), torch.arange(2)
    tree: dict[str, Any] = {
        "f16": torch.tensor([1.5], dtype=torch.float16),
        "pair": Pair(x=torch.tensor(2.0, dtype=torch.bfloat16), y=[f64, ids, "s"]),
        "box": Box(value=torch.zeros(1)),
    }
    out = convert_to_fp32(tree)
    assert_tree_equal(
        out,
        {
            "f16": torch.tensor([1.5]),
            "pair": Pair(x=torch.tensor(2.0), y=[f64, ids, "s"]),
            "box": Box(value=torch.zeros(1)),
        },
    )
    assert out["pair"].y[0] is f64 and out["pair"].y[1] is ids  # left alone, not copied
    assert tree["f16"].dtype == torch.float16


def half_forward(x: torch.Tensor, *, scale: float = 1.0) -> Any:
    """A module-level forward (picklable) with half-precision outputs."""
    return {"logits": (x * scale).half(), "aux": Pair(x=x.bfloat16(), y=x.long())}


def test_convert_outputs_to_fp32_wraps_a_forward() -> None:
    forward = convert_outputs_to_fp32(half_forward)
    x = torch.tensor([1.0, 2.5])
    expected = {"logits": torch.tensor([2.0, 5.0]), "aux": Pair(x=x, y=torch.tensor([1, 2]))}
    assert_tree_equal(forward(x, scale=2.0), expected)
    restored = pickle.loads(pickle.dumps(forward))
    assert_tree_equal(restored(x, scale=2.0), expected)


def test_convert_outputs_to_fp32_pickles_a_module_forward() -> None:
    model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    forward = convert_outputs_to_fp32(model.forward)
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    restored = pickle.loads(pickle.dumps(forward))
    assert restored(x).dtype == torch.float32
    assert_tree_equal(restored(x), model(x).float())


# --------------------------------------------------------------------- slice, concatenate


@pytest.mark.parametrize("index", [slice(1, 3), 0, (slice(None), -1)], ids=["slice", "int", "tuple"])
def test_slice_tensors(index: Any) -> None:
    a, b = torch.arange(12).reshape(4, 3), torch.arange(8.0).reshape(4, 2)
    tree = {"a": a, "rest": Pair(x=[b], y=FrozenBox(value=(a, "s")))}
    out = slice_tensors(tree, index)
    expected = {"a": a[index], "rest": Pair(x=[b[index]], y=FrozenBox(value=(a[index], "s")))}
    assert_tree_equal(out, expected)
    assert_tree_equal(tree["a"], torch.arange(12).reshape(4, 3))


def test_concatenate_nested_trees() -> None:
    def tree(k: int) -> Any:
        default: defaultdict[str, Any] = defaultdict(list, x=torch.full((k, 2), k))
        return {
            "a": torch.arange(k),
            "pair": Pair(x=[torch.full((k, 1), float(k))], y=(torch.ones(k, dtype=torch.bool), "s")),
            "box": Box(value=default, extra=FrozenBox(value=torch.zeros(k, 0))),
        }

    out = concatenate([tree(1), tree(2), tree(3)])
    assert_tree_equal(
        out,
        {
            "a": torch.cat([torch.arange(1), torch.arange(2), torch.arange(3)]),
            "pair": Pair(
                x=[torch.tensor([[1.0], [2.0], [2.0], [3.0], [3.0], [3.0]])],
                y=(torch.ones(6, dtype=torch.bool), "s"),
            ),
            "box": Box(
                value=defaultdict[str, Any](
                    list, x=torch.tensor([[1, 1], [2, 2], [2, 2], [3, 3], [3, 3], [3, 3]])
                ),
                extra=FrozenBox(value=torch.zeros(6, 0)),
            ),
        },
    )


def test_concatenate_along_another_dim() -> None:
    out = concatenate([(torch.ones(2, 1),), (torch.zeros(2, 2),)], dim=1)
    assert_tree_equal(out, (torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]),))
    assert_tree_equal(concatenate([torch.ones(1), torch.zeros(1)]), torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize(
    "trees",
    [
        [{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}],
        [{"a": torch.ones(1)}, {"b": torch.ones(1)}],
        [{"a": torch.ones(1), "b": torch.zeros(1)}, {"b": torch.zeros(1), "a": torch.ones(1)}],
        [[torch.ones(1), torch.ones(1)], [torch.ones(1)]],
        [Pair(x=torch.ones(1), y=torch.ones(1)), (torch.ones(1), torch.ones(1))],
        [[torch.ones(1), "s"], ["s", torch.ones(1)]],
    ],
    ids=["extra-key", "other-key", "key-order", "length", "namedtuple-vs-tuple", "leaf-position"],
)
def test_concatenate_rejects_a_structure_mismatch(trees: list[Any]) -> None:
    with pytest.raises(ValueError, match="tree 1 .*same structure"):
        concatenate(trees)


def test_concatenate_needs_at_least_one_tree() -> None:
    with pytest.raises(ValueError, match="at least one tree"):
        concatenate([])


@pytest.mark.parametrize(
    ("trees", "where"),
    [
        ([{"a": "x"}, {"a": "y"}], "['a']"),
        ([(torch.ones(1), 1), (torch.ones(1), 2)], "[1]"),
        (
            [{"t": torch.ones(1), "n": Pair(x=1, y="s")}, {"t": torch.ones(1), "n": Pair(x=1, y="u")}],
            "['n'].y",
        ),
        ([[torch.ones(1), 1], [torch.ones(1), 1.0]], "[1]"),  # 1 == 1.0, but not the same leaf
    ],
    ids=["strings", "ints", "nested", "int-vs-float"],
)
def test_concatenate_refuses_non_tensor_leaves_that_differ(trees: list[Any], where: str) -> None:
    """Accelerate raises TypeError ("Can only concatenate tensors"); the first tree's
    leaf was silently kept before."""
    with pytest.raises(TypeError, match=rf"Can only concatenate tensors.*{re.escape(where)}"):
        concatenate(trees)


def test_concatenate_keeps_equal_non_tensor_leaves() -> None:
    out = concatenate([{"t": torch.ones(1), "tag": ("a", 1)}, {"t": torch.zeros(1), "tag": ("a", 1)}])
    assert_tree_equal(out, {"t": torch.tensor([1.0, 0.0]), "tag": ("a", 1)})
    assert concatenate([{"a": "x"}, {"a": "x"}]) == {"a": "x"}


def test_concatenate_of_one_tree_returns_it() -> None:
    """As Accelerate: a list of one non-tensor is returned as it is (it raised before)."""
    assert concatenate(["s"]) == "s"
    tree = {"t": torch.ones(2), "n": None}
    out = concatenate([tree])
    assert_tree_equal(out, tree)
    out["t"].add_(1)  # a new tensor, as torch.cat makes
    assert_tree_equal(tree, {"t": torch.ones(2), "n": None})


def test_tree_ops_are_the_same_functions_in_fnaccel_utils() -> None:
    from fnaccel import utils

    for name in (
        "concatenate",
        "convert_outputs_to_fp32",
        "convert_to_fp32",
        "listify",
        "recursively_apply",
        "send_to_device",
        "slice_tensors",
    ):
        assert getattr(utils, name) is getattr(fa.ops, name), name


def test_tree_paths_name_each_tensor_leaf_the_same_way_in_every_process() -> None:
    from fnaccel.ops.tree import tree_paths

    class Key:  # its repr holds a memory address, which differs between processes
        pass

    tree = {"a": [torch.ones(1), "s"], 3: Pair(x=torch.ones(1), y=None), Key(): torch.ones(1)}
    assert tree_paths(tree) == ["['a'][0]", "[3].x", "[<Key>]"]
    assert tree_paths(Box(value=(torch.ones(1),))) == [".value[0]"]
