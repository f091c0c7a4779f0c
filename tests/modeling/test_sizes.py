"""Module sizes in bytes: `compute_module_sizes` and friends, checked against hand counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    dtype_byte_size,
    get_max_layer_size,
    named_module_tensors,
)


class Net(nn.Module):
    """fc1: 4x8+8 = 40 floats (160 B); bn: 8+8 params (64 B), two float stats (64 B),
    one int64 counter (8 B); fc2: 8x2+2 = 18 floats (72 B); a non-persistent mask of 4 bools."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool), persistent=False)


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        (torch.float32, 4),
        (torch.float16, 2),
        (torch.bfloat16, 2),
        (torch.float64, 8),
        (torch.int8, 1),
        (torch.int64, 8),
        (torch.uint8, 1),
        (torch.bool, 1 / 8),
        (torch.float8_e4m3fn, 1),
        (torch.complex64, 8),
        ("float16", 2),
        ("torch.bfloat16", 2),
        ("int4", 0.5),
        ("int2", 0.25),
        ("fp8", 1),
        ("int8", 1),
    ],
)
def test_dtype_byte_size(dtype: torch.dtype | str, size: float) -> None:
    assert dtype_byte_size(dtype) == size


def test_dtype_byte_size_rejects_what_is_no_dtype() -> None:
    with pytest.raises(ValueError, match="'float17' is not a dtype"):
        dtype_byte_size("float17")
    with pytest.raises(ValueError, match="not a dtype"):
        dtype_byte_size("Linear")


def test_named_module_tensors() -> None:
    net = Net()
    assert [n for n, _ in named_module_tensors(net)] == ["mask"]
    assert [n for n, _ in named_module_tensors(net, include_buffers=False)] == []
    names = [n for n, _ in named_module_tensors(net, recurse=True)]
    assert names == [
        "fc1.weight",
        "fc1.bias",
        "bn.weight",
        "bn.bias",
        "fc2.weight",
        "fc2.bias",
        "mask",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    persistent = [n for n, _ in named_module_tensors(net, recurse=True, remove_non_persistent=True)]
    assert persistent == [n for n in names if n != "mask"]
    assert [n for n, _ in named_module_tensors(net, remove_non_persistent=True)] == []


def test_compute_module_sizes_by_hand() -> None:
    sizes = compute_module_sizes(Net())
    assert sizes["fc1"] == 160 and sizes["fc1.weight"] == 128 and sizes["fc1.bias"] == 32
    assert sizes["bn"] == 64 + 64 + 8
    assert sizes["fc2"] == 72
    assert sizes["mask"] == 1  # four bools: half a byte, rounded up
    assert sizes[""] == 160 + 136 + 72 + 1
    assert sizes["no.such.module"] == 0  # a defaultdict, as in Accelerate


def test_dtype_shrinks_floats_only_and_never_grows_them() -> None:
    sizes = compute_module_sizes(Net(), dtype=torch.float16)
    assert sizes["fc1"] == 80
    assert sizes["bn"] == 32 + 32 + 8  # the int64 counter keeps its 8 bytes
    assert sizes["mask"] == 1
    assert compute_module_sizes(nn.Linear(2, 2).half(), dtype="float32")[""] == 12
    assert compute_module_sizes(nn.Linear(4, 1), dtype="int4")[""] == 3  # 5 elements of half a byte


def test_special_dtypes_win_over_dtype() -> None:
    sizes = compute_module_sizes(Net(), dtype="float16", special_dtypes={"fc1.weight": torch.float32})
    assert sizes["fc1"] == 128 + 16
    assert compute_module_sizes(Net(), special_dtypes={"bn.num_batches_tracked": "int8"})["bn"] == 64 + 64 + 1


def test_buffers_only_and_total_buffer_size() -> None:
    sizes = compute_module_sizes(Net(), buffers_only=True)
    assert sizes[""] == 64 + 8 + 1 and "fc1" not in sizes
    assert compute_module_total_buffer_size(Net()) == 73
    assert compute_module_total_buffer_size(Net(), dtype="float16") == 32 + 8 + 1
    assert compute_module_total_buffer_size(nn.Linear(2, 2)) == 0


def test_tied_parameters_are_counted_once_under_their_first_name() -> None:
    model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10)})
    model.head.weight = model.embed.weight
    sizes = compute_module_sizes(model)
    assert sizes["embed"] == 160 and sizes["head"] == 40 and sizes[""] == 200


def test_meta_models_are_sized_without_memory() -> None:
    with init_empty_weights(include_buffers=True):  # not even a transient allocation
        model = nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(16)])  # 4.3e9 parameters
    total, (largest, names) = calculate_maximum_sizes(model)
    assert total == 16 * (16384 * 16384 + 16384) * 4
    assert largest == (16384 * 16384 + 16384) * 4 and names == [str(i) for i in range(16)]


def test_get_max_layer_size_looks_into_modules_unless_told_not_to() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8),  # 288 B
        nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8)),  # 144 + 160 B
        nn.Linear(8, 8),  # 288 B
    )
    sizes = compute_module_sizes(model)
    children = list(model.named_children())
    assert get_max_layer_size(children, sizes, []) == (288, ["0", "2"])
    assert get_max_layer_size(children, sizes, ["Sequential"]) == (304, ["1"])
    assert get_max_layer_size([("1.0.weight", model[1][0].weight)], sizes, []) == (128, ["1.0.weight"])
    assert get_max_layer_size([], sizes, []) == (0, [])


def test_calculate_maximum_sizes_honours_no_split_modules() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8)))
    assert calculate_maximum_sizes(model) == (592, (288, ["0"]))
    setattr(model, "_no_split_modules", ["Sequential"])  # what transformers models set
    assert calculate_maximum_sizes(model) == (592, (304, ["1"]))


def test_top_level_parameters_and_buffers_are_layers_too() -> None:
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(100))
    model.fc = nn.Linear(2, 2)
    model.register_buffer("table", torch.zeros(50))
    assert calculate_maximum_sizes(model) == (400 + 24 + 200, (400, ["scale"]))
