"""fnaccel.utils.save / load: tied tensors stored once (logged), safetensors read back, pickles refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import fnaccel as fa
from fnaccel.utils import load, retie_parameters, save


def test_tied_tensors_are_stored_once_and_the_dropped_names_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # failed before: both names were written as separate copies, without a word
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    base = torch.arange(6.0)
    state = fa.init(cpu=True)
    with caplog.at_level(logging.WARNING, logger="fnaccel.checkpoint.single"):
        save(state, {**model.state_dict(), "base": base, "half": base[:3]}, tmp_path / "w.safetensors")
    stored = safetensors.torch.load_file(tmp_path / "w.safetensors")
    assert sorted(stored) == ["0.weight", "base", "half"]  # a distinct view is kept as a copy
    assert "Removed shared tensor ['1.weight']" in caplog.text
    restored = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    restored.load_state_dict({"0.weight": stored["0.weight"], "1.weight": stored["0.weight"]})
    retie_parameters(restored, [["0.weight", "1.weight"]])
    assert restored[1].weight is restored[0].weight


def test_load_reads_what_save_wrote_onto_the_asked_device(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(2, 3), "b": torch.arange(4)}
    save(fa.init(cpu=True), tensors, tmp_path / "t.safetensors")
    loaded = load(tmp_path / "t.safetensors", map_location="cpu")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert load(tmp_path / "t.safetensors", map_location="meta")["a"].is_meta


def test_load_refuses_a_pickle_and_a_missing_file(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(1)}, tmp_path / "model.bin")
    with pytest.raises(ValueError, match="not a safetensors file.*reads no pickles"):
        load(tmp_path / "model.bin")
    with pytest.raises(FileNotFoundError, match="no file"):
        load(tmp_path / "absent.safetensors")
