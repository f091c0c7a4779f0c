"""Merging sharded checkpoints (fnaccel's fsdp() layout and torch DCP) to safetensors, and `fnaccel merge-weights`."""

from __future__ import annotations

import json
import os
import pickle
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint import consolidate as merge
from fnaccel.commands.main import build_parser, main
from fnaccel.modeling.loading import load_checkpoint_in_model
from tests.checkpoint.test_resume import fresh_run, train


def save_fsdp_run(state: fa.RunState, root: str) -> list[str]:
    """Runs on each rank: train under fsdp(), then save it three ways."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state, model, _ = fresh_run(state, fa.compose(fa.fsdp(min_num_params=100)))  # each Linear sharded
    state, _ = train(state, epochs=1, stop_after=3)
    fa.save(state, f"{root}/ckpt")  # fnaccel's pickle-free sharded layout
    fa.save_model(state, f"{root}/consolidated")  # the reference: gathered by FSDP2 itself
    sharded = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, state.optimizer),
    }  # type: ignore[arg-type]
    dcp.save(sharded, checkpoint_id=f"{root}/dcp", process_group=state.dist.process_group)
    return [type(p).__name__ for p in model.parameters()]


@pytest.fixture(scope="module")
def saved(worlds: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("merge")
    for kinds in worlds.get(2).run(save_fsdp_run, str(root)):
        assert set(kinds) == {"DTensor"}
    return root


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _no_unpickling() -> ExitStack:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("merge-weights unpickled something")

    stack = ExitStack()
    for target in (
        "pickle.load",
        "pickle.loads",
        "pickle.Unpickler",
        "torch.load",
        "torch.serialization.load",
    ):
        stack.enter_context(mock.patch(target, refuse))
    return stack


def _assert_same(merged: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(reference) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    for name, tensor in reference.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name


def test_an_fsdp_checkpoint_merges_into_the_consolidated_weights_without_pickle(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = load_file(saved / "consolidated/model.safetensors")
    out = tmp_path / "merged"
    with _no_unpickling():
        assert main(["merge-weights", str(saved / "ckpt"), str(out)]) == 0
    assert os.listdir(out) == ["model.safetensors"]
    _assert_same(load_file(out / "model.safetensors"), reference)
    assert "Merged 4 tensors from the fnaccel checkpoint" in capsys.readouterr().out
    assert (saved / "ckpt/fnaccel.json").is_file()  # kept without --remove_checkpoint_dir


def test_a_torch_dcp_directory_merges_too(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = load_file(saved / "consolidated/model.safetensors")
    out = tmp_path / "merged"
    assert merge.merge_fsdp_weights(saved / "dcp", out) == out / "model.safetensors"
    _assert_same(load_file(out / "model.safetensors"), reference)  # the model's, not the optimizer's
    assert main(["merge-weights", str(saved / "dcp"), str(out)]) == 0  # over an earlier merge
    assert "torch.distributed.checkpoint directory (pickled .metadata read through an allowlist)" in (
        capsys.readouterr().out
    )
    _assert_same(load_file(out / "model.safetensors"), reference)


def test_a_planted_pickle_in_dcp_metadata_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _copy(saved / "dcp", tmp_path / "dcp")
    marker = tmp_path / "ran"

    class Bomb:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    (source / ".metadata").write_bytes(pickle.dumps(Bomb()))
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "refers to posix.system" in err or "refers to nt.system" in err, err
    assert "refusing to unpickle it" in err and not marker.exists() and not (tmp_path / "out").exists()
    (source / ".metadata").write_bytes(b"\x80\x04not a pickle")
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    assert ".metadata: corrupt" in capsys.readouterr().err


def test_a_corrupt_shard_is_named(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _copy(saved / "ckpt", tmp_path / "ckpt")
    shard = source / "sharded/rank1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    assert "sharded/rank1.safetensors: corrupt" in capsys.readouterr().err
    shard.unlink()
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    assert "sharded/rank1.safetensors: missing from the checkpoint" in capsys.readouterr().err


def test_remove_checkpoint_dir(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _copy(saved / "ckpt", tmp_path / "ckpt")
    assert main(["merge-weights", str(source), str(source / "merged"), "--remove_checkpoint_dir"]) == 2
    assert "inside" in capsys.readouterr().err and source.is_dir()
    assert main(["merge-weights", str(source), str(tmp_path / "merged"), "--remove_checkpoint_dir"]) == 0
    assert not source.exists() and (tmp_path / "merged/model.safetensors").is_file()
    assert f"Removed {source}" in capsys.readouterr().out


def test_writing_into_the_checkpoint_itself_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fnaccel.checkpoint.manifest import read_manifest

    source = _copy(saved / "ckpt", tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    link = tmp_path / "link"
    link.symlink_to(source)
    for given, output in (
        (source, source),
        (source, source / "merged"),
        (tmp_path / "x" / ".." / "ckpt", source / "merged"),
        (link, source / "merged"),
    ):
        assert main(["merge-weights", str(given), str(output)]) == 2
        assert "inside the checkpoint" in capsys.readouterr().err
    (tmp_path / "x").mkdir()
    for given in (tmp_path / "x" / ".." / "ckpt", link):  # the removal would take the output with it
        assert main(["merge-weights", str(given), str(source / "merged"), "--remove_checkpoint_dir"]) == 2
        assert "which --remove_checkpoint_dir would delete" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    read_manifest(source)  # still a valid checkpoint


def test_large_weights_are_sharded_with_an_index(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merge, "MAX_SHARD_SIZE", 600)  # bytes: 0.weight (1 KiB) alone, the rest together
    out = tmp_path / "merged"
    assert merge.merge_fsdp_weights(saved / "ckpt", out).name == "model.safetensors.index.json"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    load_checkpoint_in_model(model, out, strict=True)
    _assert_same(model.state_dict(), load_file(saved / "consolidated/model.safetensors"))


def test_an_unsharded_fnaccel_checkpoint_gives_its_weights_with_ties(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    model[1].weight = model[0].weight  # tied
    state = fa.prepare(fa.init(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))
    fa.save(state, tmp_path / "ckpt")
    merge.merge_fsdp_weights(tmp_path / "ckpt", tmp_path / "merged")
    fresh = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    fresh[1].weight = fresh[0].weight
    load_checkpoint_in_model(fresh, tmp_path / "merged", strict=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=False)
    )


def test_an_output_path_that_cannot_be_written_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = nn.Linear(3, 2)
    fa.save(
        fa.prepare(fa.init(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1)), tmp_path / "ckpt"
    )
    (tmp_path / "file").write_text("x")
    assert main(["merge-weights", str(tmp_path / "ckpt"), str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"fnaccel merge-weights: error: {tmp_path / 'file' / 'out'}: Not a directory "
        f"(output_path {tmp_path / 'file' / 'out'})\n"
    ), err


def test_bad_paths_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def error(*argv: str) -> str:
        assert main(["merge-weights", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fnaccel merge-weights: error: ") and err.count("\n") == 1, err
        return err

    assert "no such directory" in error(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    (tmp_path / "file").write_text("x")
    assert "not a directory" in error(str(tmp_path / "file"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    assert "not a checkpoint: no fnaccel.json (fa.save) and no .metadata" in error(
        str(tmp_path / "empty"), str(tmp_path / "out")
    )
    (tmp_path / "empty/pytorch_model_fsdp_0").mkdir()
    (tmp_path / "empty/pytorch_model_fsdp_0/.metadata").write_bytes(b"")
    assert "pass one of them (e.g. " in error(str(tmp_path / "empty"), str(tmp_path / "out"))
    (tmp_path / "ckpt/sharded").mkdir(parents=True)
    (tmp_path / "ckpt/fnaccel.json").write_text("{}")
    assert f"pass {tmp_path / 'ckpt'}, the checkpoint directory" in error(
        str(tmp_path / "ckpt/sharded"), str(tmp_path / "out")
    )
    assert "not an fnaccel checkpoint manifest" in error(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert "is a file; output_path names the directory" in error(
        str(tmp_path / "ckpt"), str(tmp_path / "file")
    )
    assert "--unsafe_serialization writes a pickled .bin" in error(
        str(tmp_path / "ckpt"), str(tmp_path / "out"), "--unsafe_serialization"
    )
    with pytest.raises(ValueError, match="safe_serialization=False"):
        merge.merge_fsdp_weights(tmp_path / "ckpt", tmp_path / "out", safe_serialization=False)
    assert not (tmp_path / "out").exists()


def test_the_flags_parse_as_accelerate_spells_them(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["merge-weights", "in", "out", "--unsafe_serialization", "--remove_checkpoint_dir"]
    )
    assert (args.checkpoint_directory, args.output_path) == ("in", "out")
    assert args.unsafe_serialization and args.remove_checkpoint_dir and args.command_name == "merge-weights"
    with pytest.raises(SystemExit) as exit_info:
        main(["merge-weights", "--help"])
    assert exit_info.value.code == 0
    assert "--remove_checkpoint_dir" in capsys.readouterr().out


def _edit_dcp_metadata(source: Path, edit: Any) -> None:
    """Rewrite DCP's pickled ``.metadata`` (written by this test's own run, so safe to unpickle)."""
    path = source / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _first_model_entry(metadata: Any) -> Any:
    return next(index for index in metadata.storage_data if index.fqn.startswith("model."))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("parent", "'../outside.distcp' does not name a file inside the checkpoint"),
        ("absolute", "does not name a file inside the checkpoint"),
        ("past the file", "which holds"),
        ("declared size", "declares"),
        ("chunk outside", "does not lie inside the tensor's size"),
        # allowed classes in the wrong places: these reached DCP or the merge as raw tracebacks
        ("dtype not a dtype", "not a tensor's metadata"),
        ("key not a string", "key 5: a key must be a string"),
        ("planner data", "key 'planner_data': must map keys to their paths"),
    ],
)
def test_a_hostile_dcp_metadata_is_refused_before_anything_is_read_or_allocated(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, expected: str
) -> None:
    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    source = _copy(saved / "dcp", tmp_path / "dcp")
    victim = next(source.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(victim.read_bytes())  # a regression would read this happily

    def edit(metadata: Any) -> None:
        index = _first_model_entry(metadata)
        info = metadata.storage_data[index]
        if case == "parent":
            metadata.storage_data[index] = dataclasses.replace(info, relative_path="../outside.distcp")
        elif case == "absolute":
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=str(outside))
        elif case == "past the file":
            metadata.storage_data[index] = dataclasses.replace(info, length=10**12)
        elif case == "dtype not a dtype":
            metadata.state_dict_metadata[index.fqn].properties.dtype = "float32"
        elif case == "key not a string":
            metadata.state_dict_metadata[5] = metadata.state_dict_metadata.pop(index.fqn)
        elif case == "planner data":
            metadata.planner_data = Path("/etc/passwd")
        else:
            item = metadata.state_dict_metadata[index.fqn]
            huge = torch.Size([2**20, 2**20])  # 4 TiB of float32
            chunk = huge if case == "declared size" else torch.Size([2**20 + 1, 2**20])
            item.size = huge
            item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=chunk)]

    _edit_dcp_metadata(source, edit)
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{source / '.metadata'}:" in err and expected in err, err
    assert not (tmp_path / "out").exists()


def test_dcp_data_files_must_be_regular_files_inside(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _copy(saved / "dcp", tmp_path / "dcp")
    victim = next(source.glob("*.distcp"))
    victim.unlink()
    victim.symlink_to("/dev/zero")
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    assert f"{victim}: a symbolic link" in capsys.readouterr().err
    victim.unlink()
    os.mkfifo(victim)
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    assert f"{victim}: a FIFO" in capsys.readouterr().err
    (source / ".metadata").rename(tmp_path / "metadata")
    (source / ".metadata").symlink_to(tmp_path / "metadata")
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    assert ".metadata: a symbolic link" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("parent", "file name '../fnaccel.json' does not name a file inside the checkpoint"),
        ("outside sharded", "file 'fnaccel.json' is not one of the checkpoint's sharded/ files"),
        ("declared size", "declares"),
        ("chunk outside", "does not lie inside the tensor's size"),
        ("dtype", "unknown dtype 'float17'"),
    ],
)
def test_a_hostile_fnaccel_sharded_index_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, expected: str
) -> None:
    from tests.checkpoint.test_hostile import _rehash

    source = _copy(saved / "ckpt", tmp_path / "ckpt")
    index = source / "sharded/metadata.json"
    content = json.loads(index.read_text())
    entry = next(s for s in content["storage"] if s["fqn"].startswith("model."))
    if case == "parent":
        entry["file"] = "../fnaccel.json"
    elif case == "outside sharded":
        entry["file"] = "fnaccel.json"
    elif case == "chunk outside":
        content["keys"][entry["fqn"]]["chunks"][0]["offsets"][0] = 10**6
    elif case == "dtype":
        content["keys"][entry["fqn"]]["dtype"] = "float17"
    else:
        item = content["keys"][entry["fqn"]]
        item["size"] = [2**20] * len(item["size"])
        item["chunks"] = [{"offsets": [0] * len(item["size"]), "sizes": item["size"]}]
    index.write_text(json.dumps(content))
    _rehash(source)
    # the torch-free reading of the index (fnaccel.checkpoint.storage.shardindex) that inspect and verify use too
    for command in (
        ["merge-weights", str(source), str(tmp_path / "out")],
        ["checkpoint", "inspect", str(source)],
        ["checkpoint", "verify", str(source)],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "sharded/metadata.json" in err and expected in err, (command, err)


def test_a_torch_dcp_shard_with_a_flipped_byte_is_one_line_naming_the_file(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _copy(saved / "dcp", tmp_path / "dcp")
    shard = sorted(source.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF  # the first stored tensor's archive header: torch.load cannot read it
    shard.write_bytes(bytes(data))
    assert main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"fnaccel merge-weights: error: {shard}: corrupt (torch cannot read a tensor "
        "stored in it: UnpicklingError); the file was damaged after it was written"
    ], err
    assert "weights_only" not in err and not (tmp_path / "out").exists()
