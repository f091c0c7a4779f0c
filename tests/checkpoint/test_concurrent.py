"""One checkpoint path, several processes: a load meeting a save, two saves meeting."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.storage.files import LOCK_MARKER, SaveLock
from tests.checkpoint.test_resume import fresh_run, train

SAVE_LOOP = Path(__file__).with_name("_save_loop.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}


def _start_saver(path: Path, *modes: str) -> subprocess.Popen[str]:
    """_save_loop.py stepping and saving to ``path`` again and again (each line on its stdin: one more)."""
    return subprocess.Popen(
        [sys.executable, str(SAVE_LOOP), str(path), "step", *modes],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def _saver(path: Path) -> subprocess.Popen[str]:
    """A saver once its first save is done."""
    process = _start_saver(path)
    assert process.stdout is not None and process.stdout.readline() == "first save done\n"
    return process


def _loop_state() -> fa.RunState:
    """A fresh state shaped like _save_loop.py's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    return fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.AdamW(model.parameters()),
        loss_fn=lambda m, b: m(b).pow(2).mean(),
    )


def _stop(process: subprocess.Popen[str], *, kill: bool = False) -> tuple[str, str]:
    """Its output, once it ended: at EOF (its loop's end), or killed mid-save."""
    try:
        if kill:
            process.kill()
        return process.communicate("" if not kill else None, timeout=120)
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_load_meeting_a_save_of_the_same_path_loads_or_says_being_replaced(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    saver = _saver(path)
    saves: list[str] = []  # the saver's lines as they come: the campaign lasts until it saved 6 times
    reader = threading.Thread(target=lambda: saves.extend(iter(saver.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        assert saver.stdin is not None
        saver.stdin.write("\n" * 1000)  # it saves as fast as it can while we load, until killed
        saver.stdin.flush()
        outcomes: dict[str, int] = {}
        state = _loop_state()
        # a campaign of 100 loads, or 20 s where the machine is slow (before the retry, about 1 load
        # in 12 failed: 100 loads miss that with a chance of 0.017 %), and at least until the saver
        # saved 6 times during it, however loaded the machine (bounded, so never a hang)
        start = time.monotonic()

        def going() -> bool:
            elapsed = time.monotonic() - start
            if elapsed > 300:
                return False
            return sum("saved" in line for line in saves) <= 5 or (
                elapsed < 20 and sum(outcomes.values()) < 100
            )

        while going():
            try:
                state = fa.load(state, path)  # its successor is fresh: the next load goes into it
                outcome = "loaded"
            except fa.CheckpointError as exc:
                outcome = str(exc)
                assert "being replaced by a save" in outcome, outcome  # never "corrupt" about a healthy one
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        saver.kill()
        saver.wait()
        reader.join(timeout=30)
        _, err = _stop(saver)
    assert sum("saved" in line for line in saves) > 5, (saves[-5:], err[-2000:])  # the loads met saves
    assert outcomes.get("loaded", 0) > 0, outcomes


def test_a_second_save_to_a_path_being_saved_is_refused_naming_the_first(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    state = train(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], epochs=1, stop_after=2)[0]
    held = SaveLock.take(path)  # what a live save in another run holds from its start to its commit
    assert isinstance(held, SaveLock)
    try:
        for blocking in (True, False):
            with pytest.raises(
                fa.CheckpointError,
                match=r"another save to this path is in progress \(\{\"pid\": "
                rf"{os.getpid()}, \"host\": .*\); two runs saving to one path",
            ):
                fa.save(state, path, blocking=blocking)
        assert not path.exists()
    finally:
        held.release()
    assert os.listdir(tmp_path) == []  # the lock file went with its save
    fa.save(state, path)


def test_the_lock_of_a_save_that_died_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    lock = tmp_path / ".ckpt.lock"
    lock.write_bytes(LOCK_MARKER + f'{{"pid": {dead.stdout.strip()}, "host": "here"}}\n'.encode())
    state = train(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], epochs=1, stop_after=2)[0]
    fa.save(state, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    lock.write_bytes(b"a user's file\n")  # not fnaccel's: never written over
    with pytest.raises(fa.CheckpointError, match=r"\.ckpt\.lock is not fnaccel's save lock"):
        fa.save(state, tmp_path / "ckpt")
    assert lock.read_bytes() == b"a user's file\n"


@pytest.mark.slow
def test_two_processes_saving_to_one_path_never_remove_each_others_directories(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    # both start (import, prepare) at once; the second's first save waits until the first's is done
    first, starting = _start_saver(path), _start_saver(path, "wait")
    second: subprocess.Popen[str] | None = starting
    try:
        assert first.stdout is not None and first.stdout.readline() == "first save done\n"
        assert starting.stdin is not None and starting.stdout is not None
        starting.stdin.write("\n")
        starting.stdin.flush()
        if (
            starting.stdout.readline() != "first save done\n"
        ):  # its first save may already be refused: it ended
            _stop(starting)
            second = None
    except BaseException:
        for process in (first, starting):
            _stop(process, kill=True)
        raise
    outputs = []
    for maybe in (first, second):
        if maybe is None:
            continue
        process = maybe
        assert process.stdin is not None
        try:
            process.stdin.write("\n" * 10)
            process.stdin.flush()
        except BrokenPipeError:  # refused and ended already
            pass
    deadline = time.monotonic() + 120
    for maybe in (first, second):
        if maybe is not None:
            outputs.append(_stop(maybe) if time.monotonic() < deadline else ("", ""))
    errors = "\n".join(err for _, err in outputs)
    assert "FileNotFoundError" not in errors, errors[-3000:]
    assert "another save to this path is in progress" in errors, errors[-3000:]  # they did meet
    fa.load(_loop_state(), path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
