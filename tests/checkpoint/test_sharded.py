"""Sharded checkpoints of fsdp() runs (torch.distributed.checkpoint, no pickle)."""

from __future__ import annotations

import json
import pickle
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.storage.dcpstore import metadata_from, metadata_json
from fnaccel.modeling.placement import is_sharded
from tests.checkpoint.test_resume import BATCH, fresh_run, train


def _save(state: fa.RunState, path: str | Path, blocking: bool = True, meanwhile: Any = None) -> Any:
    """fa.save; ``meanwhile()`` runs while a non-blocking save writes, then it is waited for."""
    handle = fa.save(state, path, blocking=blocking)
    result = meanwhile() if meanwhile is not None else None
    handle.wait()
    return result


def _load(state: fa.RunState, path: str | Path) -> fa.RunState:
    return fa.load(state, path)


def _no_unpickling() -> ExitStack:
    """Unpickling a file (pickle.load/loads, torch.load) raises while this is entered.

    (torch.distributed's object collectives, which DCP uses to agree on its
    plans, unpickle in memory with pickle.Unpickler, between the run's own
    processes; they stay.)
    """

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a checkpoint load unpickled something")

    stack = ExitStack()
    for target in ("pickle.load", "pickle.loads", "torch.load", "torch.serialization.load"):
        stack.enter_context(mock.patch(target, refuse))
    return stack


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local else p).detach().clone()


PIPELINES = {
    "root": lambda: fa.compose(fa.fsdp()),
    "per_layer": lambda: fa.compose(fa.fsdp(min_num_params=100)),  # Linear layers sharded on their own
}


def fsdp_resume(
    state: fa.RunState, kind: str, directory: str, stop_after: int, blocking: bool
) -> dict[str, Any]:
    """Runs on each rank: uninterrupted vs saved-and-resumed with fresh objects.

    A non-blocking save goes on writing while the first run takes two more
    steps: the checkpoint must hold the state at the save, not after them.
    """
    pipeline = PIPELINES[kind]()
    whole, whole_model, _ = fresh_run(state, pipeline)
    whole, whole_losses = train(whole, epochs=2)

    first, first_model, _ = fresh_run(fa.init(seed=0, cpu=True), pipeline)
    first, first_losses = train(first, epochs=2, stop_after=stop_after)
    at_save = [_local(p) for p in first_model.parameters()]
    moved_on = _save(
        first,
        directory,
        blocking=blocking,
        meanwhile=None if blocking else lambda: train(first, epochs=2, stop_after=stop_after + 2)[0],
    )
    fa.shutdown(moved_on or first)

    second, model, data = fresh_run(fa.init(seed=0, cpu=True), pipeline)
    with _no_unpickling():
        second = _load(second, directory)
    # straight after the load: the same shards and optimizer state as at the save
    restored = all(torch.equal(_local(p), q) for p, q in zip(model.parameters(), at_save, strict=False))
    reads_before = data.reads
    second, rest = train(second, epochs=2)
    fa.shutdown(second)
    return {
        "sharded": is_sharded(model),
        "restored": restored,
        "losses_equal": first_losses + rest == whole_losses,
        "params_equal": all(
            torch.equal(_local(p), _local(q))
            for p, q in zip(model.parameters(), whole_model.parameters(), strict=False)
        ),
        "adam_steps": [float(s["step"]) for s in second.optimizer.state.values()],  # type: ignore[union-attr]
        "lr": (second.scheduler.get_last_lr(), whole.scheduler.get_last_lr()),
        "reads_after_resume": data.reads - reads_before,
        "step": (second.step, second.micro_step, whole.step, whole.micro_step),
    }


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("kind", "blocking"),
    [("root", True), ("per_layer", True), ("per_layer", False)],
    ids=["root", "per_layer", "per_layer-async"],
)
def test_fsdp_resume_across_two_processes_is_bit_exact_and_pickle_free(
    world2: Any, tmp_path: Path, kind: str, blocking: bool
) -> None:
    stop_after = 7  # 5 batches per epoch per rank: mid-epoch 1
    directory = tmp_path / "ckpt"
    for result in world2.run(fsdp_resume, kind, str(directory), stop_after, blocking):
        assert result["sharded"] and result["restored"], result
        assert result["losses_equal"] and result["params_equal"], result
        assert result["reads_after_resume"] == BATCH * (10 - stop_after)  # no replay
        assert result["step"] == (10, 10, 10, 10)
        assert result["lr"][0] == result["lr"][1]
        assert set(result["adam_steps"]) == {10.0}
    files = _files(directory)
    assert files == [
        "config.yaml",
        "fnaccel.json",
        "rank0.json",
        "rank0.safetensors",
        "rank1.json",
        "rank1.safetensors",
        "run.json",
        "scheduler.json",
        "sharded/metadata.json",
        "sharded/rank0.safetensors",
        "sharded/rank1.safetensors",
        "sharded/state.json",
    ]
    manifest = json.loads((directory / "fnaccel.json").read_bytes())
    assert sorted(manifest["files"]) == [f for f in files if f != "fnaccel.json"]  # each one checksummed
    for name in files:
        data = (directory / name).read_bytes()
        assert data[:1] != b"\x80", f"{name} starts like a pickle"
        assert not data.startswith(b"PK"), f"{name} is a zip (torch.save)"
        if name.endswith(".safetensors"):
            from safetensors.torch import load

            load(data)  # a real safetensors file
        elif name.endswith(".json"):
            json.loads(data)
    index = json.loads((directory / "sharded/metadata.json").read_bytes())
    weight = next(k for k in index["keys"] if k.startswith("model.") and k.endswith("weight"))
    chunks = index["keys"][weight]["chunks"]
    assert len(chunks) == 2 and chunks[0]["offsets"][0] == 0 < chunks[1]["offsets"][0]  # one shard per rank


