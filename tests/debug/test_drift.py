"""Config drift on resume: fa.load names each difference once, refuses an inexact resume unless strict=False."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.checkpoint.manifest import ResumeDriftWarning, manifest_hash


def run(pipeline: fa.Pipeline) -> fa.RunState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    return fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        pipeline=pipeline,
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )


def saved(tmp_path: Path, pipeline: fa.Pipeline, steps: int = 2) -> Path:
    state = run(pipeline)
    for batch, _ in zip(fa.batches(state), range(steps), strict=False):
        state, _ = fa.step(state, batch)
    fa.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_the_same_pipeline_loads_without_a_warning(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, fa.compose(fa.clip_grad_norm(1.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fa.load(run(fa.compose(fa.clip_grad_norm(1.0))), ckpt).step == 2


def test_another_pipeline_warns_once_naming_each_difference(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, fa.compose(fa.clip_grad_norm(1.0)))
    with pytest.warns(ResumeDriftWarning) as caught:
        state = fa.load(run(fa.compose(fa.autocast(fa.bf16), fa.clip_grad_norm(0.5))), ckpt)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "pipeline/clip_grad_norm/max_norm: '1.0' -> '0.5'" in message
    assert "pipeline/autocast: 'absent' -> 'present'" in message
    assert "precision: 'fp32' -> 'bf16'" in message
    assert state.step == 2  # a warning: the resume went on


def test_another_accumulation_count_is_refused_unless_not_strict(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, fa.compose())
    fresh = run(fa.compose(fa.accumulate(2)))
    with pytest.raises(
        fa.CheckpointError,
        match=r"cannot resume the checkpoint exactly: micro_steps: 1 -> 2.*"
        r"strict=False",
    ):
        fa.load(fresh, ckpt)
    assert not fresh.is_spent  # refused before anything was restored
    with pytest.warns(ResumeDriftWarning, match="micro_steps: 1 -> 2"):
        assert fa.load(fresh, ckpt, strict=False).step == 2


def test_a_transform_state_the_run_lacks_is_refused_or_dropped(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, fa.compose(fa.autocast(fa.fp16), fa.grad_scaler()))  # fp16, then resumed in bf16
    with pytest.raises(
        fa.CheckpointError, match="'grad_scaler', which this run's pipeline lacks.*strict=False"
    ):
        fa.load(run(fa.compose(fa.autocast(fa.bf16))), ckpt)
    with pytest.warns(
        ResumeDriftWarning, match="pipeline/grad_scaler: 'present' -> 'absent'.*precision: 'fp16' -> 'bf16'"
    ):
        assert fa.load(run(fa.compose(fa.autocast(fa.bf16))), ckpt, strict=False).step == 2


def test_a_checkpoint_without_run_json_is_refused_naming_it(tmp_path: Path) -> None:
    """Every checkpoint of this schema records run.json: one without it was edited."""
    ckpt = saved(tmp_path, fa.compose(fa.clip_grad_norm(1.0)))
    (ckpt / "run.json").unlink()
    manifest = json.loads((ckpt / "fnaccel.json").read_text())
    del manifest["files"]["run.json"]
    manifest["manifest_sha256"] = manifest_hash(manifest)
    (ckpt / "fnaccel.json").write_text(json.dumps(manifest))
    with pytest.raises(fa.CheckpointError, match="the manifest lists no file 'run.json'"):
        fa.load(run(fa.compose(fa.clip_grad_norm(1.0))), ckpt)


def _saved_with_ddp(state: fa.RunState, directory: str, batch_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=batch_size)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        pipeline=fa.compose(fa.ddp()),
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )
    batch = next(iter(fa.batches(state)))
    state, _ = fa.step(state, batch)
    fa.save(state, directory)


def test_another_number_of_processes_is_no_drift_but_another_option_is(world2: Any, tmp_path: Path) -> None:
    # ddp() on 2 processes -> no ddp() in a world of one is a layout change fa.load reshards, not drift
    world2.run(_saved_with_ddp, str(tmp_path / "ddp"), 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)  # the same global batch
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        pipeline=fa.compose(),
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fa.load(state, tmp_path / "ddp").step == 1
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        pipeline=fa.compose(fa.clip_grad_norm(1.0)),
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )
    with pytest.warns(ResumeDriftWarning, match="pipeline/clip_grad_norm: 'absent' -> 'present'"):
        fa.load(state, tmp_path / "ddp")
