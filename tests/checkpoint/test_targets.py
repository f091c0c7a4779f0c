"""Saves hold users' files: what a save may replace, what it cleans up, and a failed save's leftovers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import fnaccel as fa
from fnaccel.checkpoint.manifest import target_problem
from fnaccel.checkpoint.storage import files
from fnaccel.checkpoint.storage.files import LEFTOVER_MARKER
from tests.checkpoint.test_resume import fresh_run, train

DISK_FULL_JOB = Path(__file__).with_name("_disk_full.py")


def _run() -> fa.RunState:
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    return train(state, epochs=1, stop_after=2)[0]


def _epoch(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "fnaccel.json").read_text())["epoch"])


def test_a_directory_holding_user_files_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _run()
    (tmp_path / "train_log.txt").write_text("epoch 1: loss 0.3")
    monkeypatch.chdir(tmp_path)
    for target in (".", tmp_path):
        with pytest.raises(
            fa.CheckpointError, match=r"is a directory that is not an fnaccel checkpoint.*train_log"
        ):
            fa.save(state, target)
        with pytest.raises(fa.CheckpointError, match="not an fnaccel checkpoint"):
            fa.save(state, target, blocking=False)  # refused at the call, before any thread starts
    assert sorted(os.listdir(tmp_path)) == ["train_log.txt"]  # nothing deleted, nothing left
    assert (tmp_path / "train_log.txt").read_text() == "epoch 1: loss 0.3"
    (tmp_path / "empty").mkdir()
    fa.save(state, "empty")  # an empty directory is fine
    assert (tmp_path / "empty" / "fnaccel.json").is_file()


def test_a_checkpoint_holding_a_foreign_file_is_refused(tmp_path: Path) -> None:
    state = _run()
    fa.save(state, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "notes.txt").write_text("keep me")
    with pytest.raises(fa.CheckpointError, match=r"holds files it did not write \(\['notes.txt'\]\)"):
        fa.save(state, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "keep me"
    (tmp_path / "ckpt" / "notes.txt").unlink()
    fa.save(state.replace(epoch=5), tmp_path / "ckpt")  # its own files only: replaced
    assert _epoch(tmp_path / "ckpt") == 5


def test_a_regular_file_target_is_refused_and_kept(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_bytes(b"user weights")
    with pytest.raises(fa.CheckpointError, match="model.pt is a file, not a checkpoint directory"):
        fa.save(_run(), target)
    assert target.read_bytes() == b"user weights"
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]
    # below it: refused before anything is tried (not "the save failed ... partial directory removed")
    with pytest.raises(fa.CheckpointError, match=r"ckpt: .*model.pt is a file, not a directory a checkpoint"):
        fa.save(_run(), target / "sub" / "ckpt")
    assert target.read_bytes() == b"user weights"


def test_a_symlink_target_replaces_the_checkpoint_it_names_and_stays_a_link(tmp_path: Path) -> None:
    state = _run()
    fa.save(state, tmp_path / "checkpoint_3")
    (tmp_path / "latest").symlink_to("checkpoint_3")
    fa.save(state.replace(epoch=7), tmp_path / "latest").wait()  # the replaced checkpoint removed too
    assert (tmp_path / "latest").is_symlink() and os.readlink(tmp_path / "latest") == "checkpoint_3"
    assert _epoch(tmp_path / "checkpoint_3") == 7  # complete, with its manifest
    assert fa.load(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], tmp_path / "latest").epoch == 7
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_3", "latest"]


def _leftover(
    parent: Path, name: str, kind: str = "tmp", marked: bool = True, token: str | None = None
) -> Path:
    path = parent / f".{name}.{kind}-{token or uuid.uuid4().hex}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"partial")
    if marked:
        (path / LEFTOVER_MARKER).write_text("")
    return path


def test_a_save_removes_its_own_crashed_leftovers_and_nothing_else(tmp_path: Path) -> None:
    crashed = [_leftover(tmp_path, "ckpt"), _leftover(tmp_path, "ckpt", kind="old")]
    kept = [
        _leftover(tmp_path, "ckpt", marked=False),  # the right name but no marker: not ours
        _leftover(tmp_path, "other"),  # another checkpoint's (perhaps another run's, in flight)
        _leftover(tmp_path, "ckpt", token="not-hex"),  # a name fnaccel never makes
    ]
    fa.save(_run(), tmp_path / "ckpt")
    assert not any(path.exists() for path in crashed)
    assert all(path.is_dir() for path in kept)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["ckpt"]


class _Crash(BaseException):
    """The process dying at this instant (nothing after it runs, no handler catches it)."""


def _crash_after(monkeypatch: pytest.MonkeyPatch, steps: int) -> list[str]:
    """Make the commit's ``steps``-th filesystem step (rename, exchange, mark, unlink, fsync)
    the last one it takes; returns the names of the steps taken."""
    taken: list[str] = []

    def step(name: str, real):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = real(*args, **kwargs)
            taken.append(name)
            if len(taken) == steps:
                raise _Crash(name)
            return result

        return run

    monkeypatch.setattr(getattr(files, "os"), "rename", step("rename", os.rename))
    monkeypatch.setattr(files, "_exchange", step("exchange", files._exchange))
    monkeypatch.setattr(files, "_mark", step("mark", files._mark))
    monkeypatch.setattr(files, "fsync_dir", step("fsync", getattr(files, "fsync_dir")))
    monkeypatch.setattr(Path, "unlink", step("unlink", Path.unlink))
    return taken


@pytest.mark.parametrize("over_a_checkpoint", [True, False])
def test_a_crash_at_any_instant_of_the_commit_leaves_only_marked_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over_a_checkpoint: bool
) -> None:
    """Killed between any two steps of moving a written checkpoint into place: the name holds
    the old or the new checkpoint, and the next save removes everything else (a hidden
    directory left without its mark would stay forever, the size of a checkpoint)."""
    state = _run()
    fa.save(state.replace(epoch=5), tmp_path / "new")
    final = tmp_path / "ckpt"
    steps = 1
    while True:
        if over_a_checkpoint:
            fa.save(state, final)
        token = uuid.uuid4().hex
        tmp = files.make_temporary(final, token)
        for name in os.listdir(tmp_path / "new"):
            shutil.copy(tmp_path / "new" / name, tmp / name)
        with monkeypatch.context() as patches:
            taken = _crash_after(patches, steps)
            try:
                files.commit(tmp, final, "fnaccel.json")
                crashed = False
            except _Crash:
                crashed = True
        if final.exists():
            assert _epoch(final) in (0, 5), taken
            assert target_problem(final) is None, taken  # a mark left inside is fnaccel's own
        files.remove_leftovers(tmp_path, "ckpt")
        assert sorted(os.listdir(tmp_path)) == (["ckpt", "new"] if final.exists() else ["new"]), taken
        if not crashed:
            break
        shutil.rmtree(final, ignore_errors=True)
        steps += 1
    assert steps > 3 and _epoch(final) == 5


@pytest.mark.slow
def test_a_failed_save_removes_its_partial_directory_and_names_the_path(tmp_path: Path) -> None:
    # a child process whose files may not grow past 1 KiB (RLIMIT_FSIZE: writes fail with EFBIG,
    # as on a full disk) saves over a good checkpoint that it wrote before the limit
    checkpoint = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, str(DISK_FULL_JOB), str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.strip().splitlines()[-1]
    assert message.startswith("CheckpointError: ") and f"{checkpoint}: the save failed" in message, message
    assert "File too large" in message and "its partial directory" in message and "was removed" in message
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no partial directory left to fill the disk
    assert _epoch(checkpoint) == 0  # the good checkpoint is untouched
    fa.load(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], checkpoint)


def _read_only(directory: Path) -> None:
    """Make ``directory`` refuse new entries even to root (whom file modes do not stop):
    the immutable attribute; a plain ``chmod`` for other users."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return
    done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(
            f"root, and no immutable attribute here to make a read-only directory: {done.stderr.strip()}"
        )


