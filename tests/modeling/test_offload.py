"""Offload folders: Accelerate's raw-file layout, pickle-free, read back lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

import fnaccel as fa
from fnaccel.modeling.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    load_offloaded_weights,
    offload_state_dict,
    offload_weight,
    read_offload_index,
    save_offload_index,
)

TENSORS = {
    "f32": torch.randn(3, 4),
    "f16": torch.randn(5).half(),
    "bf16": torch.randn(2, 3).bfloat16(),
    "i64": torch.arange(6).reshape(2, 3),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_every_dtype_round_trips_bit_for_bit(tmp_path: Path, name: str) -> None:
    tensor = TENSORS[name]
    index = offload_weight(tensor, name, tmp_path, index={})
    assert index == {name: {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}}
    back = load_offloaded_weight(tmp_path / f"{name}.dat", index[name])
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(
        back.view(torch.int16) if name == "bf16" else back,
        tensor.view(torch.int16) if name == "bf16" else tensor,
    )


def test_files_are_what_accelerate_writes_and_reads(tmp_path: Path) -> None:
    # Accelerate writes each tensor with numpy.memmap (bf16 through an int16 view) and reads it back so
    offload_state_dict(tmp_path, {"w": TENSORS["bf16"], "b": TENSORS["f32"]})
    index = json.loads((tmp_path / "index.json").read_text())
    assert index == {"b": {"dtype": "float32", "shape": [3, 4]}, "w": {"dtype": "bfloat16", "shape": [2, 3]}}
    words = np.memmap(tmp_path / "w.dat", dtype="int16", mode="r", shape=(2, 3))
    assert torch.equal(torch.tensor(np.array(words)).view(torch.bfloat16), TENSORS["bf16"])
    # and a folder Accelerate wrote loads here
    array = np.memmap(tmp_path / "acc.dat", dtype="float16", mode="w+", shape=(4,))
    array[:] = np.arange(4, dtype="float16")
    array.flush()
    save_offload_index({"acc": {"dtype": "float16", "shape": [4]}}, tmp_path)
    assert OffloadedWeightsLoader(save_folder=tmp_path)["acc"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sorted(read_offload_index(tmp_path)) == ["acc", "b", "w"]  # the index was merged, not replaced


def mapped(path: Path) -> bool:
    """Whether this process has ``path`` memory-mapped (Linux)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_loading_is_memory_mapped_and_never_writes_the_file(tmp_path: Path) -> None:
    index = offload_weight(torch.zeros(1000), "w", tmp_path, index={})
    assert index is not None and not mapped(tmp_path / "w.dat")  # the writer's mapping is gone
    tensor = load_offloaded_weight(tmp_path / "w.dat", index["w"])
    assert mapped(tmp_path / "w.dat")  # mapped, not read
    tensor += 1  # copy-on-write
    assert load_offloaded_weight(tmp_path / "w.dat", index["w"]).sum().item() == 0
    del tensor
    assert not mapped(tmp_path / "w.dat")  # released with the tensor


