"""Corrupt, truncated, mismatched and planted files fail with errors that name them."""

from __future__ import annotations

import hashlib
import json
import pickle
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.manifest import manifest_hash
from tests.checkpoint.test_resume import fresh_run, train


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))
    state, _ = train(state, epochs=1, stop_after=3)  # between micro-steps: gradients saved too
    fa.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _fresh() -> fa.RunState:
    return fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))[0]


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "optimizer.json",
                                  "scheduler.json", "rank0.safetensors", "rank0.json",
                                  "config.yaml", "fnaccel.json"])
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


def test_unknown_schema_version(checkpoint: Path) -> None:
    manifest = checkpoint / "fnaccel.json"
    content = json.loads(manifest.read_text())
    content["schema_version"] = 99
    manifest.write_text(json.dumps(content))
    with pytest.raises(fa.CheckpointError, match="schema version 99 is unknown"):
        fa.load(_fresh(), checkpoint)


@pytest.mark.parametrize("version, algorithm", [(2, "sha256"), (3, "crc32")])
def test_an_older_checkpoint_still_loads_and_names_a_corrupt_file(
    checkpoint: Path, version: int, algorithm: str,
) -> None:
    """What fnaccel wrote before blocksum (schema 2: every file's sha256, schema 3:
    its CRC-32) reads as it did."""
    expected = fa.load(_fresh(), checkpoint)
    path = checkpoint / "fnaccel.json"
    manifest = json.loads(path.read_text())
    assert manifest["schema_version"] == 5
    assert all(set(e) == {"blocksum", "size"} for e in manifest["files"].values())
    manifest["schema_version"] = version
    for name, entry in manifest["files"].items():
        entry.pop("blocksum")
        data = (checkpoint / name).read_bytes()
        entry[algorithm] = hashlib.sha256(data).hexdigest() if algorithm == "sha256" else f"{zlib.crc32(data):08x}"
    manifest["manifest_sha256"] = manifest_hash(manifest)
    path.write_text(json.dumps(manifest))
    loaded = fa.load(_fresh(), checkpoint)
    for (key, a), b in zip(expected.model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a, b), key
    assert loaded.step == expected.step and loaded.micro_step == expected.micro_step
    model = checkpoint / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x01
    model.write_bytes(bytes(data))
    with pytest.raises(fa.CheckpointError, match=rf"model\.safetensors: corrupt \(its {algorithm} does not match"):
        fa.load(_fresh(), checkpoint)


def test_another_model_gives_key_and_shape_errors(checkpoint: Path) -> None:
    wider = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
    state = fa.prepare(fa.init(seed=0, cpu=True), wider, torch.optim.AdamW(wider.parameters()))
    with pytest.raises(fa.CheckpointError, match=r"'0.weight' has shape \(32, 8\) in the checkpoint but \(64, 8\)"):
        fa.load(state, checkpoint)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    state = fa.prepare(fa.init(seed=0, cpu=True), other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(fa.CheckpointError, match=r"missing keys \['2.bias', '2.weight'\], unexpected keys \['3.bias', '3.weight'\]"):
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
    loaded = fa.load(fa.prepare(fa.init(seed=0, cpu=True), other, torch.optim.SGD(other.parameters(), lr=0.1)),
                     tmp_path / "tied")
    assert torch.equal(other.embed.weight, model.embed.weight)
    assert other.head.weight is other.embed.weight  # still one parameter
    assert loaded.step == 1
