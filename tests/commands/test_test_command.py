"""``fnaccel test`` and the check script it launches (`fnaccel.commands.test_script`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.commands import launch, test_script
from fnaccel.commands.main import main
from fnaccel.commands.test import SCRIPT
from fnaccel.commands.test_checks import (
    CheckFailed,
    CheckSkipped,
    check_process_group,
    check_repeated_resumes,
    check_resume_world_size,
)
from fnaccel.commands.test_script import CheckResult, run_checks

NAMES = [name for name, _ in test_script.CHECKS]
ENV = {"OMP_NUM_THREADS": "1"}


def _report_lines(out: str) -> dict[str, str]:
    """check name -> its outcome, from the printed report."""
    lines = {}
    for line in out.splitlines():
        for name in NAMES:
            if line.startswith(f"  {name} ."):
                lines[name] = line.split(". ", 1)[1].lstrip(".").strip()
    return lines


# ---- the script --------------------------------------------------------------------------------


def test_the_script_passes_every_check_in_a_world_of_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert test_script.main() == 0
    lines = _report_lines(capsys.readouterr().out)
    assert set(lines) == set(NAMES)
    skipped = {"mixed precision", "resume on 1 process"}
    assert all(outcome.startswith("ok") for name, outcome in lines.items() if name not in skipped)
    assert lines["mixed precision"].startswith("skipped: not configured")
    assert lines["resume on 1 process"].startswith("skipped: one process; launch with --num_processes 2")
    assert lines["training vs PyTorch"] == "ok (4 steps, parameters bit-identical to plain PyTorch)"


def test_mixed_precision_is_checked_when_the_launch_configures_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FNACCEL_MIXED_PRECISION", "bf16")
    assert test_script.main() == 0
    out = capsys.readouterr().out
    assert _report_lines(out)["mixed precision"].startswith("ok (compose(autocast(dtype=torch.bfloat16))")
    assert out.rstrip().endswith("All 11 checks passed (1 skipped).")


def test_a_failing_check_is_reported_and_the_exit_status_is_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # bf16 training whose parameters never change: the check fails, saying why
    monkeypatch.setenv("FNACCEL_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, closure=None: None)
    assert test_script.main() == 1
    captured = capsys.readouterr()
    lines = _report_lines(captured.out)
    assert lines["mixed precision"].startswith("FAILED: ") and "did not change" in lines["mixed precision"]
    assert all(lines[name].startswith(("ok", "skipped")) for name in NAMES if name != "mixed precision")
    assert captured.out.rstrip().endswith("1 of 12 checks FAILED.")
    assert "[rank 0] check 'mixed precision' failed:" in captured.err and "Traceback" in captured.err


class OwnGeneratorDropout(torch.nn.Module):
    """A dropout drawing from a generator of its own, which no checkpoint holds: the planted bug."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.noise = p, torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.noise) >= self.p
        return x * keep / (1 - self.p) if self.training else x


def test_a_generator_not_restored_fails_the_resume_check_naming_the_resume(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.nn, "Dropout", OwnGeneratorDropout)  # the check's model is built from torch.nn
    assert test_script.main() == 1
    lines = _report_lines(capsys.readouterr().out)
    assert lines["resume x3 in an epoch"].startswith(
        "FAILED: CheckFailed: verify_resume: resume 1 of 3 (at batch 2, on 1 process(es)): batch 3 after "
        "resuming at batch 2 has loss"
    ), lines
    assert lines["training vs PyTorch"].startswith("ok")


def _resume_checks_with_a_summed_loss(state: fa.RunState) -> list[CheckResult]:
    """Runs on each rank: both resume checks, with a loss summed over the local batch planted
    (its gradients change with the world size; the run on its own number of processes resumes fine)."""
    mean = torch.nn.functional.cross_entropy
    torch.nn.functional.cross_entropy = lambda *a, **k: mean(*a, **{**k, "reduction": "sum"})  # type: ignore[assignment]
    try:
        return run_checks(
            state,
            [
                ("resume x3 in an epoch", check_repeated_resumes),
                ("resume on 1 process", check_resume_world_size),
            ],
        )
    finally:
        torch.nn.functional.cross_entropy = mean


def test_a_loss_that_depends_on_the_world_size_fails_the_resume_on_one_process(world2: Any) -> None:
    for repeated, other_size in world2.run(_resume_checks_with_a_summed_loss):
        assert repeated.status == "ok", repeated
        assert other_size.status == "FAILED" and other_size.detail.startswith(
            "CheckFailed: verify_resume: resume 1 of 2 (at batch 2, on 1 process(es)): batch 3 after resuming at "
            "batch 2 has loss "
        ), other_size
        assert "the uninterrupted run's mean over its ranks (compared within atol=1e-05, rtol=0.0001)" in (
            other_size.detail
        )


