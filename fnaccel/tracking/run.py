"""`init_trackers`, `log`, `get_tracker`, `end_training`: the run's trackers, held in its state."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnaccel.checkpoint.project import project_of
from fnaccel.tracking.registry import registered_trackers
from fnaccel.tracking.trackers import BUILT_IN, GeneralTracker, resolve_trackers
from fnaccel.tracking.values import read_values

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["end_training", "get_tracker", "init_trackers", "log"]


def init_trackers(
    state: RunState,
    project_name: str,
    config: Mapping[str, object] | None = None,
    *,
    log_with: str | GeneralTracker | Iterable[str | GeneralTracker] = "jsonl",
    init_kwargs: Mapping[str, Mapping[str, object]] | None = None,
    logging_dir: str | os.PathLike[str] | None = None,
) -> RunState:
    """Opens the run's trackers; consumes nothing and returns the state holding them.

    Every rank calls it (and checks its arguments alike); only the main
    process opens files, the others get a state with no trackers. Calling it
    again closes the state's previous trackers first.

    Args:
        state: the run's state.
        project_name: the run's directory under the logging directory.
        config: hyperparameters each tracker records once (JSONL writes
            ``config.json``; TensorBoard adds hparams).
        log_with: a tracker's name (``"jsonl"``, ``"tensorboard"``, ``"wandb"``,
            ``"mlflow"``, ``"comet_ml"``, ``"aim"``, ``"clearml"``, ``"dvclive"``,
            ``"swanlab"``, ``"trackio"``, or one given to `register_tracker`),
            ``"all"`` (every installed built-in tracker), a `GeneralTracker`
            object, or a list of these.
        init_kwargs: keyword arguments for a named tracker, keyed by its
            name: ``{"tensorboard": {"flush_secs": 30}}``, ``{"wandb": {"mode": "offline"}}``.
        logging_dir: where the trackers write; default
            ``ProjectConfiguration.logging_dir``, else the project directory.
            A relative path is taken under the project directory when there is one.

    Returns:
        ``state`` with ``trackers`` set (empty off the main process).

    Raises:
        ValueError: an unknown tracker name, an empty or repeated ``log_with``,
            ``init_kwargs`` for a tracker not chosen, or no directory to log to.
        ImportError: a tracker named whose package is not installed (the
            message names the pip package and the fnaccel extra).

    >>> import json, tempfile, fnaccel as fa
    >>> from fnaccel.tracking import end_training, init_trackers, log
    >>> tmp = tempfile.TemporaryDirectory()
    >>> state = init_trackers(fa.init(cpu=True, project_dir=tmp.name), "demo", {"lr": 0.1})
    >>> log(state, {"loss": 0.5}, step=3)
    >>> end_training(state)
    >>> line = json.loads(open(f"{tmp.name}/demo/metrics.jsonl").read())
    >>> line["step"], line["values"]
    (3, {'loss': 0.5})
    >>> tmp.cleanup()
    """
    if not isinstance(project_name, str) or not project_name:
        raise ValueError(f"init_trackers: project_name must be a non-empty string, got {project_name!r}")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(
            f"init_trackers: config must be a dict, got {type(config).__name__} "
            "(for argparse arguments pass vars(args))"
        )
    registered = registered_trackers(state)
    chosen = resolve_trackers(log_with, registered)
    names = [c for c in chosen if isinstance(c, str)]
    kwargs = dict(init_kwargs or {})
    unused = sorted(set(kwargs) - set(names))
    if unused:
        raise ValueError(
            f"init_kwargs has keys {unused} but the built-in trackers chosen are {names}; "
            "key init_kwargs by the name of a tracker in log_with"
        )
    root = _logging_root(state, logging_dir) if names else None
    if not state.dist.is_main_process:
        return state
    opened: list[GeneralTracker] = []
    try:
        for item in chosen:
            if isinstance(item, str):
                assert root is not None
                made = registered.get(item) or BUILT_IN[item]
                item = made(project_name, root, **kwargs.get(item, {}))
            opened.append(item)
            if config is not None:
                item.store_init_configuration(config)
    except BaseException:
        for tracker in opened:
            tracker.finish()
        raise
    state.resources.register("trackers", OpenTrackers(opened))  # closes the old ones
    return state


class OpenTrackers(tuple[GeneralTracker, ...]):
    """The run's open trackers, registered with its resources; `fa.shutdown` closes them."""

    __slots__ = ()

    def close(self) -> None:
        for tracker in self:
            tracker.finish()