# -- damage, refusals, edge cases -------------------------------------------------------


def _save_fsdp(state: fa.RunState, directory: str, stop_after: int, accumulate: int) -> str | None:
    parts = [fa.fsdp()] + ([fa.accumulate(accumulate)] if accumulate > 1 else [])
    state, _, _ = fresh_run(state, fa.compose(*parts))
    state, _ = train(state, epochs=1, stop_after=stop_after) if stop_after else (state, [])
    had_state = bool(state.optimizer.state)  # type: ignore[union-attr]
    try:
        _save(state, directory)
    except fa.CheckpointError as exc:
        return str(exc)
    assert had_state or not state.optimizer.state, "saving allocated the optimizer's state"  # type: ignore[union-attr]
    return None


def _load_fsdp(state: fa.RunState, directory: str) -> str | None:
    state, _, _ = fresh_run(state, fa.compose(fa.fsdp()))
    try:
        _load(state, directory)
    except fa.CheckpointError as exc:
        return str(exc)
    return None


def test_damaged_shards_and_planted_pickles(world2: Any, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    assert world2.run(_save_fsdp, str(directory), 3, 1) == [None, None]
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (marker.write_text, ("boom",))  # runs only if someone unpickles it

    # DCP's own file names, holding pickles: never in the manifest, never read
    (directory / "sharded/.metadata").write_bytes(pickle.dumps(Bomb()))
    (directory / "sharded/__0_0.distcp").write_bytes(pickle.dumps(Bomb()))
    assert world2.run(_load_fsdp, str(directory)) == [None, None]
    assert not marker.exists()

    shard = directory / "sharded/rank1.safetensors"
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[-3] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    for message in world2.run(_load_fsdp, str(directory)):  # every rank fails, none hangs
        assert message is not None and "sharded/rank1.safetensors: corrupt" in message
    shard.write_bytes(original)

    index = directory / "sharded/metadata.json"
    original = index.read_bytes()
    index.write_bytes(original.replace(b'"model.', b'"mode1.', 1))  # same length: the checksum catches it
    for message in world2.run(_load_fsdp, str(directory)):
        assert message is not None and "sharded/metadata.json: corrupt" in message
    index.write_bytes(original)
    assert world2.run(_load_fsdp, str(directory)) == [None, None]


def test_between_micro_steps_is_refused_and_before_the_first_step_is_harmless(
    world2: Any, tmp_path: Path
) -> None:
    for message in world2.run(_save_fsdp, str(tmp_path / "mid"), 4, 3):
        assert message is not None and "between accumulation micro-steps" in message
    assert not (tmp_path / "mid").exists()
    assert world2.run(_save_fsdp, str(tmp_path / "start"), 0, 1) == [None, None]
    assert world2.run(_load_fsdp, str(tmp_path / "start")) == [None, None]
    state_json = json.loads((tmp_path / "start/sharded/state.json").read_bytes())
    assert "optimizer" not in state_json["values"]
    index = json.loads((tmp_path / "start/sharded/metadata.json").read_bytes())
    assert all(key.startswith("model.") for key in index["keys"])  # no optimizer state yet


def _other_model(state: fa.RunState, directory: str) -> str | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = fa.prepare(state, model, optimizer, pipeline=fa.compose(fa.fsdp()))
    try:
        _load(state, directory)
    except fa.CheckpointError as exc:
        return str(exc)
    return None


def test_another_model_is_named_before_dcp_plans(world2: Any, tmp_path: Path) -> None:
    world2.run(_save_fsdp, str(tmp_path / "ckpt"), 3, 1)
    for message in world2.run(_other_model, str(tmp_path / "ckpt")):
        assert (
            message is not None
            and "'model.0.weight' has shape (32, 8) in the checkpoint but (16, 8)" in message
        )


def _kinds(state: fa.RunState) -> tuple[bool, bool, bool, bool]:
    model = nn.Linear(4, 4)
    state = fa.prepare(state, model, pipeline=fa.compose(fa.fsdp()))
    compiled = torch.compile(state.model)  # wraps only; nothing compiles until it is called
    return (
        is_sharded(state.model),
        is_sharded(compiled),
        is_sharded(nn.Linear(2, 2)),
        is_sharded(torch.compile(nn.Linear(2, 2))),
    )


def test_is_sharded(world2: Any) -> None:
    assert world2.run(_kinds) == [(True, True, False, False)] * 2
    assert not is_sharded(None)


def test_dcp_metadata_round_trips_through_json() -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    metadata = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([4, 3]),
                [
                    ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
                    ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
                ],
            ),
            "optimizer.state.w.step": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([]),
                [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
            ),
        },
        planner_data={
            "model.w": ("model", "w"),
            "optimizer.state.w.step": ("optimizer", "state", "w", "step"),
        },
        version="1.0.0",
    )
    storage = [
        {"fqn": "model.w", "offset": [2, 0], "file": "sharded/rank1.safetensors", "key": "model.w@2,0"},
        {"fqn": "model.w", "offset": [0, 0], "file": "sharded/rank0.safetensors", "key": "model.w@0,0"},
        {
            "fqn": "optimizer.state.w.step",
            "offset": [],
            "file": "sharded/rank0.safetensors",
            "key": "optimizer.state.w.step@",
        },
    ]
    text = json.dumps(metadata_json(metadata, storage))
    files = {f"sharded/rank{r}.safetensors": {"blocksum": "0" * 64, "size": 1000} for r in (0, 1)}
    back, index = metadata_from(json.loads(text), files, "metadata.json")
    assert back.state_dict_metadata == metadata.state_dict_metadata
    assert back.planner_data == metadata.planner_data and back.version == "1.0.0"
    assert index[MetadataIndex("model.w", [2, 0])] == ("sharded/rank1.safetensors", "model.w@2,0")
    assert back.storage_data is index
    with pytest.raises(fa.CheckpointError, match="non-tensor value"):
        metadata_json(Metadata(state_dict_metadata={"x": BytesStorageMetadata()}), [])
    with pytest.raises(fa.CheckpointError, match="metadata.json: key 'keys/model.w' is malformed"):
        metadata_from({**json.loads(text), "keys": {"model.w": {"dtype": "float32"}}}, files, "metadata.json")
    with pytest.raises(fa.CheckpointError, match="unknown dtype 'nonsense'"):
        bad = json.loads(text)
        bad["keys"]["model.w"]["dtype"] = "nonsense"
        metadata_from(bad, files, "metadata.json")
