"""Model weights: sharding, fa.save_model and load_checkpoint_in_model.

Files are read back with safetensors itself (and written by it, by hand in
transformers' layout, or as pickles) so that the layout is checked against
what other tools write and read, not only against our own loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.storage import weightfiles
from fnaccel.checkpoint.storage.weightfiles import convert_file_size_to_int, shard_checkpoint
from fnaccel.modeling.loading import IncompatibleKeys, load_checkpoint_in_model
from fnaccel.modeling.weights import consolidated_state_dict, save_model


class TiedLM(nn.Module):
    """An embedding tied to the output layer, an int buffer, and a block to shard alone."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.register_buffer("position", torch.arange(4))
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(tokens))))


def make_lm(seed: int = 0, tie: bool = True) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(tie)


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))  # 4 x 4224 bytes


def prepared(model: nn.Module, *parts: fa.Transform) -> fa.RunState:
    return fa.prepare(fa.init(seed=0, cpu=True), model, pipeline=fa.compose(*parts))


def assert_same_weights(model: nn.Module, expected: nn.Module) -> None:
    ours, theirs = model.state_dict(), expected.state_dict()
    assert list(ours) == list(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def file_keys(path: Path) -> list[str]:
    with safe_open(path, framework="pt") as handle:
        return list(handle.keys())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def uint8s(*sizes: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}


# shard_checkpoint


def test_shards_are_filled_greedily_in_key_order_and_indexed() -> None:
    shards, index = shard_checkpoint(uint8s(6, 6, 2, 6, 2, 2), max_shard_size=10)
    # Accelerate's documented example: [6], [6+2], [6+2+2], not a bin packing
    assert {file: list(block) for file, block in shards.items()} == {
        "model-00001-of-00003.safetensors": ["t0"],
        "model-00002-of-00003.safetensors": ["t1", "t2"],
        "model-00003-of-00003.safetensors": ["t3", "t4", "t5"],
    }
    assert index is not None and index["metadata"] == {"total_size": 24}
    assert index["weight_map"] == {key: file for file, block in shards.items() for key in block}


def test_a_tensor_over_the_limit_gets_a_shard_of_its_own() -> None:
    shards, _ = shard_checkpoint(uint8s(3, 20, 3), max_shard_size=10)
    assert [list(block) for block in shards.values()] == [["t0"], ["t1"], ["t2"]]


def test_one_shard_keeps_the_weights_name_and_needs_no_index() -> None:
    tensors = uint8s(3, 4)
    assert shard_checkpoint(tensors) == ({"model.safetensors": tensors}, None)
    shards, _index = shard_checkpoint(tensors, 5, weights_name="pytorch_model.bin")
    assert list(shards) == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]


@pytest.mark.parametrize(
    ("size", "num_shards"),
    [
        ("1KB", 2),
        ("1KiB", 1),
        (" 1 kib ", 1),
        ("8Kb", 2),
        ("0.001MB", 2),
        ("0.5GiB", 1),
        (1024, 1),
        (1000, 2),
        ("1TB", 1),
    ],
)
def test_sizes_read_as_transformers_reads_them(size: Any, num_shards: int) -> None:
    # 1000 + 24 bytes: one shard under a KiB (1024), two under a KB (1000; "8Kb" is 8000 bits);
    # read by convert_file_size_to_int, as max_memory is
    assert convert_file_size_to_int(size) > 0
    shards, _ = shard_checkpoint(uint8s(1000, 24), max_shard_size=size)
    assert len(shards) == num_shards


@pytest.mark.parametrize("size", ["10", "GB", "-1GB", "ten GB", "0GB", "5PB", "nanGB", 0, -5, True, 1.5])
def test_bad_sizes_are_refused_with_the_fix(size: Any) -> None:
    with pytest.raises(ValueError, match=r"max_shard_size .* such as '10GB'.*got"):
        shard_checkpoint(uint8s(1), max_shard_size=size)


# save_model and load_checkpoint_in_model, in one process