def _logging_root(state: RunState, logging_dir: str | os.PathLike[str] | None) -> Path:
    project, project_dir = project_of(state)
    chosen = logging_dir if logging_dir is not None else project.logging_dir
    if chosen is None and project_dir is None:
        raise ValueError(
            "init_trackers has no directory to write to: pass logging_dir=..., or give the run "
            "a project directory (fa.init(project_dir=...) or ProjectConfiguration)"
        )
    return Path(project_dir or ".") / (chosen or "")


def log(state: RunState, values: Mapping[str, object], *, step: int | None = None) -> None:
    """Records ``values`` with every tracker of the run, on the main process; consumes nothing.

    Tensors (one element each, on any device) are read with a single
    device-to-host transfer per device for the whole call, so pass
    `fa.step`'s metrics as they are. On the other processes it returns at
    once, reading nothing.

    Args:
        state: the run's state, holding trackers from `init_trackers`.
        values: metric names to numbers, strings, one-element tensors, or
            dicts of these. Any name is taken, as Accelerate's ``log`` takes
            it, ``step`` included: a value called ``step`` is a metric like
            any other (the JSONL tracker keeps the values apart from the step
            it logs at).
        step: the step to record them at; default ``state.step``.

    Raises:
        ValueError: the state has no trackers (call `init_trackers` first).
        TypeError: a value that is not a number, string, one-element tensor or dict.

    >>> import tempfile, torch, fnaccel as fa
    >>> from fnaccel.tracking import end_training, init_trackers, log
    >>> tmp = tempfile.TemporaryDirectory()
    >>> state = init_trackers(fa.init(cpu=True), "demo", logging_dir=tmp.name)
    >>> log(state, {"loss": torch.tensor(0.25), "lr": 1e-3, "phase": "warmup"})
    >>> end_training(state)
    >>> print(open(f"{tmp.name}/demo/metrics.jsonl").read())  # doctest: +ELLIPSIS
    {"step": 0, "time": ..., "values": {"loss": 0.25, "lr": 0.001, "phase": "warmup"}}
    <BLANKLINE>
    >>> tmp.cleanup()
    """
    if not state.dist.is_main_process:
        return
    if not state.trackers:
        raise ValueError(
            "fa.log: this state has no trackers; call state = fa.init_trackers(state, project_name) "
            "first and log with the state it returns (or one advanced from it)"
        )
    if not isinstance(values, Mapping):
        raise TypeError(f"fa.log takes a dict of metrics, got {type(values).__name__}")
    if step is None:
        step = state.step
    elif isinstance(step, bool) or not isinstance(step, Integral):
        raise TypeError(f"fa.log: step must be an int, got {type(step).__name__}")
    read = read_values(values)
    for tracker in state.trackers:
        tracker.log(
            dict(read), int(step)
        )  # each its own dict, as Accelerate's get: one's edits never reach the next


def get_tracker(state: RunState, name: str, *, unwrap: bool = False) -> Any:
    """The run's tracker called ``name`` (main process only); consumes nothing.

    Args:
        state: the run's state.
        name: the tracker's name (``"jsonl"``, ``"tensorboard"``, or a custom one's).
        unwrap: return the underlying object instead (the open file, the ``SummaryWriter``).

    Raises:
        ValueError: no tracker of that name in this state (on other
            processes than the main one there are none).

    >>> import tempfile, fnaccel as fa
    >>> from fnaccel.tracking import end_training, get_tracker, init_trackers
    >>> tmp = tempfile.TemporaryDirectory()
    >>> state = init_trackers(fa.init(cpu=True), "demo", logging_dir=tmp.name)
    >>> get_tracker(state, "jsonl").path.name
    'metrics.jsonl'
    >>> end_training(state); tmp.cleanup()
    """
    for tracker in state.trackers:
        if tracker.name == name:
            return tracker.tracker if unwrap else tracker
    where = "" if state.dist.is_main_process else " (trackers live on the main process only)"
    raise ValueError(
        f"get_tracker: no tracker named {name!r} in this state{where}; it has "
        f"{[t.name for t in state.trackers]}"
    )


def end_training(state: RunState) -> None:
    """Flushes and closes the run's trackers; consumes nothing and may be called twice.

    `fa.shutdown` calls it. Logging to a closed JSONL tracker raises.

    >>> import tempfile, fnaccel as fa
    >>> from fnaccel.tracking import end_training, init_trackers
    >>> tmp = tempfile.TemporaryDirectory()
    >>> state = init_trackers(fa.init(cpu=True), "demo", logging_dir=tmp.name)
    >>> end_training(state); end_training(state)
    >>> state.trackers[0].tracker.closed
    True
    >>> tmp.cleanup()
    """
    for tracker in state.trackers:
        tracker.finish()
