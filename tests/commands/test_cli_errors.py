"""Bad input on the command line: one line naming the flag or key and the file, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fnaccel.commands.launch import max_local_processes
from fnaccel.commands.main import main

SCRIPT = Path(__file__).with_name("_launched.py")


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``fnaccel argv`` in this process; it must exit 2 with one line on stderr."""
    status: int | str | None
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BAD_FILES = {
    "not UTF-8": (b"num_processes: 2\n\xff\xfe\n", "not UTF-8 text (byte 17)"),
    "deep nesting": (b"fsdp_config: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
    "a number key": (b"1: 2\n", "the key 1 is not a string"),
    "a number key in a section": (b"fsdp_config: {1: 2}\n", "key 'fsdp_config' holds the key 1"),
    "a 5000-digit number": (b"num_processes: " + b"9" * 5000 + b"\n", "a value cannot be read"),
    "a 30-digit number": (b"num_processes: " + b"9" * 30 + b"\n", "a 30-digit number"),
    "a port out of range": (b"main_process_port: 70000\n", "key 'main_process_port' must be from 1 to 65535"),
    "no processes": (b"num_processes: 0\n", "key 'num_processes' must be from 1"),
    "a machine rank outside": (
        b"num_machines: 2\nmachine_rank: 2\nnum_processes: 2\n",
        "machine_rank 2 is outside 0..1",
    ),
    "far too many processes": (
        b"num_processes: 1000000\nuse_cpu: true\n",
        "num_processes 1000000 is 1000000 processes on this machine",
    ),
    "ipex": (b"ipex_config:\n  ipex: true\n", "key 'ipex_config': ipex: this build has no Intel"),
    "mpirun": (
        b"mpirun_config:\n  mpirun_ccl: '1'\n  mpirun_hostfile: /home/me/hosts\n",
        "key 'mpirun_config': fnaccel launches with torchrun, not mpirun",
    ),
    "deepspeed section": (
        b"distributed_type: MULTI_CPU\ndeepspeed_config:\n  zero_stage: 2\n",
        "key 'deepspeed_config' is set but distributed_type is MULTI_CPU; pass --use_deepspeed",
    ),
    "zero stage 4": (
        b"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n",
        "zero_stage must be 0, 1, 2 or 3, got 4",
    ),
    "deepspeed's launcher": (
        b"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_hostfile: /h\n",
        "deepspeed_hostfile: fnaccel launches with torchrun",
    ),
    "a TPU key": (b"tpu_name: my-pod\n", "key 'tpu_name': it configures TPU launches"),
    "fp8 on TransformerEngine": (
        b"mixed_precision: fp8\nfp8_config:\n  backend: TE\n",
        "'TE' (TransformerEngine) runs fp8 on CUDA GPUs only",
    ),
    "an fp8 recipe without fp8": (
        b"fp8_config:\n  fp8_format: E4M3\n",
        "key 'fp8_config' (or an --fp8_* flag) is set but mixed_precision is no",
    ),
    "an engine": (b"distributed_type: MEGATRON_LM\n", "distributed_type MEGATRON_LM"),
    "a cloud": (b"compute_environment: AMAZON_SAGEMAKER\n", "compute_environment AMAZON_SAGEMAKER"),
    "too large": (b"# " + b"x" * (1 << 20) + b"\n", "a config file is at most 1048576 bytes"),
}


@pytest.mark.parametrize("command", ["launch", "env"])
@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_config_files_exit_2_in_one_line_and_env_agrees_with_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, name: str
) -> None:
    text, message = BAD_FILES[name]
    config = tmp_path / "config.yaml"
    config.write_bytes(text)
    argv = [command, "--config_file", str(config)] + ([str(SCRIPT)] if command == "launch" else [])
    line = one_line(capsys, argv)
    assert message in line and str(config) in line, line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--main_process_port", "70000"], "argument --main_process_port: must be a port from 1 to 65535"),
        (["--main_process_port", "9" * 5000], "argument --main_process_port: must be a whole number"),
        (["--num_processes", "0"], "argument --num_processes: must be at least 1, got 0"),
        (["--num_machines", "0"], "argument --num_machines: must be at least 1"),
        (["--max_restarts", "-1"], "argument --max_restarts: must be at least 0, got -1"),
        (["--monitor_interval", "0"], "argument --monitor_interval: must be a positive number"),
        (
            ["--num_cpu_threads_per_process", "0"],
            "argument --num_cpu_threads_per_process: must be at least 1",
        ),
        (["--machine_rank", "-1"], "argument --machine_rank: must be at least 0"),
        (["--cpu", "--num_processes", "1000000"], "num_processes 1000000 is 1000000 processes"),
        (["--num_procesess", "2"], "unrecognized argument --num_procesess (did you mean --num_processes?)"),
        (["--mixed_precison", "bf16"], "did you mean --mixed_precision?"),
    ],
)
def test_bad_flags_exit_2_in_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    line = one_line(capsys, ["launch", *flags, str(SCRIPT)])
    assert message in line, line


def test_the_process_bound_can_be_forced(tmp_path: Path) -> None:
    from fnaccel.commands.launch import resolve
    from fnaccel.commands.main import build_parser

    many = str(max_local_processes() + 1)
    args = build_parser().parse_args(
        ["launch", "--cpu", "--num_processes", many, "--force_num_processes", str(SCRIPT)]
    )
    assert resolve(args).num_processes == int(many)


def test_a_launch_without_a_script_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, ["launch", "--cpu"])
    assert (
        line == "fnaccel launch: error: no training script given: fnaccel launch [flags] "
        "SCRIPT.py [script arguments]"
    )


def test_a_mistyped_command_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert "(did you mean launch?)" in one_line(capsys, ["lanch"])


def test_an_unwritable_config_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "config.yaml"  # under a regular file: no one can create it
    line = one_line(capsys, ["config", "default", "--config_file", str(target)])
    assert f"{target}: cannot write the config file" in line


@pytest.mark.slow
def test_the_console_script_prints_no_traceback(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_bytes(b"\xff")
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "env", "--config_file", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"fnaccel env: error: {config}: not UTF-8 text (byte 0); save it as UTF-8"
    ]


@pytest.mark.slow
def test_a_reader_that_stops_reading_ends_the_command_quietly() -> None:
    """`fnaccel env | head -1`, `fnaccel checkpoint diff A B | head`: the reader closes the pipe
    early. The command stops as a process ended by SIGPIPE does (status 141), with no traceback."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout fails with EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "fnaccel", "env"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141
