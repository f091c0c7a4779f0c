"""`fa.latest_checkpoint`: the newest complete, verified checkpoint across tiers (a RAM one and a disk one)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fnaccel as fa
from fnaccel.checkpoint.storage.files import SaveLock
from tests.checkpoint.test_resume import fresh_run, train


def _run() -> fa.RunState:
    return fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warning of any kind may be raised inside."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_two_tiers_through_real_saves(tmp_path: Path) -> None:
    """The RAM tier saved over one path every 2 steps (asynchronously), the disk tier
    every 5 steps under numbered names: the newest step wins wherever it is, and the
    loaded run continues exactly like the one that saved."""
    ram, disk = tmp_path / "shm", tmp_path / "disk"
    assert fa.latest_checkpoint(ram, disk) is None  # first run: neither tier exists yet
    state = _run()
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
        if state.step % 2 == 0:
            fa.save(state, ram / "latest", blocking=False)
        if state.step % 5 == 0:
            fa.save(state, disk / f"step_{state.step}")
        if state.step == 7:
            break
    fa.save(state, disk / "step_7x")  # the same step on both tiers once the next RAM save is in
    fa.save(state, ram / "latest")
    state, expected = train(state, epochs=1)
    fa.shutdown(state)
    with _quiet():
        assert fa.latest_checkpoint(ram, disk) == ram / "latest"  # step 7 on both: the first tier given
        assert fa.latest_checkpoint(disk, ram) == disk / "step_7x"
    (disk / "step_7x" / "model.safetensors").unlink()  # no longer complete: the RAM one still is
    with pytest.warns(fa.SkippedCheckpointWarning, match=r"step_7x.*model.safetensors: missing"):
        assert fa.latest_checkpoint(disk, ram) == ram / "latest"
    resumed = fa.load(_run(), fa.latest_checkpoint(ram, disk))
    resumed, losses = train(resumed, epochs=1)
    assert losses == expected
    fa.shutdown(resumed)


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A RAM tier holding step 6 and a disk tier holding steps 3 and 5, all complete."""
    root = tmp_path_factory.mktemp("tiers")
    state = _run()
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
        if state.step in (3, 5):
            fa.save(state, root / "disk" / f"checkpoint_{state.step}")
        if state.step == 6:
            fa.save(state, root / "ram" / "latest")
            break
    fa.shutdown(state)
    return root / "ram", root / "disk"


def _copy(tiers: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    return (
        Path(shutil.copytree(tiers[0], tmp_path / "ram", symlinks=True)),
        Path(shutil.copytree(tiers[1], tmp_path / "disk", symlinks=True)),
    )


def test_newest_valid_across_tiers_and_argument_forms(tiers: tuple[Path, Path], tmp_path: Path) -> None:
    ram, disk = _copy(tiers, tmp_path)
    (disk / "logs").mkdir()  # a directory that is not a checkpoint: passed over quietly
    (disk / "notes.txt").write_text("hello")
    with _quiet():
        assert fa.latest_checkpoint(ram, disk) == ram / "latest"
        assert fa.latest_checkpoint(disk, ram) == ram / "latest"  # by step, not by the order given
        assert fa.latest_checkpoint(disk) == disk / "checkpoint_5"
        # a checkpoint directory itself is a candidate, as is a parent's checkpoint child
        assert fa.latest_checkpoint(str(disk / "checkpoint_3"), disk / "logs") == disk / "checkpoint_3"
        assert fa.latest_checkpoint(tmp_path / "nowhere", disk / "logs") is None
    with pytest.raises(ValueError, match="notes.txt.*not a directory"):
        fa.latest_checkpoint(disk / "notes.txt")
    with pytest.raises(TypeError, match="at least one directory"):
        fa.latest_checkpoint()


def test_a_truncated_newest_is_skipped_with_a_warning(tiers: tuple[Path, Path], tmp_path: Path) -> None:
    ram, disk = _copy(tiers, tmp_path)
    model = ram / "latest" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    with pytest.warns(
        fa.SkippedCheckpointWarning, match=r"skipped .*latest \(step 6\).*model.safetensors: truncated"
    ) as caught:
        assert fa.latest_checkpoint(ram, disk) == disk / "checkpoint_5"
    assert len(caught) == 1  # the step-3 checkpoint was never read: the newest valid one stops the search


def test_a_flipped_byte_and_a_damaged_manifest_are_skipped(tiers: tuple[Path, Path], tmp_path: Path) -> None:
    ram, disk = _copy(tiers, tmp_path)
    optimizer = disk / "checkpoint_5" / "optimizer.safetensors"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))
    manifest = ram / "latest" / "fnaccel.json"
    manifest.write_text(manifest.read_text().replace('"step": 6', '"step": 9'))
    with pytest.warns(fa.SkippedCheckpointWarning) as caught:
        assert fa.latest_checkpoint(ram, disk) == disk / "checkpoint_3"
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "checkpoint_5 (step 5)" in messages[0] and "optimizer.safetensors: corrupt" in messages[0]
    assert "latest" in messages[1] and "fnaccel.json: corrupt" in messages[1]


