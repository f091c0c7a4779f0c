"""``fnaccel tpu-config``: accelerate's flags are accepted, and the command says it cannot run."""

from __future__ import annotations

import pytest

from fnaccel.commands.main import build_parser, main

FLAGS = (
    "--config_file",
    "--tpu_name",
    "--tpu_zone",
    "--command_file",
    "--command",
    "--install_accelerate",
    "--accelerate_version",
    "--debug",
)


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tpu-config", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in out, flag
    assert "no TPU support" in out


def test_the_flags_parse_as_accelerate_spells_them() -> None:
    args = build_parser().parse_args(
        [
            "tpu-config",
            "--config_file",
            "c.yaml",
            "--tpu_name",
            "pod",
            "--tpu_zone",
            "us-central1-a",
            "--command_file",
            "cmds.txt",
            "--command",
            "echo",
            "hi",
            "--command",
            "ls",
            "--install_accelerate",
            "--accelerate_version",
            "dev",
            "--debug",
        ]
    )
    assert (args.config_file, args.tpu_name, args.tpu_zone, args.command_file) == (
        "c.yaml",
        "pod",
        "us-central1-a",
        "cmds.txt",
    )
    assert args.command == [["echo", "hi"], ["ls"]]
    assert args.install_accelerate and args.debug and args.accelerate_version == "dev"


@pytest.mark.parametrize("argv", [[], ["--tpu_name", "pod", "--command", "ls", "--debug"]])
def test_it_always_fails_with_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tpu-config", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("fnaccel tpu-config: error: this build has no TPU support (no torch_xla engine)")
