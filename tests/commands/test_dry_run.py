"""`fnaccel launch --dry_run`: large layouts checked on one machine, as faithful and safe as a real launch.

The 64-process FSDP x TP launch of tests/commands/_dry_run_script.py (a small
transformer, fa.tp + fa.fsdp on dp_shard=8 x tp=8 over 8 machines) prints its mesh
and every rank's bytes; at 2 and 4 processes the dry run's bytes and refusals equal
those of real gloo ranks running the same script (the shared worlds); an impossible
mesh is refused as the real launcher refuses it; signals and SIGKILL end the dry
run's ranks with it. How the bytes of 16,384 ranks are computed is tested in
tests/test_dryrun.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fnaccel.commands.main import main
from tests._launches import alive
from tests.commands import _dry_run_script as script

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).with_name("_dry_run_script.py")
WORLD = ("--cpu", "--num_machines", "8", "--num_processes", "64", "--parallelism_config_tp_size", "8")


def dry_launch(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``fnaccel launch -q --dry_run *args`` in this process (the launcher's side of a dry run
    is this process's own; its two workers are processes as in any dry run): the status, the
    output and the errors. A launcher process of its own would import torch only to start them."""
    capsys.readouterr()
    status = main(["launch", "-q", "--dry_run", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_64_process_fsdp_x_tp_launch_prints_its_mesh_and_each_ranks_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # How long it takes is measured, not asserted (docs/cli.md, "Dry runs", quotes the figure):
    # a test must not depend on the machine's load.
    status, out, err = dry_launch(capsys, *WORLD, str(SCRIPT))
    assert status == 0, err
    assert "64 processes on 8 machine(s)" in out and "mesh: dp_shard=8 x tp=8" in out
    assert "step: one fa.step taken" in out
    # alike ranks computed once: dp_shard coordinates 0-6 hold 32 rows of the embedding, 7 holds 26
    assert "for all 64 ranks, once per class of alike ranks (2 classes" in out
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
        assert (
            f"rank {rank} measured {4 * floats} B, {4 * floats} B, {8 * floats + 4 * 35} B "
            "(parameters, gradients, optimizer) as computed"
        ) in out, out
    assert "sharded/rank<r>.safetensors for r in 0-63" in out
    assert re.search(
        r"blocks\.0\.q\.weight\s+│\s+128x128\s+│\s+float32\s+│\s+dp_shard:_S\(0, 8\) tp:S\(0\)", out
    )


def test_the_dry_runs_bytes_and_refusals_equal_a_real_gloo_runs(
    worlds: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 2 and 4 processes: every rank's bytes (FSDP; FSDP x TP) and the refusals (pp_size 2 without
    fa.pp; a tp plan naming no submodule) of the dry run, against the same script on real gloo ranks."""
    cases = {
        "fsdp": (2, {}, False),
        "fsdp_tp": (4, {"tp_size": 2}, False),
        "pp_without_pp": (2, {"pp_size": 2}, False),
        "wrong_plan": (4, {"tp_size": 2}, True),
    }
    real = {
        name: worlds.get(num).run(script.real_figures, layout, wrong)
        for name, (num, layout, wrong) in cases.items()
    }
    dry = {}
    for name, (num, layout, wrong) in cases.items():
        flags = [f for dim, size in layout.items() for f in (f"--parallelism_config_{dim}", str(size))]
        json_flags = ("--dry_run_json", str(tmp_path / f"{name}.json"))
        program = (str(SCRIPT), *(["--wrong_plan"] if wrong else []))
        dry[name] = dry_launch(capsys, *json_flags, "--cpu", "--num_processes", str(num), *flags, *program)
    for name in ("fsdp", "fsdp_tp"):
        assert dry[name][0] == 0, dry[name][2]
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["ranks"] == real[name], name  # every rank, as each real rank measured itself
        assert all(report["measured"][str(rank)] == real[name][rank] for rank in (0, cases[name][0] - 1))
    assert len({str(r) for r in real["fsdp_tp"]}) == 1 and real["fsdp_tp"][0]["parameters"] > 0
    for name, fix in (("pp_without_pp", "add fa.pp(loss_fn="), ("wrong_plan", "names 'blocks.*.mlp.up'")):
        refusal = real[name][0]
        status, out, err = dry[name]
        assert set(real[name]) == {refusal} and fix in refusal, real[name]
        assert status == 1 and refusal in err, err
        assert f"failed as rank 0 of {cases[name][0]} (exit code 1)" in err
        assert "Bytes held per rank" not in out


HANGING = """import os, sys, time
from pathlib import Path
Path(sys.argv[1], os.environ["RANK"] + ".pid").write_text(str(os.getpid()))
time.sleep(300)
"""


def _worker_pids(directory: Path, launcher: subprocess.Popen[str], ranks: tuple[int, ...]) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        texts = [
            (directory / f"{rank}.pid").read_text() if (directory / f"{rank}.pid").is_file() else ""
            for rank in ranks
        ]
        if all(text.isdigit() for text in texts):
            return [int(text) for text in texts]
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    raise AssertionError(f"the dry run's ranks did not start within 120 s: {sorted(directory.iterdir())}")


def test_a_dry_run_ends_its_ranks_with_itself_and_on_its_signals(tmp_path: Path) -> None:
    """SIGTERM and SIGINT: 143 and 130 with one line; SIGKILL: the ranks die with the launcher.
    A 4-machine, 64-process dry run starts two processes: no processes-per-CPU refusal."""
    script = tmp_path / "hang.py"
    script.write_text(HANGING)
    runs: dict[signal.Signals, tuple[Path, subprocess.Popen[str]]] = {}
    pids: list[int] = []
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            (tmp_path / sig.name).mkdir()
            runs[sig] = (
                tmp_path / sig.name,
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "fnaccel",
                        "launch",
                        "-q",
                        "--dry_run",
                        "--cpu",
                        "--num_machines",
                        "4",
                        "--num_processes",
                        "64",
                        str(script),
                        str(tmp_path / sig.name),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        for sig, (directory, launcher) in runs.items():
            pids += _worker_pids(directory, launcher, (0, 63))
            launcher.send_signal(sig)
        for sig, (_, launcher) in runs.items():
            _, err = launcher.communicate(timeout=60)
            assert (
                launcher.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -9}[sig]
            ), err
            if sig != signal.SIGKILL:
                assert err.splitlines() == [
                    f"fnaccel launch --dry_run: stopped by {sig.name}; its simulated ranks were ended"
                ], err
        deadline = time.monotonic() + 30
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if alive(pid)]
    finally:
        for _, launcher in runs.values():
            launcher.kill()
            launcher.wait()
        for pid in pids:
            if alive(pid) and "hang.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)


def test_an_impossible_mesh_is_refused_as_the_real_launch_refuses_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Both are refused before any process starts, so in this process."""
    mesh = [
        "--cpu",
        "--num_machines",
        "8",
        "--num_processes",
        "64",
        "--parallelism_config_tp_size",
        "3",
        str(SCRIPT),
    ]
    dry_status = main(["launch", "-q", "--dry_run", *mesh])
    dry = capsys.readouterr().err
    real_status = main(["launch", "-q", *mesh])
    real = capsys.readouterr().err
    assert dry_status == real_status != 0
    assert "tp_size=3 = 3 does not divide the 64 processes" in dry
    assert dry == real


def test_a_script_without_a_prepare_is_said_to_be_checked_up_to_its_init(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "init_only.py"
    script.write_text("import fnaccel as fa\nfa.shutdown(fa.init())\n")
    status, _, err = dry_launch(capsys, "--cpu", "--num_processes", "4", str(script))
    assert status == 1
    assert "ended without an fa.prepare holding a model and an optimizer" in err
