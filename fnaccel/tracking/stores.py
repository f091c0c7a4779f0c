"""Trackers that write a local store: MLflow, Aim, DVCLive.

- MLflow goes through an ``MlflowClient`` of its own (not ``mlflow``'s
  process-wide active run), so two runs in one process log apart. Its store is
  ``tracking_uri=...`` from ``init_kwargs``, else ``MLFLOW_TRACKING_URI``, else
  ``sqlite:///<logging_dir>/mlflow.db`` with artifacts in ``<logging_dir>/mlartifacts``
  (MLflow 3 keeps its plain-file store in maintenance and refuses new ones).
- Aim writes its repository in ``logging_dir`` (``aim up`` there shows it).
- DVCLive writes ``<logging_dir>/<project_name>``: ``params.yaml``, ``metrics.json``,
  ``dvc.yaml`` and one TSV per metric under ``plots/metrics`` (DVCLive's own
  default puts ``dvc.yaml`` at the root of the enclosing git repository).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fnaccel.tracking.common import flatten, numbers_and_text, require

__all__ = ["AimTracker", "DVCLiveTracker", "MLflowTracker"]


class MLflowTracker:
    """MLflow: one run of the experiment ``project_name``.

    Args:
        tracking_uri: where the store is (see the module docstring).
        run_id: continue this run (a resumed training) instead of starting one.
        run_name, tags, description: the new run's name, tags and description.
    """

    name = "mlflow"

    def __init__(
        self,
        run_name: str,
        logging_dir: str | os.PathLike[str],
        *,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        description: str | None = None,
        **run_kwargs: object,
    ) -> None:
        mlflow = require(self.name)
        if tracking_uri is None:
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if tracking_uri is None:  # the store and the artifacts (images) both under logging_dir
            Path(logging_dir).mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{Path(logging_dir).absolute() / 'mlflow.db'}"
            artifacts = (Path(logging_dir).absolute() / "mlartifacts").as_uri()
        self.client = mlflow.MlflowClient(tracking_uri)
        self._entities = mlflow.entities
        if run_id is None:
            found = self.client.get_experiment_by_name(run_name)
            experiment_id = (
                found.experiment_id
                if found
                else self.client.create_experiment(run_name, artifact_location=artifacts)
            )
            all_tags = dict(tags or {})
            if description is not None:
                all_tags["mlflow.note.content"] = description
            run_id = self.client.create_run(experiment_id, tags=all_tags, **run_kwargs).info.run_id
        self.run_id = run_id

    @property
    def tracker(self) -> Any:
        """The ``MlflowClient``; the run is ``self.run_id``."""
        return self.client

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Parameters, as strings (MLflow's limit: 6000 characters each)."""
        params = [self._entities.Param(k, str(v)[:6000]) for k, v in flatten(values).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, values: Mapping[str, object], step: int) -> None:
        """Numbers as metrics; strings as tags (MLflow metrics are numbers only)."""
        numbers, text = numbers_and_text(values)
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(k, v, now, step) for k, v in numbers.items()]
        tags = [self._entities.RunTag(k, v) for k, v in text.items()]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def log_images(self, values: Mapping[str, object], step: int) -> None:
        """Images as MLflow image artifacts at ``step``."""
        for key, value in values.items():
            self.client.log_image(self.run_id, value, key=key, step=step)

    def finish(self) -> None:
        if self.client.get_run(self.run_id).info.status == "RUNNING":
            self.client.set_terminated(self.run_id)


class AimTracker:
    """Aim: ``aim.Run(repo=logging_dir, experiment=project_name, **kwargs)``;
    ``run_hash=...`` continues a run."""

    name = "aim"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        self._aim = require(self.name)
        Path(logging_dir).mkdir(parents=True, exist_ok=True)
        self.run = self._aim.Run(repo=str(logging_dir), experiment=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        """The Aim run."""
        return self.run

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Under ``run["hparams"]``, merged with what a continued run had."""
        current = self.run.get("hparams") or {}
        self.run["hparams"] = {**current, **dict(values)}

    def log(self, values: Mapping[str, object], step: int) -> None:
        numbers, text = numbers_and_text(values)
        for key, value in numbers.items():
            self.run.track(value, name=key, step=step)
        for key, line in text.items():
            self.run.track(self._aim.Text(line), name=key, step=step)

    def log_images(self, values: Mapping[str, object], step: int, **kwargs: object) -> None:
        for key, value in values.items():
            self.run.track(self._aim.Image(value, **kwargs), name=key, step=step)

    def finish(self) -> None:
        self.run.close()


class DVCLiveTracker:
    """DVCLive: ``dvclive.Live(dir=<logging_dir>/<project_name>, **kwargs)`` (``save_dvc_exp``
    defaults to False: no DVC experiment unless asked)."""

    name = "dvclive"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: object) -> None:
        dvclive = require(self.name)
        kwargs.setdefault("save_dvc_exp", False)
        kwargs.setdefault("dvcyaml", str(Path(logging_dir) / run_name / "dvc.yaml"))
        kwargs.setdefault("resume", (Path(logging_dir) / run_name / "metrics.json").exists())
        self.live = dvclive.Live(dir=str(Path(logging_dir) / run_name), **kwargs)

    @property
    def tracker(self) -> Any:
        """The ``dvclive.Live`` object."""
        return self.live

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self.live.log_params(dict(values))

    def log(self, values: Mapping[str, object], step: int) -> None:
        """Numbers as metrics at ``step`` (DVCLive's metrics are numbers only; strings go to params)."""
        numbers, text = numbers_and_text(values)
        self.live.step = step
        for key, value in numbers.items():
            self.live.log_metric(key, value)
        if text:
            self.live.log_params(text)
        self.live.next_step()

    def log_images(self, values: Mapping[str, object], step: int) -> None:
        """Images as ``plots/images/<name>.png`` (DVCLive keeps the latest of each)."""
        self.live.step = step
        for key, value in values.items():
            self.live.log_image(key if "." in key else f"{key}.png", value)

    def finish(self) -> None:
        self.live.end()