def _writable(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
    directory.chmod(0o755)


def test_a_save_into_a_directory_it_may_not_write_says_so_and_keeps_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    state = _run()
    parent = tmp_path / "runs"
    parent.mkdir()
    fa.save(state.replace(epoch=3), parent / "ckpt")
    _read_only(parent)
    try:
        for target in (parent / "ckpt", parent / "new"):
            with pytest.raises(fa.CheckpointError) as raised:
                fa.save(state.replace(epoch=4), target)
            message = str(raised.value)
            assert message.startswith(f"fa.save: {target}: cannot be written: {parent} is not writable "), (
                message
            )
            assert message.endswith("nothing was written; save to a directory this process may write in"), (
                message
            )
        assert sorted(os.listdir(parent)) == ["ckpt"]
        assert _epoch(parent / "ckpt") == 3
        fa.load(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], parent / "ckpt")
    finally:
        _writable(parent)


def test_rotation_numbers_past_any_directory_and_cleans_deletion_leftovers(tmp_path: Path) -> None:
    project = fa.ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "checkpoint_4").mkdir()  # not a checkpoint (a user's, or an older crash's): never replaced
    (root / "checkpoint_4" / "mine.txt").write_text("x")
    crashed_deletion = _leftover(root, "checkpoint_1", kind="old")
    run = fresh_run(fa.init(seed=0, cpu=True, project_dir=tmp_path, kwargs_handlers=[project]), fa.compose())[
        0
    ]
    for _ in range(3):
        run, _ = train(run, epochs=1, stop_after=run.micro_step + 1)
        fa.save(run)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_4", "checkpoint_6", "checkpoint_7"]
    assert (root / "checkpoint_4" / "mine.txt").read_text() == "x"
    assert not crashed_deletion.exists()
    # every visible checkpoint_N that fnaccel wrote has its manifest: deletion renames first
    assert all((root / name / "fnaccel.json").is_file() for name in ("checkpoint_6", "checkpoint_7"))
