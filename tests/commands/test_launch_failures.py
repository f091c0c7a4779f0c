"""`fnaccel launch` when a rank fails: every rank ends within seconds, the first failure is named."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._launches import alive, end_launch, start_two_machines, worker_pids

CRASHING = Path(__file__).with_name("_crashing.py")

# From rank 1's exception to the launcher's exit; docs/cli.md ("When a rank fails")
# gives the times measured. The whole launch also counts importing torch in every
# process, which on a loaded machine alone can take longer.
FAIL_FAST_BOUND_S = 30.0


# ("init", "plain") is the two-machine test's case below, with the same checks; ("init", "finally")
# is left out: the error-path fa.shutdown that "finally" checks is the one ("step", "finally") runs,
# there after fa.step's all-reduce failed instead of fa.ops.reduce (two launches fewer in all)
@pytest.mark.parametrize(("where", "ending"), [("step", "plain"), ("step", "finally")])
@pytest.mark.multiprocess
def test_a_raising_rank_ends_the_launch_within_seconds(tmp_path: Path, where: str, ending: str) -> None:
    """Rank 1 raises (after fa.init, or mid-step under ddp()) while rank 0 waits in a
    collective: before, the job hung for the 30-minute process-group timeout."""
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "fnaccel",
                "launch",
                "-q",
                "--cpu",
                "--num_processes",
                "2",
                str(CRASHING),
                str(tmp_path),
                where,
                ending,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        elapsed = time.time() - float((tmp_path / "failed_at").read_text())
        pids = worker_pids(tmp_path)
        assert len(pids) == 2, result.stderr
        assert [pid for pid in pids if alive(pid)] == []
    finally:  # nothing left behind, even when an assertion failed
        end_launch(tmp_path)
    assert result.returncode == 1, result.stderr
    assert elapsed < FAIL_FAST_BOUND_S, elapsed
    message = "rank 1 fails after fa.init" if where == "init" else "rank 1 fails mid-step"
    assert message in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "failed: rank 1 exited with code 1" in last, result.stderr


@pytest.mark.multiprocess
def test_a_rank_failing_on_another_machine_is_named_by_every_machine(tmp_path: Path) -> None:
    """Two machines on the loopback address, one process each; rank 1 (machine 1) raises
    after fa.init while rank 0 waits in a collective: both launches end within seconds, and
    no worker is left. Before: machine 0's last line blamed its own rank 0, which had only
    seen the connection close."""
    launchers = start_two_machines(str(CRASHING), str(tmp_path), "init", "plain")
    try:
        stderrs = [launcher.communicate(timeout=180)[1] for launcher in launchers]
        elapsed = time.time() - float((tmp_path / "failed_at").read_text())
        pids = worker_pids(tmp_path)
        assert len(pids) == 2, stderrs
        assert [pid for pid in pids if alive(pid)] == []
    finally:  # nothing left behind, even when an assertion failed
        end_launch(tmp_path, *launchers)
    lasts = [stderr.strip().splitlines()[-1] for stderr in stderrs]
    assert [launcher.returncode for launcher in launchers] == [1, 1], lasts
    assert elapsed < FAIL_FAST_BOUND_S, elapsed
    assert "rank 1 fails after fa.init" in stderrs[1], stderrs[1]
    assert "failed: rank 1 (machine 1) failed first" in lasts[0], lasts
    assert "failed: rank 1 exited with code 1" in lasts[1], lasts
