"""`fa.save` and `fa.load`: everything a run needs to continue bit for bit.

Layout (all tensors in safetensors, everything else JSON or YAML; no pickle)::

    fnaccel.json            manifest: schema, world size, counters, tied aliases,
                            checksum and size of every other file (written last)
    model.safetensors       the weights, tied tensors once        (rank 0)
    optimizer.safetensors   optimizer state keyed "<param>/<key>" (rank 0)
    optimizer.json          its class, param groups, other state   (rank 0)
    scheduler.json          the scheduler's class and state_dict   (rank 0)
    config.yaml             the resolved launch config             (rank 0)
    run.json                pipeline, precision, accumulation count, versions (rank 0)
    rank<r>.safetensors     this rank's generators, gradients accumulated so
                            far when the save falls between micro-steps
    rank<r>.json            this rank's Python/NumPy generators, data position,
                            transform states

    extras.safetensors/.json  objects registered for checkpointing (rank 0)

That is the plain layout. Which files hold the model and the optimizer is the
run's checkpoint layout (layouts/), chosen once per save or load from what
the pipeline declares: an fsdp() run has no model.safetensors, optimizer.* or
gradients, each rank writing the shards it holds through
torch.distributed.checkpoint instead (layouts/sharded.py)::

    sharded/rank<r>.safetensors  rank r's chunks of parameters and optimizer state
    sharded/metadata.json        DCP's index: shapes, dtypes, chunks, their files (rank 0)
    sharded/state.json           optimizer class, param groups, non-tensor state (rank 0)

and a DeepSpeed ZeRO run each rank's optimizer partitions (layouts/zero.py).

Rank 0 writes the shared files; every rank writes its own; rank 0 then writes
the manifest and moves the directory into place atomically (writer.py,
files.commit). With ProjectConfiguration(save_on_each_node=True) every
machine's first process does rank 0's part on that machine's disk.

A load reads and checks every file (manifest.py, storage/files.py, storage/parts.py) before
it restores anything, so a checkpoint that does not fit leaves the state fresh.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fnaccel import ops
from fnaccel._errors import CheckpointError
from fnaccel.calls import collective
from fnaccel.checkpoint import extras as extras_codec
from fnaccel.checkpoint.manifest import ResumeDriftWarning, read_manifest, resume_drift, target_problem
from fnaccel.checkpoint.project import (
    DEFAULT_PROJECT,
    ProjectConfiguration,
    next_checkpoint,
    project_dir_of,
    rotate,
)
from fnaccel.checkpoint.storage.files import SaveLock, read_json, read_tensors
from fnaccel.checkpoint.storage.layout import CheckpointLayout
from fnaccel.checkpoint.storage.parts import (
    check_kind,
    check_like,
    derived_generators,
    rank_payload,
    refuse_moved_gradients,
    rng_from,
    scheduler_payload,
    source_rank,
)
from fnaccel.checkpoint.storage.plain import layout_for
from fnaccel.checkpoint.writer import (
    SaveHandle,
    SaveQueue,
    first_nonfinite,
    take_snapshot,
    write_snapshot,
)
from fnaccel.dist import DistContext
from fnaccel.rng import RNGState
from fnaccel.state import DataPosition, RunState

__all__ = ["load", "save", "start_save"]


def _target(path: Path) -> Path:
    """Where a save to ``path`` goes: through a symbolic link (``latest -> checkpoint_3``)
    to the directory it names, which is replaced whole while the link stays."""
    final = path.absolute()
    return final.resolve() if os.path.islink(final) else final  # False for a name too long: refused next


def save(
    state: RunState, path: str | Path | None = None, *, blocking: bool = True, allow_nonfinite: bool = False
) -> SaveHandle:
    """Write a checkpoint of ``state`` (the state is not consumed); every rank calls it.

    Atomic: a crash, or ``kill -9``, leaves either the old checkpoint or the
    new one at ``path``, never a mix. A save first waits for the run's
    previous one (and re-raises its error). It replaces only what fnaccel
    wrote: ``path`` must be new, an empty directory, or an fnaccel checkpoint
    holding only its own files (a symbolic link is followed: the checkpoint
    it names is replaced, the link stays). It removes what earlier crashed
    saves to ``path`` left beside it. The checkpoint it replaces is deleted
    after the new one is in place, beside the run (the save's handle's
    thread), so that it costs the save nothing.

    Args:
        state: the run's state.
        path: the checkpoint directory; None with
            ``ProjectConfiguration(automatic_checkpoint_naming=True)`` picks
            ``<project_dir>/checkpoints/checkpoint_<n>``.
        blocking: False snapshots the state to the CPU now and writes it on a
            background thread while training goes on; ``handle.wait()`` (or
            the next save, or `fa.shutdown`) waits for it and raises its error.
            The snapshot's CPU buffers are kept for the run's next asynchronous
            save (copying into touched memory is several times faster) and
            released by `fa.shutdown`.
        allow_nonfinite: write the checkpoint even when a parameter or an
            optimizer moment holds NaN or inf (to inspect
            a diverged run). Its manifest records it (``"finite": false``) and
            `fa.latest_checkpoint` passes it over while a finite one exists.

    Returns:
        A `SaveHandle`. When ``blocking`` the checkpoint is in place; the
        handle's ``wait()`` (or the next save, or `fa.shutdown`) also waits
        for the deletion of the one it replaced.

    Raises:
        StaleStateError: ``state`` was already consumed.
        CheckpointError: ``path`` is a file or a directory that is not an
            fnaccel checkpoint (nothing is written); a value cannot be stored
            without pickle; the write failed (a full disk: its partial
            directory is removed first); a parameter or optimizer moment
            holds NaN or inf (named, on every rank; nothing is written) and
            ``allow_nonfinite`` is False.
        TypeError: ``allow_nonfinite`` is not a bool.

    >>> import fnaccel as fa, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> (folder / "train_log.txt").write_text("epoch 1")
    7
    >>> fa.save(fa.init(cpu=True), folder)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fnaccel._errors.CheckpointError: ... is a directory that is not an fnaccel checkpoint; ...
    >>> fa.save(fa.init(cpu=True), folder / "ckpt").path.name
    'ckpt'
    """
    if state.dist.num_processes > 1:  # only then may another rank be elsewhere: agree first
        return _agreed_save(state, path, blocking=blocking, allow_nonfinite=allow_nonfinite)
    return start_save(state, path, blocking=blocking, allow_nonfinite=allow_nonfinite)


def start_save(
    state: RunState,
    path: str | Path | None,
    *,
    blocking: bool,
    allow_nonfinite: bool = False,
    after_commit: Callable[[Path], None] | None = None,
) -> SaveHandle:
    """`save`, then ``after_commit(path)`` on the ranks that wrote the shared files, once the
    checkpoint is in place and before the save's handle is done (`fa.autosave`'s rotation);
    its error fails the save on every rank, naming the checkpoint as saved."""
    state.check_fresh("fa.save")
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"fa.save: allow_nonfinite must be True or False, got {allow_nonfinite!r}")
    saves: SaveQueue = state.resources.get("saves") or state.resources.register("saves", SaveQueue())
    saves.wait()
    project: ProjectConfiguration = state.kwargs_handlers.get("ProjectConfiguration", DEFAULT_PROJECT)
    # the project directory only where a save uses it: naming the checkpoint, or rotating
    project_dir = project_dir_of(state, project) if path is None or project.total_limit else None
    if path is None:
        if not (project.automatic_checkpoint_naming and project_dir is not None):
            raise ValueError(
                "fa.save: give a path, or use ProjectConfiguration(project_dir=..., "
                "automatic_checkpoint_naming=True) in fa.init's kwargs_handlers"
            )
        path = next_checkpoint(project_dir)
    final = _target(Path(path))
    ctx = state.dist
    writer = ctx.rank == 0 or (project.save_on_each_node and ctx.local_rank == 0)
    problem, lock = None, None
    if writer:  # a target it may not replace or write in, or one another live save holds, is refused
        problem = target_problem(final)
        taken = SaveLock.take(final) if problem is None else None
        problem, lock = (taken, None) if isinstance(taken, str) else (problem, taken)
        problem = None if problem is None else f"fa.save: {problem}"
    try:  # every rank (a ZeRO-3 snapshot is collective); a value it cannot store is this rank's problem
        snap = take_snapshot(
            state, layout_for(state), writer, project.save_on_each_node, None if blocking else saves
        )
    except CheckpointError as exc:
        problem = problem or str(exc)
    nonfinite = first_nonfinite(state)  # this rank's tensors (its shards): NaN or inf?
    # one exchange: rank 0's token for the temporary directory, and every rank's verdicts
    mine = (uuid.uuid4().hex if ctx.rank == 0 else None, problem, nonfinite)
    votes = ops.gather_object(ctx, [mine]) if ctx.num_processes > 1 else [mine]
    token = votes[0][0]
    assert token is not None  # rank 0's, made above (gather_object keeps each rank's entry's type)
    problem = next((problem for _, problem, _ in votes if problem is not None), None)
    bad = next(((rank, what) for rank, (_, _, what) in enumerate(votes) if what is not None), None)
    if problem is None and bad is not None and not allow_nonfinite:
        where = f" on rank {bad[0]}" if ctx.num_processes > 1 else ""
        problem = (
            f"fa.save: {bad[1]} holds NaN or inf values{where}; nothing was written: a checkpoint "
            "of a diverged run would be loaded on restart (fa.latest_checkpoint) and rotation would "
            "delete finite ones before it. Save before the values went bad (fa.skip_nonfinite skips "
            "such updates), or pass fa.save(..., allow_nonfinite=True) to write it anyway, marked "
            "as non-finite"
        )
    if problem is not None:
        if lock is not None:
            lock.release()
        raise CheckpointError(problem)
    snap.manifest["finite"] = bad is None

    def on_commit(committed: Path) -> None:
        automatic = project_dir is not None and committed.parent == project_dir / "checkpoints"
        if project.total_limit is not None and automatic:
            assert project_dir is not None
            rotate(project_dir, project.total_limit, committed)
        if after_commit is not None:
            after_commit(committed)

    def write(on: DistContext, remove: Callable[[Callable[[], None]], None]) -> None:
        try:
            write_snapshot(snap, on, final, token, on_commit, lock, remove)
        finally:
            if lock is not None:
                lock.release()

    if blocking:  # the replaced checkpoint is deleted beside the run, on the handle's thread
        removals: list[Callable[[], None]] = []
        write(ctx, removals.append)
        return saves.removing(final, removals)
    background = saves.background_ctx(ctx)
    return saves.start(final, lambda: write(background, lambda remove: remove()))


def _rank_files(
    state: RunState, directory: Path, manifest: dict[str, Any], allow_global_batch_change: bool, strict: bool
) -> tuple[dict[str, Any], dict[str, torch.Tensor], RNGState, DataPosition]:
    """This rank's file pair (rank 0's for a rank the saving run did not have: `source_rank`),
    checked: generators, transform states, the data position, and the gradients (which
    the layout checks against the model). Returns ``(rank<r>.json, gradients by
    parameter name, generators, data position)``."""
    rank = source_rank(manifest, state.dist)
    source = str(directory / f"rank{rank}.json")
    tensor_source = str(directory / f"rank{rank}.safetensors")
    tensors = read_tensors(directory, f"rank{rank}.safetensors", manifest)
    own = read_json(directory, f"rank{rank}.json", manifest)
    _, live = rank_payload(state)  # what this rank would save now: the file must be shaped so
    check_like(own, live, source, depth=1)
    rng = rng_from(tensors, own["rng"], state.rng, source)
    if rank != state.dist.rank:
        rng = derived_generators(rng, state.dist.rank)
    position = _data_position(
        own["data"], live["data"], manifest, state, Path(source), allow_global_batch_change
    )
    grads = {key.removeprefix("grad/"): t for key, t in tensors.items() if key.startswith("grad/")}
    refuse_moved_gradients(grads, manifest, state.dist, tensor_source)
    other = sorted(k for k in tensors if not k.startswith(("grad/", "rng/torch", "rng/cuda/")))
    if other:
        raise CheckpointError(f"{tensor_source}: key {other[0]!r} is not a generator state or a gradient")
    if not strict:  # a transform this run dropped (fp16's grad scaler, resuming in bf16): its state goes too
        own["transforms"] = {
            name: saved for name, saved in own["transforms"].items() if name in state.transform_states
        }
    for name, saved in own["transforms"].items():
        value = state.transform_states.get(name)
        if value is None or not callable(getattr(value, "load_state_dict", None)):
            raise CheckpointError(
                f"{source}: state for transform {name!r}, which this run's pipeline lacks; "
                "prepare the run with the pipeline that saved it, or fa.load(..., "
                "strict=False) to drop that state"
            )
        check_like(saved, value.state_dict(), f"{source}: transforms/{name}")
    return own, grads, rng, position


def _data_position(
    data: dict[str, Any],
    live: object,
    manifest: dict[str, Any],
    state: RunState,
    where: Path,
    allow_global_batch_change: bool,
) -> DataPosition:
    """The saved data position (checked against ``live``, this run's), refused when this
    run's loader would read it differently."""
    if data.get("layout", {}) is None and state.loader is not None:  # said better than "must be an object"
        raise CheckpointError(
            f"{where}: the checkpoint was saved without a loader but this run has one; "
            "prepare the loader after fa.load, or resume a run saved with its loader"
        )
    check_like(data, live, f"{where}: data", depth=1)
    epoch, num_batches, loader_state = manifest["epoch"], data["num_batches"], data["loader_state"]
    for key, value in (("epoch", epoch), ("num_batches", num_batches)):
        if type(value) is not int or value < 0:  # JSON's integers: a bool is not one
            raise CheckpointError(f"{where}: the data position's {key} must be an int >= 0, got {value!r}")
    if loader_state is not None and not isinstance(loader_state, dict):
        raise CheckpointError(f"{where}: the data position's loader_state must be a mapping or null")
    position = DataPosition(epoch=epoch, num_batches=num_batches, loader_state=loader_state)
    if state.loader is None:
        return position
    resumed: DataPosition = state.loader.resume_position(
        data["layout"], position, str(where), allow_global_batch_change=allow_global_batch_change
    )
    return resumed


def _check_drift(state: RunState, directory: Path, manifest: dict[str, Any], strict: bool) -> None:
    """Warn once naming every way this run is set up unlike the saved one; refuse what
    cannot resume exactly (another accumulation count) unless ``strict=False``."""
    drift = resume_drift(state, directory, manifest)
    inexact = [d for d in drift if not d.exact]
    if inexact and strict:
        raise CheckpointError(
            f"{directory}: this run cannot resume the checkpoint exactly: {'; '.join(map(str, inexact))}; "
            "prepare it as the run that saved it, or pass fa.load(..., strict=False) to resume anyway"
        )
    if drift:
        warnings.warn(
            f"fa.load: {directory} was saved by a run set up differently: {'; '.join(map(str, drift))}",
            ResumeDriftWarning,
            stacklevel=3,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Saved:
    """Everything `load` restores, read from a checkpoint and checked."""

    manifest: dict[str, Any]
    layout: CheckpointLayout
    model: object  # the layout's read of the model and optimizer, for its restore
    scheduler: dict[str, Any] | None
    transforms: dict[str, Any]
    rng: RNGState
    position: DataPosition
    extras: dict[str, Any]


def _scheduler(state: RunState, directory: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """``scheduler.json``'s state_dict, checked against the run's scheduler (None without one)."""
    if state.scheduler is None:
        return None
    saved = read_json(directory, "scheduler.json", manifest)
    source = str(directory / "scheduler.json")
    check_kind(saved, state.scheduler, source)
    live = scheduler_payload(state.scheduler)  # what this run would save: the file must be shaped so
    check_like(saved, live, source, depth=1)
    check_like(saved["state_dict"], live["state_dict"], f"{source}: state_dict")
    scheduler: dict[str, Any] = saved["state_dict"]  # an object: check_like held it to the live one
    return scheduler


def _extras(state: RunState, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The registered objects' saved states, checked against theirs."""
    if not state.extras:
        return {}
    trees = read_json(directory, "extras.json", manifest)
    extra_tensors = read_tensors(directory, "extras.safetensors", manifest)
    source = str(directory / "extras.json")
    extras: dict[str, Any] = {}
    for name, obj in state.extras.items():
        if not isinstance(trees, dict) or name not in trees:
            raise CheckpointError(f"{source}: nothing saved for registered object {name!r}")
        live = obj.state_dict()
        extras[name] = extras_codec.join(trees[name], extra_tensors, f"{source}: {name}")
        check_like(extras[name], live, f"{source}: {name}", strict=False)
    return extras


def _read(state: RunState, directory: Path, allow_global_batch_change: bool, strict: bool) -> _Saved:
    """Everything `load` restores, read from ``directory`` and checked; nothing is changed."""
    manifest = read_manifest(directory)
    own, grads, rng, position = _rank_files(state, directory, manifest, allow_global_batch_change, strict)
    layout = layout_for(state, manifest)
    model = layout.read(state, directory, manifest, grads)
    scheduler, extras = _scheduler(state, directory, manifest), _extras(state, directory, manifest)
    _check_drift(state, directory, manifest, strict)  # reads config.yaml and run.json, verified
    return _Saved(
        manifest=manifest,
        layout=layout,
        model=model,
        scheduler=scheduler,
        transforms=own["transforms"],
        rng=rng,
        position=position,
        extras=extras,
    )


_READ_ATTEMPTS = 3


def _identity(directory: Path) -> tuple[int, int] | None:
    """Which directory ``directory`` names now (a save replaces it by an atomic exchange)."""
    try:
        found = os.stat(directory)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _read_stable(state: RunState, directory: Path, allow_global_batch_change: bool, strict: bool) -> _Saved:
    """`_read`, again when a save replaced the checkpoint while it was read (files of the new
    one checked against the old manifest fail, though neither is corrupt); a checkpoint
    replaced at every try is refused as being replaced, never called corrupt."""
    error: CheckpointError | None = None
    for attempt in range(_READ_ATTEMPTS):
        before = _identity(directory)
        try:
            return _read(state, directory, allow_global_batch_change, strict)
        except CheckpointError as exc:
            if before is None or _identity(directory) == before:
                raise  # nothing replaced it: the error is the checkpoint's own
            error = exc
            time.sleep(0.05 * (attempt + 1))  # let the save that replaced it finish deleting the old one
    raise CheckpointError(
        f"{directory}: being replaced by a save while it was read, {_READ_ATTEMPTS} times in a row; load it "
        f"once that save is done (the last read: {error})"
    )


def load(
    state: RunState, path: str | Path, *, allow_global_batch_change: bool = False, strict: bool = True
) -> RunState:
    """Consumes ``state``: restore the checkpoint at ``path`` into its live objects.

    ``state`` must be prepared like the run that saved (same model, optimizer,
    scheduler, loader and pipeline); the rest of the run then continues bit
    for bit as if it had never stopped. On another number of processes the
    model and optimizer are resharded (an ``fsdp()`` checkpoint loads into an
    ``fsdp()`` or a replicated run), and the data continues with the same
    samples in the same global order when the global batch size
    (per-process batch x processes) is the saved one; see docs/checkpoints.md
    for what each rank's generators become. Every file is read (only regular
    files inside ``path``, each of the size its manifest says) and checked
    before anything is restored: a checkpoint that does not fit leaves
    ``state`` and its objects untouched (an ``fsdp()`` run's shards are the
    last thing read, and checked before they are written).

    A run set up differently from the one that saved (another pipeline,
    precision or launch config: ``run.json`` and ``config.yaml``) gets one
    `ResumeDriftWarning` naming each difference. What cannot resume exactly
    is refused unless ``strict=False``: another accumulation count (the
    counters are restored as saved), or saved state for a transform this run
    lacks (dropped with ``strict=False``). See docs/debugging.md.

    Args:
        state: a fresh state prepared like the run that saved (not consumed before).
        path: the checkpoint directory.
        allow_global_batch_change: load a data position saved with another
            global batch size: the run continues at the first batch of the new
            size that starts at or before the samples already consumed in the
            epoch (nothing is skipped; part of a batch may be read twice), and
            the rest of the epoch is cut into other batches than the saved run
            would have read.
        strict: False resumes across an accumulation count change and drops
            the state of transforms this run lacks (each still warned about).

    Returns:
        The successor state, at the checkpoint's step and data position.

    Raises:
        CheckpointError: naming the file (and the key): missing, truncated,
            corrupt, a symbolic link, FIFO or device, an unknown schema
            version, a field of the wrong type or range,
            missing or unexpected keys, mismatched shapes or dtypes, an
            optimizer or scheduler of another class, a different global batch
            size (unless allowed), gradients saved between micro-steps by
            another number of processes; with ``strict``, a resume
            that cannot be exact (named).
        TypeError: ``allow_global_batch_change`` is not a bool.

    >>> import fnaccel as fa, torch, tempfile, pathlib
    >>> def prepared():
    ...     model = torch.nn.Linear(1, 1)
    ...     return fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1))
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> fa.save(prepared().replace(step=3), path).path.name
    'ckpt'
    >>> fa.load(prepared(), path).step
    3
    """
    if state.dist.num_processes > 1:  # only then may another rank be elsewhere: agree first
        return _agreed_load(state, path, allow_global_batch_change=allow_global_batch_change, strict=strict)
    return _load(state, path, allow_global_batch_change=allow_global_batch_change, strict=strict)


def _load(state: RunState, path: str | Path, *, allow_global_batch_change: bool, strict: bool) -> RunState:
    """`load` on this rank, once the ranks agreed on the call."""
    by = "fa.load"
    state.check_fresh(by)
    if not isinstance(allow_global_batch_change, bool):
        raise TypeError(
            f"fa.load: allow_global_batch_change must be True or False, got {allow_global_batch_change!r}"
        )
    saved = _read_stable(state, Path(path).absolute(), allow_global_batch_change, strict)
    saved.layout.restore(
        state, saved.model
    )  # the model and the optimizer (a sharded run's: read here, checked)
    if saved.scheduler is not None:
        state.scheduler.load_state_dict(saved.scheduler)
    for name, value in saved.transforms.items():
        state.transform_states[name].load_state_dict(value)
    new = state.advance(
        by,
        rng=saved.rng,
        step=saved.manifest["step"],
        micro_step=saved.manifest["micro_step"],
        data_position=saved.position,
        seed=saved.manifest["seed"],
    )
    if state.loader is not None:
        state.loader.forget()  # the next fa.batches positions it from the loaded state
    for name, obj in state.extras.items():
        obj.load_state_dict(saved.extras[name])
    if new.plan is not None and new.model is not None and new.dist.num_processes > 1:
        new.plan.set_sync_for(new.model, new.micro_step)  # gradient communication, between processes
    return new


# the collective forms (`fnaccel.calls`): a run of several processes agrees on the call first
_agreed_save = collective("fa.save")(start_save)
_agreed_load = collective("fa.load")(_load)
