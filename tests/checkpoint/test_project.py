"""Asynchronous saves, project naming and rotation, objects registered for checkpointing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from tests.checkpoint.test_resume import fresh_run, train


def test_an_async_save_holds_the_moment_it_was_called_and_resumes_exactly(tmp_path: Path) -> None:
    whole, whole_model, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    whole, whole_losses = train(whole, epochs=2)

    run, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    run, first = train(run, epochs=2, stop_after=6)
    handle = fa.save(run, tmp_path / "async", blocking=False)
    run, more = train(run, epochs=2)  # training goes on, mutating the weights, while it writes
    assert handle.wait() == (tmp_path / "async").absolute() and handle.done()

    resumed, model, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    resumed = fa.load(resumed, tmp_path / "async")
    resumed, rest = train(resumed, epochs=2)
    assert first + rest == whole_losses == first + more
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole_model.parameters(), strict=False))


def test_consecutive_async_saves_each_hold_their_own_moment(tmp_path: Path) -> None:
    """The second save copies into the buffers the first one wrote from (kept by the
    run's queue), only after the first is on disk: each checkpoint holds its moment."""
    from safetensors.torch import load_file

    run, model, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    moments = []
    for i in range(3):
        run, _ = train(run, epochs=5, stop_after=2 + 2 * i)
        moments.append({k: v.clone() for k, v in model.state_dict().items()})
        fa.save(run, tmp_path / f"c{i}", blocking=False)
        run, _ = train(run, epochs=5, stop_after=3 + 2 * i)  # mutates the weights while it writes
    fa.shutdown(run)
    for i, moment in enumerate(moments):
        saved = load_file(tmp_path / f"c{i}" / "model.safetensors")
        assert all(torch.equal(saved[k], v) for k, v in moment.items()), i
    assert any(not torch.equal(moments[0][k], moments[2][k]) for k in moments[0])


def test_the_queue_reuses_a_staging_buffer_of_the_same_shape_and_dtype() -> None:
    from fnaccel.checkpoint.writer import SaveQueue

    queue = SaveQueue()
    first = queue.staged("m/w", torch.ones(3))
    again = queue.staged("m/w", torch.full((3,), 2.0))
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.full((3,), 2.0))
    assert queue.staged("m/w", torch.ones(4)).data_ptr() != first.data_ptr()  # another shape: a new buffer
    assert queue.staged("m/w", torch.ones(4, dtype=torch.float64)).dtype == torch.float64
    queue.close()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_long_name_saves_and_one_past_the_limit_is_refused_at_the_call(
    tmp_path: Path, blocking: bool
) -> None:
    run, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    # 218-255 bytes: the hidden sibling ".<name>.tmp-<32 hex>" would pass the file-name limit
    for name in ("x" * 250, "é" * 127):
        fa.save(run, tmp_path / name, blocking=blocking).wait()
        assert fa.load(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], tmp_path / name).step == 0
        fa.save(run, tmp_path / name, blocking=blocking).wait()  # replaced: its sibling names fit too
    assert sorted(os.listdir(tmp_path)) == sorted(["x" * 250, "é" * 127])
    with pytest.raises(
        fa.CheckpointError, match=r"its name is 256 bytes, more than the 255 a file name may have"
    ):
        fa.save(run, tmp_path / ("x" * 256), blocking=blocking)
    fa.shutdown(run)


def test_automatic_naming_and_total_limit_rotation(tmp_path: Path) -> None:
    project = fa.ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    state = fa.init(seed=0, cpu=True, project_dir=tmp_path, kwargs_handlers=[project])
    run, _, _ = fresh_run(state, fa.compose())
    for _ in range(4):
        run, _ = train(run, epochs=1, stop_after=run.micro_step + 1)
        fa.save(run)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_2", "checkpoint_3"]  # numbered on, the newest two kept
    assert (
        fa.load(
            fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], tmp_path / "checkpoints" / "checkpoint_3"
        ).micro_step
        == 4
    )
    with pytest.raises(ValueError, match="give a path"):
        fa.save(fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0])
    with pytest.raises(ValueError, match="total_limit must be None or >= 1"):
        fa.ProjectConfiguration(total_limit=0)


