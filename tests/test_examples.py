"""The main job (examples/train_classifier.py) runs and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def test_the_classifier_example_trains_and_writes_its_weights(tmp_path: Path) -> None:
    output = tmp_path / "weights.safetensors"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_classifier.py"), "--epochs", "5",
         "--output", str(output)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    accuracy = float(re.findall(r"test accuracy ([0-9.]+)", result.stdout)[-1])
    assert accuracy > 0.8, result.stdout  # chance is 0.33; 5 epochs reach about 0.88
    weights = load_file(output)
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}
