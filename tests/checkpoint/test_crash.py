"""Crash safety: SIGKILL in the middle of fa.save never costs the last good checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import fnaccel as fa

SCRIPT = Path(__file__).with_name("_save_loop.py")


def _fresh() -> fa.RunState:
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(20)])
    return fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.AdamW(model.parameters()),
        loss_fn=lambda m, b: m(b).pow(2).mean(),
    )


def manifest_epoch(path: Path) -> int:
    return int(json.loads((path / "fnaccel.json").read_text())["epoch"])


@contextlib.contextmanager
def _save_loops(args: list[str]) -> Iterator[Callable[[int, float], None]]:
    """Start the save loop's process (torch imported, the run prepared: once) and yield
    ``kill_during_save(saves, delay)``: a save loop in a child forked from it does its first
    save, ``saves`` more one at a time, then starts one more and is SIGKILLed ``delay`` seconds
    in (which lands inside that save or, where it was quicker, while the loop waits for the
    next go-ahead: never in a later save); it returns once the child is dead and reaped."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "fork"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout, child = proc.stdin, proc.stdout, 0

    def send(line: str) -> None:
        stdin.write(line + "\n")
        stdin.flush()

    def kill_during_save(saves: int, delay: float) -> None:
        nonlocal child
        send("run")
        child = int(stdout.readline().removeprefix("pid "))
        assert stdout.readline().strip() == "first save done"
        for _ in range(saves):
            send("go")
            assert stdout.readline().startswith("saved")
        send("go")
        time.sleep(delay)
        os.kill(child, signal.SIGKILL)
        while (line := stdout.readline().strip()) != "ended":  # reaped once it says so: nothing of it runs on
            assert line.startswith("saved"), line  # the last save, where it ended before the kill
        child = 0

    try:
        yield kill_during_save
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        stdin.close()
        stdout.close()