def test_total_limit_rotation_keeps_a_checkpoint_holding_a_users_file(tmp_path: Path) -> None:
    """fnaccel deletes only what it wrote: a checkpoint_<n> the user added a file to stays,
    uncounted, with a warning naming the file; the rotation goes on among the others."""
    project = fa.ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    state = fa.init(seed=0, cpu=True, project_dir=tmp_path, kwargs_handlers=[project])
    run, _, _ = fresh_run(state, fa.compose())
    fa.save(run)
    notes = tmp_path / "checkpoints" / "checkpoint_0" / "notes.txt"
    notes.write_text("the run with the good learning rate")
    for _ in range(2):
        run, _ = train(run, epochs=1, stop_after=run.micro_step + 1)
        fa.save(run)
    run, _ = train(run, epochs=1, stop_after=run.micro_step + 1)
    with pytest.warns(UserWarning, match=r"checkpoint_0 is kept: .*notes\.txt"):
        fa.save(run)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_0", "checkpoint_2", "checkpoint_3"]
    assert notes.read_text() == "the run with the good learning rate"


class Ema:
    """A typical object saved with a run: tensors, numbers and nested containers."""

    def __init__(self, value: float) -> None:
        self.shadow = {"w": torch.full((3,), value)}
        self.decay, self.updates, self.history = 0.99, 7, [1.5, (2, "x")]

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "decay": self.decay, "updates": self.updates, "history": self.history}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.shadow, self.decay = saved["shadow"], saved["decay"]
        self.updates, self.history = saved["updates"], saved["history"]


def test_registered_objects_round_trip_without_pickle(tmp_path: Path) -> None:
    run, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose())
    run = fa.utils.register_for_checkpointing(run, ema=Ema(2.0))
    fa.save(run, tmp_path / "with_ema")
    other = Ema(0.0)
    fresh = fa.utils.register_for_checkpointing(
        fresh_run(fa.init(seed=0, cpu=True), fa.compose())[0], ema=other
    )
    fa.load(fresh, tmp_path / "with_ema")
    assert torch.equal(other.shadow["w"], torch.full((3,), 2.0))
    assert (other.decay, other.updates, other.history) == (0.99, 7, [1.5, (2, "x")])  # tuples as tuples

    class Bad(Ema):
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

    with pytest.raises(
        fa.CheckpointError, match=r"registered object 'bad': key 'when': a object cannot be stored"
    ):
        fa.save(fa.utils.register_for_checkpointing(run, bad=Bad(1.0)), tmp_path / "bad")
    with pytest.raises(TypeError, match="has no state_dict"):
        fa.utils.register_for_checkpointing(run, x=3)


def async_save_under_ddp(state: fa.RunState, directory: str) -> list[torch.Tensor]:
    # runs of their own (fa.init makes each its own group): shutting them down leaves the world's
    run, model, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))
    run, _ = train(run, epochs=1, stop_after=3)
    saved = [p.detach().clone() for p in model.parameters()]
    handle = fa.save(run, directory, blocking=False)
    run, _ = train(run, epochs=2)  # DDP all-reduces on the run's group while the save writes
    handle.wait()
    fa.shutdown(run)  # releases the saves' own group too
    loaded, model2, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))
    fa.load(loaded, directory)
    fa.shutdown(loaded)
    return [torch.equal(p, q) for p, q in zip(model2.parameters(), saved, strict=False)]  # type: ignore[misc]


def test_async_save_across_two_processes(world2: Any, tmp_path: Path) -> None:
    for equal in world2.run(async_save_under_ddp, str(tmp_path / "ddp_async")):
        assert all(equal)
