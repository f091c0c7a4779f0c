"""The data position is the state's: a batch fetched and never stepped is read again after a resume.

The loop in every case is the one users write, with the break between the
fetch and the step; the second half runs in a new interpreter (or, on 2
ranks, with fresh objects in each rank) after `fa.load`, and must end
bit-identical to the uninterrupted run: losses, weights and counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import fnaccel as fa
from tests.checkpoint import _position_job as job

ROOT = Path(__file__).resolve().parents[2]


def _run(part: str, directory: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, job.__file__, part, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _assert_all_equal(results: dict[str, Any], cases: dict[str, Any]) -> None:
    assert sorted(results) == sorted(cases)
    for name, result in results.items():
        counters = result["counters"]
        assert result["losses_equal"] and result["weights_equal"], (name, result)
        assert counters[:3] == counters[3:], (name, counters)


@pytest.mark.slow
def test_a_new_interpreter_resumes_every_loop_shape_bit_for_bit(tmp_path: Path) -> None:
    job.first(tmp_path, job.CASES)  # in this interpreter: a new one for it would only add its imports
    _run("second", tmp_path)
    _assert_all_equal(json.loads((tmp_path / "results.0.json").read_text()), job.CASES)


def test_two_ranks_resume_bf16_accumulation_and_a_new_epochs_first_fetch(world2: Any, tmp_path: Path) -> None:
    world2.run(job.in_world, "first", str(tmp_path))
    world2.run(job.in_world, "second", str(tmp_path))
    for rank in range(2):
        _assert_all_equal(json.loads((tmp_path / f"results.{rank}.json").read_text()), job.DIST_CASES)


def _prepared(batch_size: int = 4, num_samples: int = job.NUM_SAMPLES) -> fa.RunState:
    dataset = torch.utils.data.Subset(job.Samples(), range(num_samples))
    state, _ = job.fresh((lambda: fa.compose(), {"shuffle": True}, lambda: dataset, 1, None))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    return state if batch_size == 4 else _with_loader(state, loader)


def _with_loader(state: fa.RunState, loader: DataLoader[Any]) -> fa.RunState:
    return fa.prepare(state.replace(loader=None), loader=loader)


def _save_mid_epoch(directory: Path) -> None:
    state, _ = job.run(_prepared(), epochs=1, stop_at=3)
    fa.save(state, directory)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"batch_size": 6},
            r"global batch of 4 samples per step \(4 per process x 1 process\(es\)\) but this run reads 6",
        ),
        ({"num_samples": 30}, "num_samples=36 but this run's loader has num_samples=30"),
    ],
)
def test_a_resume_that_cannot_be_exact_is_refused_naming_both_values(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    _save_mid_epoch(tmp_path / "ckpt")
    other = _prepared(**kwargs)
    with pytest.raises(fa.CheckpointError, match=message):
        fa.load(other, tmp_path / "ckpt")
    assert not other.is_spent  # refused before anything was consumed


def test_fetching_without_stepping_moves_nothing_and_the_next_reading_starts_there() -> None:
    state = _prepared()
    first = next(iter(fa.batches(state)))
    assert state.data_position == fa.DataPosition()  # fetched, not consumed
    again = next(iter(fa.batches(state)))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
    state, _ = fa.step(state, again)
    assert state.data_position == fa.DataPosition(epoch=0, num_batches=1)
    state, _ = fa.step(state, again)  # stepping a batch again consumes nothing more
    assert state.data_position == fa.DataPosition(epoch=0, num_batches=1)


def test_the_epoch_is_the_states_and_moves_on_after_the_last_step() -> None:
    state = _prepared()
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
    assert state.epoch == 1 and state.data_position.num_batches == 0
    assert state.step == len(state.loader)
    for batch in fa.batches(state):  # the rest of the current epoch: epoch 1
        state, _ = fa.step(state, batch)
    assert state.epoch == 2 and state.step == 2 * len(state.loader)


def test_batches_refuses_a_consumed_state() -> None:
    state = _prepared()
    newer, _ = fa.step(state, next(iter(fa.batches(state))))
    with pytest.raises(fa.StaleStateError):
        fa.batches(state)
    assert newer.micro_step == 1
