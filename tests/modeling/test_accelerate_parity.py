"""Modelling utilities where Accelerate's own tests found a name or a behaviour missing:
`get_state_dict_offloaded_model`, `SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING`, the
"insufficient memory" log of `infer_auto_device_map`, the unexpected-keys log of
`load_checkpoint_in_model`, and `set_module_tensor_to_device`'s shape check.
Compared with Accelerate itself where it is installed (the bench extra)."""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from fnaccel.utils import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
    cpu_offload,
    disk_offload,
    get_state_dict_offloaded_model,
    infer_auto_device_map,
    load_checkpoint_in_model,
    set_module_tensor_to_device,
)


def _accelerate() -> Any:
    return pytest.importorskip("accelerate", reason="accelerate is not installed (the bench extra has it)")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    net.batchnorm.running_mean.uniform_()  # buffers that differ from a fresh module's
    return net


# get_state_dict_offloaded_model


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_the_offloaded_model_state_dict_equals_the_model_before_offloading(
    tmp_path: Path, where: str
) -> None:
    expected = {k: v.clone() for k, v in make_net().state_dict().items()}
    model = make_net()
    if where == "cpu":
        cpu_offload(model, "cpu", offload_buffers=True)
    else:
        disk_offload(model, tmp_path, "cpu", offload_buffers=True)
    assert model.linear1.weight.is_meta
    state = get_state_dict_offloaded_model(model)
    assert list(state) == list(expected)
    for key, tensor in expected.items():
        assert state[key].device.type == "cpu" and torch.equal(state[key], tensor), key
    assert model.linear1.weight.is_meta  # loaded for the copy, released after


def test_root_tensors_are_kept_and_meta_leftovers_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = make_net()
    model.scale = nn.Parameter(torch.ones(2))  # the model's own tensor (Accelerate's leaves it out)
    cpu_offload(model, "cpu")
    with torch.device("meta"):
        model.extra = nn.Linear(2, 2)  # never loaded, offloaded nowhere
    with caplog.at_level(logging.WARNING, logger="fnaccel.modeling.big_modeling"):
        state = get_state_dict_offloaded_model(model)
    assert torch.equal(state["scale"], torch.ones(2))
    assert "extra.weight" not in state and "linear1.weight" in state
    assert "extra.weight" in caplog.text and "meta" in caplog.text


def test_get_state_dict_offloaded_model_agrees_with_accelerate() -> None:
    accelerate = _accelerate()
    from accelerate.utils.modeling import get_state_dict_offloaded_model as theirs

    ours_model, their_model = make_net(), make_net()
    cpu_offload(ours_model, "cpu", offload_buffers=True)
    accelerate.cpu_offload(their_model, torch.device("cpu"), offload_buffers=True)
    ours, expected = get_state_dict_offloaded_model(ours_model), theirs(their_model)
    assert list(ours) == list(expected)
    assert all(torch.equal(ours[key], expected[key]) for key in expected)


# SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING


def test_the_upcasting_layers_are_accelerates() -> None:
    assert (
        nn.Linear in SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
        and nn.Conv2d in SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    )
    accelerate = _accelerate()
    del accelerate
    from accelerate.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING as theirs

    assert theirs == SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING


# infer_auto_device_map: devices left empty are logged


def _nested() -> nn.Module:
    inner = nn.Sequential(
        OrderedDict(
            [("linear1", nn.Linear(10, 4)), ("linear2", nn.Linear(4, 4)), ("linear3", nn.Linear(4, 8))]
        )
    )
    return nn.Sequential(OrderedDict([("module", inner)]))


def test_a_device_left_empty_is_logged_with_the_bytes_it_needed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fnaccel.modeling.device_map"):
        device_map = infer_auto_device_map(_nested(), max_memory={0: 256})
    assert device_map == {"": "disk"}
    assert "insufficient memory" in caplog.text and "  - 0: 336 bytes required" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fnaccel.modeling.device_map"):
        device_map = infer_auto_device_map(_nested(), max_memory={0: 256}, fallback_allocation=True)
    assert device_map == {"module.linear2": 0, "module.linear1": "disk", "module.linear3": "disk"}
    assert "insufficient memory" not in caplog.text


@pytest.mark.parametrize("case", ["nested", "nested-fallback", "no-fit", "partial", "tied", "buffers"])
def test_fallback_allocation_and_its_log_agree_with_accelerate(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    _accelerate()
    from accelerate.utils import infer_auto_device_map as theirs

    model, memory, fallback = _fallback_case(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn about the buffers in the last case
        with caplog.at_level(logging.INFO):
            ours = infer_auto_device_map(model, max_memory=memory, fallback_allocation=fallback)
        our_log = [r.getMessage() for r in caplog.records if "insufficient memory" in r.getMessage()]
        caplog.clear()
        with caplog.at_level(logging.INFO):
            expected = theirs(model, max_memory=memory, fallback_allocation=fallback)
        their_log = [r.getMessage() for r in caplog.records if "insufficient memory" in r.getMessage()]
    assert ours == dict(expected)
    assert [m.splitlines()[1] for m in our_log] == [m.splitlines()[1] for m in their_log]  # "  - 0: N bytes"


def _fallback_case(case: str) -> tuple[nn.Module, dict[Any, int], bool]:
    if case.startswith("nested"):
        return _nested(), {0: 256}, case.endswith("fallback")
    if case == "no-fit":
        inner = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        return nn.Sequential(OrderedDict([("module", inner)])), {0: 30}, True
    if case == "partial":
        blocks = [
            (f"module{i}", nn.Sequential(OrderedDict([("a", nn.Linear(20, 20)), ("b", nn.Linear(20, 20))])))
            for i in range(3)
        ]
        return nn.Sequential(OrderedDict(blocks)), {0: 5000}, True
    if case == "tied":
        model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
        model[1].weight = model[0].weight
        return model, {0: 600}, True
    model = nn.Sequential(
        OrderedDict(
            [
                ("linear1", nn.Linear(10, 10)),
                ("batchnorm", nn.BatchNorm1d(10)),
                ("linear2", nn.Linear(10, 10)),
            ]
        )
    )
    return model, {0: 678}, True


# load_checkpoint_in_model: unexpected weights, in Accelerate's words, on the logger


def test_unexpected_weights_are_logged_in_accelerates_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = {**make_net().state_dict(), "foo": torch.rand(4, 5)}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    for device_map in (None, {"": "cpu"}):
        caplog.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the logger, as Accelerate, never `warnings`
            with caplog.at_level(logging.WARNING, logger="fnaccel.modeling.loading"):
                load_checkpoint_in_model(make_net(1), tmp_path / "model.safetensors", device_map=device_map)
        assert "were not used when initializing Net: ['foo']" in caplog.text
        assert "missing" not in caplog.text
        with pytest.raises((ValueError, RuntimeError), match="foo"):
            load_checkpoint_in_model(
                make_net(1), tmp_path / "model.safetensors", device_map=device_map, strict=True
            )


# set_module_tensor_to_device: the shape check


def test_a_value_of_another_shape_is_a_value_error_naming_both_shapes() -> None:
    """Accelerate's exception type; the message names the full tensor name (Accelerate's
    names the attribute only): docs/migration.md."""
    model = make_net()
    with pytest.raises(ValueError, match=r"'linear1.weight' has shape \(2, 2\).*\(4, 3\)"):
        set_module_tensor_to_device(model, "linear1.weight", "cpu", value=torch.zeros(2, 2))
