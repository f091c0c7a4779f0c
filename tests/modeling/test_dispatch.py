"""dispatch_model and load_checkpoint_and_dispatch: a small model split over the CPU and disk
runs like the whole model, one offloaded layer in memory at a time (benchmarks/big_model.py
does the same at 1 GB and measures the memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fnaccel as fa
from fnaccel.modeling.dispatch import dispatch_model, load_checkpoint_and_dispatch
from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules
from fnaccel.modeling.offload import offload_state_dict, read_offload_index
from fnaccel.modeling.tensors import device_for

DIM = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class Net(nn.Module):
    """8 blocks of 33 KB each (about 0.27 MB) and a tied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(8))
        self.head = nn.Linear(DIM, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.embed(tokens) * scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


TOKENS = torch.tensor([[1, 5, 7, 2], [3, 3, 0, 31]])


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    fa.save_model(fa.prepare(fa.init(cpu=True), make_net(0)), tmp_path / "ckpt", max_shard_size="100KB")
    return tmp_path / "ckpt"


def disk_params(model: nn.Module) -> dict[str, torch.Tensor]:
    device_map = model.hf_device_map
    return {n: p for n, p in model.named_parameters() if device_for(n, device_map) == "disk"}


def test_a_model_split_over_cpu_and_disk_runs_like_the_whole_model(checkpoint: Path, tmp_path: Path) -> None:
    with init_empty_weights():
        model = Net()
    model = load_checkpoint_and_dispatch(
        model,
        checkpoint,
        device_map="auto",
        max_memory={"cpu": "120KB"},
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "off",
    )
    places = set(getattr(model, "hf_device_map").values())
    assert places == {"cpu", "disk"}
    with torch.no_grad():
        expected = make_net(0)(TOKENS, scale=0.5)
        assert torch.equal(model(TOKENS, scale=0.5), expected)
        assert torch.equal(model(TOKENS, scale=0.5), expected)  # and again: the weights come back each time
    on_disk = disk_params(model)
    assert on_disk and all(p.is_meta for p in on_disk.values())  # released after each layer
    assert len(read_offload_index(tmp_path / "off")) == len(on_disk)


def test_one_offloaded_layer_at_a_time_is_in_memory(checkpoint: Path, tmp_path: Path) -> None:
    with init_empty_weights():
        model = Net()
    device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks": "disk", "head": "cpu"}
    model = load_checkpoint_and_dispatch(model, checkpoint, device_map, offload_folder=tmp_path / "off")
    loaded: list[list[str]] = []

    def record(module: nn.Module, args: Any) -> None:  # runs after the offload hook has loaded the weights
        loaded.append(sorted(n for n, p in disk_params(model).items() if not p.is_meta))

    for name, module in model.named_modules():
        if name.startswith("blocks.3."):
            module.register_forward_pre_hook(record)
    with torch.no_grad():
        model(TOKENS)
    assert loaded == [
        ["blocks.3.fc1.bias", "blocks.3.fc1.weight"],
        ["blocks.3.fc2.bias", "blocks.3.fc2.weight"],
        ["blocks.3.norm.bias", "blocks.3.norm.weight"],
    ]


def test_a_weight_tied_across_cpu_and_disk_runs_from_both(checkpoint: Path, tmp_path: Path) -> None:
    with init_empty_weights():
        model = Net()
    model = load_checkpoint_and_dispatch(
        model, checkpoint, {"": "cpu", "head": "disk"}, offload_folder=tmp_path
    )
    assert model.head.weight.is_meta and not model.embed.weight.is_meta
    assert torch.equal(model(TOKENS), make_net(0)(TOKENS)) and model.head.weight.is_meta


def test_dispatching_a_loaded_model_offloads_it_and_removing_the_hooks_undoes_it(tmp_path: Path) -> None:
    model = make_net(0)
    expected = model(TOKENS)
    device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks": "disk", "head": "cpu"}
    dispatch_model(model, device_map, offload_dir=tmp_path / "off")
    assert model.blocks[5].fc1.weight.is_meta and not model.blocks[1].fc1.weight.is_meta
    assert "blocks.5.fc1.weight" in read_offload_index(tmp_path / "off")  # written from the model's weights
    assert torch.equal(model(TOKENS), expected)
    remove_hook_from_submodules(model)
    assert not any(p.is_meta for p in model.parameters()) and not hasattr(model, "hf_device_map")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert torch.equal(model(TOKENS), expected)


def test_the_weights_are_released_when_the_forward_raises(tmp_path: Path) -> None:
    model = make_net(0)
    dispatch_model(model, {"": "cpu", "head": "disk"}, offload_dir=tmp_path / "off")
    assert model.head(torch.ones(2, DIM)).shape == (2, 32) and model.head.weight.is_meta
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        model.head(torch.ones(2, 3))  # fails inside the head, its weights loaded
    assert model.head.weight.is_meta


def test_preload_module_classes_load_a_whole_subtree_for_modules_that_use_weights_directly(
    tmp_path: Path,
) -> None:
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.dense.weight, self.dense.bias)  # never calls self.dense

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Direct())
    expected = model(torch.ones(2, 4))
    dispatch_model(
        model, {"0": "cpu", "1": "disk"}, offload_dir=tmp_path / "off", preload_module_classes=["Direct"]
    )
    assert torch.equal(model(torch.ones(2, 4)), expected) and model[1].dense.weight.is_meta
    remove_hook_from_submodules(model)
    with pytest.raises((RuntimeError, NotImplementedError)):  # without preloading, the weights stay on meta
        dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=tmp_path / "off")(torch.ones(2, 4))


