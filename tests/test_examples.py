"""The main job (examples/train_classifier.py) runs and learns."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def test_the_classifier_example_trains_on_two_processes_and_writes_its_weights(tmp_path: Path) -> None:
    """The README's main job: `fnaccel launch --cpu --num_processes 2 examples/train_classifier.py`."""
    output = tmp_path / "weights.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "launch", "--cpu", "--num_processes", "2",
         "--num_cpu_threads_per_process", "1", str(ROOT / "examples" / "train_classifier.py"),
         "--epochs", "10", "--output", str(output)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    accuracy = float(re.findall(r"test accuracy ([0-9.]+)", result.stdout)[-1])
    assert accuracy > 0.8, result.stdout  # chance is 0.33
    weights = load_file(output)
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}
    logged = [json.loads(line) for line in (tmp_path / "classifier" / "metrics.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in logged] == list(range(1, 11))  # the main process only: once each
    assert round(logged[-1]["test_accuracy"], 3) == accuracy
