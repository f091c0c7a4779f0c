"""The launcher's own life: its workers end with it (even by SIGKILL), a signal ends the
launch with one line and 128 + the signal's number (from the launcher's first line on),
waiting for machines speaks, hears Ctrl-C and times out with one line, and a machine
lost mid-run, or before its ranks joined, is named by the survivors (docs/cli.md, "The
launcher's own life")."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fnaccel.commands.main import main
from tests._launches import alive, end_launch, free_port, start_launch, start_two_machines, worker_pids

SCRIPT = Path(__file__).with_name("_lifetime.py")


def _wait_for(condition, seconds: float, launcher: subprocess.Popen[str]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        if launcher.poll() is not None:
            pytest.fail(f"the launcher ended first ({launcher.returncode}): {launcher.communicate()[1]}")
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for the workers")
        time.sleep(0.1)


def _first_line(launcher: subprocess.Popen[str], seconds: float) -> str:
    """The first line on the launcher's stderr, failing (not hanging) when none comes in time."""
    import selectors

    assert launcher.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(launcher.stderr, selectors.EVENT_READ)
        if not selector.select(timeout=seconds):
            pytest.fail(f"the launcher said nothing in {seconds} s")
    return launcher.stderr.readline()


@pytest.mark.multiprocess
def test_sigterm_reaches_the_workers_and_ends_the_launch_with_143(tmp_path: Path) -> None:
    """Before: a 28-line traceback and exit 1. The workers exit 0 on SIGTERM, an asynchronous
    save perhaps still writing: the checkpoint left is whole."""
    launcher = start_launch("--cpu", "--num_processes", "2", str(SCRIPT), str(tmp_path), "save")
    try:
        _wait_for(lambda: len(worker_pids(tmp_path)) == 2, 240, launcher)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 143, stderr
        assert "Traceback" not in stderr, stderr
        assert stderr.strip().splitlines()[-1].startswith("fnaccel launch: stopped by SIGTERM"), stderr
        assert [pid for pid in worker_pids(tmp_path) if alive(pid)] == []
        assert sorted(path.name for path in tmp_path.glob("in_flight.*")) == ["in_flight.0", "in_flight.1"]
    finally:
        end_launch(tmp_path, launcher)
    assert main(["checkpoint", "verify", str(tmp_path / "ckpt")]) == 0
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []  # no temporary


@pytest.mark.multiprocess
def test_waiting_for_machines_speaks_hears_ctrl_c_and_times_out(tmp_path: Path) -> None:
    """Before: silent for torchrun's whole timeout (900 s), deaf to Ctrl-C, then a 43-line
    traceback. Machine 0 waits alone for 4 s; machine 1, on a port nobody serves, gets Ctrl-C."""
    every_second = {"FNACCEL_LAUNCH_REPORT_INTERVAL": "1"}
    machine = ["--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1"]
    alone = start_launch(
        *machine,
        "--machine_rank",
        "0",
        "--main_process_port",
        str(free_port()),
        "--rdzv_conf",
        "timeout=4",
        str(SCRIPT),
        str(tmp_path),
        "sleep",
        env=every_second,
    )
    interrupted = start_launch(
        *machine,
        "--machine_rank",
        "1",
        "--main_process_port",
        str(free_port()),
        str(SCRIPT),
        str(tmp_path),
        "sleep",
        env=every_second,
    )
    try:
        first = _first_line(interrupted, 120)
        assert "machine 1: waiting up to 900 s for the machines at 127.0.0.1:" in first, first
        assert "the machine of rank 0 does not answer" in first
        interrupted.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, rest = interrupted.communicate(timeout=60)
        assert time.monotonic() - sent < 20  # at once (the interpreter's own exit, on a loaded machine)
        assert interrupted.returncode == 130 and "Traceback" not in rest, rest
        assert rest.strip().splitlines() == [rest.strip()] and "stopped by SIGINT while waiting" in rest

        _, lines = alone.communicate(timeout=120)
        assert alone.returncode == 1 and "Traceback" not in lines, lines
        said = lines.strip().splitlines()
        assert "machine 0: waiting up to 4 s" in said[0] and "1 of 2 machines joined" in said[0]
        assert any("still waiting" in line for line in said[1:-1]), said
        assert "gave up after 4 s" in said[-1] and "missing machine_rank 1" in said[-1]
        assert "--rdzv_conf timeout=SECONDS" in said[-1]
        assert worker_pids(tmp_path) == []  # no worker ever started
    finally:
        end_launch(tmp_path, alone, interrupted)


