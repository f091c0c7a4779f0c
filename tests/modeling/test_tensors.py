"""set_module_tensor_to_device: Accelerate's semantics, checked one rule at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fnaccel.modeling.tensors import as_device, device_for, parse_device_map, set_module_tensor_to_device


class Scaled(nn.Parameter):
    """A parameter subclass, as quantization libraries define them."""


def meta_model() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    return model


def test_dotted_names_reach_nested_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.BatchNorm1d(2))
    set_module_tensor_to_device(model, "0.0.weight", "meta")
    set_module_tensor_to_device(model, "1.running_mean", "meta")
    assert model[0][0].weight.is_meta and isinstance(model[0][0].weight, nn.Parameter)
    assert model[1].running_mean.is_meta and "running_mean" in model[1]._buffers
    assert not model[0][0].bias.is_meta


def test_a_meta_tensor_needs_a_value_to_become_real() -> None:
    model = meta_model()
    with pytest.raises(ValueError, match=r"'0.weight' is on the meta device and holds no data: pass value="):
        set_module_tensor_to_device(model, "0.weight", "cpu")
    set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(2, 3))
    assert model[0].weight.device.type == "cpu" and torch.equal(model[0].weight, torch.ones(2, 3))


def test_parameters_keep_their_class_and_requires_grad() -> None:
    model = nn.Linear(2, 2)
    model.weight = Scaled(torch.zeros(2, 2), requires_grad=False)
    set_module_tensor_to_device(model, "weight", "cpu", value=torch.ones(2, 2))
    set_module_tensor_to_device(model, "bias", "meta")
    assert type(model.weight) is Scaled and not model.weight.requires_grad
    assert type(model.bias) is nn.Parameter and model.bias.requires_grad and model.bias.is_meta


def test_a_tensor_already_there_stays_the_same_object() -> None:
    model = nn.Linear(2, 2)
    weight = model.weight
    set_module_tensor_to_device(model, "weight", "cpu")
    assert model.weight is weight


def test_values_take_the_model_dtype_unless_a_dtype_is_given_and_integers_are_never_cast() -> None:
    model = meta_model()
    set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(2, 3, dtype=torch.float64))
    assert model[0].weight.dtype == torch.float32  # as nn.Module.load_state_dict does
    set_module_tensor_to_device(model, "0.bias", "cpu", value=torch.ones(2), dtype=torch.bfloat16)
    assert model[0].bias.dtype == torch.bfloat16
    set_module_tensor_to_device(
        model, "1.num_batches_tracked", "cpu", value=torch.tensor(7), dtype=torch.float16
    )
    assert model[1].num_batches_tracked.dtype == torch.int64 and model[1].num_batches_tracked.item() == 7
    set_module_tensor_to_device(model, "1.weight", "meta", dtype=torch.float16)  # meta keeps shape and dtype
    assert model[1].weight.dtype == torch.float16 and model[1].weight.is_meta


def test_shape_mismatches_unknown_names_and_bad_devices_are_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"shape \(3,\) but the module's tensor has \(2,\)"):
        set_module_tensor_to_device(model, "bias", "cpu", value=torch.ones(3))
    with pytest.raises(ValueError, match="has no parameter or buffer 'scale'"):
        set_module_tensor_to_device(model, "scale", "cpu")
    with pytest.raises(ValueError, match="has no submodule 'head'"):
        set_module_tensor_to_device(model, "head.weight", "cpu")
    with pytest.raises(ValueError, match="'disk' is only a device_map value"):
        set_module_tensor_to_device(model, "weight", "disk")
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        set_module_tensor_to_device(model, "weight", "gpu0")


def test_fp16_statistics_are_set_on_the_new_parameter_only() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    stats = torch.ones(2, dtype=torch.float16)
    set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.zeros(2, 2), fp16_statistics=stats)
    assert torch.equal(model[0].weight.SCB, stats)
    with pytest.raises(ValueError, match="is a buffer"):
        set_module_tensor_to_device(model, "1.running_mean", "cpu", fp16_statistics=stats)


def test_tied_params_map_reuses_the_tensor_already_on_the_device() -> None:
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    shared = torch.randn(2, 2)
    tied: dict[int, dict[torch.device, torch.Tensor]] = {shared.data_ptr(): {}}
    set_module_tensor_to_device(model, "0.weight", "cpu", value=shared, tied_params_map=tied)
    assert tied[shared.data_ptr()][torch.device("cpu")] is model[0].weight
    set_module_tensor_to_device(model, "1.weight", "cpu", value=shared, tied_params_map=tied)
    assert model[1].weight is model[0].weight  # one tensor on the device, not two


def test_device_maps_are_parsed_and_looked_up_by_longest_prefix() -> None:
    parsed = parse_device_map({"": "cpu", "h": "disk", "h.1": torch.device("cpu")})
    assert parsed == {"": torch.device("cpu"), "h": "disk", "h.1": torch.device("cpu")}
    assert device_for("h.10.weight", parsed) == "disk" and device_for("h.1.weight", parsed) == torch.device(
        "cpu"
    )
    assert device_for("x", {"h": "disk"}) is None
    assert as_device(1) == torch.device("cuda", 1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'h' on cuda:0, but CUDA is not available"):
            parse_device_map({"h": 0})
