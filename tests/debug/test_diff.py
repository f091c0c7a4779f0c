"""fa.diff and `fnaccel checkpoint inspect/verify/diff` on a real 50M-parameter AdamW checkpoint (~600 MB)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.checkpoint.summary import summarize
from fnaccel.commands.main import main

WIDTH = 3536  # four Linear(WIDTH, WIDTH): 50,027,328 parameters


def big_state() -> tuple[fa.RunState, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(8, WIDTH))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        optimizer,
        loader,
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )
    return state, model


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 50M-parameter checkpoint one AdamW step in (exp_avg, exp_avg_sq: ~600 MB)."""
    root = tmp_path_factory.mktemp("big")
    state, _ = big_state()
    state, _ = fa.step(state, next(iter(fa.batches(state))))
    fa.save(state, root / "ckpt")
    fa.shutdown(state)
    return root / "ckpt"


def _twin(source: Path, target: Path, copied: str) -> Path:
    """``source`` with every file hard-linked except ``copied``, which is a real copy to edit."""
    target.mkdir()
    for entry in source.iterdir():
        (shutil.copyfile if entry.name == copied else os.link)(entry, target / entry.name)
    return target


def _flip(directory: Path, tensor: str, index: int) -> None:
    """Add 1.0 to element ``index`` (flat) of float32 ``tensor`` in model.safetensors, in place."""
    path = directory / "model.safetensors"
    with open(path, "r+b") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        begin = json.loads(f.read(length))[tensor]["data_offsets"][0]
        f.seek(8 + length + begin + 4 * index)
        value = struct.unpack("<f", f.read(4))[0]
        f.seek(-4, os.SEEK_CUR)
        f.write(struct.pack("<f", value + 1.0))


def test_a_single_flipped_element_is_found_and_named(big: Path, tmp_path: Path, capsys: Any) -> None:
    flipped = _twin(big, tmp_path / "flipped", "model.safetensors")
    _flip(flipped, "2.weight", 17 * WIDTH + 42)
    found = fa.diff(big, flipped)
    assert found.names == ("model/2.weight",), str(found)
    first = found.first
    assert first is not None and first.index == (17, 42) and first.count == 1
    assert first.max_abs == pytest.approx(1.0, abs=1e-3)
    # the checksum no longer matches: verify names the file, exit 2, one line
    assert main(["checkpoint", "verify", str(flipped)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(flipped / "model.safetensors") in err and "corrupt" in err
    assert main(["checkpoint", "diff", str(big), str(flipped)]) == 1
    assert "model/2.weight: 1 element(s) differ, first at [17, 42]" in capsys.readouterr().out


def test_a_resumed_then_saved_twin_is_equal(big: Path, tmp_path: Path, capsys: Any) -> None:
    state, _ = big_state()
    state = fa.load(state, big)
    assert not fa.diff(state, big)  # the live state against its checkpoint
    fa.save(state, tmp_path / "twin")
    fa.shutdown(state)
    found = fa.diff(big, tmp_path / "twin")
    assert not found and len(found) == 0 and "are equal" in str(found)
    assert main(["checkpoint", "diff", str(big), str(tmp_path / "twin")]) == 0
    assert "are equal" in capsys.readouterr().out


def test_inspect_reads_headers_only(big: Path, capsys: Any) -> None:
    summary = summarize(big)  # once first: the imports it needs are loaded
    with open("/proc/self/io") as f:
        before = int(next(line for line in f if line.startswith("rchar")).split()[1])
    summary = summarize(big)
    with open("/proc/self/io") as f:
        read = int(next(line for line in f if line.startswith("rchar")).split()[1]) - before
    total = sum(summary.files.values())
    assert total > 590e6 and read < 2**20, (total, read)  # a 600 MB checkpoint, under 1 MB read
    assert summary.parameters == 4 * (WIDTH * WIDTH + WIDTH) == 50_027_328
    assert summary.parameters_by_dtype == {"float32": summary.parameters}
    assert summary.parameters_by_module == {str(i): WIDTH * WIDTH + WIDTH for i in range(4)}
    assert (summary.step, summary.epoch, summary.num_batches, summary.num_processes) == (1, 0, 1, 1)
    assert summary.precision == "fp32" and summary.micro_steps == 1
    assert summary.torch_version == str(torch.__version__)
    assert main(["checkpoint", "inspect", "--json", str(big)]) == 0
    assert json.loads(capsys.readouterr().out)["files"]["optimizer.safetensors"] > 400e6
    assert main(["checkpoint", "inspect", str(big)]) == 0
    screen = capsys.readouterr().out
    assert "step         1 (micro step 1), epoch 0, 1 batches into it" in screen
    assert "50,027,328 parameters" in screen


def _small(seed: int = 0) -> fa.RunState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4, shuffle=True)
    return fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        optimizer,
        loader,
        scheduler,
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )


def test_rng_data_position_and_counters_are_named(tmp_path: Path) -> None:
    state = _small()
    batches = fa.batches(state)
    state, _ = fa.step(state, next(batches))
    fa.save(state, tmp_path / "a")
    state, _ = fa.with_rng(state, torch.rand, 1)  # draws from the run's generator only
    found = fa.diff(tmp_path / "a", state)
    assert found.names == ("rank0/rng/torch",), str(found)
    old = state
    state, _ = fa.step(state, next(batches))
    with pytest.raises(fa.StaleStateError, match="fa.diff"):
        fa.diff(old, state)
    found = fa.diff(tmp_path / "a", state)
    for name in (
        "step",
        "micro_step",
        "rank0/data/num_batches",
        "rank0/rng/torch",
        "model/0.weight",
        "optimizer/0.weight/exp_avg",
        "scheduler/last_epoch",
        "optimizer/param_groups/0/lr",
    ):
        assert name in found, (name, str(found))
    assert "epoch" not in found


def test_tolerance_pipeline_and_bad_input(tmp_path: Path) -> None:
    a, b = _small(), _small()
    with torch.no_grad():
        b.model[0].weight[1, 2] += 1e-4
    assert fa.diff(a, b).names == ("model/0.weight",)
    assert not fa.diff(a, b, atol=2e-4)
    fa.save(a, tmp_path / "a")
    c = fa.prepare(fa.init(seed=0, cpu=True), nn.Linear(4, 1), pipeline=fa.compose(fa.clip_grad_norm(0.5)))
    found = fa.diff(tmp_path / "a", c)
    assert (
        "pipeline/clip_grad_norm/max_norm" in found and "model/0.weight" in found and "model/weight" in found
    )
    with pytest.raises(ValueError, match="atol and rtol must be >= 0"):
        fa.diff(a, b, atol=-1)
    with pytest.raises(TypeError, match="not int"):
        fa.diff(a, 3)  # type: ignore[arg-type]
    with pytest.raises(fa.CheckpointError, match="fnaccel.json is missing"):
        fa.diff(a, tmp_path)
