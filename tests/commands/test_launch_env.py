"""What a launched process receives: the config the launch resolved, recorded as the run's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fnaccel.config.launch import LAUNCH_VARIABLES, LaunchConfig, launch_env, with_launch_env

_SCRIPT = """\
import sys, torch, fnaccel as fa
from torch import nn
state = fa.init(seed=0)
model = nn.Linear(2, 1)
state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1),
                   pipeline=fa.compose(fa.ddp()))  # leaves out the launch's autocast: a warning
print(f"rank {state.dist.rank}: {state.config.mixed_precision} {state.config.use_cpu} "
      f"{state.config.debug}", flush=True)
fa.save(state, sys.argv[1])
fa.shutdown(state)
"""


@pytest.mark.multiprocess
def test_the_run_records_the_resolved_config_and_warns_once(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("mixed_precision: fp16\nnum_processes: 2\n")
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fnaccel",
            "launch",
            "-q",
            "--config_file",
            str(config),
            "--cpu",
            "--mixed_precision",
            "bf16",
            str(script),
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "rank 0: bf16 True False" in result.stdout and "rank 1: bf16 True False" in result.stdout
    assert result.stderr.count("the launch asked for mixed_precision bf16") == 1, result.stderr
    recorded = yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text())
    assert (recorded["mixed_precision"], recorded["use_cpu"]) == ("bf16", True)


def test_one_table_encodes_and_decodes_the_launch_environment() -> None:
    config = LaunchConfig(
        mixed_precision="bf16",
        use_cpu=True,
        debug=True,
        enable_cpu_affinity=True,
        distributed_type="FSDP",
        fsdp_config={"fsdp_offload_params": True},
        dynamo_config={"dynamo_backend": "EAGER"},
    )
    env = launch_env(config)
    assert set(LAUNCH_VARIABLES.values()) <= set(env)
    back = with_launch_env(LaunchConfig(), env)
    for key in LAUNCH_VARIABLES:
        assert getattr(back, key) == getattr(config, key), key
    assert back.fsdp_config == {"fsdp_offload_params": "true"}  # sections travel as text
    assert back.dynamo_config == {"dynamo_backend": "EAGER"}


def test_a_bad_launch_variable_is_named() -> None:
    import pytest

    from fnaccel import ConfigError

    with pytest.raises(ConfigError, match="FNACCEL_USE_CPU='maybe' must be true or false"):
        with_launch_env(LaunchConfig(), {"FNACCEL_USE_CPU": "maybe"})
    with pytest.raises(ConfigError, match="FNACCEL_MIXED_PRECISION: key 'mixed_precision' must be one of"):
        with_launch_env(LaunchConfig(), {"FNACCEL_MIXED_PRECISION": "fp12"})
