"""cpu_offload, disk_offload, cpu_offload_with_hook, has_offloaded_params, align_module_device
and layerwise casting."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fnaccel.modeling.big_modeling import (
    CpuOffload,
    UserCpuOffloadHook,
    align_module_device,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    has_offloaded_params,
)
from fnaccel.modeling.hooks import remove_hook_from_module
from fnaccel.modeling.layerwise_casting import LayerwiseCastingHook, attach_layerwise_casting_hooks
from fnaccel.modeling.offload import read_offload_index


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).eval()


def test_cpu_offload_keeps_weights_off_the_modules_and_gives_the_whole_models_outputs() -> None:
    model, reference = _net(), _net()
    cpu_offload(model, "cpu")
    assert all(p.is_meta for p in model.parameters())
    assert not model[1].running_mean.is_meta  # buffers stay unless offload_buffers
    x = torch.randn(6, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert all(p.is_meta for p in model.parameters()) and has_offloaded_params(model[0])


def test_cpu_offload_with_offload_buffers_puts_buffers_on_meta_too() -> None:
    model, reference = _net(), _net()
    cpu_offload(model, "cpu", offload_buffers=True)
    assert model[1].running_mean.is_meta
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_disk_offload_reads_every_weight_from_the_folder(tmp_path: Path) -> None:
    model, reference = _net(), _net()
    disk_offload(model, tmp_path, "cpu")
    assert "0.weight" in read_offload_index(tmp_path) and all(p.is_meta for p in model.parameters())
    x = torch.randn(6, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_disk_offload_of_a_model_on_meta_without_a_folder_index_is_refused(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        disk_offload(model, tmp_path, "cpu")


def test_has_offloaded_params_is_false_for_plain_and_non_offloading_hooks() -> None:
    model = _net()
    assert not has_offloaded_params(model[0])
    cpu_offload_with_hook(model[0], "cpu")
    assert not has_offloaded_params(model[0])


def test_align_module_device_gives_real_weights_inside_and_releases_them_after() -> None:
    model, reference = _net(), _net()
    cpu_offload(model, "cpu")
    with align_module_device(model[0]):
        torch.testing.assert_close(model[0].weight, reference[0].weight, rtol=0, atol=0)
    assert model[0].weight.is_meta


def test_align_module_device_moves_a_plain_modules_parameters_there_and_puts_them_back() -> None:
    layer = nn.Linear(2, 2)
    weight = layer.weight
    with align_module_device(layer, "meta"):
        assert layer.weight.is_meta
    assert layer.weight is weight  # the same parameter object: an optimizer still holds it
    with align_module_device(layer):  # nothing asked, nothing moved
        assert layer.weight.device.type == "cpu"


class Tracked(nn.Linear):
    """A model that logs each device move it is asked for (nn.Module.to is how CpuOffload moves it)."""

    def __init__(self, name: str, log: list[str], n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.name, self.log = name, log

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.log.append(f"{self.name}->{torch.device(args[0]).type if args else kwargs}")
        return super().to(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(f"{self.name} runs")
        return super().forward(x)


def test_cpu_offload_with_hook_offloads_a_chain_of_three_models_in_turn() -> None:
    # On this CPU-only box the execution device is the CPU, so residency itself is not visible;
    # what is: every model is moved to the execution device right before it runs and the previous
    # model of the chain is sent back first (test_..._on_cuda below checks the residency on a GPU).
    log: list[str] = []
    torch.manual_seed(0)
    models = [Tracked("a", log, 4, 4), Tracked("b", log, 4, 4), Tracked("c", log, 4, 2)]
    reference = copy.deepcopy(models)
    hook = None
    hooks: list[UserCpuOffloadHook] = []
    for model in models:
        _, hook = cpu_offload_with_hook(model, "cpu", prev_module_hook=hook)
        hooks.append(hook)
    assert log == ["a->cpu", "b->cpu", "c->cpu"]
    log.clear()
    x = torch.randn(3, 4)
    out = models[2](models[1](models[0](x)))
    assert log == ["a->cpu", "a runs", "a->cpu", "b->cpu", "b runs", "b->cpu", "c->cpu", "c runs"]
    hooks[-1].offload()
    assert log[-1] == "c->cpu"
    expected = reference[2](reference[1](reference[0](x)))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert isinstance(models[1]._hf_hook, CpuOffload) and models[1]._hf_hook.prev_module_hook is hooks[0]
    hooks[1].remove()
    assert not hasattr(models[1], "_hf_hook")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: residency on the execution device")
def test_cpu_offload_with_hook_keeps_only_the_running_model_on_cuda() -> None:
    models = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)]
    hook = None
    hooks = []
    for model in models:
        _, hook = cpu_offload_with_hook(model, "cuda", prev_module_hook=hook)
        hooks.append(hook)
    seen: list[list[str]] = []
    for model in models:
        model.register_forward_pre_hook(
            lambda m, a: seen.append([next(x.parameters()).device.type for x in models])
        )
    x = torch.randn(2, 4)
    models[2](models[1](models[0](x)))
    assert seen == [["cuda", "cpu", "cpu"], ["cpu", "cuda", "cpu"], ["cpu", "cpu", "cuda"]]
    hooks[-1].offload()
    assert all(next(m.parameters()).device.type == "cpu" for m in models)


def test_cpu_offload_refuses_a_prev_hook_of_another_kind() -> None:
    with pytest.raises(TypeError, match="UserCpuOffloadHook"):
        CpuOffload("cpu", prev_module_hook=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_layerwise_casting_stores_low_precision_and_matches_a_model_cast_by_hand(
    storage: torch.dtype,
) -> None:
    model = _net()
    by_hand = _net()
    with torch.no_grad():
        for layer in (by_hand[0], by_hand[3]):
            for param in layer.parameters():
                param.copy_(param.to(storage).to(torch.float32))
    attach_layerwise_casting_hooks(model, storage, torch.float32)
    assert {p.dtype for layer in (model[0], model[3]) for p in layer.parameters()} == {storage}
    assert model[1].weight.dtype == torch.float32  # norms are not cast
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), by_hand(x), rtol=0, atol=0)
    assert model[0].weight.dtype == storage  # back to storage after the forward


def test_layerwise_casting_skips_by_pattern_and_class() -> None:
    model = _net()
    attach_layerwise_casting_hooks(
        model, torch.float16, torch.float32, skip_modules_pattern="^3$", skip_modules_classes=[nn.BatchNorm1d]
    )
    assert model[0].weight.dtype == torch.float16 and model[3].weight.dtype == torch.float32
    assert isinstance(model[0]._hf_hook, LayerwiseCastingHook) and not hasattr(model[3], "_hf_hook")
    remove_hook_from_module(model, recurse=True)
    assert model[0].weight.dtype == torch.float16  # removing the hook leaves the stored dtype


def test_layerwise_casting_refuses_non_float_dtypes() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        attach_layerwise_casting_hooks(_net(), torch.int8, torch.float32)
    with pytest.raises(TypeError, match="floating-point"):
        LayerwiseCastingHook(torch.float16, "float32")  # type: ignore[arg-type]


def test_dispatch_model_runs_on_the_public_hooks(tmp_path: Path) -> None:
    from fnaccel.modeling.dispatch import dispatch_model
    from fnaccel.modeling.hooks import AlignDevicesHook, ModelHook, add_hook_to_module

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            Count.calls += 1
            return args, kwargs

    model, reference = _net(), _net()
    dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "cpu", "3": "disk"}, offload_dir=tmp_path)
    assert isinstance(model[3]._hf_hook, AlignDevicesHook) and has_offloaded_params(model[3])
    assert not has_offloaded_params(model[0])
    with align_module_device(model[3]):
        torch.testing.assert_close(model[3].weight, reference[3].weight, rtol=0, atol=0)
    assert model[3].weight.is_meta
    add_hook_to_module(model[3], Count(), append=True)  # a user's hook after fnaccel's
    x = torch.randn(4, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert Count.calls == 1 and model[3].weight.is_meta
