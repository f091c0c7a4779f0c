"""`fa.save_policy` / `fa.autosave`: checkpointing as a value (issue 33 point 7).

Values first (built, composed, printed, compared, bad arguments refused naming
the argument), then `autosave` on one process (the steps it saves, rotation
that keeps what it should and nothing of the user's, continuous saving, time
and preemption), then on 2 processes: every rank saves the same steps, with
no collective on steps where nothing is due, and a run resumed from
`fa.latest_checkpoint` over the policy's tiers ends bit for bit like the
uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.checkpoint import policy as policy_module
from fnaccel.checkpoint.policy import AnySavePolicy, SavePolicy
from tests.checkpoint.test_resume import fresh_run, train


def _steps(directory: Path) -> list[int]:
    """The steps of the ``step_<n>`` checkpoints in ``directory``, from their manifests."""
    found = []
    for path in sorted(directory.glob("step_*")):
        if (path / "fnaccel.json").is_file():
            manifest = json.loads((path / "fnaccel.json").read_text())
            assert path.name == f"step_{manifest['step']}", path
            found.append(manifest["step"])
    return sorted(found)


@pytest.fixture(autouse=True)
def _no_save_left_running() -> Iterator[None]:
    yield
    assert not [t for t in threading.enumerate() if t.name.startswith("fnaccel-save-")]


# --- values -------------------------------------------------------------------------------------


def test_a_policy_is_an_immutable_printable_comparable_value() -> None:
    disk = fa.save_policy(every_steps=100, keep_last=2, keep_every=1000, directories="ckpt")
    assert isinstance(disk, SavePolicy)
    assert disk == fa.save_policy(every_steps=100, keep_last=2, keep_every=1000, directories=[Path("ckpt")])
    assert hash(disk) == hash(
        fa.save_policy(every_steps=100, keep_last=2, keep_every=1000, directories=("ckpt",))
    )
    assert disk != fa.save_policy(every_steps=100, keep_last=3, keep_every=1000, directories="ckpt")
    assert repr(disk) == "save_policy(every_steps=100, keep_last=2, keep_every=1000, directories='ckpt')"
    with pytest.raises(AttributeError):
        disk.every_steps = 5  # type: ignore[misc]
    both = fa.save_policy(every_steps=3, directories=("a", "b"))
    assert both.directories == (Path("a"), Path("b"))
    assert repr(both) == "save_policy(every_steps=3, directories=('a', 'b'))"
    assert repr(fa.save_policy(directories="ckpt")) == "save_policy(directories='ckpt')"  # on preemption only


def test_policies_compose_as_any_of_in_order() -> None:
    ram = fa.save_policy(continuous=True, keep_last=1, on_preemption=False, directories="/dev/shm/run")
    disk = fa.save_policy(every_steps=500, directories="ckpt")
    cold = fa.save_policy(every_seconds=3600.0, directories="cold")
    both = ram | disk
    assert isinstance(both, AnySavePolicy) and both.policies == (ram, disk)
    assert both.directories == (Path("/dev/shm/run"), Path("ckpt"))
    assert (both | cold) == (ram | (disk | cold)) == AnySavePolicy(policies=(ram, disk, cold))
    assert (ram | disk) != (disk | ram)  # the order is the tiers' order for fa.latest_checkpoint
    assert repr(both) == (
        "save_policy(on_preemption=False, continuous=True, keep_last=1, "
        "directories='/dev/shm/run') | save_policy(every_steps=500, directories='ckpt')"
    )
    assert len({both, ram | disk}) == 1
    with pytest.raises(TypeError):
        ram | 5  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_steps": 0}, "save_policy: every_steps must be None or an int >= 1, got 0"),
        ({"every_steps": -3}, "save_policy: every_steps must be None or an int >= 1, got -3"),
        ({"every_steps": True}, "save_policy: every_steps must be None or an int >= 1, got True"),
        ({"every_steps": 2.0}, "save_policy: every_steps must be None or an int >= 1, got 2.0"),
        ({"keep_last": 0}, "save_policy: keep_last must be None or an int >= 1, got 0"),
        ({"keep_last": False}, "save_policy: keep_last must be None or an int >= 1, got False"),
        ({"keep_every": 0, "keep_last": 1}, "save_policy: keep_every must be None or an int >= 1, got 0"),
        ({"every_seconds": 0}, "save_policy: every_seconds must be None or a number of seconds > 0, got 0"),
        ({"every_seconds": -1.5}, "save_policy: every_seconds must be None or a number of seconds > 0"),
        (
            {"every_seconds": float("nan")},
            "save_policy: every_seconds must be None or a number of seconds > 0",
        ),
        (
            {"every_seconds": True},
            "save_policy: every_seconds must be None or a number of seconds > 0, got True",
        ),
        ({"on_preemption": 1}, "save_policy: on_preemption must be True or False, got 1"),
        ({"continuous": "yes"}, "save_policy: continuous must be True or False, got 'yes'"),
        (
            {"continuous": True, "every_steps": 10},
            "save_policy: continuous must be False when every_steps or every_seconds is given",
        ),
        ({"on_preemption": False}, "save_policy: this policy never saves"),
        ({"every_steps": 10, "keep_every": 100}, "save_policy: keep_every must be given with keep_last"),
        (
            {"every_steps": 10, "keep_last": 2, "keep_every": 25},
            "save_policy: keep_every must be a multiple of every_steps=10, got 25",
        ),
        (
            {"directories": ()},
            "save_policy: directories must be a directory (a str or os.PathLike) or a "
            "non-empty list or tuple of them, got ()",
        ),
        ({"directories": []}, "save_policy: directories must be"),
        ({"directories": ""}, "save_policy: directories must be .* '' is not a directory's path"),
        ({"directories": None}, "save_policy: directories must be .* got None"),
        ({"directories": 5}, "save_policy: directories must be .* got 5"),
        ({"directories": {"ram": "/dev/shm"}}, "save_policy: directories must be"),
        ({"directories": ("ckpt", 3)}, "save_policy: directories must be .* 3 is not a directory's path"),
        ({"directories": (b"ckpt",)}, "save_policy: directories must be"),
        ({"directories": ("ckpt", "./ckpt")}, "save_policy: directories must be distinct directories"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(").replace(")", r"\)"),
    ):
        fa.save_policy(**{"directories": "ckpt", **kwargs})


def test_a_directory_in_two_members_is_refused() -> None:
    one = fa.save_policy(every_steps=10, keep_last=1, directories="ckpt")
    with pytest.raises(
        ValueError,
        match="save_policy: directories must be in one composed policy only, got "
        "'ckpt': each member rotates its own directories",
    ):
        one | fa.save_policy(every_steps=7, directories=("other", "./ckpt"))
    with pytest.raises(ValueError, match="save_policy: directories must be in one composed policy only"):
        one | one


def test_missing_directories_is_named() -> None:
    with pytest.raises(TypeError, match="directories"):
        fa.save_policy(every_steps=10)  # type: ignore[call-arg]


# --- one process ----------------------------------------------------------------------------------


def _run(pipeline: fa.Pipeline | None = None, **init: Any) -> fa.RunState:
    """A small run: 10 batches an epoch (tests/checkpoint/test_resume.py's model and data)."""
    return fresh_run(fa.init(seed=0, cpu=True, **init), pipeline or fa.compose())[0]


def _book(state: fa.RunState) -> dict[SavePolicy, Any]:
    """autosave's bookkeeping per member policy (empty before its first update boundary)."""
    book = state.resources.get("autosave")
    return {} if book is None else dict(book._members)


def _autosaving(
    state: fa.RunState, policy: Any, *, stop_after: int | None = None, epochs: int = 1
) -> tuple[fa.RunState, list[int]]:
    """Train with ``fa.autosave`` after every step; the steps at which a save started."""
    started = []
    for batch in fa.batches(state, epochs=epochs):
        state, _ = fa.step(state, batch)
        before = {p: mine.last_saved for p, mine in _book(state).items()}
        state = fa.autosave(state, policy)
        if any(mine.last_saved != before.get(p) for p, mine in _book(state).items()):
            started.append(state.step)
        if stop_after is not None and state.micro_step == stop_after:
            break
    return state, started


def test_every_steps_saves_at_update_boundaries_into_step_directories(tmp_path: Path) -> None:
    """Every 2 optimizer steps under accumulate(3): saved after the window's last micro-step
    (no gradients mid-window in the checkpoint), once per step, never step 0."""
    state = _run(fa.compose(fa.accumulate(3)))
    state = fa.autosave(state, fa.save_policy(every_steps=2, directories=tmp_path))  # step 0: nothing
    state, started = _autosaving(state, fa.save_policy(every_steps=2, directories=tmp_path), epochs=2)
    fa.shutdown(state)
    assert state.step == 6 and started == [2, 4, 6]
    assert _steps(tmp_path) == [2, 4, 6]
    for step in (2, 4, 6):
        manifest = json.loads((tmp_path / f"step_{step}" / "fnaccel.json").read_text())
        assert manifest["micro_step"] == 3 * step
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_2",
        "step_4",
        "step_6",
    ]  # no lock, no leftover


