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


def test_examples_import_only_documented_public_modules() -> None:
    """An example is what users copy: it may import `fnaccel` and the modules docs/api.md
    documents, never an implementation module (`fnaccel.data.sharding`, ...)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    public = set(re.findall(r"^## `(fnaccel[\w.]*)`", (root / "docs" / "api.md").read_text(), re.M))
    assert "fnaccel" in public
    for example in sorted((root / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(example.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.split(".")[0] == "fnaccel":
                    assert name in public, f"{example.name}:{node.lineno} imports {name}, not in docs/api.md"
