"""load_state_dict and load_checkpoint_in_model into meta models, over devices and disk."""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.storage import weightfiles as checkpoint_files
from fnaccel.modeling import loading
from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.loading import IncompatibleKeys, load_checkpoint_in_model, load_state_dict
from fnaccel.modeling.offload import OffloadedWeightsLoader, read_offload_index


class TiedLM(nn.Module):
    """An embedding tied to the output layer, an int buffer, a norm and a block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position", torch.arange(4))
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(tokens))))


def make_lm(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    model = TiedLM()
    assert model.norm.running_mean is not None and model.norm.num_batches_tracked is not None
    model.norm.running_mean += torch.randn(8)  # buffers worth loading
    model.norm.num_batches_tracked += 3
    return model


def empty_lm() -> TiedLM:
    with init_empty_weights():
        return TiedLM()


def saved(path: Path, model: nn.Module, max_shard_size: int | str = "10GB") -> Path:
    fa.save_model(fa.prepare(fa.init(cpu=True), model), path, max_shard_size=max_shard_size)
    return path


def same_weights(model: nn.Module, expected: nn.Module) -> bool:
    ours, theirs = model.state_dict(), expected.state_dict()
    return list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


# load_state_dict


def test_load_state_dict_maps_the_cpu_part_and_gives_tied_names_back(tmp_path: Path) -> None:
    source = make_lm(0)
    saved(tmp_path, source)
    tensors = load_state_dict(tmp_path / "model.safetensors")
    assert sorted(tensors) == sorted(source.state_dict())
    assert all(torch.equal(tensors[k], v) for k, v in source.state_dict().items())
    assert tensors["head.weight"] is tensors["embed.weight"]  # stored once, returned tied
    mapped = load_state_dict(tmp_path / "model.safetensors", {"embed": "cpu", "block": "disk"})
    assert {t.device.type for t in mapped.values()} == {
        "cpu"
    }  # disk and unmapped: on the CPU, for offloading
    assert torch.equal(mapped["block.0.weight"], source.block[0].weight)


def test_load_state_dict_refuses_pickles_and_other_frameworks(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "w.bin")
    with pytest.raises(fa.CheckpointError, match="pickle checkpoint; fnaccel never unpickles"):
        load_state_dict(tmp_path / "w.bin")
    safetensors.torch.save_file({"w": torch.ones(1)}, tmp_path / "tf.safetensors", metadata={"format": "tf"})
    with pytest.raises(fa.CheckpointError, match="holds tf weights"):
        load_state_dict(tmp_path / "tf.safetensors")


# into a model on the meta device


def test_a_sharded_checkpoint_fills_a_meta_model_with_ties_and_buffers(tmp_path: Path) -> None:
    source = make_lm(0)
    saved(tmp_path, source, max_shard_size=600)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    model = empty_lm()
    assert load_checkpoint_in_model(model, tmp_path, strict=True) == IncompatibleKeys([], [])
    assert same_weights(model, source)
    assert model.head.weight is model.embed.weight
    assert all(type(p) is nn.Parameter and p.requires_grad for p in model.parameters())
    assert model.position.dtype == torch.int64
    tokens = torch.tensor([[1, 2, 3]])
    model.eval(), source.eval()
    assert torch.equal(model(tokens.flatten()), source(tokens.flatten()))


def test_the_files_are_released_and_mapped_a_slice_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved(tmp_path, make_lm(0))
    opened: list[str] = []
    real = getattr(loading, "safe_open")  # the name fnaccel.modeling.loading opens files with

    def counting(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(file).name)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(loading, "safe_open", counting)
    monkeypatch.setattr(checkpoint_files, "safe_open", counting)  # the header
    monkeypatch.setattr(loading, "_MAPPED_BYTES", 1)  # a new mapping for every tensor
    load_checkpoint_in_model(empty_lm(), tmp_path)
    assert len(opened) == 1 + len(make_lm(0).state_dict()) - 1  # the header, then each stored tensor once
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(tmp_path) not in maps.read_text()  # no mapping outlives the load


def test_dtype_casts_floats_except_modules_kept_in_fp32(tmp_path: Path) -> None:
    saved(tmp_path, make_lm(0))
    model = empty_lm()
    load_checkpoint_in_model(model, tmp_path, dtype=torch.float16, keep_in_fp32_modules=["norm"], strict=True)
    assert model.embed.weight.dtype == model.block[0].weight.dtype == torch.float16
    assert model.norm.weight.dtype == model.norm.running_mean.dtype == torch.float32
    assert model.norm.num_batches_tracked.dtype == model.position.dtype == torch.int64
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight, make_lm(0).embed.weight.half())


def test_a_partial_checkpoint_leaves_the_rest_on_meta_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = {k: v for k, v in make_lm(0).state_dict().items() if not k.startswith(("block.2", "head"))}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    model = empty_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported through the logger (as Accelerate does), not warnings
        with caplog.at_level(logging.WARNING, logger="fnaccel.modeling.loading"):
            result = load_checkpoint_in_model(model, tmp_path)
    assert re.search(r"missing from the checkpoint: \['block.2.weight', 'block.2.bias'\]", caplog.text)
    assert result == IncompatibleKeys(["block.2.weight", "block.2.bias"], [])
    assert model.block[2].weight.is_meta and not model.block[0].weight.is_meta


# device maps and disk


def test_disk_weights_go_to_the_offload_folder_and_stay_on_meta(tmp_path: Path) -> None:
    source = make_lm(0)
    saved(tmp_path / "ckpt", source)
    model = empty_lm()
    device_map = {"position": "cpu", "embed": "cpu", "block": "disk", "norm": "disk", "head": "disk"}
    load_checkpoint_in_model(
        model,
        tmp_path / "ckpt",
        device_map=device_map,
        offload_folder=tmp_path / "off",
        dtype="bfloat16",
        strict=True,
    )
    assert model.embed.weight.dtype == torch.bfloat16 and not model.embed.weight.is_meta
    assert model.block[0].weight.is_meta and model.block[0].weight.dtype == torch.bfloat16
    assert not model.norm.running_mean.is_meta  # buffers stay in memory unless offload_buffers
    assert torch.equal(
        model.norm.running_mean, source.norm.running_mean.bfloat16()
    )  # float buffers are cast too
    index = read_offload_index(tmp_path / "off")
    assert sorted(index) == [
        "block.0.bias",
        "block.0.weight",
        "block.2.bias",
        "block.2.weight",
        "head.weight",
        "norm.bias",
        "norm.weight",
    ]
    assert (
        "weight_name" not in index["head.weight"]
    )  # its partner stays in memory: the name gets its own file
    weights = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert torch.equal(weights["block.2.weight"], source.block[2].weight.bfloat16())
    assert torch.equal(
        weights["head.weight"], source.embed.weight.bfloat16()
    )  # tied: reached through its partner


def test_offload_buffers_and_offload_state_dict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = make_lm(0)
    saved(tmp_path / "ckpt", source)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    model = empty_lm()
    device_map = {"": "cpu", "norm": "disk"}
    load_checkpoint_in_model(
        model,
        tmp_path / "ckpt",
        device_map=device_map,
        offload_folder=tmp_path / "off",
        offload_state_dict=True,
        offload_buffers=True,
        strict=True,
    )
    assert os.listdir(scratch) == []  # the parked CPU weights were read back and their folder removed
    assert model.norm.running_mean.is_meta and model.norm.weight.is_meta
    assert sorted(read_offload_index(tmp_path / "off")) == [
        "norm.bias",
        "norm.num_batches_tracked",
        "norm.running_mean",
        "norm.running_var",
        "norm.weight",
    ]
    assert (
        torch.equal(model.block[2].weight, source.block[2].weight) and model.head.weight is model.embed.weight
    )


def test_a_tie_across_cpu_and_disk_keeps_the_weight_in_memory_and_offloads_the_name(tmp_path: Path) -> None:
    saved(tmp_path / "ckpt", make_lm(0))
    model = empty_lm()
    load_checkpoint_in_model(
        model, tmp_path / "ckpt", device_map={"": "cpu", "embed": "disk"}, offload_folder=tmp_path / "off"
    )
    assert model.embed.weight is model.head.weight and not model.embed.weight.is_meta
    assert torch.equal(
        OffloadedWeightsLoader(save_folder=tmp_path / "off")["embed.weight"], make_lm(0).embed.weight
    )


def test_bad_device_maps_and_arguments_are_refused(tmp_path: Path) -> None:
    saved(tmp_path, make_lm(0))
    with pytest.raises(ValueError, match="to 'disk': pass offload_folder="):
        load_checkpoint_in_model(empty_lm(), tmp_path, device_map={"": "disk"})
    with pytest.raises(ValueError, match="gives no device to 'embed.weight'"):
        load_checkpoint_in_model(empty_lm(), tmp_path, device_map={"block": "cpu"})
    with pytest.raises(ValueError, match="names 'blocks', which is not a module or tensor"):
        load_checkpoint_in_model(empty_lm(), tmp_path, device_map={"": "cpu", "blocks": "cpu"})
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        load_checkpoint_in_model(empty_lm(), tmp_path, offload_8bit_bnb=True)


def test_cpu_device_maps_load_a_real_model_in_place(tmp_path: Path) -> None:
    saved(tmp_path, make_lm(0))
    model = make_lm(1)
    params = list(model.parameters())
    load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu"}, strict=True)
    assert same_weights(model, make_lm(0)) and all(
        p is q for p, q in zip(model.parameters(), params, strict=False)
    )
    load_checkpoint_in_model(
        model,
        tmp_path,
        device_map={
            "position": "cpu",
            "embed": "cpu",
            "block": "cpu",
            "norm": torch.device("cpu"),
            "head": "cpu",
        },
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weights_load_straight_onto_the_gpu(tmp_path: Path) -> None:
    saved(tmp_path, make_lm(0))
    tensors = load_state_dict(tmp_path / "model.safetensors", {"": 0, "block": "cpu"})
    assert tensors["embed.weight"].is_cuda and not tensors["block.0.weight"].is_cuda
    model = empty_lm()
    load_checkpoint_in_model(model, tmp_path, device_map={"": 0, "norm": "cpu"}, strict=True)
    assert model.embed.weight.is_cuda and model.head.weight is model.embed.weight
    assert not model.norm.weight.is_cuda


def test_a_flat_index_of_tensor_to_file_is_read_as_accelerate_reads_it(tmp_path: Path) -> None:
    # failed before: "has no 'weight_map' from tensor names to file names"
    source = make_lm(0)
    state = source.state_dict()
    names = list(state)
    safetensors.torch.save_file({k: state[k].contiguous() for k in names[:3]}, tmp_path / "a.safetensors")
    safetensors.torch.save_file(
        {k: state[k].contiguous() for k in names[3:] if k != "head.weight"}, tmp_path / "b.safetensors"
    )
    flat = {
        k: ("a.safetensors" if i < 3 else "b.safetensors") for i, k in enumerate(names) if k != "head.weight"
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(flat))
    model = empty_lm()
    load_checkpoint_in_model(model, tmp_path / "model.safetensors.index.json", strict=True)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_strict_mismatches_are_caught_by_accelerates_except_clauses(tmp_path: Path) -> None:
    # Accelerate raises ValueError (device map path) or torch's RuntimeError (load_state_dict path)
    tensors = {k: v for k, v in make_lm(0).state_dict().items() if not k.startswith(("block.2", "head"))}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    for caught in (ValueError, RuntimeError, fa.CheckpointError):
        with pytest.raises(caught, match="missing from the checkpoint"):
            load_checkpoint_in_model(empty_lm(), tmp_path, strict=True)
    with pytest.raises(ValueError, match="maps no tensor names"):
        (tmp_path / "bad.index.json").write_text(json.dumps({"hidden_size": 4}))
        load_checkpoint_in_model(empty_lm(), tmp_path / "bad.index.json")
