"""`verify_resume`: the resume preflight ``fnaccel test`` runs, for a user's own setup.

An uninterrupted run of the user's ``make_state`` trains ``(resumes + 1) * steps``
batches. A chain of runs covers the same batches in parts of ``steps``: the
first trains and saves; each later one is a fresh state that loads the last
checkpoint, trains its part and saves for the next. Every part must read the
batches the uninterrupted run read and reach the same losses, and the last one
must end where the uninterrupted run ended (`fa.diff` of the final states
empty). On the run's own number of processes all of it is bit for bit. A part
on another number of processes (rank 0 alone, inside a run of several) follows
DESIGN principle 5 instead: the same samples in the same global order, the
losses and the final parameters equal within ``atol``/``rtol``.

Resume bugs hide in the second and third resume of an epoch (a position saved
relative to the last load) and in a change of world size, so both are parts
of the chain, not separate runs. Every comparison is agreed across the ranks:
a failure on one rank raises on every rank, naming the rank.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from fnaccel import ops
from fnaccel.checkpoint.saveload import load, save
from fnaccel.checks import is_int
from fnaccel.data.prepared import batches
from fnaccel.debug.diff import Diff, diff
from fnaccel.runtime import shutdown
from fnaccel.state import RunState
from fnaccel.train import step

__all__ = ["train_steps", "verify_resume"]

# What a change of world size changes by design, left out of the final comparison then:
# each rank's generators (a rank's stream has no counterpart on another number of
# processes), the recorded world, and the pipeline and config that follow from it (ddp()).
_WORLD_SIZE_ITEMS = ("num_processes", "pipeline/", "config/")
# and the data layout's fields that `LoaderLayout.check_resume` lets differ on another number of
# processes: each rank's share of the global batch, the ranks sharing it, and the padding of a
# last global batch (one process never pads); the samples read are compared batch by batch
_WORLD_SIZE_LAYOUT = tuple(
    f"data/layout/{key}" for key in ("batch_size", "num_processes", "num_shards", "even_batches")
)


def train_steps(state: RunState, num_steps: int) -> tuple[RunState, list[torch.Tensor]]:
    """Consumes ``state``: step ``num_steps`` batches from its loader, across epochs;
    returns the new state and each batch's loss (tensors: no device sync)."""
    state, losses, _ = _train(state, num_steps)
    return state, losses


def _train(state: RunState, num_steps: int) -> tuple[RunState, list[torch.Tensor], list[list[object]]]:
    """`train_steps`, also returning each batch's leaves (on the CPU) to compare the data read."""
    if state.loader is None:
        raise ValueError(
            "verify_resume: make_state() must return a state prepared with a loader "
            "(fa.prepare(state, model, optimizer, loader, ...)); the check steps its batches"
        )
    losses: list[torch.Tensor] = []
    read: list[list[object]] = []
    while len(losses) < num_steps:
        before = len(losses)
        for batch in batches(state, epochs=state.epoch + 1):
            read.append(_leaves(batch))
            state, metrics = step(state, batch)
            losses.append(metrics["loss"].detach())
            if len(losses) == num_steps:
                break
        if len(losses) == before:
            raise ValueError("verify_resume: the prepared loader yields no batches")
    return state, losses, read


def _leaves(tree: object) -> list[object]:
    """A batch's leaves in order (tensors on the CPU), for comparing what two runs read."""
    if isinstance(tree, torch.Tensor):
        return [tree.detach().cpu()]
    if isinstance(tree, dict):
        return [leaf for key in tree for leaf in _leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def _same_leaves(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def _global_batch(per_rank: Sequence[list[object]]) -> list[object]:
    """The ranks' batches of one step concatenated in rank order: the global batch, which
    a run on another number of processes must read (DESIGN principle 5)."""
    return [
        torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0]
        for column in zip(*per_rank, strict=True)
    ]


def _shared_temporary(state: RunState) -> Path:
    """A fresh directory made by rank 0, named the same on every rank."""
    made = tempfile.mkdtemp(prefix="fnaccel-resume-") if state.dist.is_main_process else None
    shared = ops.broadcast_object_list(state, [made])[0]
    assert shared is not None  # rank 0's, made above
    return Path(shared)


@contextmanager
def _alone() -> Iterator[None]:
    """The launch environment of a world of one, for ``make_state()``'s `fa.init` on rank 0."""
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(
        WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0", GROUP_WORLD_SIZE="1"
    )
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    return (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b)) or a == b