def _fails() -> str:
    raise CheckFailed("expected 1, got 2")


def _skips() -> str:
    raise CheckSkipped("not here")


def test_run_checks_turns_outcomes_into_report_lines(capsys: pytest.CaptureFixture[str]) -> None:
    state = fa.init(cpu=True)
    results = run_checks(
        state,
        [
            ("works", lambda state: "fine"),
            ("breaks", lambda state: _fails()),
            ("does not apply", lambda state: _skips()),
        ],
    )
    assert results == [
        CheckResult(name="works", status="ok", detail="fine"),
        CheckResult(name="breaks", status="FAILED", detail="CheckFailed: expected 1, got 2"),
        CheckResult(name="does not apply", status="skipped", detail="not here"),
    ]
    assert results[1].line() == "  breaks ................... FAILED: CheckFailed: expected 1, got 2"
    report = test_script.format_report(state, results)
    assert report.splitlines()[0].startswith("fnaccel installation check: 1 process(es), device cpu")
    assert report.endswith("1 of 3 checks FAILED.")
    assert "check 'breaks' failed" in capsys.readouterr().err


def _fails_on_rank_1(state: fa.RunState) -> str:
    if state.dist.rank == 1:
        raise RuntimeError("only rank 1 sees this")
    return "fine here"


def _checks_with_one_rank_failing(state: fa.RunState) -> list[CheckResult]:
    checks = [("lopsided", _fails_on_rank_1), ("process group", check_process_group)]
    return run_checks(state, checks)


def test_a_failure_on_one_rank_is_reported_on_every_rank(world2: Any) -> None:
    for lopsided, group in world2.run(_checks_with_one_rank_failing):
        assert lopsided == CheckResult(
            name="lopsided", status="FAILED", detail="rank 1: RuntimeError: only rank 1 sees this"
        )
        assert group.status == "ok" and "2 processes" in group.detail


# ---- the command -------------------------------------------------------------------------------


def _fake_launch(monkeypatch: pytest.MonkeyPatch, status: int) -> list[Sequence[str]]:
    calls: list[Sequence[str]] = []

    def run_launch(argv: Sequence[str]) -> int:
        calls.append(list(argv))
        return status

    monkeypatch.setattr(launch, "run_launch", run_launch)
    return calls


def test_launch_flags_pass_through_in_order_with_the_config_file_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _fake_launch(monkeypatch, 0)
    assert (
        main(["test", "--cpu", "--config_file", "c.yaml", "--num_processes", "2", "--mixed_precision=bf16"])
        == 0
    )
    assert calls == [
        ["--config_file", "c.yaml", "--cpu", "--num_processes", "2", "--mixed_precision=bf16", str(SCRIPT)]
    ]
    assert "Test is a success!" in capsys.readouterr().out
    assert main(["test"]) == 0
    assert calls[1] == [str(SCRIPT)]


def test_a_failed_check_run_returns_its_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_launch(monkeypatch, 1)
    assert main(["test", "--cpu"]) == 1
    captured = capsys.readouterr()
    assert "Test is a success" not in captured.out
    assert "fnaccel test: the installation check failed (exit status 1)" in captured.err


def test_a_launch_usage_error_is_launchs_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", "--cpu", "--use_megatron_lm"]) == 2  # refused before any process starts
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fnaccel launch: error:") and "Megatron" in lines[0]


def test_help_says_where_other_flags_go(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["test", "--help"])
    out = capsys.readouterr().out
    assert "--config_file" in out and "fnaccel launch" in out


@pytest.mark.multiprocess
def test_fnaccel_test_end_to_end_on_two_cpu_processes(tmp_path: Path) -> None:
    """Needs `fnaccel.commands.launch.run_launch`. The script passes every check on 2 processes
    under torchrun's agent (which `fnaccel launch` runs), and only the main process reports."""
    result = subprocess.run(
        [sys.executable, "-m", "fnaccel", "test", "--cpu", "--num_processes", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = _report_lines(result.stdout)
    assert set(lines) == set(NAMES), result.stdout
    assert all(lines[name].startswith("ok") for name in NAMES if name != "mixed precision"), result.stdout
    assert lines["process group"] == "ok (2 processes on 1 machine(s), backend gloo, device cpu)"
    assert "atol=1e-05, rtol=0.0001" in lines["resume on 1 process"]
    assert result.stdout.count("fnaccel installation check") == 1  # the main process reports
    assert "All 11 checks passed (1 skipped)." in result.stdout
    assert "resume on 1 process ...... ok (2 processes, resumed on 1, then on 2" in result.stdout
    assert "ok (2 processes on 1 machine(s), backend gloo, device cpu)" in result.stdout
    assert "Test is a success! You are ready for your distributed training!" in result.stdout
