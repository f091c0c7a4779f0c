"""Save in one interpreter, load in a new one: the run continues bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import fnaccel as fa
from tests.checkpoint.test_resume import PIPELINES, fresh_run, train

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("_resume_job.py")


def _run(part: str, checkpoint: Path, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(JOB), part, str(checkpoint), str(out)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr


def test_a_new_interpreter_resumes_bit_for_bit(tmp_path: Path) -> None:
    _run("first", tmp_path / "ckpt", tmp_path / "first")
    _run("second", tmp_path / "ckpt", tmp_path / "second")
    whole, model, _ = fresh_run(fa.init(seed=0, cpu=True), PIPELINES["accumulate3"]())
    whole, losses = train(whole, epochs=2)
    halves = json.loads((tmp_path / "first.json").read_text()) + json.loads((tmp_path / "second.json").read_text())
    assert halves == losses  # accumulate(3), saved between micro-steps, dropout, shuffling
    final = load_file(str(tmp_path / "second.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