def test_a_model_over_max_shard_size_is_saved_in_shards_and_loads_back(tmp_path: Path) -> None:
    source = make_mlp(0)
    save_model(prepared(source), tmp_path, max_shard_size="10KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert sorted(os.listdir(tmp_path)) == sorted([*files, "model.safetensors.index.json"])
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        tensors = safetensors.torch.load_file(tmp_path / file)
        assert sum(nbytes(t) for t in tensors.values()) <= 10_000
        assert all(index["weight_map"][key] == file for key in tensors)
        stored.update(tensors)
    assert sorted(stored) == sorted(index["weight_map"]) == sorted(source.state_dict())
    assert index["metadata"]["total_size"] == sum(nbytes(t) for t in stored.values())

    target = make_mlp(1)
    params = list(target.parameters())
    assert load_checkpoint_in_model(target, tmp_path, strict=True) == IncompatibleKeys([], [])
    assert_same_weights(target, source)
    assert all(
        p is q for p, q in zip(target.parameters(), params, strict=False)
    )  # in place: optimizers stay valid
    load_checkpoint_in_model(make_mlp(2), tmp_path / "model.safetensors.index.json", strict=True)


def test_tied_weights_are_stored_once_and_tied_again_on_load(tmp_path: Path) -> None:
    source = make_lm(0)
    save_model(prepared(source), tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        assert "head.weight" not in handle.keys()  # noqa: SIM118 (safe_open is not a container)
        assert handle.metadata() == {"format": "pt", "head.weight": "embed.weight"}

    target = make_lm(1)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, source)
    assert target.head.weight is target.embed.weight

    untied = make_lm(1, tie=False)  # the recorded alias fills a model that does not tie
    load_checkpoint_in_model(untied, tmp_path / "model.safetensors", strict=True)
    assert torch.equal(untied.head.weight, source.embed.weight)


def test_a_file_written_by_safetensors_save_model_loads(tmp_path: Path) -> None:
    source = make_lm(0)
    safetensors.torch.save_model(source, str(tmp_path / "model.safetensors"))
    target = make_lm(1)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, source)
    assert target.head.weight.data_ptr() == target.embed.weight.data_ptr()


def test_a_hand_written_transformers_sharded_directory_loads(tmp_path: Path) -> None:
    source = make_lm(0)
    tensors = {k: v for k, v in source.state_dict().items() if k != "head.weight"}  # tied: not stored
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in shards.items():
        safetensors.torch.save_file({k: tensors[k] for k in keys}, tmp_path / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(nbytes(t) for t in tensors.values())},
        "weight_map": {k: file for file, keys in shards.items() for k in keys},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (tmp_path / "config.json").write_text("{}")
    for checkpoint in (tmp_path, tmp_path / "model.safetensors.index.json"):
        target = make_lm(1)
        load_checkpoint_in_model(target, checkpoint, strict=True)
        assert_same_weights(target, source)
        assert target.head.weight is target.embed.weight


def test_missing_and_unexpected_keys_raise_when_strict_and_warn_otherwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = {k: v for k, v in make_lm(0, tie=False).state_dict().items() if k != "norm.bias"}
    tensors["extra.weight"] = torch.ones(2)
    safetensors.torch.save_file(tensors, tmp_path / "w.safetensors")
    target = make_lm(1, tie=False)
    with pytest.raises(
        fa.CheckpointError, match=r"missing .*\['norm\.bias'\].*unexpected .*\['extra\.weight'\]"
    ):
        load_checkpoint_in_model(target, tmp_path / "w.safetensors", strict=True)
    assert_same_weights(target, make_lm(1, tie=False))  # checked before anything was copied
    with caplog.at_level("WARNING", logger="fnaccel.modeling.loading"):  # logged, as Accelerate does
        result = load_checkpoint_in_model(target, tmp_path / "w.safetensors")
    assert "norm.bias" in caplog.text
    assert result == IncompatibleKeys(["norm.bias"], ["extra.weight"])
    assert torch.equal(target.block[0].weight, tensors["block.0.weight"])


