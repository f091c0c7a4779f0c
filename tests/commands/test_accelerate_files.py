"""Config files as older Accelerate versions wrote them: they load, launch and update."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fnaccel.commands.launch import resolve
from fnaccel.commands.main import build_parser, main
from fnaccel.config.launch import LaunchConfig, load_config

# What `accelerate config` wrote around 0.12-0.15 (null where nothing was set).
ACCELERATE_0_12 = """\
command_file: null
commands: null
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_CPU
downcast_bf16: 'no'
dynamo_backend: 'NO'
fsdp_config: {}
gpu_ids: null
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_name: null
tpu_zone: null
use_cpu: true
"""

# What the first versions wrote (0.5), before mixed_precision existed.
ACCELERATE_0_5 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_CPU
fp16: false
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
num_machines: 1
num_processes: 2
"""

# Accelerate's multi-CPU example (docs), with its IPEX and mpirun sections switched off.
ACCELERATE_MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
downcast_bf16: 'no'
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: bf16
mpirun_config: {}
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            ACCELERATE_0_12,
            {
                "commands": [],
                "gpu_ids": "all",
                "command_file": None,
                "use_cpu": True,
                "mixed_precision": "no",
                "dynamo_config": {},
            },
        ),
        (ACCELERATE_0_5, {"mixed_precision": "no", "num_processes": 2, "distributed_type": "MULTI_CPU"}),
        (ACCELERATE_0_5.replace("fp16: false", "fp16: true"), {"mixed_precision": "fp16"}),
        (
            ACCELERATE_MULTI_CPU,
            {"mixed_precision": "bf16", "ipex_config": {"ipex": False}, "main_process_port": 29500},
        ),
    ],
)
def test_older_files_load_with_null_as_not_set(tmp_path: Path, text: str, expected: dict) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(text)
    config = load_config(path)
    assert {key: getattr(config, key) for key in expected} == expected
    args = build_parser().parse_args(["launch", "--config_file", str(path), "train.py"])
    assert resolve(args).num_processes == 2  # and launch accepts it


@pytest.mark.parametrize("text", [ACCELERATE_0_12, ACCELERATE_0_5])
def test_config_update_converts_an_older_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(text)
    assert main(["config", "update", "--config_file", str(path)]) == 0
    written = yaml.safe_load(path.read_text())
    assert "fp16" not in written and "dynamo_backend" not in written
    assert set(written) == set(LaunchConfig().to_dict())
    assert written["commands"] == [] and written["gpu_ids"] == "all"
    assert load_config(path).num_processes == 2


@pytest.mark.multiprocess
def test_an_older_file_runs(tmp_path: Path) -> None:
    """A real launch of 2 processes from the 0.12-era file."""
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_0_12)
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""\
        import torch, fnaccel as fa
        state = fa.init()
        total = fa.ops.reduce(state, torch.tensor(1.0), "sum").item()
        print(f"rank {state.dist.rank} of {state.dist.num_processes}: {total} "
              f"{state.config.gpu_ids} {state.config.commands}", flush=True)
        fa.shutdown(state)
    """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "launch", "-q", "--config_file", str(path), str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2: 2.0 all []" in result.stdout
