"""Save in one interpreter, load in a new one: the run continues bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fnaccel as fa
from tests.checkpoint import _resume_job
from tests.checkpoint.test_resume import PIPELINES, fresh_run, train

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("_resume_job.py")


def _start(part: str, checkpoint: Path, out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(JOB), part, str(checkpoint), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_a_new_interpreter_resumes_bit_for_bit(tmp_path: Path) -> None:
    # the first half in this interpreter (a new one for it would only add its imports), the second
    # in a new one; the uninterrupted run here while that one runs
    _resume_job.main("first", str(tmp_path / "ckpt"), tmp_path / "first")
    second = _start("second", tmp_path / "ckpt", tmp_path / "second")
    try:
        whole, model, _ = fresh_run(fa.init(seed=0, cpu=True), PIPELINES["accumulate3"]())
        whole, losses = train(whole, epochs=2)
        _, stderr = second.communicate(timeout=120)
    finally:
        second.kill()
        second.wait()
    assert second.returncode == 0, stderr
    halves = json.loads((tmp_path / "first.json").read_text()) + json.loads(
        (tmp_path / "second.json").read_text()
    )
    assert halves == losses  # accumulate(3), saved between micro-steps, dropout, shuffling
    final = load_file(str(tmp_path / "second.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