def test_a_port_in_use_is_one_line_and_exit_2_before_any_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = main(
            [
                "launch",
                "--cpu",
                "--num_processes",
                "2",
                "--main_process_port",
                str(port),
                str(SCRIPT),
                str(tmp_path),
                "sleep",
            ]
        )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"--main_process_port {port} is already in use" in err
    assert worker_pids(tmp_path) == []


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(") ", 1)[1].split()[1])


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line.split()[1] for line in status if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (sig - 1) & 1)


@pytest.mark.multiprocess
def test_sigterm_while_the_launcher_imports_is_one_line_and_143(tmp_path: Path) -> None:
    """Before: no handler until the launch had imported torch (seconds), so SIGTERM then
    ended it with -15 and no word; now the console entry's first line installs one."""
    launcher = start_launch("--cpu", "--num_processes", "2", str(SCRIPT), str(tmp_path), "sleep")
    try:
        deadline = time.monotonic() + 60
        while not _catches(launcher.pid, signal.SIGTERM):
            assert launcher.poll() is None and time.monotonic() < deadline, "no SIGTERM handler came"
            time.sleep(0.002)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        end_launch(tmp_path, launcher)
    assert launcher.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["fnaccel launch: stopped by SIGTERM (exit 143)"], stderr
    assert worker_pids(tmp_path) == []


@pytest.mark.multiprocess
def test_a_launcher_killed_with_sigkill_leaves_no_worker_and_the_survivor_names_it(tmp_path: Path) -> None:
    """Two launchers on the loopback address, one process each; machine 1's is SIGKILLed
    mid-run. Its worker ends with it (before: torchrun's workers, each in its own session,
    ran on forever as orphans). Machine 0 then ends naming the lost machine (before: it
    ended within seconds, but its last line blamed its own rank, ``rank 0 exited with code
    1 (its traceback is above ...)``, under gloo's ``Connection closed by peer``)."""
    survivor, lost = start_two_machines(str(SCRIPT), str(tmp_path), "reduce")
    try:
        _wait_for(lambda: len(worker_pids(tmp_path)) == 2, 240, survivor)
        time.sleep(1)  # both ranks in their loop of all-reduces
        (orphan,) = (pid for pid in worker_pids(tmp_path) if _parent(pid) == lost.pid)
        lost.kill()
        lost.wait()  # not communicate(): a worker left running would hold its pipes open
        deadline = time.monotonic() + 10  # its all-reduces with rank 0 would go on without the signal
        while alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(orphan), "machine 1's worker outlived its launcher"
        _, stderr = survivor.communicate(timeout=120)
    finally:
        end_launch(tmp_path, survivor, lost)
    assert survivor.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("fnaccel launch: machine 1 (rank 1) was lost: connection closed"), stderr
    assert "rank 0" not in last, last
    assert [pid for pid in worker_pids(tmp_path) if alive(pid)] == []


@pytest.mark.multiprocess
def test_a_machine_lost_before_its_ranks_joined_is_named_within_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine 1 is SIGKILLed while rank 0 waits for its rank inside ``fa.init``. No worker
    fails there, so nothing asked who was lost: the survivor waited out the init's timeout of
    many minutes (seen as a launcher that never ended). Now the launchers watch each other's
    heartbeat: after FNACCEL_LAUNCH_LOST_AFTER seconds (20 by default) the survivor stops its
    workers and names the machine."""
    monkeypatch.setenv("FNACCEL_LAUNCH_LOST_AFTER", "2")
    survivor, lost = start_two_machines(str(SCRIPT), str(tmp_path), "init")
    try:
        _wait_for(lambda: len(worker_pids(tmp_path)) == 2, 240, survivor)
        lost.kill()
        lost.wait()
        _, stderr = survivor.communicate(timeout=120)
    finally:
        end_launch(tmp_path, survivor, lost)
    assert survivor.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        "fnaccel launch: machine 1 (rank 1) was lost: its launcher stopped answering on the store at "
    ), stderr
    assert "for 2 s while this machine's ranks waited for it" in last and "rank 0" not in last, last
    assert [pid for pid in worker_pids(tmp_path) if alive(pid)] == []
