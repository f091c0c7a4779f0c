"""The hooks API (ModelHook, SequentialHook, add/remove) and the attach_* helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fnaccel.modeling.attach import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from fnaccel.modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
)
from fnaccel.modeling.offload import OffloadedWeightsLoader, offload_state_dict


class Recorder(ModelHook):
    """A user's hook: logs its calls in a shared list."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.log.append(f"{self.name}.init")
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.log.append(f"{self.name}.pre")
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.log.append(f"{self.name}.post")
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        self.log.append(f"{self.name}.detach")
        return module


class AddToInput(ModelHook):
    def __init__(self, value: float) -> None:
        self.value = value

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (args[0] + self.value, *args[1:]), kwargs


class ScaleOutput(ModelHook):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output * self.factor


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def test_user_hooks_change_inputs_and_outputs_and_compose_in_order() -> None:
    layer, reference = _linear(), _linear()
    x = torch.randn(4, 3)
    add_hook_to_module(layer, SequentialHook(AddToInput(1.0), ScaleOutput(3.0), AddToInput(2.0)))
    torch.testing.assert_close(layer(x), reference(x + 1.0 + 2.0) * 3.0, rtol=0, atol=0)


def test_append_runs_the_new_hook_after_the_old_and_replace_detaches_the_old() -> None:
    log: list[str] = []
    layer = _linear()
    add_hook_to_module(layer, Recorder("a", log))
    add_hook_to_module(layer, Recorder("b", log), append=True)
    assert isinstance(layer._hf_hook, SequentialHook)
    layer(torch.ones(1, 3))
    assert log == ["a.init", "b.init", "a.pre", "b.pre", "a.post", "b.post"]
    log.clear()
    add_hook_to_module(layer, Recorder("c", log))  # replaces: both old hooks detach, newest first
    assert log == ["b.detach", "a.detach", "c.init"]
    log.clear()
    layer(torch.ones(1, 3))
    assert log == ["c.pre", "c.post"]


def test_remove_restores_the_plain_module_and_recurse_reaches_submodules() -> None:
    log: list[str] = []
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(_linear(1)))
    for module in (model, model[0], model[1][0]):
        add_hook_to_module(module, Recorder("r", log))
    remove_hook_from_module(model)
    assert not hasattr(model, "_hf_hook") and hasattr(model[0], "_hf_hook")
    remove_hook_from_module(model, recurse=True)
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    log.clear()
    model(torch.ones(1, 3))
    assert log == []


def test_no_grad_hook_runs_the_forward_without_autograd_and_restores_it() -> None:
    class NoGrad(ModelHook):
        no_grad = True

    layer = add_hook_to_module(_linear(), NoGrad())
    assert not layer(torch.ones(1, 3)).requires_grad and torch.is_grad_enabled()
    remove_hook_from_module(layer)
    assert layer(torch.ones(1, 3)).requires_grad


def test_post_forward_runs_even_when_the_forward_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    log: list[str] = []
    module = add_hook_to_module(Boom(), Recorder("r", log))
    with pytest.raises(RuntimeError, match="boom"):
        module(torch.ones(1))
    assert log == ["r.init", "r.pre", "r.post"]


def test_a_hook_that_is_not_a_model_hook_is_refused() -> None:
    with pytest.raises(TypeError, match="subclass"):
        add_hook_to_module(_linear(), object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ModelHook"):
        SequentialHook(ScaleOutput(1.0), "not a hook")  # type: ignore[arg-type]


def test_align_devices_hook_io_same_device_returns_the_output_where_the_input_was() -> None:
    # "meta" stands in for an accelerator: the input goes there, the output comes back to the CPU
    layer = _linear()
    seen: list[str] = []
    add_hook_to_module(layer, AlignDevicesHook("meta", io_same_device=True))
    layer.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].device.type)
    )  # runs after the hook
    with pytest.raises(
        NotImplementedError
    ):  # meta -> cpu copies have no data: torch refuses, which shows the move
        layer(torch.ones(1, 3))
    assert seen == ["meta"] and layer.weight.is_meta


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))


def test_attach_execution_device_hook_hooks_modules_that_own_tensors_only() -> None:
    model = _net()
    attach_execution_device_hook(model, "cpu")
    assert [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")] == ["0", "2.0", "2.1"]
    torch.testing.assert_close(model(torch.ones(2, 4)), _net()(torch.ones(2, 4)), rtol=0, atol=0)


def test_attach_align_device_hook_offloads_every_layer_from_a_weights_map(tmp_path: Path) -> None:
    model, reference = _net(), _net()
    offload_state_dict(tmp_path, model.state_dict())
    attach_align_device_hook(
        model, "cpu", offload=True, weights_map=OffloadedWeightsLoader(save_folder=tmp_path)
    )
    assert all(p.is_meta for p in model.parameters())
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert all(p.is_meta for p in model.parameters())


def test_preload_module_classes_load_their_whole_subtree_at_once() -> None:
    model = _net()
    attach_align_device_hook(model, "cpu", offload=True, preload_module_classes=["Sequential"])
    assert [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")] == [""]
    assert model._hf_hook.place_submodules
    torch.testing.assert_close(model(torch.ones(1, 4)), _net()(torch.ones(1, 4)), rtol=0, atol=0)


def test_on_blocks_splits_a_model_between_memory_and_disk_with_the_whole_models_outputs(
    tmp_path: Path,
) -> None:
    model, reference = _net(), _net()
    offload_state_dict(tmp_path, {k: v for k, v in model.state_dict().items() if k.startswith("2.")})
    weights = OffloadedWeightsLoader(save_folder=tmp_path)
    attach_align_device_hook_on_blocks(
        model, {"0": "cpu", "2": "cpu"}, {"0": False, "2": True}, weights_map=weights, module_name=""
    )
    assert not model[0].weight.is_meta and model[2][0].weight.is_meta and model[2][1].weight.is_meta
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert model[2][1].weight.is_meta


def test_on_blocks_with_one_device_and_no_offload_moves_the_whole_model() -> None:
    model = _net()
    attach_align_device_hook_on_blocks(model, "cpu", offload=False)
    assert model._hf_hook.place_submodules and model._hf_hook.io_same_device


def test_on_blocks_refuses_maps_of_different_blocks() -> None:
    with pytest.raises(ValueError, match="same blocks"):
        attach_align_device_hook_on_blocks(_net(), {"0": "cpu"}, {"2": True})
