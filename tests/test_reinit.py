"""`fa.init` / `fa.shutdown` many times in one process, under a real `fnaccel launch`.

benchmarks/reinit.py is the script: each cycle inits, prepares, steps and shuts
down, and records what it trained and what it still holds. One launch of 10
cycles here (CI time): each of the script's 5 kinds of cycle twice, so
verify_resume runs on an even and an odd cycle (both of its layouts), and a
socket leaked per cycle shows in the later half's median; the note's figure (10
launches of 20 cycles in a row) comes from running that file directly.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from tests._launches import end_launch

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "reinit.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reinit_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ten_init_shutdown_cycles_in_one_launch(tmp_path: Path) -> None:
    """Every cycle joins a fresh group (before: a hang or 'Connection refused' at an
    early re-init), trains the same weights as the first, and releases what it held."""
    reinit = _script()
    try:
        code, output, _ = reinit.launch(10, tmp_path, timeout=300)
    finally:
        end_launch(tmp_path)  # each worker recorded its pid
    assert code == 0, output[-4000:]
    assert reinit.check(tmp_path, 10) == []
    assert "Traceback" not in output and "not every rank reached" not in output, output[-4000:]


def test_a_failure_in_the_middle_of_a_cycle_ends_the_launch(tmp_path: Path) -> None:
    """Rank 1 raises in cycle 2 after its first step while rank 0 waits in the next
    step's collective: the launch ends with the error, not a hang."""
    reinit = _script()
    try:
        code, output, seconds = reinit.launch(5, tmp_path, timeout=180, fail_at=2)
    finally:
        end_launch(tmp_path)  # each worker recorded its pid
    assert code != 0 and "killed after" not in output, output[-4000:]
    assert "RuntimeError: rank 1 fails in the middle of cycle 2" in output, output[-4000:]
    done = [json.loads(line)["cycle"] for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert done == [0, 1]  # the cycles before the failure completed; nothing after it ran
    assert seconds < 120, seconds  # generous: the agent ends rank 0 within seconds of rank 1's exit