@pytest.mark.slow
def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    epochs_seen = set()
    # several kill points: after a number of saves, at growing delays into the next one
    with _save_loops([str(path)]) as kill_during_save:
        for saves, delay in ((0, 0.0), (1, 0.05), (2, 0.13), (1, 0.29), (3, 0.41)):
            kill_during_save(saves, delay)
            # the killed save either committed or left the one before it: never anything else
            assert manifest_epoch(path) in (saves, saves + 1)

            # the next run's first save removed what this one's killed save left: one at most (and the
            # killed save's lock file, which the kernel unlocked at its death: the next save takes it over)
            assert (
                len([p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.") and p.name != ".ckpt.lock"])
                <= 1
            )
            manifest = json.loads((path / "fnaccel.json").read_text())
            epochs_seen.add(manifest["epoch"])
            state = fa.load(_fresh(), path)  # verifies every checksum
            assert state.epoch == manifest["epoch"]
            # nothing beside it that could pass for a checkpoint: only hidden temporaries
            others = [p.name for p in tmp_path.iterdir() if p.name not in ("ckpt", ".ckpt.lock")]
            assert all(name.startswith(".ckpt.tmp-") for name in others), others
            for leftover in others:  # a temporary with a manifest is complete (killed before the swap)
                if (tmp_path / leftover / "fnaccel.json").exists():
                    fa.load(_fresh(), tmp_path / leftover)
    assert len(epochs_seen) > 1  # by construction: after 0 saves the epoch is 0 or 1, after 3 it is 3 or 4


@pytest.mark.slow
def test_sigkill_during_rotation_never_shows_a_checkpoint_without_its_manifest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    with _save_loops([str(tmp_path), "rotate"]) as kill_during_save:
        for saves, delay in ((1, 0.0), (2, 0.19), (3, 0.43)):
            kill_during_save(saves, delay)
            visible = [p for p in root.iterdir() if not p.name.startswith(".")]
            assert visible and all((p / "fnaccel.json").is_file() for p in visible), sorted(os.listdir(root))
            newest = max(visible, key=lambda p: int(p.name.removeprefix("checkpoint_")))
            assert fa.load(_fresh(), newest).epoch == manifest_epoch(newest)
            # the leftovers of earlier kills went with later saves: only this kill's remain
            assert len([p for p in root.iterdir() if p.name.startswith(".")]) <= 2, sorted(os.listdir(root))


@pytest.mark.slow
def test_sigkill_between_a_commit_and_the_replaced_checkpoints_removal_leaves_the_new_one(
    tmp_path: Path,
) -> None:
    # The replaced checkpoint is removed beside the run, after the save returned; killed in between (its manifest
    # gone, its other files not), the new checkpoint is in place and found, and the next save removes the rest
    path = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(path), "hold", "fork"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout, child = proc.stdin, proc.stdout, 0

    def lines(*wanted: str) -> dict[str, str]:
        """The child's next lines, one starting with each of ``wanted`` (the removal's thread and the loop print
        side by side, in either order)."""
        got: dict[str, str] = {}
        while len(got) < len(wanted):
            line = stdout.readline().strip()
            start = next((w for w in wanted if line.startswith(w)), None)
            assert start is not None, f"expected lines starting with {wanted}, got {line!r}"
            got[start] = line
        return got

    def leftovers() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-"))

    def stop() -> None:  # a line that never comes ends the wait for it (EOF), never hangs the suite
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.kill()

    watchdog = threading.Timer(300, stop)
    watchdog.start()
    try:
        stdin.write("run\n")
        stdin.flush()
        child = int(stdout.readline().removeprefix("pid "))
        lines("first save done")  # nothing replaced yet
        stdin.write("go\n")
        stdin.flush()
        first = lines("removing", "saved 1")["removing"].removeprefix("removing ")  # the save returned, held
        os.kill(child, signal.SIGKILL)
        assert stdout.readline().strip() == "ended"
        child = 0
        assert manifest_epoch(path) == 1 and fa.load(_fresh(), path).epoch == 1
        with pytest.warns(UserWarning, match="skipped .*ckpt.tmp-.*an unfinished save or deletion"):
            assert fa.latest_checkpoint(tmp_path) == path
        assert leftovers() == [first] and not (tmp_path / first / "fnaccel.json").exists()
        assert (tmp_path / first / ".fnaccel-leftover").is_file()  # marked: the next save's to remove

        stdin.write(
            "run\n"
        )  # the next run's first save replaces epoch 1, and removes the killed run's leftover
        stdin.flush()
        child = int(stdout.readline().removeprefix("pid "))
        second = lines("removing", "first save done")["removing"].removeprefix("removing ")
        assert leftovers() == [second] != [first]
        assert manifest_epoch(path) == 0
    finally:
        watchdog.cancel()
        stop()
        proc.wait(timeout=30)
        stdin.close()
        stdout.close()


def test_the_replaced_checkpoint_is_removed_beside_the_run_and_wait_or_shutdown_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fnaccel.checkpoint import writer
    from fnaccel.checkpoint.storage import files

    go, started = threading.Event(), threading.Event()

    def slow(old: Path, manifest: str) -> None:
        started.set()
        go.wait(timeout=60)
        files.remove_replaced(old, manifest)

    def replaced() -> list[Path]:
        return [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]

    monkeypatch.setattr(writer, "remove_replaced", slow)
    state = _fresh()
    assert fa.save(state, tmp_path / "ckpt").done()  # nothing replaced
    for epoch, settle in ((1, "handle"), (2, "shutdown")):
        go.clear()
        started.clear()
        handle = fa.save(state.replace(epoch=epoch), tmp_path / "ckpt")  # returns before the removal ends
        assert started.wait(timeout=60) and not handle.done()
        (old,) = replaced()
        assert manifest_epoch(tmp_path / "ckpt") == epoch and manifest_epoch(old) == epoch - 1
        threading.Timer(0.2, go.set).start()
        handle.wait() if settle == "handle" else fa.shutdown(state)  # each waits for the removal
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