def test_offload_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).eval()
    norm = model[1]
    assert isinstance(norm, nn.BatchNorm1d) and norm.running_mean is not None
    norm.running_mean += 1.0
    expected = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
    dispatch_model(
        model, {"0": "cpu", "1": "disk", "2": "cpu"}, offload_dir=tmp_path / "off", offload_buffers=True
    )
    assert model[1].running_mean.is_meta and "1.running_mean" in read_offload_index(tmp_path / "off")
    assert torch.equal(model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))), expected)


def test_one_device_needs_no_hooks_unless_forced(tmp_path: Path) -> None:
    model = dispatch_model(make_net(0), {"": "cpu"})
    assert model.hf_device_map == {"": "cpu"} and not model._forward_pre_hooks
    forced = dispatch_model(make_net(0), {"": "cpu"}, force_hooks=True)
    assert forced._forward_pre_hooks and torch.equal(forced(TOKENS), make_net(0)(TOKENS))
    on_disk = dispatch_model(make_net(0), {"": "disk"}, offload_dir=tmp_path / "off", force_hooks=True)
    assert torch.equal(on_disk(TOKENS), make_net(0)(TOKENS)) and on_disk.embed.weight.is_meta


def test_mistakes_are_refused_with_the_fix(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"puts \['head'\] on 'disk': pass offload_dir="):
        dispatch_model(make_net(0), {"": "cpu", "head": "disk"})
    with pytest.raises(ValueError, match="whole model on 'disk': pass force_hooks=True"):
        dispatch_model(make_net(0), {"": "disk"}, offload_dir=tmp_path)
    with init_empty_weights():
        empty = Net()
    dispatch_model(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), {"0": "cpu", "1": "disk"}, offload_dir=tmp_path / "c"
    )  # leaves an offload folder for another model
    offload_state_dict(tmp_path / "c", {f"blocks.7.{k}": v for k, v in Block().state_dict().items()})
    with pytest.raises(ValueError, match="'embed.weight' is on the meta device, but the device_map keeps it"):
        dispatch_model(empty, {"": "cpu"})
    with pytest.raises(ValueError, match="'embed.weight' is on the meta device, but the device_map keeps it"):
        dispatch_model(empty, {"": "cpu", "blocks.7": "disk"}, offload_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="are on the meta device and the offload folder has no index.json"):
        dispatch_model(empty, {"": "disk", "embed": "cpu"}, offload_dir=tmp_path / "b")
    with pytest.raises(ValueError, match=r"'1.weight' has shape \[3, 3\] in .* but \[4, 4\] in the model"):
        dispatch_model(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
            {"0": "cpu", "1": "disk"},
            offload_dir=tmp_path / "c",
        )
    with pytest.raises(ValueError, match="'1.bias' is offloaded but .* has no weights for it"):
        dispatch_model(
            nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)),
            {"0": "cpu", "1": "disk"},
            offload_index={"1.weight": {"dtype": "float32", "shape": [3, 3]}},
            offload_dir=tmp_path / "c",
        )
    with pytest.raises(
        ValueError, match="a string must be one of auto, balanced, balanced_low_0, sequential"
    ):
        load_checkpoint_and_dispatch(make_net(0), checkpoint, device_map="fastest")


