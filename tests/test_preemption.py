"""Preemption-aware loops (`fa.PreemptionKwargs`, docs/training.md "Preemption"): a signal
ends `fa.batches` at the same update boundary on every rank, the run saves and resumes
bit for bit, and the signal handlers are the run's: `fa.shutdown` puts the previous back.
A signal is heard wherever it lands (evaluation, preparation, a save), and the launch's
exit status says whether to requeue: 143 for a preempted run wherever the signal arrived,
0 for a run that had finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.commands.main import main
from tests._launches import end_launch

SCRIPT = Path(__file__).with_name("_preemption_script.py")


def test_the_handlers_are_the_runs_and_fa_shutdown_puts_the_previous_back() -> None:
    def own(_signum: int, _frame: Any) -> None: ...

    before_term = signal.getsignal(signal.SIGTERM)
    before_usr1 = signal.signal(signal.SIGUSR1, own)
    try:
        state = fa.init(cpu=True, kwargs_handlers=[fa.PreemptionKwargs()])
        assert signal.getsignal(signal.SIGTERM) not in (before_term, own)
        assert signal.getsignal(signal.SIGUSR1) not in (before_usr1, own)
        fa.shutdown(state)
        assert signal.getsignal(signal.SIGTERM) == before_term
        assert signal.getsignal(signal.SIGUSR1) == own
        fa.shutdown(state)  # twice: nothing left to put back
        assert signal.getsignal(signal.SIGUSR1) == own
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)


def test_one_process_ends_the_loop_at_the_next_update_boundary() -> None:
    """No collective in one process: the signal is seen before the next batch, and the
    loop ends once the accumulation window is complete (micro-step 6 of windows of 2)."""
    model = nn.Linear(2, 1)
    data = DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=2)
    state = fa.prepare(
        fa.init(seed=0, cpu=True, kwargs_handlers=[fa.PreemptionKwargs(signals=("SIGUSR1",))]),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        pipeline=fa.compose(fa.accumulate(2)),
        loss_fn=lambda m, b: m(b[0]).mean(),
    )
    try:
        for batch in fa.batches(state, epochs=3):
            state, _ = fa.step(state, batch)
            if state.micro_step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)
        assert (state.micro_step, state.step, state.preempted) == (6, 3, "SIGUSR1")
        assert state.data_position.key == (0, 6)
        assert list(fa.batches(state)) == []  # the run stays preempted: it saves and exits
    finally:
        fa.shutdown(state)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_one_process_hears_a_signal_during_evaluate_and_before_the_loop() -> None:
    """fa.evaluate stops at the batch after the signal (before: it ran to its end, 20 of 20
    samples, and nothing said the run was preempted until the next fa.batches); a signal
    that came before the loop stops it before its first batch (one process already did;
    2 processes: the launch test's ``prepare`` case)."""
    model = nn.Linear(2, 1)
    samples = TensorDataset(torch.randn(40, 2))
    data = DataLoader(samples, batch_size=2)
    handlers = [fa.PreemptionKwargs(signals=("SIGUSR1",))]
    state = fa.prepare(
        fa.init(seed=0, cpu=True, kwargs_handlers=handlers),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=lambda m, b: m(b[0]).mean(),
    )
    try:

        def fn(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
            if batch[0].shape[0] and torch.equal(batch[0], samples.tensors[0][4:6]):
                os.kill(os.getpid(), signal.SIGUSR1)  # during the third batch
            return m(batch[0])[:, 0]

        assert len(fa.evaluate(state, data, fn)) == 6 and state.preempted == "SIGUSR1"
        assert list(fa.batches(state)) == [] and state.step == 0
    finally:
        fa.shutdown(state)
    state = fa.prepare(
        fa.init(seed=0, cpu=True, kwargs_handlers=handlers),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=lambda m, b: m(b[0]).mean(),
    )
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # while the run prepares
        for batch in fa.batches(state):
            state, _ = fa.step(state, batch)
        assert (state.step, state.preempted) == (0, "SIGUSR1")
    finally:
        fa.shutdown(state)


def test_handlers_outside_the_main_thread_and_bad_signals_are_refused() -> None:
    errors: list[BaseException] = []

    def init() -> None:
        try:
            fa.init(cpu=True, kwargs_handlers=[fa.PreemptionKwargs()])
        except BaseException as exc:
            errors.append(exc)

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=init, name="loader-thread")
    thread.start()
    thread.join()
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])
    assert "'loader-thread'" in str(errors[0])
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(ValueError, match="SIGKILL and SIGSTOP cannot be caught"):
        fa.PreemptionKwargs(signals=("SIGKILL",))
    with pytest.raises(ValueError, match="signals must be"):
        fa.PreemptionKwargs(signals=("SIGTERMM",))
    with pytest.raises(ValueError, match="check_every must be an int >= 1"):
        fa.PreemptionKwargs(check_every=0)


