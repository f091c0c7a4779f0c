"""A save that fails is never lost: on every rank at once, at the next call, or at exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint import _failure_fns as fns

ROOT = Path(__file__).parents[2]
ASYNC_JOB = Path(__file__).with_name("_async_failure.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_a_write_failing_on_one_rank_fails_on_every_rank_within_seconds(world2: Any, tmp_path: Path) -> None:
    results = world2.run(fns.one_rank_fails, str(tmp_path), 1)
    for out in results:
        message = out["blocking"]
        assert message.startswith(
            f"{tmp_path / 'blocking'}: the save failed on rank 1 (OSError: [Errno 27] File too large)"
        ), message
        assert out["blocking_s"] < 10, out
        # the asynchronous save's failure reaches fa.shutdown on both ranks, promptly
        assert "the save failed on rank 1" in out["shutdown"] and "File too large" in out["shutdown"], out
        assert out["shutdown_s"] < 10, out
    assert results[0]["blocking"] == results[1]["blocking"]
    assert [r["after_step"] for r in results] == [4, 4]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"], strict=False))
    assert results[0]["left"] == ["after"]  # no partial directory of either failed save


@pytest.mark.slow
def test_a_failed_asynchronous_save_is_raised_by_the_next_call_or_ends_the_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ASYNC_JOB), str(tmp_path), "--checks"],
        capture_output=True,
        text=True,
        timeout=180,
        env=ENV,
    )
    lines = done.stdout.splitlines()
    for where, line in zip(("step", "save", "shutdown"), lines, strict=False):
        assert line.startswith(f"{where}: the asynchronous save to {tmp_path / where} failed: "), lines
        assert "File too large" in line, line
    assert lines[3:] == ["script ended"], lines
    # the script ended without waiting for its last save, which failed: status 1 and one line
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"fnaccel: the asynchronous save to {tmp_path / 'lost'} failed"), (
        done.stderr
    )
    assert "File too large" in done.stderr
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.multiprocess
def test_a_lost_asynchronous_failure_ends_a_two_process_launch(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fnaccel",
            "launch",
            "-q",
            "--cpu",
            "--num_processes",
            "2",
            str(ASYNC_JOB),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("fnaccel: the asynchronous save")]
    assert len(lines) == 2, done.stderr[-3000:]  # each rank's one line: rank 1's write failed, both know
    assert all(
        f"{tmp_path / 'lost'}: the save failed on rank 1 (OSError: [Errno 27] File too large)" in line
        for line in lines
    ), lines
    assert "failed: rank" in done.stderr.splitlines()[-1], done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("blocking", [True, False])
def test_an_unwritable_target_is_refused_when_the_save_starts(tmp_path: Path, blocking: bool) -> None:
    import fnaccel as fa
    from tests.checkpoint.test_targets import _read_only, _run, _writable

    parent = tmp_path / "runs"
    parent.mkdir()
    _read_only(parent)
    try:
        with pytest.raises(
            fa.CheckpointError, match=r"cannot be written: .* is not writable by this process"
        ):
            fa.save(_run(), parent / "deeper" / "ckpt", blocking=blocking)
    finally:
        _writable(parent)
    assert os.listdir(parent) == []
