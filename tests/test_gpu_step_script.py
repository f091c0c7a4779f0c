"""benchmarks/gpu_step.py, the GPU benchmark of issue 15, kept working without a GPU:
its toy size on the CPU trains the same weights in the fa.step loop as in the
hand-written bf16 autocast loop, bit for bit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_step.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_step", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_toy_size_trains_the_hand_loops_weights_on_the_cpu() -> None:
    rows = _script().main(["--tiny", "--device", "cpu", "--rounds", "1", "--steps", "2", "--no-compile"])
    assert [row["case"] for row in rows] == ["bf16 autocast"]
    assert rows[0]["max_weight_difference"] == 0.0
    assert rows[0]["hand_s"] > 0 and rows[0]["fnaccel_s"] > 0


def test_without_cuda_the_default_device_is_refused_with_the_way_out() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the refusal is for machines without one")
    with pytest.raises(SystemExit, match="no CUDA device here"):
        _script().main(["--rounds", "1"])