def test_rotation_keeps_the_newest_and_every_kth_and_nothing_of_the_users(tmp_path: Path) -> None:
    """keep_last=2, keep_every=4 over steps 2..10: 4 and 8 (each multiple's first) and the
    newest two stay. A user's file, a user's step_<n> directory, a checkpoint the user put a
    file into and a checkpoint under another name are never deleted."""
    (tmp_path / "train_log.txt").write_text("mine")
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "notes.txt").write_text("mine too")
    state = _run()
    fa.save(state, tmp_path / "best")
    state, _ = train(state, epochs=1, stop_after=1)
    fa.save(state, tmp_path / "step_1")
    (tmp_path / "step_1" / "README").write_text("I put this here")
    policy = fa.save_policy(every_steps=2, keep_last=2, keep_every=4, directories=tmp_path)
    state, started = _autosaving(state, policy)
    fa.shutdown(state)
    assert started == [2, 4, 6, 8, 10]
    assert _steps(tmp_path) == [1, 4, 8, 10]  # step_1: the user's README is in it; kept
    assert (tmp_path / "train_log.txt").read_text() == "mine"
    assert (tmp_path / "step_3" / "notes.txt").read_text() == "mine too"
    assert (tmp_path / "step_1" / "README").is_file() and (tmp_path / "best" / "fnaccel.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best",
        "step_1",
        "step_10",
        "step_3",
        "step_4",
        "step_8",
        "train_log.txt",
    ]


