"""`fnaccel launch --dry_run`: a 64-process FSDP x TP launch checked on this machine.

Each test is one real `fnaccel launch --dry_run` of tests/commands/_dry_run_script.py
(a small transformer, fa.tp + fa.fsdp on a dp_shard=8 x tp=8 mesh over 8 machines);
the refusals are compared with what the real code raises in a one-process run and
with what the real launcher says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).with_name("_dry_run_script.py")
WORLD = ("--cpu", "--num_machines", "8", "--num_processes", "64", "--parallelism_config_tp_size", "8")


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fnaccel", "launch", "-q", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_64_process_fsdp_x_tp_launch_prints_its_mesh_and_each_ranks_bytes() -> None:
    # How long it takes is measured, not asserted (docs/cli.md, "Dry runs", quotes the figure):
    # a test must not depend on the machine's load.
    done = launch("--dry_run", *WORLD, str(SCRIPT))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "64 processes on 8 machine(s)" in out and "mesh: dp_shard=8 x tp=8" in out
    assert "step: one fa.step taken" in out
    # the 250-row embedding splits 32 x 7 + 26 over dp_shard: the last dp_shard coordinate
    # (ranks 56-63) holds less; the rows group identical ranks
    rows = dict(re.findall(r"│\s+(\d+-\d+)\s+│\s+([\d.]+ KB)", out))
    assert rows == {"0-55": "56.98 KB", "56-63": "50.96 KB"}, out
    # by hand: per block, the tp-split q/k/v (weight and bias), o.weight, up and down.weight
    # (197504 elements) over 64 ranks is 3086, the rest (norms, o.bias, down.bias: 768) over
    # dp_shard 96; the embedding and head rows over dp_shard: 32 rows on ranks 0-55, 26 on
    # 56-63, the head's bias likewise. Rank 0: 2 x 3182 + 2 x 32 x 128 + 32 = 14588 floats;
    # rank 63: 2 x 3182 + 2 x 26 x 128 + 26 = 13046. AdamW: two moments per element and a
    # 4-byte step per parameter (35). Each simulated rank measured what rank 0 computed.
    for rank, floats in ((0, 14588), (63, 13046)):
        assert (f"rank {rank} measured {4 * floats} B, {4 * floats} B, {8 * floats + 4 * 35} B "
                "(parameters, gradients, optimizer) as computed") in out, out
    assert "sharded/rank<r>.safetensors for r in 0-63" in out
    assert re.search(r"blocks\.0\.q\.weight\s+│\s+128x128\s+│\s+float32\s+│\s+dp_shard:_S\(0, 8\) tp:S\(0\)", out)


def _start_one_process_run() -> subprocess.Popen[str]:
    """A real one-process run of the same script with the planted plan (it runs beside the dry run:
    one process, a core of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FNACCEL_", "RANK", "WORLD_SIZE"))}
    return subprocess.Popen([sys.executable, str(SCRIPT), "--wrong_plan"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _refusal(run: subprocess.Popen[str]) -> str:
    """What fa.tp raised for the planted plan in that run."""
    try:
        _, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
        run.wait()
    assert run.returncode != 0
    return stderr.strip().splitlines()[-1]


def test_a_wrong_tp_plan_is_refused_with_the_real_runs_exception_and_message() -> None:
    real = _start_one_process_run()
    try:
        done = launch("--dry_run", *WORLD, str(SCRIPT), "--wrong_plan")
    except BaseException:
        real.kill()
        real.wait()
        raise
    expected = _refusal(real)
    assert done.returncode == 1
    assert expected.startswith("ValueError: fa.prepare: tp plan names 'blocks.*.mlp.up'")
    assert expected in done.stderr
    assert "failed as rank 0 of 64 (exit code 1)" in done.stderr
    assert "Bytes held per rank" not in done.stdout


def test_an_impossible_mesh_is_refused_as_the_real_launch_refuses_it() -> None:
    mesh = ["--cpu", "--num_machines", "8", "--num_processes", "64", "--parallelism_config_tp_size", "3", str(SCRIPT)]
    # side by side: each is refused in its launcher, one process each
    started = [subprocess.Popen([sys.executable, "-m", "fnaccel", "launch", "-q", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for argv in (["--dry_run", *mesh], mesh)]
    try:
        outputs = [process.communicate(timeout=240) for process in started]
    finally:
        for process in started:
            process.kill()
            process.wait()
    dry, real = (subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(started, outputs))
    assert dry.returncode == real.returncode != 0
    assert "tp_size=3 = 3 does not divide the 64 processes" in dry.stderr
    assert dry.stderr == real.stderr


def test_a_script_without_a_prepare_is_said_to_be_checked_up_to_its_init(tmp_path: Path) -> None:
    script = tmp_path / "init_only.py"
    script.write_text("import fnaccel as fa\nfa.shutdown(fa.init())\n")
    done = launch("--dry_run", "--cpu", "--num_processes", "4", str(script))
    assert done.returncode == 1
    assert "ended without an fa.prepare holding a model and an optimizer" in done.stderr
