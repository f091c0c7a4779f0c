"""The trackers: the `GeneralTracker` protocol, the built-in JSONL and TensorBoard ones,
and how ``log_with`` names them (the services' trackers are in hosted.py and stores.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from numbers import Real
from pathlib import Path
from types import MappingProxyType
from typing import IO, TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from fnaccel.constants import LoggerType
from fnaccel.tracking.common import is_installed, require
from fnaccel.tracking.hosted import (
    ClearMLTracker,
    CometMLTracker,
    SwanLabTracker,
    TrackioTracker,
    WandBTracker,
)
from fnaccel.tracking.stores import AimTracker, DVCLiveTracker, MLflowTracker

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["GeneralTracker", "JSONLTracker", "TensorBoardTracker", "resolve_trackers"]


@runtime_checkable
class GeneralTracker(Protocol):
    """What a tracker provides (Accelerate's ``GeneralTracker``, as a protocol).

    Pass an object with these members in ``init_trackers(log_with=...)`` to log
    where fnaccel has no built-in tracker (wandb, MLflow, ...). `log` hands it
    plain Python values: numbers, strings and dicts of them, tensors already read.

    Attributes:
        name: the name `get_tracker` finds it by.
        tracker: the underlying object (an open file, a ``SummaryWriter``, a wandb run).
    """

    @property
    def name(self) -> str: ...

    @property
    def tracker(self) -> Any: ...

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Record the run's hyperparameters, once, at `init_trackers`."""

    def log(self, values: Mapping[str, object], step: int) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Flush and close; called by `end_training`, and must be harmless twice."""


class JSONLTracker:
    """Writes ``<logging_dir>/<run_name>/metrics.jsonl``: one JSON object per `log` call.

    Each line is ``{"step": ..., "time": ..., "values": {...}}``: the step it was
    logged at, the time (seconds since the epoch), and the values as logged, in a
    place of their own, so a value may have any name (the transformers scripts
    log one called ``step``). Each line is flushed at once, so the file can be
    followed while the run goes on. The file is appended to: a resumed run continues it. The
    configuration goes to ``config.json`` next to it; a resumed run's
    configuration is merged into the one there (its values win), so keys only
    the first start knew are kept.

    Args:
        run_name: the project's name: the files' directory under ``logging_dir``.
        logging_dir: where the run's directory is made.
        filename: the metrics file's name.
    """

    __slots__ = ("_file", "directory", "path")
    name = LoggerType.JSONL.value

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str], *, filename: str = "metrics.jsonl"
    ) -> None:
        self.directory = Path(logging_dir) / run_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / filename
        # held open for the run, closed by `finish`
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    @property
    def tracker(self) -> IO[str]:
        """The open metrics file."""
        return self._file

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Write ``config.json``, merged into an existing one; a value JSON cannot hold is written as its ``str()``."""
        path = self.directory / "config.json"
        merged: dict[str, object] = {}
        if path.is_file():
            try:
                merged = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                raise ValueError(
                    f"{path} is not valid JSON, so a resumed run cannot add to it; repair or remove it"
                ) from None
            if not isinstance(merged, dict):
                raise ValueError(f"{path} does not hold a JSON object; repair or remove it")
        merged.update(json.loads(json.dumps(dict(values), default=str)))
        text = json.dumps(merged, indent=2)
        partial = path.with_name("config.json.partial")
        partial.write_text(text + "\n", encoding="utf-8")
        partial.replace(path)  # whole or absent, the old one kept until the new one is written

    def log(self, values: Mapping[str, object], step: int) -> None:
        """Append one line; non-finite floats are written as Python's json writes them (NaN)."""
        if self._file.closed:
            raise ValueError(
                f"the JSONL tracker writing {self.path} was closed (fa.end_training); "
                "call init_trackers again to log more"
            )
        self._file.write(json.dumps({"step": step, "time": time.time(), "values": dict(values)}) + "\n")
        self._file.flush()

    def finish(self) -> None:
        """Close the file."""
        self._file.close()


class TensorBoardTracker:
    """Writes TensorBoard event files to ``<logging_dir>/<run_name>`` (needs ``tensorboard``).

    Numbers become scalars, strings text, and a dict of numbers one
    ``add_scalars`` group, as in Accelerate; events are flushed at each `log`.

    Args:
        run_name: the project's name: the event files' directory under ``logging_dir``.
        logging_dir: where the run's directory is made.
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter``.
    """

    __slots__ = ("directory", "writer")
    name = LoggerType.TENSORBOARD.value

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        writer_class = _summary_writer_class()
        self.directory = Path(logging_dir) / run_name
        self.writer = writer_class(str(self.directory), **kwargs)

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Record the values as hyperparameters; those TensorBoard cannot hold go in as ``str()``."""
        hparams = {
            key: value if isinstance(value, (bool, int, float, str, torch.Tensor)) else str(value)
            for key, value in values.items()
        }
        self.writer.add_hparams(hparams, metric_dict={})
        self.writer.flush()

    def log(self, values: Mapping[str, object], step: int) -> None:
        """Add each value at ``step`` and flush."""
        for key, value in values.items():
            if isinstance(value, Real):
                self.writer.add_scalar(key, value, global_step=step)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step)
            elif isinstance(value, Mapping) and all(isinstance(v, Real) for v in value.values()):
                self.writer.add_scalars(key, dict(value), global_step=step)
            else:
                raise TypeError(
                    f"fa.log: TensorBoard takes numbers, strings and dicts of numbers, but "
                    f"{key!r} holds a nested dict; flatten it (e.g. 'a/b' keys)"
                )
        self.writer.flush()

    def finish(self) -> None:
        """Flush and close the event files."""
        self.writer.close()


def _summary_writer_class() -> type[SummaryWriter]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "log_with names 'tensorboard' but the tensorboard package is not installed: "
            "pip install tensorboard (or fnaccel[tensorboard]), or log with 'jsonl' only"
        ) from None
    return SummaryWriter


# The trackers fnaccel builds itself, each made as cls(project_name, logging_dir, **init_kwargs).
BUILT_IN: Mapping[str, type] = MappingProxyType(
    {
        LoggerType.JSONL.value: JSONLTracker,
        LoggerType.TENSORBOARD.value: TensorBoardTracker,
        LoggerType.WANDB.value: WandBTracker,
        LoggerType.MLFLOW.value: MLflowTracker,
        LoggerType.COMETML.value: CometMLTracker,
        LoggerType.AIM.value: AimTracker,
        LoggerType.CLEARML.value: ClearMLTracker,
        LoggerType.DVCLIVE.value: DVCLiveTracker,
        LoggerType.SWANLAB.value: SwanLabTracker,
        LoggerType.TRACKIO.value: TrackioTracker,
    }
)


def _installed(name: str) -> bool:
    if name == LoggerType.JSONL.value:
        return True
    if name == LoggerType.TENSORBOARD.value:
        return _tensorboard_installed()
    return is_installed(name)


def _tensorboard_installed() -> bool:
    try:
        _summary_writer_class()
    except ImportError:
        return False
    return True


def resolve_trackers(
    log_with: object, registered: Mapping[str, type] = MappingProxyType({})
) -> list[str | GeneralTracker]:
    """Tracker names (built in, or ``registered`` with `register_tracker`) and tracker
    objects, checked on every rank alike."""
    items: Iterable[object]
    if isinstance(log_with, (str, GeneralTracker)) or not isinstance(log_with, Iterable):
        items = [log_with]
    else:
        items = log_with
    chosen: list[str | GeneralTracker] = []
    for item in items:
        found: list[str | GeneralTracker]
        if isinstance(item, str):
            found = [item] if item in registered else list(_built_in_names(item))
        elif isinstance(item, GeneralTracker):
            found = [item]
        else:
            raise TypeError(
                f"log_with takes tracker names or GeneralTracker objects, got {type(item).__name__}"
            )
        for tracker in found:
            label = _label(tracker)
            if label in {_label(c) for c in chosen}:
                raise ValueError(f"log_with names the tracker {label!r} twice; keep one")
            chosen.append(tracker)
    if not chosen:
        raise ValueError("log_with is empty; name at least one tracker (e.g. 'jsonl')")
    return chosen


def _label(tracker: str | GeneralTracker) -> str:
    return tracker if isinstance(tracker, str) else tracker.name


def _built_in_names(item: str) -> tuple[str, ...]:
    try:
        kind = LoggerType(item.lower())
    except ValueError:
        raise ValueError(
            f"log_with: {item!r} is not a tracker; use one of "
            f"{', '.join(repr(n) for n in BUILT_IN)}, 'all' (every installed one), a name given "
            "to register_tracker, or an object following fnaccel.tracking.GeneralTracker"
        ) from None
    if kind is LoggerType.ALL:
        return tuple(name for name in BUILT_IN if _installed(name))
    if kind is LoggerType.TENSORBOARD:
        _summary_writer_class()  # every rank names the missing package now, not the main one later
    elif kind is not LoggerType.JSONL:
        require(kind.value)
    return (kind.value,)