def test_rotation_removes_leftovers_of_crashed_saves_only(tmp_path: Path) -> None:
    crashed = tmp_path / f".step_3.tmp-{'a' * 32}"
    crashed.mkdir()
    (crashed / ".fnaccel-leftover").write_text("fnaccel: a checkpoint being written or deleted\n")
    unmarked = tmp_path / f".step_5.tmp-{'b' * 32}"
    unmarked.mkdir()
    state, _ = _autosaving(_run(), fa.save_policy(every_steps=4, keep_last=1, directories=tmp_path))
    fa.shutdown(state)
    assert not crashed.exists() and unmarked.is_dir()
    assert _steps(tmp_path) == [8]


def test_continuous_saves_only_once_the_last_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one process: a save starts only at a step where the last one is done (no save ever
    waits for another), and the RAM-like tier keeps one checkpoint. The CPU clock stands still,
    so snapshots cost nothing and the 5% pacing never holds a save (that is the next test's);
    every other step waits for the save in flight, so at least two start whatever the writer's
    speed, and the steps between show whether one starts while another is still writing."""
    monkeypatch.setattr(policy_module, "_work_clock", lambda: 0.0)
    state = _run()
    policy = fa.save_policy(continuous=True, keep_last=1, directories=tmp_path)
    starts, idle = [], []
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
        mine = _book(state).get(policy)
        idle.append(mine is None or mine.handle is None or mine.handle.done())
        before = None if mine is None else mine.last_saved
        state = fa.autosave(state, policy)
        starts.append(_book(state)[policy].last_saved != before)
        if state.step % 2:
            _book(state)[policy].handle.wait()
    last = _book(state)[policy].last_saved
    fa.shutdown(state)
    assert starts[0] and sum(starts) >= 2
    assert all(was_idle for started, was_idle in zip(starts, idle, strict=True) if started)
    assert _steps(tmp_path) == [last]


def test_continuous_is_paced_by_its_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU clock advancing 1 s a read: a snapshot (read before and after it) takes 1 s, and a
    step's autosave reads it once while the last save is done. Every save committed before the
    next step: the next save still waits until the loop spent 20 snapshots' CPU time since the
    last started (snapshots take at most 5% of the loop)."""
    work = iter(range(1000))
    monkeypatch.setattr(policy_module, "_work_clock", lambda: float(next(work)))
    policy = fa.save_policy(continuous=True, keep_last=1, directories=tmp_path)
    state = _run()
    started = []
    for batch in fa.batches(state, epochs=5):
        state, _ = fa.step(state, batch)
        state = fa.autosave(state, policy)
        mine = _book(state)[policy]
        if mine.last_saved == state.step:
            started.append(state.step)
        mine.handle.wait()
    fa.shutdown(state)
    assert started == [1, 20, 39]  # the first at read 1 (done at 2); step 20 reads 21 = 1 + 20; ...


def test_every_seconds_reads_the_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock advancing 1 s a step and every_seconds=3: saves 3 steps apart from the first call."""
    ticks = iter(range(1000))
    monkeypatch.setattr(policy_module, "_clock", lambda: float(next(ticks)))
    state, started = _autosaving(_run(), fa.save_policy(every_seconds=3, directories=tmp_path))
    fa.shutdown(state)
    assert started == [4, 7, 10]


def test_on_preemption_saves_before_autosave_returns(tmp_path: Path) -> None:
    """SIGUSR2 after step 4: fa.batches ends; the autosave after the loop writes the preempted
    step to the members that save on preemption, before it returns (the script may exit)."""
    state = _run(kwargs_handlers=[fa.PreemptionKwargs(signals=("SIGUSR2",))])
    policy = fa.save_policy(every_steps=100, directories=tmp_path / "disk") | fa.save_policy(
        every_steps=100, on_preemption=False, directories=tmp_path / "other"
    )
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
        state = fa.autosave(state, policy)
        if state.step == 4:
            os.kill(os.getpid(), signal.SIGUSR2)
    assert state.preempted == "SIGUSR2" and state.step == 4
    state = fa.autosave(state, policy)
    assert _steps(tmp_path / "disk") == [4]  # before fa.shutdown: written by autosave itself
    assert not (tmp_path / "other").exists()
    fa.shutdown(state)


def test_autosave_refuses_bad_input(tmp_path: Path) -> None:
    state = _run()
    state, _ = train(state, epochs=1, stop_after=1)
    with pytest.raises(
        TypeError, match=r"fa.autosave: policy must be a fa.save_policy\(...\) value .* got 'ckpt'"
    ):
        fa.autosave(state, "ckpt")  # type: ignore[arg-type]
    fa.save(state, tmp_path / "ckpt")
    with pytest.raises(
        ValueError,
        match="fa.autosave: directories: .*ckpt is a checkpoint itself; give the directory that should hold",
    ):
        fa.autosave(state, fa.save_policy(every_steps=1, directories=tmp_path / "ckpt"))
    policy = fa.save_policy(every_steps=1, directories=tmp_path / "ok")
    old, state = state, fa.autosave(state, policy)
    with pytest.raises(
        fa.StaleStateError, match="fa.autosave was given a RunState already consumed by fa.autosave"
    ):
        fa.autosave(old, policy)
    fa.shutdown(state)


# --- two processes --------------------------------------------------------------------------------


class _Counting:
    """`fnaccel.ops` as the policy module sees it, counting its broadcasts."""

    def __init__(self) -> None:
        self.broadcasts = 0

    def broadcast_object_list(self, *args: Any, **kwargs: Any) -> Any:
        self.broadcasts += 1
        return fa.ops.broadcast_object_list(*args, **kwargs)


def agreed_saves(state: fa.RunState, root: str) -> dict[str, Any]:
    """Runs on each rank: 20 steps autosaving with every_steps and every_seconds members (a clock
    ticking 1 s a read); the steps each member saved and the steps at which autosave broadcast."""
    counting, ticks = _Counting(), iter(range(10_000))
    saved_ops, saved_clock = getattr(policy_module, "ops"), policy_module._clock
    setattr(policy_module, "ops", counting)  # a counting stand-in for the module fnaccel.ops
    policy_module._clock = lambda: float(next(ticks))
    try:
        members = (
            fa.save_policy(every_steps=3, keep_last=1, directories=f"{root}/steps"),
            fa.save_policy(every_seconds=4, keep_last=1, directories=f"{root}/seconds"),
        )
        policy = members[0] | members[1]
        state = fresh_run(state, fa.compose(fa.ddp()))[0]
        started: list[list[int]] = [[] for _ in members]
        broadcasts_at: list[int] = []
        for batch in fa.batches(state, epochs=4):
            state, _ = fa.step(state, batch)
            before = counting.broadcasts
            state = fa.autosave(state, policy)
            for index, member in enumerate(members):
                if _book(state)[member].last_saved == state.step:
                    started[index].append(state.step)
            if counting.broadcasts != before:
                broadcasts_at.append(state.step)
        fa.shutdown(state)
    finally:
        setattr(policy_module, "ops", saved_ops)
        policy_module._clock = saved_clock
    return {
        "started": started,
        "broadcasts_at": broadcasts_at,
        "kept": [_steps(Path(root) / name) for name in ("steps", "seconds")],
    }


def test_two_ranks_save_the_same_steps_without_collectives_on_idle_steps(world2: Any, tmp_path: Path) -> None:
    """20 steps (5 batches an epoch per rank): every_steps never broadcasts; every_seconds
    broadcasts once to time a step, then only at the steps it saves; both ranks save alike."""
    results = world2.run(agreed_saves, str(tmp_path))
    assert results[0] == results[1]
    (steps, seconds), broadcasts_at = results[0]["started"], results[0]["broadcasts_at"]
    assert steps == [3, 6, 9, 12, 15, 18]
    assert seconds == [5, 9, 13, 17]  # the first call (step 1) starts the clock; 4 s a save
    assert broadcasts_at == [2, *seconds]
    assert results[0]["kept"] == [[18], [17]]


def interrupted_and_resumed(state: fa.RunState, root: str) -> dict[str, Any]:
    """Runs on each rank: the uninterrupted run (no autosave), then a run with a two-tier
    policy (continuous to one directory, every 4 steps to another) stopped after micro-step 7,
    then a fresh run resumed from fa.latest_checkpoint over the policy's directories; the
    last two's final weights against the first's, and the steps at which each saved."""
    whole, model, _ = fresh_run(state, fa.compose(fa.ddp()))
    whole, _whole_losses = train(whole, epochs=3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    policy = fa.save_policy(continuous=True, keep_last=1, directories=f"{root}/ram") | fa.save_policy(
        every_steps=4, keep_last=2, directories=f"{root}/disk"
    )
    first = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))[0]
    first, first_saves = _autosaving(first, policy, stop_after=7, epochs=3)
    fa.shutdown(first)
    found = fa.latest_checkpoint(*policy.directories)
    assert found is not None
    second, model, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))
    second = fa.load(second, found)
    resumed_at = second.step
    second, second_saves = _autosaving(second, policy, epochs=3)
    fa.shutdown(second)
    equal = all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
    return {
        "found": str(found),
        "resumed_at": resumed_at,
        "equal": equal,
        "steps": second.step,
        "whole": whole.step,
        "disk": _steps(Path(root) / "disk"),
        "saves": (first_saves, second_saves),
    }


def test_a_resume_from_the_policys_tiers_equals_the_uninterrupted_run(world2: Any, tmp_path: Path) -> None:
    results = world2.run(interrupted_and_resumed, str(tmp_path))
    assert results[0]["found"] == results[1]["found"]
    # continuous: rank 0's clock says when the last save committed; both ranks start the next alike
    assert results[0]["saves"] == results[1]["saves"] and results[0]["saves"][0][0] == 1, results
    for result in results:
        assert result["equal"] and result["steps"] == result["whole"] == 15, result
        assert 4 <= result["resumed_at"] <= 7, result
    assert results[0]["disk"] == [8, 12], results[0]


def autosave_against_save(state: fa.RunState, root: str) -> str:
    """Runs on each rank of a run of its own: rank 0 in an autosave that saves, rank 1 in fa.save."""
    run = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.ddp()))[0]
    run, _ = train(run, epochs=1, stop_after=2)
    try:
        if run.dist.rank == 0:
            fa.autosave(run, fa.save_policy(every_steps=2, directories=f"{root}/policy"))
        else:
            fa.save(run, f"{root}/ckpt")
    except fa.CollectiveCallError as error:
        fa.shutdown(run)  # on the error path: waits for no other rank
        return str(error)
    raise AssertionError("the two calls went on together")


def test_an_autosave_on_one_rank_is_named_not_waited_for(world2: Any, tmp_path: Path) -> None:
    """fa.autosave's saves are a collective fnaccel call, agreed first as fa.save's are: rank 0
    autosaving while rank 1 saves by hand raises on both at once, naming both calls."""
    messages = world2.run(autosave_against_save, str(tmp_path))
    assert (
        messages
        == [
            "the ranks made different collective calls at the same point (rank 0: fa.autosave, "
            "rank 1: fa.save): every rank must make the same collective fnaccel calls in the same "
            "order"
        ]
        * 2
    )
    assert not (tmp_path / "policy").exists() and not (tmp_path / "ckpt").exists()
