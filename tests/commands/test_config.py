"""`fnaccel config`, `config default`, `config update`: the files they write."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from fnaccel.commands.config import Questions, ask_config
from fnaccel.commands.main import main
from fnaccel.config.launch import default_config_file, load_config


def answer(lines: str) -> tuple[dict[str, object], str]:
    out = io.StringIO()
    return ask_config(Questions(io.StringIO(lines), out)), out.getvalue()


def test_answers_from_a_pipe_become_the_config() -> None:
    # multi-CPU, 2 machines, rank 1, ip, port, c10d, same network, debug, FSDP (SHARD_GRAD_OP,
    # no offload, size-based wrap with 1000 params, full state dict), dynamo (AOT_EAGER, default,
    # fullgraph, not dynamic), 4 processes, bf16
    config, transcript = answer(
        "1\n2\n1\n10.0.0.1\n29400\n1\nyes\nyes\nyes\n1\nno\n1\n1000\nno\nyes\n1\n0\nyes\nno\n4\n2\n"
    )
    assert config == {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "use_cpu": True,
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29400,
        "rdzv_backend": "c10d",
        "same_network": True,
        "debug": True,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_sharding_strategy": "SHARD_GRAD_OP",
            "fsdp_offload_params": False,
            "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
            "fsdp_min_num_params": 1000,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": False,
        },
        "dynamo_config": {
            "dynamo_backend": "AOT_EAGER",
            "dynamo_mode": "default",
            "dynamo_use_fullgraph": True,
            "dynamo_use_dynamic": False,
        },
        "num_processes": 4,
        "mixed_precision": "bf16",
    }
    assert "Which type of machine are you using?" in transcript


def test_bad_answers_are_asked_again_and_the_end_of_input_takes_defaults() -> None:
    config, transcript = answer("7\nmaybe\n0\n")  # a bad number, then a bad yes/no, then ...
    assert "please enter a number from 0 to 2" in transcript
    assert "no more input" in transcript
    assert config["distributed_type"] == "NO" and config["mixed_precision"] == "no"


@pytest.mark.slow
def test_config_without_a_terminal_writes_the_defaults(tmp_path: Path) -> None:
    target = tmp_path / "c.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "config", "--config_file", str(target)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert load_config(target).num_processes == 1


def test_config_writes_the_default_location(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("1\n1\nno\nno\nno\n3\n1\n"))
    assert main(["config"]) == 0
    written = load_config(default_config_file())
    assert (written.distributed_type, written.num_processes, written.mixed_precision) == (
        "MULTI_CPU",
        3,
        "fp16",
    )


def test_config_default_writes_this_machine_and_keeps_an_existing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's CPU, even on a GPU box
    target = tmp_path / "sub" / "default.yaml"
    assert main(["config", "default", "--config_file", str(target), "--mixed_precision", "fp16"]) == 0
    written = load_config(target)
    assert written.mixed_precision == "fp16" and written.use_cpu and written.num_processes == 1
    target.write_text("mixed_precision: bf16\n")
    assert main(["config", "default", "--config_file", str(target)]) == 0
    assert "already exists" in capsys.readouterr().err
    assert target.read_text() == "mixed_precision: bf16\n"
    assert not list(tmp_path.glob("sub/.*tmp"))  # the atomic write left nothing behind
    # a directory is no config file "already there": exit 2, one line
    assert main(["config", "default", "--config_file", str(tmp_path / "sub")]) == 2
    assert capsys.readouterr().err == (
        f"fnaccel config default: error: {tmp_path / 'sub'}: not a file "
        "(a directory?); choose a file path for --config_file\n"
    )


def test_config_update_keeps_values_and_adds_todays_keys(tmp_path: Path) -> None:
    target = tmp_path / "old.yaml"  # an older Accelerate file
    target.write_text(
        textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_GPU
        dynamo_backend: INDUCTOR
        mixed_precision: bf16
        num_processes: 8
    """)
    )
    assert main(["config", "update", "--config_file", str(target)]) == 0
    data = yaml.safe_load(target.read_text())
    assert data["num_processes"] == 8 and data["mixed_precision"] == "bf16"
    assert data["dynamo_config"] == {"dynamo_backend": "INDUCTOR"} and "dynamo_backend" not in data
    assert data["rdzv_backend"] == "static" and data["fsdp_config"] == {}  # today's defaults


def test_config_update_without_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "update", "--config_file", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no config file at" in err and "fnaccel config" in err


def test_config_update_names_a_bad_key(tmp_path: Path) -> None:
    target = tmp_path / "bad.yaml"
    target.write_text("num_processes: 2\nrdzv_backend: carrier-pigeon\n")
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "config", "update", "--config_file", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "key 'rdzv_backend' must be one of" in result.stderr and str(target) in result.stderr
    assert target.read_text() == "num_processes: 2\nrdzv_backend: carrier-pigeon\n"