def _world_size_differences(found: Diff) -> Diff:
    kept = tuple(
        d
        for d in found.differences
        if "/rng/" not in d.item
        and not d.item.startswith(_WORLD_SIZE_ITEMS)
        and not d.item.endswith(_WORLD_SIZE_LAYOUT)
    )
    return dataclasses.replace(found, differences=kept)


def _made(make_state: Callable[[], RunState]) -> RunState:
    """``make_state()``, checked to be a state."""
    state = make_state()
    if not isinstance(state, RunState):
        raise TypeError(
            f"verify_resume: make_state() must return a fa.RunState prepared with a loader "
            f"(fa.prepare(fa.init(...), model, optimizer, loader, ...)), got {type(state).__name__}"
        )
    return state


def _check_sizes(num_processes: Sequence[int] | None, resumes: int, n: int) -> list[int]:
    if num_processes is None:
        return [n] * resumes
    sizes = list(num_processes)
    if len(sizes) != resumes:
        raise ValueError(
            f"verify_resume: num_processes gives {len(sizes)} number(s) of processes for "
            f"{resumes} resume(s); give one per resume, e.g. {tuple([n] * resumes)}"
        )
    for i, size in enumerate(sizes):
        if size not in (1, n) or isinstance(size, bool):
            raise ValueError(
                f"verify_resume: num_processes[{i}] is {size!r}, but inside a run of {n} process(es) a resume "
                f"runs on all {n} or on 1 (rank 0 alone): fa.init cannot form a group over some of a running "
                f"group's ranks. Check {size!r} by loading a checkpoint in a World({size!r}) or a launch of "
                f"{size!r} processes"
            )
    return sizes


class _Chain:
    """The uninterrupted run's record and the comparisons of each resumed part against it."""

    def __init__(
        self,
        whole: RunState,
        losses: list[torch.Tensor],
        read: list[list[object]],
        steps: int,
        resumes: int,
        atol: float,
        rtol: float,
        world_size_changes: bool,
    ) -> None:
        self.whole, self.steps, self.resumes, self.atol, self.rtol = whole, steps, resumes, atol, rtol
        self.losses = [loss.item() for loss in losses]
        self.read = read
        # another number of processes compares with the global batches and mean losses: every rank's record
        self.everyone = ops.gather_object(whole, [(self.losses, read)]) if world_size_changes else None

    def where(self, resume: int, size: int) -> str:
        return (
            f"verify_resume: resume {resume} of {self.resumes} (at batch {resume * self.steps}, "
            f"on {size} process(es))"
        )

    def compare_part(
        self,
        resume: int,
        size: int,
        losses: list[torch.Tensor],
        read: list[list[object]],
        restored: Diff | None,
        exact: bool,
    ) -> str | None:
        """None, or what this rank's part did differently from the uninterrupted run, first difference first.
        ``exact``: no part so far ran on another number of processes, so the losses must be bit-equal
        (after one, the weights, and so the losses, are equal within the tolerance only)."""
        start = resume * self.steps
        same_world = size == self.whole.dist.num_processes
        for k, (loss, leaves) in enumerate(zip(losses, read, strict=True)):
            index = start + k
            if same_world:
                expected_leaves, expected = self.read[index], self.losses[index]
                data = f"batch {index + 1} reads other data than the uninterrupted run"
            else:
                assert self.everyone is not None
                expected_leaves = _global_batch([record[1][index] for record in self.everyone])
                expected = sum(record[0][index] for record in self.everyone) / len(self.everyone)
                data = (
                    f"batch {index + 1} reads other samples, or another order, than the uninterrupted run's "
                    f"global batch (its ranks' batches in rank order)"
                )
            if not _same_leaves(leaves, expected_leaves):
                return f"{self.where(resume, size)}: {data}: the data position was not restored{_lacks(restored)}"
            value = loss.item()
            if not (value == expected if exact else _close(value, expected, self.atol, self.rtol)):
                tolerance = "" if exact else f" (compared within atol={self.atol:g}, rtol={self.rtol:g})"
                against = (
                    "the uninterrupted run" if same_world else "the uninterrupted run's mean over its ranks"
                ) + tolerance
                hint = _lacks(restored) or (
                    "; the batches are the same and the loaded state equals the saved one, so something the "
                    "checkpoint does not hold changed the step (a generator or counter of your own, outside the "
                    "model, optimizer, scheduler and registered objects)"
                    if restored is not None
                    else ""
                )
                return (
                    f"{self.where(resume, size)}: batch {index + 1} after resuming at batch {start} has loss "
                    f"{value!r}, {against} {expected!r}{hint}"
                )
        return None

    def compare_end(self, resumed: RunState, changed: bool) -> str | None:
        if not changed:
            found = diff(self.whole, resumed)
        else:
            found = _world_size_differences(diff(self.whole, resumed, atol=self.atol, rtol=self.rtol))
        if not found:
            return None
        ignored = (
            " (after a change of world size, compared within float tolerance and without each rank's "
            "generators, the world size, the pipeline and the data layout's per-rank share)"
            if changed
            else ""
        )
        return (
            f"verify_resume: every batch of the resumed runs matches, but the final state differs from "
            f"the uninterrupted run's{ignored}:\n{found}"
        )


