"""`fa.save_policy` and `fa.autosave`: when a run saves, where, and which checkpoints stay, as a value.

A `SavePolicy` is a frozen record (printable, comparable, hashable) built by
`save_policy`; ``a | b`` composes policies into an `AnySavePolicy`: the run
saves whenever any member says so, each member into its own directories with
its own rotation. That is how the two tiers read: a RAM tier saved often and a
disk tier saved rarely are two members::

    policy = (fa.save_policy(continuous=True, keep_last=1, directories="/dev/shm/run")
              | fa.save_policy(every_steps=500, keep_last=3, directories="runs/x/checkpoints"))
    found = fa.latest_checkpoint(*policy.directories)   # the tiers, fastest first

`autosave(state, policy)`, called once per batch after `fa.step`, saves only at
an update boundary (after the accumulation window's last micro-step, so a
checkpoint never holds gradients mid-window), into
``<directory>/step_<state.step>``, asynchronously through the run's save queue
(a save first waits for the one before it), except the save a preemption asks
for, which is written before `autosave` returns. Step 0 is never saved.

Agreement. Every rank must start a save at the same step, and a step where
nothing is due pays no collective:

- ``every_steps`` and ``on_preemption`` are decided from the state alone
  (``state.step``; ``state.preempted``, which every rank sees at the same
  micro-step): no collective ever.
- ``every_seconds`` and ``continuous`` are decided on rank 0's clock and
  agreed by one broadcast at *act steps* only: rank 0 turns seconds into a
  number of steps from its measured step time, and every rank acts again that
  many steps later. At an act step the run saves (that step pays the save's
  own exchanges anyway) or, when rank 0 finds the deadline not reached (the
  steps got faster) or the last save not committed yet, agrees on a new act
  step. A process's first ``every_seconds`` act comes one step after its first
  call, to measure a step; ``continuous`` acts at its first call, then as
  many steps after each save as its last save took to commit (or its pace,
  below, if longer), so the next save starts at the first boundary after the
  last one committed. One process
  needs no agreement and reads its own clock at every call.

Pace. The snapshot a save takes (every tensor copied to CPU memory) is the
part the loop waits for. A continuous save therefore also waits until the
calling thread has spent 20 times the last snapshot's CPU time since that
save started (CPU time, not the wall clock: under load, or while rank 0
waits for a slower rank in the save's first exchange, the wall clock runs
without the loop working), so snapshots take at most 5% of the loop's own
time: with a large model on a slow disk the commit decides, with a small
model on ``/dev/shm`` the pace.

Rotation runs on the save's own thread right after the commit, on the ranks
that wrote the shared files (`fnaccel.checkpoint.saveload.start_save`). It deletes
only ``step_<n>`` children of the policy's directory that are fnaccel
checkpoints holding nothing but the files their manifest lists (what
`fa.save` may replace), never one a live save holds, never anything else in
the directory; then the marked leftovers of crashed saves there.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fnaccel import ops
from fnaccel.calls import collective
from fnaccel.checkpoint.manifest import MANIFEST, target_problem
from fnaccel.checkpoint.saveload import start_save
from fnaccel.checkpoint.storage.files import discard, locked, remove_leftovers, sibling_stem
from fnaccel.checkpoint.writer import SaveHandle
from fnaccel.checks import check_value, is_int, is_number, require
from fnaccel.state import RunState

__all__ = ["AnySavePolicy", "SavePolicy", "autosave", "save_policy"]

_NAME = re.compile(r"step_(\d+)")
_RESOURCE = "autosave"
_clock = time.monotonic  # the clock every_seconds and continuous read (rank 0's decides)
# What a snapshot costs the loop: this thread's CPU time, not the wall clock, which would also count
# the wait for a slower rank in the save's first exchange (time the next step would wait anyway)
_work_clock = time.thread_time
# A continuous save starts once the loop's thread spent this many times the last snapshot's CPU time
# since that save started: snapshots then take at most 1/20 = 5% of it, however fast the saves are.
_PACE = 20


def _directories(value: Any) -> tuple[Path, ...]:
    """``directories`` as a tuple of paths: one path, or a non-empty sequence of distinct ones."""
    expected = "a directory (a str or os.PathLike) or a non-empty list or tuple of them"
    items = (value,) if isinstance(value, (str, os.PathLike)) else value
    check_value(
        "save_policy: directories",
        value,
        isinstance(items, (list, tuple)) and len(items) > 0,
        expected,
        "e.g. directories='/dev/shm/run' or directories=('ckpt_a', 'ckpt_b')",
    )
    for item in items:
        ok = isinstance(item, (str, os.PathLike)) and isinstance(os.fspath(item), str)
        check_value(
            "save_policy: directories",
            value,
            ok and os.fspath(item) != "",
            expected,
            f"{item!r} is not a directory's path",
        )
    paths = tuple(Path(item) for item in items)
    seen = [os.path.normpath(path) for path in paths]
    check_value(
        "save_policy: directories",
        value,
        len(set(seen)) == len(seen),
        "distinct directories",
        "give each directory once",
    )
    return paths


@dataclass(frozen=True, slots=True, kw_only=True)
class SavePolicy:
    """When a run saves and which checkpoints it keeps, in its directories; built by `save_policy`.

    Attributes:
        every_steps: save when ``state.step`` is a multiple of it.
        every_seconds: save when this many seconds (rank 0's clock) passed since the last save.
        on_preemption: save when the run's preemption agreement stops it (`PreemptionKwargs`).
        continuous: start the next save as soon as the last one committed (paced: snapshots
            take at most 5% of the loop's time).
        keep_last: keep the newest this many checkpoints (None: all).
        keep_every: also keep the first checkpoint at or after each multiple of this many steps.
        directories: where the checkpoints go (``step_<n>`` in each).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    on_preemption: bool = True
    continuous: bool = False
    keep_last: int | None = None
    keep_every: int | None = None
    directories: tuple[Path, ...]

    def __post_init__(self) -> None:
        name = "save_policy: "
        for field in ("every_steps", "keep_last", "keep_every"):
            value = getattr(self, field)
            check_value(
                name + field, value, value is None or (is_int(value) and value >= 1), "None or an int >= 1"
            )
        seconds = self.every_seconds
        check_value(
            name + "every_seconds",
            seconds,
            seconds is None or (is_number(seconds) and math.isfinite(seconds) and seconds > 0),
            "None or a number of seconds > 0",
        )
        for field in ("on_preemption", "continuous"):
            check_value(
                name + field, getattr(self, field), isinstance(getattr(self, field), bool), "True or False"
            )
        object.__setattr__(self, "directories", _directories(self.directories))
        check_value(
            name + "continuous",
            self.continuous,
            not (self.continuous and (self.every_steps is not None or self.every_seconds is not None)),
            "False when every_steps or every_seconds is given",
            "a continuous policy saves whenever the last save has committed, so an interval adds "
            "nothing; compose two policies with | to save elsewhere on another rule",
        )
        require(
            self.on_preemption
            or self.continuous
            or self.every_steps is not None
            or self.every_seconds is not None,
            "save_policy: this policy never saves (on_preemption=False, and no every_steps, every_seconds or "
            "continuous=True): give one of them",
        )
        if self.keep_every is not None:
            check_value(
                name + "keep_every",
                self.keep_every,
                self.keep_last is not None,
                "given with keep_last",
                "without keep_last every checkpoint is kept anyway",
            )
            check_value(
                name + "keep_every",
                self.keep_every,
                self.every_steps is None or self.keep_every % self.every_steps == 0,
                f"a multiple of every_steps={self.every_steps}",
                "otherwise the steps it keeps are not the ones saved",
            )

    @property
    def policies(self) -> tuple[SavePolicy, ...]:
        """The members: this policy alone."""
        return (self,)

    def __or__(self, other: SavePolicy | AnySavePolicy) -> AnySavePolicy:
        if not isinstance(other, (SavePolicy, AnySavePolicy)):
            return NotImplemented
        return AnySavePolicy(policies=self.policies + other.policies)

    def __repr__(self) -> str:
        defaults = {
            "every_steps": None,
            "every_seconds": None,
            "on_preemption": True,
            "continuous": False,
            "keep_last": None,
            "keep_every": None,
        }
        given = [
            f"{k}={getattr(self, k)!r}" for k, default in defaults.items() if getattr(self, k) != default
        ]
        places = [str(path) for path in self.directories]
        shown = repr(places[0]) if len(places) == 1 else repr(tuple(places))
        return f"save_policy({', '.join([*given, f'directories={shown}'])})"


@dataclass(frozen=True, slots=True, kw_only=True)
class AnySavePolicy:
    """Policies composed with ``|``: the run saves whenever any member says so, each member
    into its own directories with its own rotation (no directory in two members).

    Attributes:
        policies: the members, in the order composed (list the fastest tier first).
    """

    policies: tuple[SavePolicy, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", tuple(self.policies))
        check_value(
            "AnySavePolicy: policies",
            self.policies,
            len(self.policies) >= 2 and all(isinstance(p, SavePolicy) for p in self.policies),
            "two or more SavePolicy values",
            "compose them with fa.save_policy(...) | fa.save_policy(...)",
        )
        seen: dict[str, int] = {}
        for index, policy in enumerate(self.policies):
            for path in policy.directories:
                owner = seen.setdefault(os.path.normpath(path), index)
                check_value(
                    "save_policy: directories",
                    str(path),
                    owner == index,
                    "in one composed policy only",
                    "each member rotates its own directories, so two would delete each other's "
                    "checkpoints; give each member a directory of its own",
                )

    @property
    def directories(self) -> tuple[Path, ...]:
        """Every member's directories, in order: the tiers for `fa.latest_checkpoint`."""
        return tuple(path for policy in self.policies for path in policy.directories)

    def __or__(self, other: SavePolicy | AnySavePolicy) -> AnySavePolicy:
        if not isinstance(other, (SavePolicy, AnySavePolicy)):
            return NotImplemented
        return AnySavePolicy(policies=self.policies + other.policies)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


def save_policy(
    *,
    every_steps: int | None = None,
    every_seconds: float | None = None,
    on_preemption: bool = True,
    continuous: bool = False,
    keep_last: int | None = None,
    keep_every: int | None = None,
    directories: str | os.PathLike[str] | list[Any] | tuple[Any, ...],
) -> SavePolicy:
    """When to save, where, and which checkpoints to keep: an immutable value for `autosave`.

    Compose policies with ``|`` (any of them saves, each into its own
    directories): ``fast | slow`` is a RAM tier and a disk tier. Print a policy
    to read it back; equal arguments give equal (and equally hashed) policies.

    Args:
        every_steps: save when ``state.step`` is a multiple of it (decided from
            the state: no collective).
        every_seconds: save when this many seconds passed since the last save,
            on rank 0's clock (agreed at the steps that save; see the module).
        on_preemption: save, before `autosave` returns, when the run's
            preemption agreement stopped `fa.batches` (`PreemptionKwargs`).
        continuous: start the next asynchronous save as soon as the last one
            committed, and once the loop's thread spent 20 times the last
            snapshot's CPU time since it started, so that snapshots take at
            most 5% of the loop's time (not with ``every_steps`` or
            ``every_seconds``).
        keep_last: after each save, keep the newest this many ``step_<n>``
            checkpoints in each directory and delete older ones fnaccel wrote
            (None keeps all).
        keep_every: with ``keep_last``, also keep the first checkpoint at or
            after each multiple of this many steps (a multiple of
            ``every_steps`` when that is given).
        directories: where the checkpoints go, ``<directory>/step_<n>``: one
            directory, or several that each get every save.

    Returns:
        A `SavePolicy`.

    Raises:
        ValueError: naming the argument: a count that is not an int >= 1 (a
            bool included), seconds not > 0, a flag not a bool, ``continuous``
            with an interval, a policy that never saves, ``keep_every`` without
            ``keep_last`` or not a multiple of ``every_steps``, ``directories``
            empty, not paths, or repeated.

    >>> import fnaccel as fa
    >>> ram = fa.save_policy(continuous=True, keep_last=1, directories="/dev/shm/run")
    >>> disk = fa.save_policy(every_steps=500, keep_last=2, keep_every=5000, directories="ckpt")
    >>> ram | disk  # doctest: +NORMALIZE_WHITESPACE
    save_policy(continuous=True, keep_last=1, directories='/dev/shm/run')
    | save_policy(every_steps=500, keep_last=2, keep_every=5000, directories='ckpt')
    >>> disk == fa.save_policy(every_steps=500, keep_last=2, keep_every=5000, directories=["ckpt"])
    True
    >>> [str(path) for path in (ram | disk).directories]
    ['/dev/shm/run', 'ckpt']
    >>> fa.save_policy(every_steps=0, directories="ckpt")
    Traceback (most recent call last):
    ValueError: save_policy: every_steps must be None or an int >= 1, got 0
    """
    return SavePolicy(
        every_steps=every_steps,
        every_seconds=every_seconds,
        on_preemption=on_preemption,
        continuous=continuous,
        keep_last=keep_last,
        keep_every=keep_every,
        directories=_directories(directories),
    )


def _rotate(directory: Path, policy: SavePolicy, newest: Path) -> None:
    """Delete the ``step_<n>`` checkpoints ``policy`` does not keep (only fnaccel's own, never
    one a live save holds), then the marked leftovers of crashed saves in ``directory``."""
    assert policy.keep_last is not None
    found: list[tuple[int, Path]] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _NAME.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False) and os.path.isfile(Path(entry.path) / MANIFEST):
                found.append((int(match.group(1)), Path(entry.path)))
    found.sort()
    keep = {path for _, path in found[-policy.keep_last :]} | {newest}
    if policy.keep_every is not None:
        firsts: dict[int, Path] = {}
        for step, path in found:
            if step >= policy.keep_every:  # the first at or after each multiple (step 0 is never saved)
                firsts.setdefault(step // policy.keep_every, path)
        keep |= set(firsts.values())
    for _, path in found:
        lock = directory / f".{sibling_stem(path.name)}.lock"
        if path not in keep and target_problem(path) is None and not locked(lock):
            discard(path, MANIFEST)
    remove_leftovers(directory, r"step_\d+")


class _Progress:
    """One member's live bookkeeping in a run (rank 0's clocks are read on rank 0 only)."""

    __slots__ = (
        "act_at",
        "handle",
        "last_saved",
        "mark",
        "save_seconds",
        "since",
        "snapshot_seconds",
        "started",
        "work_mark",
        "work_started",
    )

    def __init__(self) -> None:
        self.last_saved: int | None = None  # the step this member last saved
        self.act_at: int | None = None  # the step of the next agreement (timed members, several processes)
        self.since = 0.0  # when the last save started (or the first call)
        self.mark: tuple[float, int] | None = None  # (time, step) of the last agreement: the step time
        self.work_mark = (0.0, 0)  # (this thread's CPU time, step) then: the step's CPU time
        self.handle: SaveHandle | None = None  # the member's last save
        self.started = 0.0  # when that save was started
        self.work_started = 0.0  # this thread's CPU time then
        self.save_seconds: float | None = None  # how long it took to commit, as first seen here
        self.snapshot_seconds = 0.0  # this thread's CPU time starting it took (continuous members: the pace)

    def observe(self, now: float) -> None:
        """Note when the last save was first seen committed (a thread's liveness: no wait)."""
        if self.save_seconds is None and self.handle is not None and self.handle.done():
            self.save_seconds = now - self.started


class Autosaves:
    """The run's `autosave` bookkeeping, a live resource keyed by member policy (``"autosave"``)."""

    __slots__ = ("_members",)

    def __init__(self) -> None:
        self._members: dict[SavePolicy, _Progress] = {}

    def progress(self, policy: SavePolicy, state: RunState, now: float) -> _Progress:
        found = self._members.get(policy)
        if found is None:
            for directory in policy.directories:  # once per member: a checkpoint is not a directory of them
                if os.path.lexists(directory / MANIFEST):
                    raise ValueError(
                        f"fa.autosave: directories: {directory} is a checkpoint itself; give the "
                        "directory that should hold the policy's step_<n> checkpoints"
                    )
            found = self._members[policy] = _Progress()
            found.since = now
            found.mark = (now, state.step)
            found.work_mark = (_work_clock() if policy.continuous else 0.0, state.step)
            # continuous: agree at once (the first save); every_seconds: one step later, to time a step
            found.act_at = state.step if policy.continuous else state.step + 1
        return found

    def close(self) -> None:
        """Nothing to release: the saves are the queue's (closed by `fa.shutdown`)."""
        self._members.clear()


def _decide(policy: SavePolicy, progress: _Progress, step: int, now: float, saves: bool) -> tuple[bool, int]:
    """Rank 0's verdict at an act step of a timed member: save now (surely when ``saves``: the
    member saves this step for another reason), and the steps to the next act."""
    assert progress.mark is not None
    mark_time, mark_step = progress.mark
    step_seconds = max((now - mark_time) / max(step - mark_step, 1), 1e-9)
    progress.mark = (now, step)
    if policy.continuous:
        progress.observe(now)
        work = _work_clock()
        work_mark, work_step = progress.work_mark
        step_work = max((work - work_mark) / max(step - work_step, 1), 1e-9)
        progress.work_mark = (work, step)
        pace = _PACE * progress.snapshot_seconds
        pace_left = progress.work_started + pace - work  # this thread's CPU time still to spend
        if (
            saves
            or progress.handle is None
            or (progress.save_seconds is not None and pace_left <= step_work / 2)
        ):
            commit = math.ceil((progress.save_seconds or step_seconds) / step_seconds)
            return True, max(1, commit, math.ceil(pace / step_work))
        # not committed yet: look again after as long again; committed: when the pace allows
        if progress.save_seconds is None:
            return False, max(1, math.ceil((now - progress.started) / step_seconds))
        return False, max(1, math.ceil(pace_left / step_work))
    assert policy.every_seconds is not None
    remaining = policy.every_seconds - (now - progress.since)
    if saves or remaining <= step_seconds / 2:
        return True, max(1, math.ceil(policy.every_seconds / step_seconds))
    return False, max(1, math.ceil(remaining / step_seconds))


def _due(policy: SavePolicy, progress: _Progress, state: RunState, now: float) -> bool | None:
    """Whether ``policy`` saves this step by what every rank knows alike; None when rank 0's
    clock decides (a timed member's act step on several processes)."""
    if progress.last_saved == state.step:
        return False
    if policy.on_preemption and state.preempted is not None:
        return True
    if policy.every_steps is not None and state.step % policy.every_steps == 0:
        return True
    if policy.every_seconds is None and not policy.continuous:
        return False
    if state.dist.num_processes == 1:
        if policy.continuous:
            return progress.handle is None or (
                progress.handle.done()
                and _work_clock() - progress.work_started >= _PACE * progress.snapshot_seconds
            )
        return now - progress.since >= policy.every_seconds  # type: ignore[operator]
    assert progress.act_at is not None
    return None if state.step >= progress.act_at else False


def _timed(policy: SavePolicy, state: RunState) -> bool:
    """Whether rank 0's clock schedules ``policy`` (and its saves also agree on its next act step)."""
    return (policy.continuous or policy.every_seconds is not None) and state.dist.num_processes > 1


def autosave(state: RunState, policy: SavePolicy | AnySavePolicy) -> RunState:
    """Consumes ``state``: save it when ``policy`` says so, and return the state to continue with.

    Call it once per batch, after `fa.step`, on every rank. It saves only at
    an update boundary and never step 0, into ``<directory>/step_<step>``, in
    the background (`fa.save(..., blocking=False)`: a save first waits for the
    one before it), except when the run was preempted: then every member with
    ``on_preemption`` saves before this returns, so the script may exit.
    After each save commits, the member's ``keep_last``/``keep_every``
    rotation deletes older ``step_<n>`` checkpoints fnaccel wrote there. Ranks
    agree without any collective on steps where nothing is due (see
    `fnaccel.checkpoint.policy` for the rule per setting).

    Args:
        state: the run's state after a step (not consumed before).
        policy: a `save_policy` value, or several composed with ``|``.

    Returns:
        The state to continue with (the same run, not yet consumed).

    Raises:
        StaleStateError: ``state`` was already consumed.
        TypeError: ``policy`` is not a `save_policy` value.
        ValueError: one of the policy's directories is a checkpoint itself.
        CheckpointError: a save failed (as `fa.save`'s, on every rank).

    >>> import fnaccel as fa, torch, tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> model = torch.nn.Linear(2, 1)
    >>> data = torch.utils.data.TensorDataset(torch.randn(12, 2))
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1),
    ...                    torch.utils.data.DataLoader(data, batch_size=2), loss_fn=lambda m, b: m(b[0]).sum())
    >>> policy = fa.save_policy(every_steps=2, keep_last=2, directories=root)
    >>> for batch in fa.batches(state, epochs=1):
    ...     state, _ = fa.step(state, batch)
    ...     state = fa.autosave(state, policy)
    >>> fa.shutdown(state)
    >>> sorted(path.name for path in root.iterdir())
    ['step_4', 'step_6']
    >>> fa.latest_checkpoint(*policy.directories).name
    'step_6'
    """
    state.check_fresh("fa.autosave")
    if not isinstance(policy, (SavePolicy, AnySavePolicy)):
        raise TypeError(
            f"fa.autosave: policy must be a fa.save_policy(...) value (or several joined with |), "
            f"got {policy!r}"
        )
    window = state.plan.micro_steps if state.plan is not None else 1
    if state.step > 0 and state.micro_step % window == 0:
        _save_due(state, policy.policies)
    return state.advance("fa.autosave")


def _save_due(state: RunState, members: tuple[SavePolicy, ...]) -> None:
    """Save for each member due at this update boundary (agreeing first where needed)."""
    book: Autosaves = state.resources.get(_RESOURCE) or state.resources.register(_RESOURCE, Autosaves())
    now = _clock()
    ctx = state.dist
    verdicts: dict[SavePolicy, bool] = {}
    acting: list[tuple[SavePolicy, bool]] = []
    progress = {policy: book.progress(policy, state, now) for policy in members}
    for policy in members:
        if ctx.is_main_process:
            progress[policy].observe(now)
        due = _due(policy, progress[policy], state, now)
        if due is not False and _timed(policy, state):
            acting.append((policy, due is True))
        else:
            verdicts[policy] = bool(due)
    if acting or any(verdicts.values()):  # alike on every rank: they all act here, or none does
        _act(state, progress, verdicts, acting, now)


@collective("fa.autosave")
def _act(
    state: RunState,
    progress: dict[SavePolicy, _Progress],
    verdicts: dict[SavePolicy, bool],
    acting: list[tuple[SavePolicy, bool]],
    now: float,
) -> None:
    """The collective part of `_save_due`: rank 0's verdicts for the timed members (one
    broadcast), then the saves. A collective fnaccel call: on a distributed run the ranks
    first agree they are all in it (a rank that called `autosave` alone is named, not waited
    for), as `fa.save` does."""
    ctx = state.dist
    if acting:  # rank 0's clock decides; one broadcast, on act steps only
        decisions = (
            [_decide(policy, progress[policy], state.step, now, saves) for policy, saves in acting]
            if ctx.is_main_process
            else [None] * len(acting)
        )
        decisions = ops.broadcast_object_list(ctx, [decisions], from_process=0)[0]
        for (policy, _), decision in zip(acting, decisions, strict=True):
            assert decision is not None  # rank 0's, broadcast
            save, steps = decision
            progress[policy].act_at = state.step + steps
            verdicts[policy] = save
    preempted = state.preempted is not None
    for policy, save in verdicts.items():
        if not save:
            continue
        rotate = (
            None
            if policy.keep_last is None
            else (lambda committed, member=policy: _rotate(committed.parent, member, committed))
        )
        mine = progress[policy]
        began = _work_clock() if policy.continuous else 0.0
        mine.work_started = began
        for directory in policy.directories:
            mine.handle = start_save(
                state,
                directory / f"step_{state.step}",
                blocking=preempted and policy.on_preemption,
                after_commit=rotate,
            )
        if policy.continuous:
            mine.snapshot_seconds = _work_clock() - began
        mine.last_saved, mine.since, mine.started, mine.save_seconds = state.step, now, now, None