def test_truncated_and_missing_files_name_the_file(tmp_path: Path) -> None:
    index = offload_weight(torch.zeros(10), "w", tmp_path, index={})
    assert index is not None
    (tmp_path / "w.dat").write_bytes(b"\0" * 12)
    with pytest.raises(fa.CheckpointError, match=r"w\.dat holds 12 bytes, but its index entry .* needs 40"):
        load_offloaded_weight(tmp_path / "w.dat", index["w"])
    with pytest.raises(fa.CheckpointError, match=r"gone\.dat is missing: offload the weights again"):
        load_offloaded_weight(tmp_path / "gone.dat", index["w"])
    with pytest.raises(fa.CheckpointError, match="'float17' is not a torch dtype"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float17", "shape": [3]})
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(fa.CheckpointError, match="index.json is not a readable offload index"):
        read_offload_index(tmp_path)


def test_index_entries_of_the_wrong_kind_are_refused_naming_the_field(tmp_path: Path) -> None:
    """index.json is JSON read from disk: a shape that is not a list of sizes, or a file
    name that is not a string, is refused by name (not an int() or safe_open() error)."""
    offload_weight(torch.zeros(3), "w", tmp_path, index={})
    with pytest.raises(fa.CheckpointError, match="shape must be a list of sizes, got 'abc'"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": "abc"})
    with pytest.raises(fa.CheckpointError, match="safetensors_file must be a string, got 3"):
        OffloadedWeightsLoader(index={"w": {"safetensors_file": 3}}, save_folder=tmp_path)["w"]


def test_writes_leave_no_partial_files_and_meta_tensors_are_refused(tmp_path: Path) -> None:
    offload_state_dict(tmp_path / "new", nn.Linear(3, 2).state_dict())
    assert sorted(os.listdir(tmp_path / "new")) == ["bias.dat", "index.json", "weight.dat"]
    with pytest.raises(ValueError, match="'w' is on the meta device and holds no data"):
        offload_weight(torch.empty(2, device="meta"), "w", tmp_path)
    assert offload_weight(torch.ones(1), "x", tmp_path) is None  # no index asked for


_WRITE_PAST_THE_FILE_SIZE_LIMIT = """
import errno, os, resource, signal, sys, torch
from fnaccel.modeling.offload import offload_weight
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, a write fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    offload_weight(torch.ones(10_000), "w", sys.argv[1], index={})
except OSError as exc:
    print(type(exc).__name__, exc.errno == errno.EFBIG, os.listdir(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGXFSZ"), reason="needs POSIX file size limits")
def test_a_failed_write_is_an_oserror_and_leaves_no_file(tmp_path: Path) -> None:
    # a full disk, as a file size limit: plain writes report it (a shared mapping would SIGBUS)
    result = subprocess.run(
        [sys.executable, "-c", _WRITE_PAST_THE_FILE_SIZE_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.split() == ["OSError", "True", "[]"], result.stdout + result.stderr


def test_tied_tensors_are_written_once(tmp_path: Path) -> None:
    shared = torch.randn(4, 2)
    offload_state_dict(tmp_path, {"embed.weight": shared, "head.weight": shared})
    assert sorted(os.listdir(tmp_path)) == ["embed.weight.dat", "index.json"]
    index = read_offload_index(tmp_path)
    assert index["head.weight"] == {"dtype": "float32", "shape": [4, 2], "weight_name": "embed.weight"}
    assert torch.equal(OffloadedWeightsLoader(save_folder=tmp_path)["head.weight"], shared)


def test_the_loader_serves_a_state_dict_first_then_the_folder_lazily(tmp_path: Path) -> None:
    offload_state_dict(tmp_path, {"a": torch.zeros(2), "b": torch.ones(2)})
    weights = OffloadedWeightsLoader(state_dict={"b": torch.full((2,), 7.0)}, save_folder=tmp_path)
    assert list(weights) == ["b", "a"] and len(weights) == 2 and "a" in weights and "z" not in weights
    assert weights["b"].tolist() == [7.0, 7.0] and weights["a"].tolist() == [0.0, 0.0]
    held = weights["a"]  # read on demand: the file is mapped while the tensor lives
    assert mapped(tmp_path / "a.dat") or not Path("/proc/self/maps").exists()
    del held
    with pytest.raises(KeyError):
        weights["z"]
    with pytest.raises(ValueError, match="needs a state_dict, a save_folder or an index"):
        OffloadedWeightsLoader()
    with pytest.raises(
        ValueError, match="offloaded to a .dat file, but this loader was given no save_folder"
    ):
        OffloadedWeightsLoader(index={"a": {"dtype": "float32", "shape": [2]}})["a"]


def test_the_loader_reads_entries_pointing_into_a_safetensors_file(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"layer.weight": torch.arange(4.0)}, file)
    index = {"w": {"safetensors_file": str(file), "weight_name": "layer.weight", "dtype": "float16"}}
    tensor = OffloadedWeightsLoader(index=index, device="cpu")["w"]
    assert tensor.dtype == torch.float16 and tensor.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_offloaded_weights_load_back_into_a_meta_model_with_ties(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    source[1].weight = source[0].weight
    offload_state_dict(tmp_path, source.state_dict())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    load_offloaded_weights(model, read_offload_index(tmp_path), tmp_path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), source.state_dict().values(), strict=False)
    )
    assert model[1].weight is model[0].weight  # tied, and read once
    assert not mapped(tmp_path / "0.weight.dat")  # read into memory: the folder may go
    load_offloaded_weights(model, {}, tmp_path)  # nothing to do


def test_prefixed_views_and_submodule_extraction() -> None:
    weights = {"h.1.w": torch.ones(1), "h.10.w": torch.zeros(1), "x": torch.ones(2)}
    view = PrefixedDataset(weights, "h.1.")
    assert list(view) == ["w"] and len(view) == 1 and torch.equal(view["w"], torch.ones(1))
    assert list(extract_submodules_state_dict(weights, ["h.1", "x"])) == ["h.1.w", "x"]
    assert list(extract_submodules_state_dict(weights, [""])) == list(weights)