def _lacks(restored: Diff | None) -> str:
    """What the load did not restore (the loaded state against the one that saved), if anything."""
    return f"; the loaded state differs from the one that saved it:\n{restored}" if restored else ""


def _agree(state: RunState, message: str | None) -> None:
    """Raise the same AssertionError on every rank when any rank found a difference."""
    found = ops.gather_object(state, [message])
    failed = [(rank, text) for rank, text in enumerate(found) if text is not None]
    if not failed:
        return
    if len(failed) == 1 or len({text for _, text in failed}) == 1:
        prefix = "" if state.dist.num_processes == 1 else f"rank {failed[0][0]}: "
        raise AssertionError(prefix + failed[0][1])
    raise AssertionError("\n".join(f"rank {rank}: {text}" for rank, text in failed))


def verify_resume(
    make_state: Callable[[], RunState],
    *,
    steps: int,
    resumes: int = 1,
    num_processes: Sequence[int] | None = None,
    directory: str | Path | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Check that a run of ``make_state()`` resumes after `fa.save` / `fa.load`, again and again.

    ``make_state()`` must return a fresh, prepared state (model, optimizer,
    loader, any scheduler and pipeline), built the same way each time. An
    uninterrupted run trains ``(resumes + 1) * steps`` batches; a chain of
    fresh runs trains the same batches in parts of ``steps``, each part loading
    the checkpoint the one before saved. Every part must read the same batches
    and reach the same losses, and the final state must equal the
    uninterrupted run's (`fa.diff`: parameters, optimizer, scheduler, counters,
    every generator, the data position, transform and registered states).
    Every rank calls it; each state is shut down when the check ends.

    A resume on another number of processes (``num_processes``) follows
    DESIGN principle 5: the same samples in the same global order, the losses
    (the mean over the ranks) and the final state equal within ``atol`` /
    ``rtol`` rather than bit for bit, without each rank's generators. So it
    holds for a step that draws no random numbers (a rank's dropout stream
    has no counterpart on another number of processes), a ``make_state()``
    that keeps the global batch (``batch_size = global_batch // fa.init(...)
    .dist.num_processes``), and saves at accumulation boundaries.

    Args:
        make_state: builds the state, e.g. ``lambda: fa.prepare(fa.init(seed=0), ...)``.
        steps: batches in each part; a save between accumulation micro-steps
            is a good case to check, and ``(resumes + 1) * steps`` within one
            epoch checks resumes within an epoch.
        resumes: how many times the chain saves and resumes.
        num_processes: the number of processes of each resumed part, one per
            resume: this run's, or 1 (rank 0 alone while the other ranks wait);
            default: this run's for every part. Inside a `World` or a launch
            of 2, ``(1, 2)`` resumes on one process and then on two again.
        directory: where the checkpoints go, one subdirectory per resume
            (default: a temporary directory made by rank 0, removed
            afterwards; give a shared path when the machines share no /tmp).
        atol, rtol: the float tolerance after a change of world size (an
            element counts as equal when ``|a - b| <= atol + rtol * |b|``);
            the error says which it used.

    Raises:
        AssertionError: a resumed part differs, on every rank: which resume,
            the first batch that reads other data or has another loss, what
            the loaded state lacks against the state that saved it (`fa.diff`),
            or every differing item of the final states.
        ValueError: ``steps`` or ``resumes`` < 1, a ``num_processes`` that
            cannot run here, or a state without a loader.

    >>> import fnaccel as fa, torch
    >>> from fnaccel.testing import verify_resume
    >>> def make_state():
    ...     torch.manual_seed(0)
    ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    ...     data = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4, shuffle=True)
    ...     return fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.AdamW(model.parameters()),
    ...                       data, loss_fn=lambda m, b: m(b).pow(2).mean(), pipeline=fa.compose(fa.accumulate(3)))
    >>> verify_resume(make_state, steps=2, resumes=3)  # saves at batches 2, 4 and 6 of an epoch of 8
    """
    if not callable(make_state):
        raise TypeError(
            f"verify_resume: make_state must be a function returning a fresh, prepared state "
            f"(e.g. lambda: fa.prepare(fa.init(seed=0), ...)), got {type(make_state).__name__}"
        )
    for name, value in (("steps", steps), ("resumes", resumes)):
        if not is_int(value) or value < 1:
            raise ValueError(f"verify_resume: {name} must be an integer >= 1, got {value!r}")
    states: list[RunState] = []  # every run, shut down at the end
    created: Path | None = None
    try:
        whole = _made(make_state)
        states.append(whole)
        n, rank = whole.dist.num_processes, whole.dist.rank
        sizes = _check_sizes(num_processes, resumes, n)
        if directory is None:
            created = _shared_temporary(whole)
            root = created
        else:
            root = Path(directory)
        whole, losses, read = _train(whole, (resumes + 1) * steps)
        chain = _Chain(whole, losses, read, steps, resumes, atol, rtol, any(s != n for s in sizes))
        first = _made(make_state)
        states.append(first)
        current: RunState | None
        current, _ = train_steps(first, steps)
        save(current, root / "resume_1")
        previous_size = n
        for resume, size in enumerate(sizes, 1):
            checkpoint = root / f"resume_{resume}"
            if size == n:
                fresh = _made(make_state)
                states.append(fresh)
                loaded = load(fresh, checkpoint)
                # the state that saved is live here only when the part before ran on this world
                restored = diff(current, loaded) if previous_size == n and current is not None else None
                current, part_losses, part_read = _train(loaded, steps)
                exact = all(s == n for s in sizes[:resume])
                _agree(whole, chain.compare_part(resume, size, part_losses, part_read, restored, exact))
                if resume < resumes:
                    save(current, root / f"resume_{resume + 1}")
                previous_size = size
                continue
            # rank 0 alone: the others wait in the broadcast of its outcome
            outcome: str | None = None
            error: BaseException | None = None
            if rank == 0:
                try:
                    with _alone():
                        fresh = _made(make_state)
                    states.append(fresh)
                    current, part_losses, part_read = _train(load(fresh, checkpoint), steps)
                    outcome = chain.compare_part(resume, size, part_losses, part_read, None, exact=False)
                    if outcome is None and resume < resumes:
                        save(current, root / f"resume_{resume + 1}")
                except Exception as exc:  # re-raised here, and named on the waiting ranks
                    error, outcome = exc, f"{chain.where(resume, size)}: {type(exc).__name__}: {exc}"
            else:
                current = None  # this rank holds no state of the part on one process
            outcome = ops.broadcast_object_list(whole, [outcome])[0]
            if error is not None:
                raise error
            if outcome is not None:
                raise AssertionError(outcome)
            previous_size = size
        changed = any(s != n for s in sizes)
        if sizes[-1] == n:
            assert current is not None
            _agree(whole, chain.compare_end(current, changed))
        else:
            ended = chain.compare_end(current, changed) if current is not None else None
            _agree(whole, ended if rank == 0 else None)
    finally:
        if created is not None and states and states[0].dist.is_main_process:
            shutil.rmtree(created, ignore_errors=True)
        for state in states:
            shutdown(state)
