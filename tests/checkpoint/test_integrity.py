"""Corrupt, truncated, mismatched and planted files fail with errors that name them."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.manifest import SCHEMA_VERSION, manifest_hash, read_manifest
from tests.checkpoint.test_resume import fresh_run, train


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))
    state, _ = train(state, epochs=1, stop_after=3)  # between micro-steps: gradients saved too
    fa.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _fresh() -> fa.RunState:
    return fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))[0]


@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "scheduler.json",
        "rank0.safetensors",
        "rank0.json",
        "config.yaml",
        "fnaccel.json",
    ],
)
def test_a_flipped_byte_names_the_file(checkpoint: Path, name: str) -> None:
    path = checkpoint / name
    data = bytearray(path.read_bytes())
    if name == "fnaccel.json":  # a digit that still parses: the step counter
        text = data.decode()
        at = text.index('"step": ') + len('"step": ')
        data[at] = ord("7") if text[at] != "7" else ord("8")
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(fa.CheckpointError, match=f"{name}: corrupt"):
        fa.load(_fresh(), checkpoint)


def test_truncated_missing_and_manifest_damage(checkpoint: Path) -> None:
    model = checkpoint / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    with pytest.raises(fa.CheckpointError, match="model.safetensors: truncated"):
        fa.load(_fresh(), checkpoint)
    model.unlink()
    with pytest.raises(fa.CheckpointError, match="model.safetensors: missing"):
        fa.load(_fresh(), checkpoint)
    manifest = checkpoint / "fnaccel.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(fa.CheckpointError, match="fnaccel.json: corrupt"):
        fa.load(_fresh(), checkpoint)
    manifest.unlink()
    with pytest.raises(fa.CheckpointError, match="fnaccel.json is missing"):
        fa.load(_fresh(), checkpoint)


def _reseal(checkpoint: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and recompute its own sha256, as a stranger (or another fnaccel) would."""
    path = checkpoint / "fnaccel.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_hash(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "version, age",
    [(5, "older than"), (2, "older than"), (7, "newer than"), (99, "newer than"), ("6", "not")],
)
def test_a_checkpoint_of_another_schema_is_refused_naming_its_version_and_this_one(
    checkpoint: Path,
    version: object,
    age: str,
) -> None:
    assert json.loads((checkpoint / "fnaccel.json").read_text())["schema_version"] == SCHEMA_VERSION == 6
    _reseal(checkpoint, lambda manifest: manifest.update(schema_version=version))
    expected = (
        f"fnaccel.json: checkpoint schema version {version!r} is {age} the one this fnaccel reads "
        "(schema version 6); load it with the fnaccel that wrote it"
    )
    for read in (lambda: fa.load(_fresh(), checkpoint), lambda: read_manifest(checkpoint)):
        with pytest.raises(fa.CheckpointError, match=re.escape(expected)):
            read()


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_a_file_checksum_other_than_blocksum_is_refused(checkpoint: Path, algorithm: str) -> None:
    """One checksum algorithm: entries naming another (as schemas 2 and 3 did) are malformed."""

    def edit(manifest: dict[str, Any]) -> None:
        entry = manifest["files"]["model.safetensors"]
        data = (checkpoint / "model.safetensors").read_bytes()
        entry.pop("blocksum")
        entry[algorithm] = (
            hashlib.sha256(data).hexdigest() if algorithm == "sha256" else f"{zlib.crc32(data):08x}"
        )

    _reseal(checkpoint, edit)
    with pytest.raises(
        fa.CheckpointError,
        match=r"fnaccel\.json: key 'files' must be an object of relative "
        r'file names to \{"blocksum": 64 hex digits, "size": bytes\}',
    ):
        fa.load(_fresh(), checkpoint)


def test_another_model_gives_key_and_shape_errors(checkpoint: Path) -> None:
    wider = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
    state = fa.prepare(fa.init(seed=0, cpu=True), wider, torch.optim.AdamW(wider.parameters()))
    with pytest.raises(
        fa.CheckpointError, match=r"'0.weight' has shape \(32, 8\) in the checkpoint but \(64, 8\)"
    ):
        fa.load(state, checkpoint)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    state = fa.prepare(fa.init(seed=0, cpu=True), other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(
        fa.CheckpointError,
        match=r"missing keys \['2.bias', '2.weight'\], unexpected keys \['3.bias', '3.weight'\]",
    ):
        fa.load(state, checkpoint)


def test_no_file_is_a_pickle_and_a_planted_pickle_is_never_read(checkpoint: Path, tmp_path: Path) -> None:
    for path in checkpoint.iterdir():
        head = path.read_bytes()[:2]
        assert head[:1] != b"\x80", f"{path.name} starts like a pickle"  # pickle protocol 2+
        assert not path.read_bytes().startswith(b"PK"), f"{path.name} is a zip (torch.save)"
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (marker.write_text, ("boom",))  # runs only if someone unpickles it

    (checkpoint / "optimizer.pt").write_bytes(pickle.dumps(Bomb()))
    fa.load(_fresh(), checkpoint)  # loads: the planted file is not in the manifest, never read
    assert not marker.exists()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # an lm_head tied to the embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).logsumexp(-1).mean()


def test_tied_weights_round_trip_and_stay_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, _ = fa.step(state, torch.tensor([1, 2, 3]))
    fa.save(state, tmp_path / "tied")
    manifest = json.loads((tmp_path / "tied" / "fnaccel.json").read_text())
    assert manifest["tied"] == {"head.weight": "embed.weight"}  # stored once
    torch.manual_seed(5)
    other = Tied()
    loaded = fa.load(
        fa.prepare(fa.init(seed=0, cpu=True), other, torch.optim.SGD(other.parameters(), lr=0.1)),
        tmp_path / "tied",
    )
    assert torch.equal(other.embed.weight, model.embed.weight)
    assert other.head.weight is other.embed.weight  # still one parameter
    assert loaded.step == 1
