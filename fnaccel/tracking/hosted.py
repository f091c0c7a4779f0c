"""Trackers of hosted services, each in the service's offline or local mode when asked:
Weights & Biases, Comet, ClearML, SwanLab, Trackio.

Each is made as ``cls(project_name, logging_dir, **init_kwargs[name])`` by
`init_trackers`, on the main process only. ``init_kwargs`` go to the
package's own entry point (``wandb.init``, ``comet_ml.start``, ``Task.init``,
``swanlab.init``, ``trackio.init``), so its modes apply: ``{"wandb": {"mode":
"offline"}}``, ``{"comet_ml": {"online": False}}``, ``{"swanlab": {"mode":
"offline"}}``; ClearML's offline mode is the ``CLEARML_OFFLINE_MODE=1``
variable (the package keeps it process-wide), Trackio's local database lives in
``TRACKIO_DIR``. Each logs numbers and strings at a step, stores the config,
and offers ``log_images`` (and ``log_table`` where the service has tables), as
Accelerate's trackers do: ``fa.get_tracker(state, "wandb").log_images({...}, step)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fnaccel.tracking.common import flatten, numbers_and_text, require

__all__ = ["ClearMLTracker", "CometMLTracker", "SwanLabTracker", "TrackioTracker", "WandBTracker"]


class WandBTracker:
    """Weights & Biases: ``wandb.init(project=project_name, dir=logging_dir, **kwargs)``.

    A resumed run continues its wandb run when given ``id=...`` and
    ``resume="allow"``; its config is updated, not replaced.
    """

    name = "wandb"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        self._wandb = require(self.name)
        Path(logging_dir).mkdir(parents=True, exist_ok=True)
        self.run = self._wandb.init(project=run_name, dir=str(logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        """The ``wandb`` run."""
        return self.run

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    def log(self, values: Mapping[str, object], step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_images(self, values: Mapping[str, object], step: int, **kwargs: object) -> None:
        """Images (arrays, PIL images) or lists of them, as ``wandb.Image``."""
        self.run.log(
            {k: _each(v, lambda i: self._wandb.Image(i, **kwargs)) for k, v in values.items()}, step=step
        )

    def log_table(
        self,
        table_name: str,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[object]] | None = None,
        dataframe: object = None,
        step: int | None = None,
    ) -> None:
        """A ``wandb.Table`` from ``columns`` and ``data``, or from a pandas ``dataframe``."""
        table = self._wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step)

    def finish(self) -> None:
        self.run.finish()


class CometMLTracker:
    """Comet: ``comet_ml.start(project_name=project_name, **kwargs)``; ``online=False``
    writes the experiment to a zip under ``logging_dir/project_name`` for ``comet upload``."""

    name = "comet_ml"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        comet_ml = require(self.name)
        config = kwargs.pop("experiment_config", None) or comet_ml.ExperimentConfig()
        if config.has_default_offline_directory():
            config.offline_directory = str(Path(logging_dir) / run_name)
        self.experiment = comet_ml.start(project_name=run_name, experiment_config=config, **kwargs)

    @property
    def tracker(self) -> Any:
        """The Comet experiment."""
        return self.experiment

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self.experiment.log_parameters(flatten(values))

    def log(self, values: Mapping[str, object], step: int) -> None:
        numbers, text = numbers_and_text(values)
        self.experiment.log_metrics(numbers, step=step)
        for key, value in text.items():
            self.experiment.log_other(key, value)

    def log_images(self, values: Mapping[str, object], step: int, **kwargs: object) -> None:
        for key, value in values.items():
            self.experiment.log_image(value, name=key, step=step, **kwargs)

    def log_table(
        self,
        table_name: str,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[object]] | None = None,
        dataframe: object = None,
        step: int | None = None,
    ) -> None:
        """A CSV table named ``table_name`` (with ``.csv`` added when it has no suffix)."""
        filename = table_name if "." in table_name else f"{table_name}.csv"
        if dataframe is not None:
            self.experiment.log_table(filename, tabular_data=dataframe)
        else:
            self.experiment.log_table(filename, tabular_data=data, headers=list(columns or []) or False)

    def finish(self) -> None:
        self.experiment.end()


class ClearMLTracker:
    """ClearML: ``Task.init(project_name=project_name, **kwargs)`` (one task per process, as
    ClearML has it); ``CLEARML_OFFLINE_MODE=1`` keeps the session on disk for
    ``clearml-task --import-offline-session``."""

    name = "clearml"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        clearml = require(self.name)
        kwargs.setdefault("task_name", run_name)
        self.task = clearml.Task.init(project_name=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        """The ClearML task."""
        return self.task

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self.task.connect_configuration(dict(values), name="config")

    def log(self, values: Mapping[str, object], step: int) -> None:
        logger = self.task.get_logger()
        numbers, text = numbers_and_text(values)
        for key, value in numbers.items():
            title, _, series = key.rpartition("/")
            logger.report_scalar(title=title or series, series=series, value=value, iteration=step)
        for key, line in text.items():
            logger.report_text(f"{key}: {line}", print_console=False)

    def log_images(self, values: Mapping[str, object], step: int, **kwargs: object) -> None:
        logger = self.task.get_logger()
        for key, value in values.items():
            logger.report_image(title=key, series=key, iteration=step, image=value, **kwargs)

    def log_table(
        self,
        table_name: str,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[object]] | None = None,
        dataframe: object = None,
        step: int | None = None,
    ) -> None:
        table = dataframe if dataframe is not None else [list(columns or []), *map(list, data or [])]
        self.task.get_logger().report_table(
            title=table_name, series=table_name, iteration=step or 0, table_plot=table
        )

    def finish(self) -> None:
        self.task.close()


class SwanLabTracker:
    """SwanLab: ``swanlab.init(project=project_name, logdir=logging_dir, **kwargs)``;
    ``mode="offline"`` writes the run under ``logging_dir`` for ``swanlab sync``."""

    name = "swanlab"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        self._swanlab = require(self.name)
        self.run = self._swanlab.init(project=run_name, logdir=str(logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        """The SwanLab run."""
        return self.run

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self._swanlab.config.update(dict(values))

    def log(self, values: Mapping[str, object], step: int) -> None:
        numbers, text = numbers_and_text(values)
        self.run.log({**numbers, **{k: self._swanlab.Text(v) for k, v in text.items()}}, step=step)

    def log_images(self, values: Mapping[str, object], step: int, **kwargs: object) -> None:
        self.run.log(
            {k: _each(v, lambda i: self._swanlab.Image(i, **kwargs)) for k, v in values.items()}, step=step
        )

    def finish(self) -> None:
        self.run.finish()


class TrackioTracker:
    """Trackio: ``trackio.init(project=project_name, **kwargs)``, stored in its local database
    (``TRACKIO_DIR``); nothing leaves the machine unless ``space_id=...`` is given."""

    name = "trackio"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        self._trackio = require(self.name)
        self.run = self._trackio.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        """The Trackio run."""
        return self.run

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self.run.config.update(dict(values))

    def log(self, values: Mapping[str, object], step: int) -> None:
        self.run.log(flatten(values), step=step)

    def log_images(self, values: Mapping[str, object], step: int, **kwargs: object) -> None:
        self.run.log(
            {k: _each(v, lambda i: self._trackio.Image(i, **kwargs)) for k, v in values.items()}, step=step
        )

    def log_table(
        self,
        table_name: str,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[object]] | None = None,
        dataframe: object = None,
        step: int | None = None,
    ) -> None:
        table = self._trackio.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step)

    def finish(self) -> None:
        self.run.finish()


def _each(value: object, make: Callable[[object], object]) -> object:
    return [make(v) for v in value] if isinstance(value, (list, tuple)) else make(value)
