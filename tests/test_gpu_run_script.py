"""benchmarks/gpu/run.sh, issue 29's one device call, kept working without a GPU:
``--tiny`` runs it end to end on the CPU at the toy size (the rows that need CUDA
or a compile recorded as skipped with the reason, the suite's CUDA files listed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_tiny_run_writes_every_figure_and_the_suite_selection(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    bench_log = (tmp_path / "bench.log").read_text()
    assert "exit status 0" in bench_log, bench_log
    assert "\ntorch " + torch.__version__ in (tmp_path / "env.txt").read_text()  # the machine's report
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert not [row for row in figures["rows"] if "error" in row], bench_log
    assert figures["header"]["peak_bf16_flops"] is None  # no peak on the CPU, so no MFU
    rows = {(row["section"], row.get("row")): row for row in figures["rows"]}
    assert list(rows) == [
        ("step", "eager"),
        ("step", "fsdp"),
        ("step", "deepspeed_zero2"),
        ("resume", None),
        ("async_save", None),
        ("step", "compiled"),
        ("step", "fp8"),
    ]
    for name in ("eager", "fsdp", "deepspeed_zero2"):
        row = rows["step", name]
        assert "error" not in row, row
        assert row["hand_tokens_per_second"] > 0 and row["fnaccel_tokens_per_second"] > 0
        assert row["hand_mfu"] is None and row["fnaccel_mfu"] is None
        # 6 * tokens * matmul parameters + attention, for gpu_step's toy GPT (2 blocks of 64, vocab 512)
        assert row["flops_per_batch"] == 6 * 128 * (2 * 12 * 64 * 64 + 512 * 64) + 12 * 2 * 2 * 64 * 64 * 64
    # the same bf16 autocast steps as the hand loop, bit for bit (fa.fsdp() on one process shards nothing)
    assert rows["step", "eager"]["max_weight_difference"] == 0.0
    assert rows["step", "fsdp"]["max_weight_difference"] == 0.0
    assert rows["step", "compiled"]["skipped"].startswith("compiled rows are for the device")
    assert "skipped" in rows["step", "fp8"]
    assert rows["resume", None]["bit_identical"] is True
    assert rows["resume", None]["micro_steps"] == [16, 16]
    save = rows["async_save", None]
    assert save["checkpoint_bytes"] > 0 and save["async_blocked_s"] > 0 and save["blocking_save_s"] > 0
    suite = (tmp_path / "suite.log").read_text().splitlines()
    assert "tests/test_tracking_throughput.py" in suite and "tests/modeling/test_weights.py" in suite
    assert "tests/test_tracking.py" not in suite  # CPU-only: not part of the device run


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "benchmarks" / "gpu" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # it puts the checkout and benchmarks/ first on the path
    return module


def test_unknown_rows_and_a_missing_device_are_refused_with_the_choices() -> None:
    script = _script()
    with pytest.raises(SystemExit, match=r"unknown sections or rows \['bogus'\]: sections are"):
        script.main(["--tiny", "--device", "cpu", "--rows", "eager,bogus"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device here"):
            script.main([])