def test_without_a_device_map_the_checkpoint_is_only_loaded(checkpoint: Path) -> None:
    with init_empty_weights():
        model = Net()
    model = load_checkpoint_and_dispatch(model, checkpoint, strict=True)
    assert not hasattr(model, "hf_device_map") and torch.equal(model(TOKENS), make_net(0)(TOKENS))


def test_an_offloading_hook_alone_keeps_a_cpu_copy_and_gives_it_back() -> None:
    layer = nn.Linear(3, 2)
    weight = layer.weight.detach().clone()
    add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", offload=True))
    assert layer.weight.is_meta and "offload=True" in repr(layer._hf_hook)
    layer(torch.ones(1, 3))
    remove_hook_from_submodules(layer)
    assert torch.equal(layer.weight, weight) and isinstance(layer.weight, nn.Parameter)


def test_under_another_main_device_cpu_layers_are_offloaded_too(tmp_path: Path) -> None:
    # "meta" stands in for a GPU here: the path is the one a CUDA main device takes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    middle = model[1]
    assert isinstance(middle, nn.Linear)
    weight = middle.weight.detach().clone()
    dispatch_model(model, {"0": "meta", "1": "cpu", "2": "disk"}, main_device="meta", offload_dir=tmp_path)
    assert all(layer.weight.is_meta for layer in model)
    seen: list[tuple[str, str]] = []
    model[1].register_forward_pre_hook(
        lambda module, args: seen.append((module.weight.device.type, args[0].device.type))
    )
    assert model[1](torch.ones(2, 4)).is_meta and seen == [
        ("meta", "meta")
    ]  # weights and input on the main device
    hook = model[1]._hf_hook
    assert hook.offload and torch.equal(
        hook.weights_map["weight"], weight
    )  # kept in CPU memory between forwards
    assert not (tmp_path / "1.weight.dat").exists() and (tmp_path / "2.weight.dat").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_main_device_brings_cpu_and_disk_layers_over_one_at_a_time(
    checkpoint: Path, tmp_path: Path
) -> None:
    with init_empty_weights():
        model = Net()
    device_map = {
        "embed": 0,
        "blocks.0": 0,
        "blocks.1": "cpu",
        "blocks.2": "cpu",
        "blocks": "disk",
        "head": 0,
    }
    model = load_checkpoint_and_dispatch(model, checkpoint, device_map, offload_folder=tmp_path / "off")
    assert (
        model.blocks[1].fc1.weight.is_meta and model.blocks[0].fc1.weight.is_cuda
    )  # cpu layers: offloaded too
    out = model(TOKENS)  # CPU input: moved to the GPU, and the output back
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, make_net(0)(TOKENS))
    assert model.blocks[1].fc1.weight.is_meta and model.blocks[5].fc1.weight.is_meta