def _launch(out: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fnaccel",
            "launch",
            "-q",
            "--cpu",
            "--num_processes",
            "2",
            str(SCRIPT),
            str(out),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.multiprocess
def test_sigusr1_to_a_2_process_launch_during_evaluate_saves_at_one_step_and_resumes_bit_for_bit(
    tmp_path: Path,
) -> None:
    """Slurm's ``--signal=USR1@90`` to the launcher while the run is in fa.evaluate, mid-epoch.
    Before: SIGUSR1's default action ended the launcher and, with it, every worker unsaved (and a
    signal during fa.evaluate let the evaluation run to its end, 64 of 64 samples, exit 0); now
    the evaluation stops at the batch after it, the workers stop at one step, save, and the
    launch ends with the one status of a preempted run, 143 (before this round: 138). The run
    then resumes bit for bit; the same launch's uninterrupted reference gets SIGTERM after its
    loop and exits 0 (before: 143, and a finished run was requeued). SIGTERM stops the loop in
    the cases of the next test, and a launch with 143 in tests/commands/test_launch_lifetime.py."""
    cut = tmp_path / "cut"
    cut.mkdir()
    launcher = _launch(cut, "evaluate")
    try:
        deadline = time.monotonic() + 240
        while not (cut / "evaluating").exists():
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, "the run never reached its evaluation"
            time.sleep(0.05)
        sent = time.time()
        launcher.send_signal(signal.SIGUSR1)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        end_launch(cut, launcher)
    assert launcher.returncode == 143, stderr
    assert "preempted by SIGUSR1" in stderr.strip().splitlines()[-1], stderr
    stops = [json.loads((cut / f"stop.{rank}.json").read_text()) for rank in (0, 1)]
    # the loop left and the checkpoint written (not the interpreters' exit, which a loaded
    # machine can stretch to several seconds more: the launch's end is bounded above)
    took = max(stop.pop("saved_at") for stop in stops) - sent
    assert took < 10, f"the ranks had saved {took:.1f} s after SIGUSR1"
    assert stops[0] == stops[1], stops  # every rank left the loop at the same step
    # evaluation stopped at a batch boundary (4 samples a step), well before its 64 samples,
    # and the loop at the update it had reached, mid-epoch (32 updates an epoch)
    assert stops[0]["preempted"] == "SIGUSR1" and stops[0]["epoch"] == 0, stops
    assert 0 < stops[0]["evaluated"] < 64 and stops[0]["evaluated"] % 4 == 0, stops
    assert stops[0]["micro_step"] == 4 and stops[0]["step"] == 2, stops
    # in fresh processes; then the same processes run the uninterrupted reference, whose
    # launcher gets SIGTERM once its loop has finished
    launcher = _launch(cut, "resume")
    try:
        deadline = time.monotonic() + 240
        while len(list(cut.glob("finished.*"))) < 2:
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, "the reference run never finished its loop"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        (cut / "go").touch()
        _, stderr = launcher.communicate(timeout=120)
    finally:
        end_launch(cut, launcher)
    assert launcher.returncode == 0, stderr
    assert "after the run had finished" in stderr.strip().splitlines()[-1], stderr
    assert (cut / "final").is_dir()
    for rank in (0, 1):
        resumed = torch.load(cut / f"resumed.{rank}.pt")
        expected = torch.load(cut / f"full.{rank}.pt")
        for name, tensor in expected.items():
            assert torch.equal(resumed[name], tensor), name


def _worker(out: Path, rank: int) -> int:
    """The pid of the worker of ``rank`` (each writes its rank into OUT/pid.<pid>)."""
    return next(int(path.name.split(".")[1]) for path in out.glob("pid.*") if path.read_text() == str(rank))


@pytest.mark.multiprocess
def test_a_signal_is_heard_wherever_it_lands_and_the_status_says_whether_to_requeue(tmp_path: Path) -> None:
    """Two 2-process launches side by side (docs/training.md, "Preemption"). Before:
    ``prepare``, SIGTERM to both workers before fa.prepare: the run took its first update first
    (step 1), exit 0; ``save``, rank 1 signalled during a save: exit 0. (A signal during
    fa.evaluate, and SIGTERM to the launcher after the loop had finished, which exited 143: the
    previous test's launches.)"""
    modes = ("prepare", "save")
    outs = {mode: tmp_path / mode for mode in modes}
    for out in outs.values():
        out.mkdir()
    launchers = {mode: _launch(outs[mode], mode) for mode in modes}
    try:
        deadline = time.monotonic() + 240  # "save" signals itself
        while len(list(outs["prepare"].glob("preparing.*"))) < 2:
            assert launchers["prepare"].poll() is None, launchers["prepare"].communicate()[1]
            assert time.monotonic() < deadline, "prepare never reached the point to signal"
            time.sleep(0.05)
        for rank in (0, 1):
            os.kill(_worker(outs["prepare"], rank), signal.SIGTERM)
        (outs["prepare"] / "go").touch()
        ended = {mode: launcher.communicate(timeout=120)[1] for mode, launcher in launchers.items()}
    finally:
        for mode, launcher in launchers.items():
            end_launch(outs[mode], launcher)
    status = {mode: launcher.returncode for mode, launcher in launchers.items()}
    assert status == {"prepare": 143, "save": 143}, ended
    for mode in modes:
        assert "preempted by SIGTERM" in ended[mode].strip().splitlines()[-1], ended[mode]
        stops = [json.loads((outs[mode] / f"stop.{rank}.json").read_text()) for rank in (0, 1)]
        for stop in stops:
            stop.pop("saved_at")
        assert stops[0] == stops[1] and stops[0]["preempted"] == "SIGTERM", (mode, stops)
        assert main(["checkpoint", "verify", str(outs[mode] / "ckpt")]) == 0
    prepare, save = (json.loads((outs[mode] / "stop.0.json").read_text()) for mode in modes)
    assert prepare["micro_step"] == 0 and prepare["step"] == 0, prepare  # before the first batch
    # the save in flight completed (whole), then the run stopped within 2 * check_every + a window
    assert (outs["save"] / "in_flight").read_text() == "True"
    assert main(["checkpoint", "verify", str(outs["save"] / "mid")]) == 0
    assert 3 <= save["step"] <= 6, save


@pytest.mark.parametrize(
    "signals, why",
    [
        ((True,), r"True is not a signal name or number \(a bool would be read as signal 1, SIGHUP\)"),
        (("SIGCHLD",), r"SIGCHLD arrives whenever a child process ends"),
        ((signal.SIGCHLD.value,), r"SIGCHLD arrives whenever a child process ends"),
        (("SIGSEGV",), r"SIGSEGV reports a fault in this process"),
        (
            ("SIGTERM", "SIGWINCH"),
            r"SIGWINCH does not ask a job to stop \(those are SIGALRM, SIGHUP, .*SIGTERM",
        ),
        ((), r"give at least one"),
    ],
)
def test_signals_that_do_not_ask_a_job_to_stop_are_refused_saying_why(
    signals: tuple[Any, ...], why: str
) -> None:
    """Before: (True,) was taken as SIGHUP, SIGCHLD (every DataLoader worker's exit) and SIGSEGV accepted."""
    with pytest.raises(
        ValueError,
        match=rf"signals must be names or numbers of signals that ask a job to stop, "
        rf"got .*: {why}.*; use e\.g\. \('SIGTERM', 'SIGUSR1'\)",
    ):
        fa.PreemptionKwargs(signals=signals)


def test_one_signal_name_instead_of_a_tuple_gets_the_tuple_to_write() -> None:
    """Before: 'SIGTERM' was read as its characters ('S', 'I', ...) and the message listed them."""
    with pytest.raises(
        ValueError,
        match=r"^signals must be a tuple of signal names or numbers, got 'SIGTERM': "
        r"write signals=\('SIGTERM',\)$",
    ):
        fa.PreemptionKwargs(signals="SIGTERM")  # type: ignore[arg-type]
    accepted = fa.PreemptionKwargs(signals=["SIGTERM", signal.SIGUSR2, "SIGINT"])  # type: ignore[arg-type]
    assert accepted.signal_numbers == (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