def test_shape_mismatches_always_raise_naming_each_key_and_both_shapes(tmp_path: Path) -> None:
    tensors = {**nn.Linear(4, 3).state_dict(), "extra": torch.ones(1)}  # not strict: still raises
    safetensors.torch.save_file(tensors, tmp_path / "w.safetensors")
    expected = (
        r"'bias' is \(3,\) in w\.safetensors but \(2,\) in the model; "
        r"'weight' is \(3, 4\) in w\.safetensors but \(2, 4\)"
    )
    with pytest.raises(fa.CheckpointError, match=expected):
        load_checkpoint_in_model(nn.Linear(4, 2), tmp_path / "w.safetensors")


class Boom:
    """Unpickling this creates its marker file: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_pickle_checkpoints_are_refused_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    torch.save({"weight": Boom(marker)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"weight": "pytorch_model.bin"}})
    )
    for checkpoint in ("pytorch_model.bin", "pytorch_model.bin.index.json", "."):
        with pytest.raises(fa.CheckpointError, match="pickle checkpoint; fnaccel never unpickles"):
            load_checkpoint_in_model(nn.Linear(2, 1), tmp_path / checkpoint)
    os.replace(tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors")  # a pickle in disguise
    with pytest.raises(fa.CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_checkpoint_in_model(nn.Linear(2, 1), tmp_path)
    assert not marker.exists()


def test_truncated_files_and_broken_indexes_name_the_file(tmp_path: Path) -> None:
    save_model(prepared(make_mlp(0)), tmp_path, max_shard_size="10KB")
    shard = tmp_path / "model-00002-of-00002.safetensors"
    index = tmp_path / "model.safetensors.index.json"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(fa.CheckpointError, match="model-00002-of-00002.safetensors is not a readable"):
        load_checkpoint_in_model(make_mlp(1), tmp_path)
    shard.unlink()
    with pytest.raises(
        fa.CheckpointError, match="maps tensors to model-00002-of-00002.safetensors, which is missing"
    ):
        load_checkpoint_in_model(make_mlp(1), tmp_path)
    mapping = json.loads(index.read_text())
    mapping["weight_map"] = {k: "model-00001-of-00002.safetensors" for k in mapping["weight_map"]}
    index.write_text(json.dumps(mapping))
    with pytest.raises(fa.CheckpointError, match=r"model-00001-of-00002.safetensors lacks \['2.bias'"):
        load_checkpoint_in_model(make_mlp(1), tmp_path)
    with pytest.raises(fa.CheckpointError, match="no checkpoint at"):
        load_checkpoint_in_model(make_mlp(1), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        fa.CheckpointError, match="holds no model.safetensors and no model.safetensors.index.json"
    ):
        load_checkpoint_in_model(make_mlp(1), tmp_path / "empty")


def test_views_and_transposed_parameters_are_saved_as_their_own_values(tmp_path: Path) -> None:
    source = nn.Module()
    base = torch.randn(8)
    source.a = nn.Parameter(base[:4])  # two parameters viewing one storage
    source.b = nn.Parameter(base[4:])
    source.t = nn.Parameter(torch.randn(3, 4).t())  # not contiguous
    save_model(prepared(source), tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(stored[k], v) for k, v in source.state_dict().items())


def test_compiled_models_save_and_load_under_their_own_names(tmp_path: Path) -> None:
    source = make_lm(0)
    state = prepared(source, fa.compile(backend="eager"))
    assert type(state.model).__name__ == "OptimizedModule"
    assert list(consolidated_state_dict(state.model)) == list(source.state_dict())
    save_model(state, tmp_path)
    assert sorted(file_keys(tmp_path / "model.safetensors")) == sorted(
        set(source.state_dict()) - {"head.weight"}
    )
    target = torch.compile(make_lm(1), backend="eager")
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(getattr(target, "_orig_mod"), source)


def test_dtype_casts_floats_except_modules_kept_in_fp32(tmp_path: Path) -> None:
    save_model(prepared(make_lm(0)), tmp_path)
    target = make_lm(1)
    load_checkpoint_in_model(target, tmp_path, dtype="float16", keep_in_fp32_modules=["norm"], strict=True)
    assert target.embed.weight.dtype == target.block[0].weight.dtype == torch.float16
    assert target.norm.weight.dtype == torch.float32 and target.position.dtype == torch.int64
    assert target.head.weight is target.embed.weight
    torch.testing.assert_close(target.embed.weight, make_lm(0).embed.weight.half())
    with pytest.raises(ValueError, match="'float17' is not a torch dtype"):
        load_checkpoint_in_model(make_lm(1), tmp_path, dtype="float17")


def test_device_maps_load_onto_the_cpu_and_meta_models_load(tmp_path: Path) -> None:
    save_model(prepared(make_lm(0)), tmp_path)
    target = make_lm(1)
    load_checkpoint_in_model(target, tmp_path, device_map={"": "cpu"}, strict=True)
    assert_same_weights(target, make_lm(0))
    load_checkpoint_in_model(
        make_lm(1),
        tmp_path,
        device_map={
            "position": "cpu",
            "embed": "cpu",
            "block": "cpu",
            "norm": torch.device("cpu"),
            "head": "cpu",
        },
    )
    with pytest.raises(ValueError, match="gives no device to 'embed.weight'"):
        load_checkpoint_in_model(make_lm(1), tmp_path, device_map={"position": "cpu", "block": "cpu"})
    with pytest.raises(ValueError, match="to 'disk': pass offload_folder="):
        load_checkpoint_in_model(make_lm(1), tmp_path, device_map={"": "disk"})
    with torch.device("meta"):
        on_meta = TiedLM()
    load_checkpoint_in_model(on_meta, tmp_path, strict=True)
    assert_same_weights(on_meta, make_lm(0))
    assert on_meta.head.weight is on_meta.embed.weight


def test_save_model_refuses_pickles_stale_states_and_states_without_a_model(tmp_path: Path) -> None:
    fresh = fa.init(seed=0, cpu=True)
    with pytest.raises(ValueError, match="has no model"):
        save_model(fresh, tmp_path)
    state = fa.prepare(fresh, make_lm(0))
    with pytest.raises(ValueError, match="never does"):
        save_model(state, tmp_path, safe_serialization=False)
    with pytest.raises(fa.StaleStateError, match="fa.save_model"):
        save_model(fresh, tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_models_save_tied_and_load_on_their_device_or_onto_the_cpu(tmp_path: Path) -> None:
    state = fa.prepare(fa.init(seed=0), make_lm(0))  # onto the GPU
    assert state.model is not None and state.model.embed.weight.is_cuda
    save_model(state, tmp_path)  # ties found before the copy to the CPU
    assert "head.weight" not in file_keys(tmp_path / "model.safetensors")
    target = make_lm(1).cuda()
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert target.embed.weight.is_cuda and target.head.weight is target.embed.weight
    load_checkpoint_in_model(target, tmp_path, device_map={"": "cpu"}, strict=True)
    assert not target.embed.weight.is_cuda and target.head.weight is target.embed.weight
    assert_same_weights(target, make_lm(0))


# replacing an older save


def test_resaving_removes_stale_weights_and_keeps_other_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    save_model(prepared(make_mlp(0)), tmp_path, max_shard_size="5KB")  # 4 shards
    save_model(prepared(make_mlp(1)), tmp_path, max_shard_size="10KB")  # 2 shards
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    save_model(prepared(make_mlp(2)), tmp_path)  # one file
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    save_model(prepared(make_mlp(3)), tmp_path, max_shard_size="10KB")  # the old file would shadow the index
    assert "model.safetensors" not in os.listdir(tmp_path)
    target = make_mlp(0)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, make_mlp(3))


@pytest.mark.parametrize("max_shard_size", ["10KB", "1GB"], ids=["sharded", "single"])
def test_an_interrupted_write_leaves_the_previous_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_shard_size: str
) -> None:
    save_model(prepared(make_mlp(0)), tmp_path, max_shard_size=max_shard_size)
    before = sorted(os.listdir(tmp_path))
    real_save_file, calls = safetensors.torch.save_file, []

    def failing_save_file(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real_save_file(*args, **kwargs)

    monkeypatch.setattr(weightfiles, "save_file", failing_save_file)
    with pytest.raises(OSError, match="simulated"):
        save_model(prepared(make_mlp(1)), tmp_path, max_shard_size="5KB")
    assert sorted(os.listdir(tmp_path)) == before  # no staging folder left
    target = make_mlp(2)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, make_mlp(0))


@pytest.mark.parametrize("hard_links", [True, False], ids=["linked", "copied"])
def test_a_crash_between_renames_keeps_a_complete_set_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    save_model(prepared(make_mlp(0)), tmp_path, max_shard_size="10KB")
    real_replace, calls = os.replace, []

    def crash_on_the_second_shard(src: Any, dst: Any) -> None:
        calls.append(Path(dst).name)
        if calls.count("model-00001-of-00002.safetensors") and Path(dst).name.startswith("model-00002"):
            raise OSError("killed (simulated)")
        real_replace(src, dst)

    def no_links(src: Any, dst: Any) -> None:
        raise OSError("no hard links on this filesystem (simulated)")

    monkeypatch.setattr(os, "replace", crash_on_the_second_shard)
    if not hard_links:
        monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(OSError, match="killed"):  # same shard names: the old ones get parked
        save_model(prepared(make_mlp(1)), tmp_path, max_shard_size="10KB")
    monkeypatch.undo()
    assert calls[0] == "model.safetensors.index.json"  # the live index moved to the parked shards first
    target = make_mlp(2)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, make_mlp(0))

    save_model(prepared(make_mlp(1)), tmp_path, max_shard_size="10KB")  # the next save cleans up
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, make_mlp(1))


# across processes (module-level: the workers import these by name)


def save_under_ddp(state: fa.RunState, path: str) -> dict[str, Any]:
    state = fa.prepare(state, make_lm(0), pipeline=fa.compose(fa.ddp()))
    save_model(state, path)
    return {"wrapped": type(state.model).__name__, "keys": list(consolidated_state_dict(state.model))}


def test_ddp_models_save_under_the_users_names(world2: Any, tmp_path: Path) -> None:
    for result in world2.run(save_under_ddp, str(tmp_path)):
        assert result["wrapped"] == "DistributedDataParallel"
        assert result["keys"] == list(make_lm(0).state_dict())
    target = make_lm(1)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, make_lm(0))


def save_under_fsdp(state: fa.RunState, path: str) -> dict[str, Any]:
    model = make_lm(0)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline=fa.compose(fa.fsdp(transformer_cls_names_to_wrap=["Sequential"])),
    )
    save_model(state, path)
    gathered = consolidated_state_dict(state.model)
    try:
        load_checkpoint_in_model(state.model, path)
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    return {
        "sharded": type(model.block).__name__,
        "keys": list(gathered),
        "tied": bool(gathered) and gathered["head.weight"] is gathered["embed.weight"],
        "refused": refused,
    }


def test_fsdp_models_save_the_full_weights_from_the_main_process(world2: Any, tmp_path: Path) -> None:
    main, other = world2.run(save_under_fsdp, str(tmp_path))
    assert main["sharded"] == "FSDPSequential"
    assert main["keys"] == list(make_lm(0).state_dict()) and main["tied"]
    assert other["keys"] == []  # the gather lands on the main process only
    assert "before fa.prepare" in main["refused"] and "before fa.prepare" in other["refused"]
    assert sorted(file_keys(tmp_path / "model.safetensors")) == sorted(
        set(make_lm(0).state_dict()) - {"head.weight"}
    )
    target = make_lm(1)
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert_same_weights(target, make_lm(0))
    assert target.head.weight is target.embed.weight


def fail_on_the_main_process(state: fa.RunState, path: str) -> str:
    state = fa.prepare(state, make_lm(0), pipeline=fa.compose(fa.ddp()))
    try:
        save_model(state, path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_failure_on_the_main_process_is_raised_on_every_rank(world2: Any, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    main, other = world2.run(fail_on_the_main_process, str(tmp_path / "file"))
    assert main.startswith("ValueError: fa.save_model writes into a directory, but") and "is a file" in main
    assert other.startswith("CheckpointError: fa.save_model: the main process failed to write")