def test_hidden_leftovers_and_a_live_save_are_skipped_with_a_warning(
    tiers: tuple[Path, Path], tmp_path: Path
) -> None:
    ram, disk = _copy(tiers, tmp_path)
    # what a save killed mid-write leaves: a hidden, marked directory (here even with a manifest)
    import shutil

    leftover = shutil.copytree(ram / "latest", ram / f".latest.tmp-{'0' * 32}")
    (Path(leftover) / ".fnaccel-leftover").write_bytes(b"")
    (ram / ".cache").mkdir()  # hidden and not fnaccel's: quietly ignored
    with pytest.warns(fa.SkippedCheckpointWarning, match=r"\.latest\.tmp-0+: an unfinished save") as caught:
        assert fa.latest_checkpoint(ram, disk) == ram / "latest"
    assert len(caught) == 1
    shutil.rmtree(leftover)
    lock = SaveLock.take(ram / "latest")  # a live save to it: it may be replaced while read
    assert isinstance(lock, SaveLock)
    try:
        with pytest.warns(fa.SkippedCheckpointWarning, match=r"latest \(step 6\).*save to it is in progress"):
            assert fa.latest_checkpoint(ram, disk) == disk / "checkpoint_5"
    finally:
        lock.release()


def test_hostile_entries_are_not_followed(tiers: tuple[Path, Path], tmp_path: Path) -> None:
    ram, disk = _copy(tiers, tmp_path)
    outside = tmp_path / "outside"
    os.symlink(ram / "latest", disk / "link")  # a link among the children: not followed
    (disk / "checkpoint_9").mkdir()  # a manifest that is a FIFO: refused without blocking
    os.mkfifo(disk / "checkpoint_9" / "fnaccel.json")
    outside.mkdir()
    (disk / "checkpoint_8").mkdir()  # a manifest that is a link to a file outside
    (outside / "fnaccel.json").write_text(json.dumps({"format": "fnaccel-checkpoint"}))
    os.symlink(outside / "fnaccel.json", disk / "checkpoint_8" / "fnaccel.json")
    with pytest.warns(fa.SkippedCheckpointWarning) as caught:
        assert fa.latest_checkpoint(disk) == disk / "checkpoint_5"
    named = sorted(Path(str(w.message).split()[2].rstrip(":")).name for w in caught)
    assert named == ["checkpoint_8", "checkpoint_9"], [str(w.message) for w in caught]


def test_doctest_shape_of_the_answer(tmp_path: Path) -> None:
    """What is returned is the path a load takes (`Path`), the directory given joined with the child."""
    state = fa.prepare(fa.init(cpu=True), torch.nn.Linear(2, 2))
    fa.save(state, tmp_path / "a" / "ckpt")
    found = fa.latest_checkpoint(os.path.relpath(tmp_path / "a"))
    assert isinstance(found, Path) and found == Path(os.path.relpath(tmp_path / "a")) / "ckpt"


def test_the_two_tier_block_of_the_docs_runs_and_resumes_from_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/checkpoints.md's two-tier loop, run twice as written: the second run starts
    from the RAM tier's checkpoint of the first."""
    import shutil
    import uuid

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_docs_snippets import _block

    code = _block("docs/checkpoints.md", "fa.latest_checkpoint(ram,")
    job = f"fnaccel-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.chdir(tmp_path)
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 2))
    try:
        steps = []
        for _ in range(2):
            model = nn.Linear(8, 2)
            names = {
                "model": model,
                "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                "loader": DataLoader(data, batch_size=4),
                "loss_fn": lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
            }
            exec(code, names)
            state = names["state"]
            assert isinstance(state, fa.RunState)
            steps.append((names["found"], state.step))
            fa.shutdown(names["state"])
        assert steps == [(None, 36), (Path(f"/dev/shm/{job}/latest"), 36)]
    finally:
        shutil.rmtree(f"/dev/shm/{job}", ignore_errors=True)


def test_an_empty_path_or_a_value_that_is_no_path_is_refused_naming_the_argument(tmp_path: Path) -> None:
    """Before: "" scanned the current directory (and returned a checkpoint found there)."""
    with pytest.raises(
        ValueError,
        match=r"directories\[1\] is an empty path, which would scan the current "
        r"directory; .*\('\.' for the current one\)",
    ):
        fa.latest_checkpoint(tmp_path, "")
    with pytest.raises(
        TypeError, match=r"directories\[0\] must be a path \(str or os\.PathLike\), got NoneType"
    ):
        fa.latest_checkpoint(None)  # type: ignore[arg-type]
