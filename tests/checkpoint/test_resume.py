"""fa.save / fa.load: the resumed run equals the uninterrupted one bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fnaccel as fa

NUM_SAMPLES, BATCH = 40, 4  # 10 batches per epoch per process


class CountingDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Counts __getitem__ calls: resuming must not replay earlier batches."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(NUM_SAMPLES, 8, generator=g)
        self.y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
        self.reads = 0

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i], self.y[i]


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def fresh_run(state: fa.RunState, pipeline: fa.Pipeline) -> tuple[fa.RunState, nn.Module, CountingDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    data = CountingDataset()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    state = fa.prepare(state, model, optimizer, loader, scheduler, pipeline=pipeline, loss_fn=loss_fn)
    return state, model, data


def train(state: fa.RunState, epochs: int, stop_after: int | None = None) -> tuple[fa.RunState, list[float]]:
    losses = []
    for batch in fa.batches(state, epochs=epochs):
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"].item())
        if stop_after is not None and state.micro_step == stop_after:
            break
    return state, losses


PIPELINES = {
    "fp32": lambda: fa.compose(fa.ddp()),
    "fp16": lambda: fa.compose(fa.autocast(fa.fp16), fa.ddp()),
    "accumulate3": lambda: fa.compose(fa.ddp(), fa.accumulate(3)),
}


def resume_matches(state: fa.RunState, kind: str, directory: str, stop_after: int) -> dict[str, Any]:
    """Runs on each rank: uninterrupted vs saved-and-resumed with fresh objects."""
    pipeline = PIPELINES[kind]()
    seed_state = state
    whole, whole_model, _ = fresh_run(seed_state, pipeline)
    whole, whole_losses = train(whole, epochs=2)

    first, _, _ = fresh_run(fa.init(seed=0, cpu=True), pipeline)
    first, first_losses = train(first, epochs=2, stop_after=stop_after)
    fa.save(first, directory)
    fa.shutdown(first)  # in a larger world each fa.init above made its own group

    second, model, data = fresh_run(fa.init(seed=0, cpu=True), pipeline)
    second = fa.load(second, directory)
    reads_before = data.reads
    second, rest = train(second, epochs=2)
    fa.shutdown(second)
    return {
        "losses_equal": first_losses + rest == whole_losses,
        "params_equal": all(
            torch.equal(p, q) for p, q in zip(model.parameters(), whole_model.parameters(), strict=False)
        ),
        "reads_after_resume": data.reads - reads_before,
        "remaining_batches": len(rest),
        "step": (second.step, second.micro_step, whole.step, whole.micro_step),
    }


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_resume_in_one_process_is_bit_exact_and_does_not_replay(tmp_path: Path, kind: str) -> None:
    stop_after = 13  # mid-epoch (epoch 1, batch 3); under accumulate(3), between micro-steps
    result = resume_matches(fa.init(seed=0, cpu=True), kind, str(tmp_path / "ckpt"), stop_after)
    assert result["losses_equal"] and result["params_equal"], result
    assert result["remaining_batches"] == 20 - stop_after
    assert result["reads_after_resume"] == BATCH * (20 - stop_after)  # no replay of earlier batches
    assert result["step"][1] == result["step"][3] == 20


def test_saving_or_loading_a_consumed_state_raises(tmp_path: Path) -> None:
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    newer, _ = train(state, epochs=1, stop_after=1)
    with pytest.raises(fa.StaleStateError):
        fa.save(state, tmp_path / "c")
    fa.save(newer, tmp_path / "c")
    with pytest.raises(fa.StaleStateError):
        fa.load(state, tmp_path / "c")


def test_resume_across_two_processes_is_bit_exact(world2: Any, tmp_path: Path) -> None:
    stop_after = 7  # 5 batches per epoch per rank: mid-epoch 1; between accumulate(3)'s micro-steps
    for kind in ("fp32", "accumulate3"):
        results = world2.run(resume_matches, kind, str(tmp_path / kind), stop_after)
        for result in results:
            assert result["losses_equal"] and result["params_equal"], (kind, result)
            assert result["reads_after_resume"] == BATCH * (10 - stop_after)
    files = sorted(p.name for p in (tmp_path / "fp32").iterdir())
    assert files == [
        "config.yaml",
        "fnaccel.json",
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
        "rank0.json",
        "rank0.safetensors",
        "rank1.json",
        "rank1.safetensors",
        "run.json",
        "scheduler.json",
    ]


def test_a_two_process_checkpoint_on_one_process_needs_the_same_global_batch(
    world2: Any, tmp_path: Path
) -> None:
    # another number of processes itself is fine (tests/checkpoint/test_reshard.py); another global batch is not
    world2.run(_save_two, str(tmp_path / "two"))
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    with pytest.raises(fa.CheckpointError, match="global batch of 8 .* per-process batch_size of 8, or pass"):
        fa.load(state, tmp_path / "two")


def _save_two(state: fa.RunState, directory: str) -> None:
    state, _, _ = fresh_run(state, fa.compose(fa.ddp()))
    state, _ = train(state, epochs=1, stop_after=2)
    fa.save(state, directory)
