"""``fnaccel env``: versions, hardware and the config file, in accelerate's layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fnaccel
from fnaccel.commands.main import main
from fnaccel.config.launch import default_config_file


def _write_default_config(text: str) -> Path:
    path = default_config_file()  # under the test's own HF_HOME (conftest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.slow
def test_the_command_line_prints_versions_and_the_default_config() -> None:
    path = _write_default_config("mixed_precision: bf16\nnum_processes: 2\n")
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Copy-and-paste the text below in your GitHub issue" in out
    assert f"- `fnaccel` version: {fnaccel.__version__}" in out
    assert f"- PyTorch version: {torch.__version__}" in out
    for name in (
        "torchdata",
        "safetensors",
        "PyYAML",
        "NumPy",
        "Platform",
        "CPU count",
        "System RAM",
        "CUDA available",
        "GPU count",
        "Distributed backends",
    ):
        assert f"- {name}" in out, name
    assert f"- `fnaccel` config file (default location): {path}" in out
    assert "\t- mixed_precision: bf16" in out and "\t- num_processes: 2" in out


def test_a_given_config_file_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("use_cpu: true\nnum_processes: 3\n")
    assert main(["env", "--config_file", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"- `fnaccel` config file (--config_file): {config}" in out
    assert "\t- use_cpu: True" in out and "\t- num_processes: 3" in out
    backends = next(line for line in out.splitlines() if line.startswith("- Distributed backends"))
    assert "gloo True" in backends and "nccl" in backends and "mpi" in backends


def test_the_environment_variable_names_the_file_fa_init_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "from_env.yaml"
    config.write_text("mixed_precision: fp16\n")
    monkeypatch.setenv("FNACCEL_CONFIG_FILE", str(config))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"config file ($FNACCEL_CONFIG_FILE): {config}" in out and "\t- mixed_precision: fp16" in out
    assert f"FNACCEL_CONFIG_FILE={config}" in out


def test_no_config_file_says_not_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"(default location): {default_config_file()}\n\tnot found" in out


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("bogus_key: 1\n", "unknown key 'bogus_key'"),
        ("num_processes: [\n", "malformed YAML"),
        ("num_processes: two\n", "key 'num_processes' must be int"),
    ],
)
def test_an_invalid_config_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    assert main(["env", "--config_file", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fnaccel env: error: ") and fragment in lines[0]
    assert str(config) in lines[0]


def test_a_missing_config_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--config_file", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "cannot read the config file" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_an_invalid_default_config_fails_the_real_command_without_a_traceback() -> None:
    _write_default_config("distributed_type: [\n")
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert "malformed YAML" in result.stderr
